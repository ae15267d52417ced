"""Prompt processing for Whisper: one clip of at most 30 s -> its log-mel window, attended by
every row of the decoder prompt.

A Whisper request is its decoder prompt (`<|startoftranscript|>`, a language, a task,
`<|notimestamps|>` or not, optionally preceded by `<|startofprev|>` and earlier text; built by
models/whisper/prompt.py) and exactly one clip. The clip is zero-padded to the 30 s window and
turned into log-mel features as transformers' WhisperFeatureExtractor does
(models/processing/log_mel.py); the encoder sees the whole window, as Whisper was trained. The
clip is a cross-attention item placed on the prompt's first token (which keeps its text
embedding) and attended from there to the end of the sequence, generated tokens included: in
Whisper every decoder row sees the encoder output. Longer audio is cut into windows by the
transcription front end, one request per window (engine/transcription.py): each sends the whole
clip and its window's first 10 ms frame (`mm_processor_kwargs` `clip_window`), and the window
is that slice of the whole clip's features, zero-padded past its end, as transformers'
long-form generation and openai-whisper compute it (the clip's features computed once, kept in
the processed cache).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, choose_schema, read_settings
from models.interfaces import (
    CrossRows,
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.media_inputs import AudioClip, MediaError
from models.processing.base import ProcessedCache, ProcessorDefaults
from models.processing.hashing import hash_audio, hash_part
from models.processing.log_mel import FEATURE_EXTRACTOR, LogMelExtractor, MelConfig
from models.processing.options import OptionRange, check_mm_kwargs

# A window of a longer clip (engine.transcription): its first 10 ms frame in the clip.
OPTIONS = {"clip_window": OptionRange(0, integer=True, why="a frame of the clip")}


class WhisperProcessor(ProcessorDefaults):
    """One clip per prompt, cross-attended by every decoder row."""

    modalities = ("audio",)

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg = ctx.hf_config
        self.model_id = ctx.model_id
        found = ctx.files.component("feature_extractor")
        mel = read_settings(found, choose_schema(
            found, {FEATURE_EXTRACTOR.cls: FEATURE_EXTRACTOR}, FEATURE_EXTRACTOR.cls,
            "feature_extractor_type"))
        self.read = {"feature_extractor": mel}
        self.mel = MelConfig.from_settings(mel)
        if self.mel.n_mels != cfg.num_mel_bins:
            raise CheckpointError(
                f"{mel.sources['feature_size']}: feature_size={self.mel.n_mels} but the encoder "
                f"expects config.json's num_mel_bins={cfg.num_mel_bins}")
        # The encoder's positions cover exactly one window (transformers refuses other lengths).
        self.positions = (self.mel.window_frames - 1) // 2 + 1
        if self.positions != cfg.max_source_positions:
            raise CheckpointError(
                f"a {self.mel.chunk_length} s window gives {self.positions} encoder positions, "
                f"but config.json's max_source_positions={cfg.max_source_positions}")
        self.extractor = LogMelExtractor(self.mel)
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def loader_kwargs(self, mm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Options for engine.media: decode audio at the feature extractor's rate."""
        check_mm_kwargs(mm_kwargs, OPTIONS, "Whisper")
        return {"audio_kwargs": {"sample_rate": self.mel.sample_rate}}

    def max_embeds_per_item(self) -> int:
        """Key positions of a clip: the whole window's."""
        return self.positions

    def plan(self, token_ids: list[int], media: dict[str, list],
             mm_kwargs: dict[str, Any]) -> PromptPlan:
        options = check_mm_kwargs(mm_kwargs, OPTIONS, "Whisper")
        self._clip(token_ids, media, options.get("clip_window"))
        return PromptPlan(len(token_ids), [("audio", self.positions)])

    def process(self, token_ids: list[int], media: dict[str, list],
                mm_kwargs: dict[str, Any]) -> ProcessedPrompt:
        first = check_mm_kwargs(mm_kwargs, OPTIONS, "Whisper").get("clip_window")
        clip = self._clip(token_ids, media, first)
        stages: dict[str, float] = {}
        whole = hash_audio(clip, model_id=self.model_id, processor_kwargs=asdict(self.mel))
        identifier = whole if first is None else hash_part(whole, clip_window=first)
        data = self.cache.get_or_compute(identifier, partial(self._features, clip, whole,
                                                             first))
        seconds = clip.duration_s
        part = f"{seconds:.1f} s in a {self.mel.chunk_length} s window, cross-attended"
        if first is not None:
            start = first * self.mel.hop_length / self.mel.sample_rate
            seen = min(seconds - start, self.mel.chunk_length)
            part = (f"{seen:.1f} s from {start:.1f} s of a {seconds:.1f} s clip in a "
                    f"{self.mel.chunk_length} s window, cross-attended")
        feature = MultiModalFeature(
            "audio", identifier, PlaceholderRange(0, 1, is_embed=(False,)), data, part=part,
            cross=CrossRows(0, None, self.positions))
        return ProcessedPrompt(None, list(token_ids), [feature], None, stages)

    def _clip(self, token_ids: list[int], media: dict[str, list],
              first: int | None = None) -> AudioClip:
        """The prompt's one clip, checked: at most one window long, or (`first`: a window of
        a longer clip, from that frame) holding that frame."""
        clips = media.get("audio", [])
        others = sorted(m for m, items in media.items() if items and m != "audio")
        if others or len(clips) != 1:
            raise ValueError(f"a Whisper prompt takes exactly one audio clip, got {len(clips)}"
                             + (f" and {', '.join(others)}" if others else ""))
        if not token_ids:
            raise ValueError("a Whisper prompt needs its decoder tokens (<|startoftranscript|> "
                             "first)")
        (clip,) = clips
        if clip.sample_rate != self.mel.sample_rate:
            raise ValueError(f"audio 1 is at {clip.sample_rate} Hz, expected "
                             f"{self.mel.sample_rate} Hz (load it through engine.media)")
        if first is not None:
            frames = len(clip.samples) // self.mel.hop_length
            if first >= frames:
                raise MediaError(f"audio 1: clip_window={first} is past the clip's last 10 ms "
                                 f"frame ({frames} frames, {clip.duration_s:.1f} s)")
        elif len(clip.samples) > self.mel.window_samples:
            raise MediaError(
                f"audio 1: duration {clip.duration_s:.1f} s exceeds one Whisper window of "
                f"{self.mel.chunk_length} s; transcribe it through /v1/audio/transcriptions "
                "(engine.transcription), which cuts long audio into windows")
        if not len(clip.samples):
            raise MediaError("audio 1 contains no samples")
        return clip

    def _features(self, clip: AudioClip, whole: str, first: int | None) -> dict:
        """The window's features (`whole`: the clip's digest; `first`: the window's first
        frame in a longer clip, whose features are computed once and kept)."""
        if first is None:
            features = self.extractor([clip.samples]).features[0]
        else:
            features = self.extractor.window_of(self.cache.get_or_compute(
                hash_part(whole, clip_window="all"), partial(self._clip_features, clip))[
                "clip_features"], first)
        return {"input_features": features, "num_frames": self.mel.window_frames}

    def _clip_features(self, clip: AudioClip) -> dict:
        return {"clip_features": self.extractor.clip_features(clip.samples)}
