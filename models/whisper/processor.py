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
transcription front end, one request per window (engine/transcription.py).
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, choose_schema, read_settings
from models.interfaces import (
    AudioClip,
    CrossRows,
    MediaError,
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.processing.base import ProcessedCache, ProcessorDefaults
from models.processing.hashing import hash_audio
from models.processing.log_mel import FEATURE_EXTRACTOR, LogMelExtractor, MelConfig
from models.processing.options import check_mm_kwargs


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
        check_mm_kwargs(mm_kwargs, {}, "Whisper")
        return {"audio_kwargs": {"sample_rate": self.mel.sample_rate}}

    def max_embeds_per_item(self) -> int:
        """Key positions of a clip: the whole window's."""
        return self.positions

    def plan(self, token_ids: list[int], media: dict[str, list],
             mm_kwargs: dict[str, Any]) -> PromptPlan:
        self._clip(token_ids, media)
        return PromptPlan(len(token_ids), [("audio", self.positions)])

    def process(self, token_ids: list[int], media: dict[str, list],
                mm_kwargs: dict[str, Any]) -> ProcessedPrompt:
        check_mm_kwargs(mm_kwargs, {}, "Whisper")
        clip = self._clip(token_ids, media)
        stages: dict[str, float] = {}
        identifier = hash_audio(clip, model_id=self.model_id, processor_kwargs=asdict(self.mel))
        data = self.cache.get_or_compute(identifier, partial(self._features, clip))
        seconds = clip.duration_s
        feature = MultiModalFeature(
            "audio", identifier, PlaceholderRange(0, 1, is_embed=(False,)), data,
            part=f"{seconds:.1f} s in a {self.mel.chunk_length} s window, cross-attended",
            cross=CrossRows(0, None, self.positions))
        return ProcessedPrompt(None, list(token_ids), [feature], None, stages)

    def _clip(self, token_ids: list[int], media: dict[str, list]) -> AudioClip:
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
        if len(clip.samples) > self.mel.window_samples:
            raise MediaError(
                f"audio 1: duration {clip.duration_s:.1f} s exceeds one Whisper window of "
                f"{self.mel.chunk_length} s; transcribe it through /v1/audio/transcriptions "
                "(engine.transcription), which cuts long audio into windows")
        if not len(clip.samples):
            raise MediaError("audio 1 contains no samples")
        return clip

    def _features(self, clip: AudioClip) -> dict:
        mel = self.extractor([clip.samples])
        return {"input_features": mel.features[0], "num_frames": self.mel.window_frames}
