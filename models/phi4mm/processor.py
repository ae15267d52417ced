"""Prompt processing for Phi-4-multimodal: images -> dynamic-HD crops, audio -> log-mel frames,
each `<|image|>` / `<|audio|>` placeholder expanded into its item's span.

The chat template writes one placeholder per item; an image's becomes as many image tokens as
its crops' pooled patches and separators (models/phi4mm/preprocess.py), a clip's as many audio
tokens as its frames in groups of the compression rate (models/phi4mm/fbank.py). Each item is
one encoder item with its own content hash. A clip is projected by the "vision" projection when
its request also has images (as transformers does for a batch with images), else the "speech"
one; that choice is part of the clip's encoder inputs and hash, so one clip's two projections
never share a cache entry.

Per-request options: `dynamic_hd` (crops per image, at most the checkpoint's, as transformers'
processor takes it per call) and `max_audio_duration_s` (600 s by default; it can only lower
that bound, which keeps every item within the encoder budget).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, replace
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Schema, choose_schema, own_keys, read_settings
from models.interfaces import ProcessedPrompt, ProcessorContext, PromptPlan
from models.media_inputs import AudioClip, MediaError
from models.phi4mm.fbank import FEATURE_EXTRACTOR, FbankConfig, FbankExtractor
from models.phi4mm.preprocess import HDConfig, hd_layout, num_image_tokens, preprocess_hd
from models.processing.base import (
    Expansion,
    ProcessedCache,
    ProcessorDefaults,
    check_placeholder_count,
    expand_placeholders,
    hashed_and_processed,
)
from models.processing.hashing import hash_audio, hash_image
from models.processing.options import OptionRange, check_mm_kwargs

# transformers' Phi4MultimodalImageProcessor with its own (class) defaults; it resizes every
# image whatever do_resize says.
IMAGE_PROCESSOR = Schema("Phi4MultimodalImageProcessor", {
    "size": {"height": 448, "width": 448}, "patch_size": 14, "dynamic_hd": 36,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "rescale_factor": 1 / 255,
    "do_convert_rgb": True,
}, fixed={"do_rescale": True, "do_normalize": True, "resample": 3},
    inert=frozenset({"do_resize"}))
PROCESSOR_SCHEMA = Schema("Phi4MultimodalProcessor", {})
# transformers' processor counts a global view's tokens as 256 + 16 (16 x 16 pooled patches and
# a separator per row), whatever the crop and patch sizes: right for 32 x 32 patches per crop.
POOLED_SIDE = 16
DEFAULT_MAX_AUDIO_DURATION_S = 600.0


class Phi4MMProcessor(ProcessorDefaults):
    modalities = ("image", "audio")

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg, files = ctx.hf_config, ctx.files
        self.model_id = ctx.model_id
        vision, audio = cfg.vision_config, cfg.audio_config
        self.image_token_id, self.audio_token_id = vision.image_token_id, audio.audio_token_id
        image, found = files.component("image_processor"), files.component("feature_extractor")
        image_schema = choose_schema(image, {IMAGE_PROCESSOR.cls: IMAGE_PROCESSOR},
                                     IMAGE_PROCESSOR.cls)
        mel_schema = choose_schema(found, {FEATURE_EXTRACTOR.cls: FEATURE_EXTRACTOR},
                                   FEATURE_EXTRACTOR.cls, "feature_extractor_type")
        # Older checkpoints keep both in one preprocessor_config.json: each reads its own keys.
        pre = read_settings(own_keys(image, found, mel_schema), image_schema)
        mel = read_settings(own_keys(found, image, image_schema), mel_schema)
        own = read_settings(files.processor_fields(), PROCESSOR_SCHEMA)
        self.read = {"image_processor": pre, "feature_extractor": mel, "processor": own}
        size = pre["size"]
        if size.get("height") != size.get("width"):
            raise CheckpointError(f"{pre.sources['size']}: size={size} is not square, which "
                                  "Phi4MultimodalImageProcessor refuses")
        geometry = (size["height"], pre["patch_size"])
        if geometry != (vision.crop_size, vision.patch_size):
            raise CheckpointError(
                f"{pre.sources['size']}: crops of {geometry[0]} px and {geometry[1]} px patches, "
                f"but config.json's vision_config has crop_size={vision.crop_size}, patch_size="
                f"{vision.patch_size}: the model would cut its features differently")
        per_side = geometry[0] // geometry[1]
        if -(-per_side // 2) != POOLED_SIDE:
            raise CheckpointError(
                f"{pre.sources['size']}: crops of {geometry[0]} px and {geometry[1]} px patches "
                f"hold {per_side} x {per_side} patches: transformers' processor counts an "
                f"image's tokens for crops of {2 * POOLED_SIDE} x {2 * POOLED_SIDE} patches "
                f"({POOLED_SIDE} x {POOLED_SIDE} after pooling) only")
        self.hd = HDConfig(crop=size["height"], patch=pre["patch_size"],
                           dynamic_hd=int(pre["dynamic_hd"]),
                           rescale_factor=float(pre["rescale_factor"]),
                           image_mean=tuple(pre["image_mean"]), image_std=tuple(pre["image_std"]),
                           do_convert_rgb=bool(pre["do_convert_rgb"]))
        self.fbank = FbankConfig.from_settings(mel)
        if self.fbank.n_mels != audio.input_size:
            raise CheckpointError(f"{mel.sources['feature_size']}: feature_size="
                                  f"{self.fbank.n_mels} but the audio encoder takes "
                                  f"config.json's audio_config.input_size={audio.input_size}")
        if self.fbank.compression != audio.time_reduction:
            raise CheckpointError(
                f"{mel.sources['audio_compression_rate']}: audio_compression_rate="
                f"{self.fbank.compression} tokens per frame group, but the encoder reduces "
                f"time by config.json's audio_config.time_reduction={audio.time_reduction}")
        for token, want in (("image_token", self.image_token_id),
                            ("audio_token", self.audio_token_id)):
            name = getattr(ctx.tokenizer, token, None)
            if name is not None and ctx.tokenizer.convert_tokens_to_ids(name) != want:
                raise CheckpointError(f"the tokenizer's {token} {name!r} is not the token "
                                      f"config.json names ({want})")
        self.options = {
            "dynamic_hd": OptionRange(1, self.hd.dynamic_hd, integer=True,
                                      why="crops per image; at most the checkpoint's"),
            "max_audio_duration_s": OptionRange(0, DEFAULT_MAX_AUDIO_DURATION_S, low_open=True,
                                                why="seconds per clip; it can only lower it"),
        }
        self.extractor = FbankExtractor(self.fbank)
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Decode audio at the feature extractor's rate."""
        check_mm_kwargs(mm_kwargs, self.options, "Phi-4-multimodal")
        return {"audio_kwargs": {"sample_rate": self.fbank.sample_rate}}

    def max_embeds_per_item(self) -> int:
        """The largest image (over every grid of at most dynamic_hd crops) or clip."""
        side = self.hd.pooled_side
        image = max(side * (side + 1) + 1 + rows * side * (cols * side + 1)
                    for rows in range(1, self.hd.dynamic_hd + 1)
                    for cols in range(1, self.hd.dynamic_hd // rows + 1))
        clip = self.fbank.num_embeds(int(DEFAULT_MAX_AUDIO_DURATION_S * self.fbank.sample_rate))
        return max(image, clip)

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """Each item's tokens from its size alone (nothing resized or extracted)."""
        hd, limit = self._options(mm_kwargs)
        images, clips = self._media(token_ids, media, limit)
        items = [("image", hd_layout(i.width, i.height, hd).num_tokens(hd)) for i in images]
        items += [("audio", self.fbank.num_embeds(len(c.samples))) for c in clips]
        return PromptPlan(len(token_ids) - len(items) + sum(n for _, n in items), items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        hd, limit = self._options(mm_kwargs)
        images, clips = self._media(token_ids, media, limit)
        stages: dict[str, float] = {}
        encoded = {
            "image": [self._image(i, hd, stages) for i in images],
            "audio": [self._clip(c, "vision" if images else "speech", stages) for c in clips],
        }
        ids, features = expand_placeholders(token_ids, self._placeholders(), encoded,
                                            self._span)
        return ProcessedPrompt(None, ids, features, None, stages)

    def _placeholders(self) -> dict[int, str]:
        return {self.image_token_id: "image", self.audio_token_id: "audio"}

    def _span(self, modality: str, item: tuple[str, dict, int]) -> list[Expansion]:
        identifier, data, n = item
        return [Expansion([self._token(modality)] * n, identifier=identifier, data=data)]

    def _token(self, modality: str) -> int:
        return self.image_token_id if modality == "image" else self.audio_token_id

    def _options(self, mm_kwargs: Mapping[str, Any]) -> tuple[HDConfig, float]:
        options = check_mm_kwargs(mm_kwargs, self.options, "Phi-4-multimodal")
        hd = self.hd if "dynamic_hd" not in options else replace(
            self.hd, dynamic_hd=options["dynamic_hd"])
        return hd, options.get("max_audio_duration_s", DEFAULT_MAX_AUDIO_DURATION_S)

    def _media(self, token_ids: list[int], media: dict[str, list],
               limit: float) -> tuple[list, list[AudioClip]]:
        images, clips = media.get("image", []), media.get("audio", [])
        check_placeholder_count(token_ids, self._placeholders(), media)
        for number, clip in enumerate(clips, start=1):
            if clip.sample_rate != self.fbank.sample_rate:
                raise ValueError(f"audio {number} is at {clip.sample_rate} Hz, expected "
                                 f"{self.fbank.sample_rate} Hz (load it through engine.media)")
            if clip.duration_s > limit:
                raise MediaError(f"audio {number}: duration {clip.duration_s:.1f} s exceeds the "
                                 f"limit of {limit:g} s (mm_processor_kwargs "
                                 "max_audio_duration_s)")
            if self.fbank.num_frames(len(clip.samples)) == 0:
                raise MediaError(
                    f"audio {number}: {len(clip.samples)} samples are shorter than one "
                    f"analysis window ({self.fbank.win_length} samples, "
                    f"{1000 * self.fbank.win_length / self.fbank.sample_rate:g} ms)")
        return images, clips

    def _image(self, image, hd: HDConfig, stages: dict[str, float]):
        options = {"dynamic_hd": hd.dynamic_hd, "crop": hd.crop}
        identify = partial(hash_image, image, model_id=self.model_id, processor_kwargs=options)
        identifier, data = hashed_and_processed(self.cache, identify,
                                                partial(preprocess_hd, image, hd), stages)
        return identifier, data, num_image_tokens(data["useful"], hd)

    def _clip(self, clip: AudioClip, projection: str, stages: dict[str, float]):
        options = {**asdict(self.fbank), "projection": projection}
        t0 = time.perf_counter()
        identifier = hash_audio(clip, model_id=self.model_id, processor_kwargs=options)
        t1 = time.perf_counter()
        data = self.cache.get_or_compute(identifier, lambda: {
            "audio_input_features": self.extractor(clip.samples), "projection": projection})
        stages["hashing"] = stages.get("hashing", 0.0) + t1 - t0
        stages["preprocess"] = stages.get("preprocess", 0.0) + time.perf_counter() - t1
        return identifier, data, self.fbank.num_embeds(len(clip.samples))
