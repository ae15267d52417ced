"""Prompt processing for Qwen2-Audio: audio clips -> log-mel windows, placeholder spans, hashes.

The chat template writes `<|audio_bos|><|AUDIO|><|audio_eos|>` per clip. The encoder sees one
window of `chunk_length` seconds (30 s) at a time, so a clip is split into consecutive 30 s
windows (the last one shorter), each its own encoder item with its own span and content hash.
The clip's `<|AUDIO|>` token becomes, per window, as many `<|AUDIO|>` tokens as the encoder
emits for that window's real frames, and consecutive windows are separated by
`<|audio_eos|><|audio_bos|>`, so every window reads like a clip of its own:

    <|audio_bos|> AUDIO x n1 <|audio_eos|><|audio_bos|> AUDIO x n2 <|audio_eos|>

A window shorter than the encoder's minimum (3 frames, 20 ms, for one embedding) is padded with
silence to it. Clips longer than `max_audio_duration_s` (default 600 s, 10 minutes; per request
through mm_processor_kwargs) are refused, as are clips past engine.media's
`MediaLimits.max_audio_duration_s` while decoding. The i-th `<|AUDIO|>` takes the i-th clip.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np

from models.checkpoint import CheckpointError, Schema, choose_schema, read_settings
from models.encoders.whisper import encoder_lengths, receptive_frames
from models.interfaces import ProcessedPrompt, ProcessorContext, PromptPlan
from models.media_inputs import AudioClip, MediaError
from models.processing.base import (
    Expansion,
    Pieces,
    ProcessedCache,
    ProcessorDefaults,
    check_placeholder_count,
    expand_placeholders,
    special_token_id,
)
from models.processing.hashing import hash_audio
from models.processing.log_mel import FEATURE_EXTRACTOR, LogMelExtractor, MelConfig
from models.processing.options import OptionRange, check_mm_kwargs

DEFAULT_MAX_AUDIO_DURATION_S = 600.0
_MIN_FRAMES = 3  # the fewest mel frames from which the encoder emits an embedding
_OPTIONS = {
    "max_audio_duration_s": OptionRange(
        0, DEFAULT_MAX_AUDIO_DURATION_S, low_open=True,
        why="seconds per clip; it can only lower the default",
    ),
}


# transformers' Qwen2AudioProcessor's own fields (processor_config.json), with its defaults.
PROCESSOR_SCHEMA = Schema("Qwen2AudioProcessor", {
    "audio_token": "<|AUDIO|>", "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>"})


class QwenAudioProcessor(ProcessorDefaults):
    """Expands `<|AUDIO|>` placeholders into per-window spans and prepares their mel features."""

    modalities = ("audio",)

    def __init__(self, ctx: ProcessorContext) -> None:
        hf_config, tokenizer = ctx.hf_config, ctx.tokenizer
        self.model_id = ctx.model_id
        self.audio_token_id = hf_config.audio_token_id
        audio = hf_config.audio_config
        found = ctx.files.component("feature_extractor")
        mel = read_settings(found, choose_schema(
            found, {FEATURE_EXTRACTOR.cls: FEATURE_EXTRACTOR}, FEATURE_EXTRACTOR.cls,
            "feature_extractor_type"))
        own = read_settings(ctx.files.processor_fields(), PROCESSOR_SCHEMA)
        self.read = {"feature_extractor": mel, "processor": own}
        self.mel = MelConfig.from_settings(mel)
        if self.mel.n_mels != audio.num_mel_bins:
            raise CheckpointError(
                f"{mel.sources['feature_size']}: feature_size={self.mel.n_mels} but the audio "
                f"encoder expects config.json's audio_config.num_mel_bins={audio.num_mel_bins}")
        if special_token_id(tokenizer, own["audio_token"],
                            own.sources["audio_token"]) != self.audio_token_id:
            raise CheckpointError(
                f"{own.sources['audio_token']}: audio_token {own['audio_token']!r} is not the "
                f"token config.json's audio_token_id={self.audio_token_id} names")
        if encoder_lengths(self.mel.window_frames)[0] > audio.max_source_positions:
            raise ValueError(
                f"a {self.mel.chunk_length} s window gives more encoder positions than the "
                f"encoder's max_source_positions={audio.max_source_positions}"
            )
        self.bos_token_id, self.eos_token_id = (
            special_token_id(tokenizer, own[t], own.sources[t])
            for t in ("audio_bos_token", "audio_eos_token"))
        self.extractor = LogMelExtractor(self.mel)
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Options for engine.media: decode audio at the feature extractor's rate."""
        _max_duration(mm_kwargs)
        return {"audio_kwargs": {"sample_rate": self.mel.sample_rate}}


    def max_embeds_per_item(self) -> int:
        """A full window's embeddings, for the start-up budget check."""
        return encoder_lengths(self.mel.window_frames)[1]

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """The expanded prompt's length and each window's embeddings, from the clips' lengths
        (no feature is extracted)."""
        windows = self._all_windows(token_ids, media, mm_kwargs)
        items = [("audio", encoder_lengths(self.mel.num_frames(len(w.samples)))[1])
                 for clip in windows for w in clip]
        separators = sum(2 * (len(clip) - 1) for clip in windows)
        num_tokens = len(token_ids) - len(windows) + separators + sum(n for _, n in items)
        return PromptPlan(num_tokens, items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        stages = {"hashing": 0.0, "preprocess": 0.0}
        windows = self._all_windows(token_ids, media, mm_kwargs)
        t0 = time.perf_counter()
        options = asdict(self.mel)
        keys = [[hash_audio(w, model_id=self.model_id, processor_kwargs=options) for w in clip]
                for clip in windows]
        t1 = time.perf_counter()
        flat = [w for clip in windows for w in clip]
        data = iter(self._features(flat, [k for clip in keys for k in clip]))
        encoded = [[(key, next(data)) for key in clip] for clip in keys]
        ids, features = self._expand(token_ids, encoded)
        stages["hashing"] += t1 - t0
        stages["preprocess"] += time.perf_counter() - t1
        return ProcessedPrompt(None, ids, features, None, stages)

    def _all_windows(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> list[list[AudioClip]]:
        """Every clip cut into its windows, after the options and placeholders are checked."""
        limit = _max_duration(mm_kwargs)
        clips = media.get("audio", [])
        check_placeholder_count(token_ids, {self.audio_token_id: "audio"}, media,
                                {"audio": "audio clip"})
        return [self._windows(clip, i, limit) for i, clip in enumerate(clips, start=1)]

    def _windows(self, clip: AudioClip, number: int, limit: float) -> list[AudioClip]:
        """The clip cut into consecutive windows, the last one padded to the encoder minimum."""
        if clip.sample_rate != self.mel.sample_rate:
            raise ValueError(f"audio {number} is at {clip.sample_rate} Hz, expected "
                             f"{self.mel.sample_rate} Hz (load it through engine.media)")
        if clip.duration_s > limit:
            raise MediaError(
                f"audio {number}: duration {clip.duration_s:.1f} s exceeds the limit of "
                f"{limit:g} s (mm_processor_kwargs max_audio_duration_s)"
            )
        size, shortest = self.mel.window_samples, (_MIN_FRAMES - 1) * self.mel.hop_length + 1
        out = []
        for start in range(0, len(clip.samples), size):
            samples = clip.samples[start : start + size]
            if len(samples) < shortest:
                samples = np.pad(samples, (0, shortest - len(samples)))
            out.append(AudioClip(samples, clip.sample_rate))
        return out

    def _features(self, windows: list[AudioClip], keys: list[str]) -> list[dict]:
        """Encoder inputs per window, from the processed cache or, for every window of the
        prompt at once, from one batched extraction on the first miss."""
        extracted: list[dict] = []

        def compute(i: int) -> dict:
            if not extracted:
                mel = self.extractor([w.samples for w in windows])
                for row, n in zip(mel.features, mel.num_frames, strict=True):
                    kept = receptive_frames(n, self.mel.window_frames)
                    extracted.append({"input_features": row[:, :kept].clone(), "num_frames": n})
            return extracted[i]

        return [self.cache.get_or_compute(key, partial(compute, i)) for i, key in enumerate(keys)]

    def _expand(self, token_ids: list[int], encoded: list[list[tuple[str, dict]]]):
        """Each `<|AUDIO|>` -> its clip's windows' spans, separated by eos/bos tokens."""
        return expand_placeholders(token_ids, {self.audio_token_id: "audio"},
                                   {"audio": encoded}, self._windows_spans)

    def _windows_spans(self, _: str, windows: list[tuple[str, dict]]) -> Pieces:
        pieces: list[Expansion | list[int]] = []
        for k, (identifier, data) in enumerate(windows):
            if k:
                pieces.append([self.eos_token_id, self.bos_token_id])
            n = encoder_lengths(data["num_frames"])[1]
            pieces.append(Expansion([self.audio_token_id] * n, identifier=identifier, data=data))
        return pieces


def _max_duration(mm_kwargs: Mapping[str, Any]) -> float:
    options = check_mm_kwargs(mm_kwargs, _OPTIONS, "Qwen2-Audio")
    return float(options.get("max_audio_duration_s", DEFAULT_MAX_AUDIO_DURATION_S))
