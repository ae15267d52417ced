"""Prompt processing for Gemma 3: images (and pan-and-scan crops) -> SigLIP inputs, spans.

Gemma's chat template writes one `<start_of_image>` per image. Each becomes, as transformers'
Gemma3Processor writes it, "\\n\\n<start_of_image>" + `<image_soft_token>` x mm_tokens_per_image
+ "<end_of_image>\\n\\n"; with pan-and-scan crops the image reads "Here is the original image
{image} and here are some crops to help you see better {crop} {crop}...". The expansion is done
on the text before tokenizing when the prompt is text (so newlines merge with their neighbours
exactly as the reference's tokenizer merges them), on the token ids otherwise. Every image and
every crop is its own encoder item whose span, the soft tokens only, is attended both ways.

Pan-and-scan (off unless the preprocessor config or mm_processor_kwargs turn it on): an image
whose aspect ratio reaches `pan_and_scan_min_ratio_to_activate` is cut along its long side into
2..max crops, about one per unit of aspect ratio, none smaller than the minimum crop size.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Schema, choose_schema, read_settings
from models.interfaces import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.processing.base import (
    Pieces,
    ProcessedCache,
    ProcessorDefaults,
    check_mm_kwargs,
    check_placeholder_count,
    expand_placeholders,
    hashed_and_processed,
    soft_runs,
)
from models.processing.clip_image import IMAGE_PROCESSORS, ClipPreprocessConfig, preprocess_clip
from models.processing.hashing import hash_image

_KWARGS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
           "pan_and_scan_min_ratio_to_activate")


@dataclass(frozen=True)
class PanAndScan:
    """Pan-and-scan settings, validated; the defaults are transformers' Gemma3Processor's."""

    enabled: bool = False
    min_crop_size: int = 256
    max_num_crops: int = 4
    min_ratio_to_activate: float = 1.2

    def __post_init__(self) -> None:
        if not 1 <= self.min_crop_size <= 8192:
            raise ValueError(f"pan_and_scan_min_crop_size must be in [1, 8192], got "
                             f"{self.min_crop_size}")
        if not 2 <= self.max_num_crops <= 16:
            raise ValueError(f"pan_and_scan_max_num_crops must be in [2, 16], got "
                             f"{self.max_num_crops}")
        if not 1.0 <= self.min_ratio_to_activate <= 100.0:
            raise ValueError(f"pan_and_scan_min_ratio_to_activate must be in [1, 100], got "
                             f"{self.min_ratio_to_activate}")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> PanAndScan:
        def get(key, kind, default):
            value = options.get(key)
            if value is None:
                return default
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be true or false, got {value!r}")
                return value
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"{key} must be a number, got {value!r}")
            return kind(value)

        base = cls()
        return cls(
            enabled=get("do_pan_and_scan", bool, base.enabled),
            min_crop_size=get("pan_and_scan_min_crop_size", int, base.min_crop_size),
            max_num_crops=get("pan_and_scan_max_num_crops", int, base.max_num_crops),
            min_ratio_to_activate=get("pan_and_scan_min_ratio_to_activate", float,
                                      base.min_ratio_to_activate),
        )

    def crops(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """The crop boxes (left, top, right, bottom) of an image, or [] when none apply."""
        if not self.enabled:
            return []
        long, short = max(width, height), min(width, height)
        if long / short < self.min_ratio_to_activate:
            return []
        n = int(math.floor(long / short + 0.5))  # rounds halves up
        n = min(self.max_num_crops, max(2, min(int(math.floor(long / self.min_crop_size)), n)))
        across, down = (n, 1) if width >= height else (1, n)
        crop_w, crop_h = math.ceil(width / across), math.ceil(height / down)
        if min(crop_w, crop_h) < self.min_crop_size:
            return []
        return [(x, y, min(x + crop_w, width), min(y + crop_h, height))
                for y in range(0, crop_h * down, crop_h) for x in range(0, crop_w * across, crop_w)]


# Gemma3Processor's own field (processor_config.json), with its default.
PROCESSOR_SCHEMA = Schema("Gemma3Processor", {"image_seq_length": 256})


class Gemma3Processor(ProcessorDefaults):
    modalities = ("image",)

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg, tok = ctx.hf_config, ctx.tokenizer
        self.model_id = ctx.model_id
        self.tokenizer = tok
        self.num_tokens = cfg.mm_tokens_per_image
        self.boi_id, self.eoi_id = cfg.boi_token_index, cfg.eoi_token_index
        self.soft_id = cfg.image_token_index
        self.boi, self.eoi, self.soft = (tok.convert_ids_to_tokens(i) for i in (
            self.boi_id, self.eoi_id, self.soft_id))
        image = ctx.files.component("image_processor")
        pre = read_settings(image, choose_schema(image, IMAGE_PROCESSORS, "Gemma3ImageProcessor"))
        own = read_settings(ctx.files.processor_fields(), PROCESSOR_SCHEMA)
        self.read = {"image_processor": pre, "processor": own}
        if own["image_seq_length"] != self.num_tokens:
            raise CheckpointError(
                f"{own.sources['image_seq_length']}: image_seq_length={own['image_seq_length']} "
                f"but the model emits config.json's mm_tokens_per_image={self.num_tokens} "
                "embeddings per image: transformers would fail on this checkpoint too")
        self.pre = ClipPreprocessConfig.from_settings(pre)
        # transformers' Gemma3Processor passes its own pan-and-scan defaults to the image
        # processor on every call (overriding the image processor's saved values): off unless
        # a request asks (mm_processor_kwargs).
        self.pan_and_scan = PanAndScan()
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def _sequence(self) -> str:
        return f"\n\n{self.boi}{self.soft * self.num_tokens}{self.eoi}\n\n"

    def _image_text(self, num_crops: int) -> str:
        if not num_crops:
            return self._sequence()
        return (f"Here is the original image {self._sequence()} and here are some crops to help "
                "you see better " + " ".join([self._sequence()] * num_crops))

    def _settings(self, mm_kwargs: Mapping[str, Any]) -> PanAndScan:
        check_mm_kwargs(mm_kwargs, _KWARGS, "Gemma 3")
        if not mm_kwargs:
            return self.pan_and_scan
        merged = {**{k: getattr(self.pan_and_scan, f) for k, f in zip(_KWARGS, (
            "enabled", "min_crop_size", "max_num_crops", "min_ratio_to_activate"), strict=True)},
            **mm_kwargs}
        return PanAndScan.from_options(merged)

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        self._settings(mm_kwargs)
        return {}

    def max_bidirectional_span(self) -> int:
        return self.num_tokens

    def max_embeds_per_item(self) -> int:
        return self.num_tokens

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        """Each image's `<start_of_image>` replaced by its full sequence (crops included)."""
        images = media.get("image", [])
        pieces = text.split(self.boi)
        if len(pieces) - 1 != len(images):
            return text  # `process` reports the mismatch
        settings = self._settings(mm_kwargs)
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:], strict=True):
            out.append(self._image_text(len(settings.crops(image.height, image.width))) + piece)
        return "".join(out)

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """Items (images and crops) and the expanded length, from the images' sizes."""
        settings = self._settings(mm_kwargs)
        crops = [len(settings.crops(i.height, i.width)) for i in media.get("image", [])]
        items = [("image", self.num_tokens)] * sum(1 + n for n in crops)
        if self.soft_id in token_ids:  # a text prompt, expanded before tokenizing
            return PromptPlan(len(token_ids), items)
        extra = sum(len(self.tokenizer.encode(self._image_text(n), add_special_tokens=False)) - 1
                    for n in crops)
        return PromptPlan(len(token_ids) + extra, items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        settings = self._settings(mm_kwargs)
        images = media.get("image", [])
        if self.soft_id not in token_ids:  # token-id prompt: expand here
            check_placeholder_count(token_ids, {self.boi_id: "image"}, media)
            token_ids = self._expand_ids(token_ids, images, settings)
        stages: dict[str, float] = {}
        items = [item for image in images for item in self._items(image, settings, stages)]
        spans = [(offset, n) for offset, n, _ in soft_runs(token_ids, {self.soft_id: "image"})]
        if len(spans) != len(items) or any(n != self.num_tokens for _, n in spans):
            raise ValueError(
                f"the prompt has {len(spans)} image token run(s) for {len(items)} image(s) and "
                f"crop(s), each of {self.num_tokens} tokens; write one <start_of_image> per "
                "image and no image soft tokens"
            )
        features = [
            MultiModalFeature("image", identifier,
                              PlaceholderRange(offset, n, bidirectional=True), data)
            for (offset, n), (identifier, data) in zip(spans, items, strict=True)
        ]
        return ProcessedPrompt(None, token_ids, features, None, stages)

    def _expand_ids(self, token_ids: list[int], images, settings: PanAndScan) -> list[int]:
        def text(_: str, image) -> Pieces:
            crops = len(settings.crops(image.height, image.width))
            return [self.tokenizer.encode(self._image_text(crops), add_special_tokens=False)]

        return expand_placeholders(token_ids, {self.boi_id: "image"}, {"image": images}, text)[0]

    def _items(self, image, settings: PanAndScan, stages) -> list[tuple[str, dict]]:
        """The image, then its crops: (content hash, {"pixel_values" [3, S, S]}) each."""
        rgb = image if image.mode == "RGB" else image.convert("RGB")
        parts = [rgb] + [rgb.crop(box) for box in settings.crops(rgb.height, rgb.width)]
        out = []
        for part in parts:
            compute = partial(lambda p: {"pixel_values": preprocess_clip(p, self.pre)}, part)
            identify = partial(hash_image, part, model_id=self.model_id,
                               processor_kwargs={"size": self.pre.base_size})
            out.append(hashed_and_processed(self.cache, identify, compute, stages))
        return out

