"""Prompt processing for LLaVA-1.5 and LLaVA-NeXT: images -> tower inputs, `<image>` spans.

The chat template writes one `<image>` per image; it becomes as many `<image>` tokens as the
model emits for that image, one span per image. LLaVA-1.5: the tower's patches of the one
center-cropped image (less the class token with the "default" feature strategy). LLaVA-NeXT:
the base image's patches, then the unpadded grid of its tiles with one newline per row, counted
with the same `unpad_bounds` the model cuts with, so the count and the embeddings agree.
A checkpoint with a Pixtral tower is served by models/mistral3/processor.py instead (see the
registry's vision-tower variants).
"""

from __future__ import annotations

from typing import Any

from models.checkpoint import PROCESSOR, CheckpointError, Schema, choose_schema, read_settings
from models.interfaces import ProcessorContext
from models.llava.preprocess import (
    llava_next_num_image_tokens,
    llava_num_image_tokens,
    preprocess_llava_next,
)
from models.processing.base import Expansion, ProcessedCache
from models.processing.clip_image import IMAGE_PROCESSORS, ClipPreprocessConfig, preprocess_clip
from models.processing.image_spans import ImageSpanProcessor

_OWN = {"patch_size": None, "vision_feature_select_strategy": None,
        "num_additional_image_tokens": 0, "image_token": "<image>"}
# transformers' processors' own fields (processor_config.json), with their defaults.
PROCESSORS = {"llava": Schema("LlavaProcessor", _OWN),
              "llava_next": Schema("LlavaNextProcessor", _OWN)}


class LlavaProcessor(ImageSpanProcessor):
    family = "LLaVA"

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg = ctx.hf_config
        self.model_id = ctx.model_id
        self.image_token_id = cfg.image_token_index
        self.anyres = cfg.model_type == "llava_next"
        files = ctx.files
        image = files.component("image_processor")
        pre = read_settings(image, choose_schema(
            image, IMAGE_PROCESSORS,
            "LlavaNextImageProcessor" if self.anyres else "CLIPImageProcessor"))
        own = read_settings(files.processor_fields(), PROCESSORS[cfg.model_type])
        self.read = {"image_processor": pre, "processor": own}
        self.pre = ClipPreprocessConfig.from_settings(pre)
        # The tokens an image becomes, as transformers' processor counts them (its own fields),
        # which must be the features the model emits for it (the model config's).
        vision = cfg.vision_config
        self.tile, self.patch = self.pre.tile_size, own["patch_size"]
        if self.patch is None:
            raise CheckpointError(
                f"{PROCESSOR} has no patch_size: {own.schema.cls} cannot count an image's "
                f"tokens without it (the vision tower's patch_size is {vision.patch_size})")
        # transformers drops one token for "default" and none for anything else (None too).
        given = own["vision_feature_select_strategy"]
        self.strategy = "default" if given == "default" else "full"
        self.class_tokens = own["num_additional_image_tokens"]
        self.side = self.tile // self.patch  # patches per tile side
        self.per_tile = llava_num_image_tokens(self.tile, self.patch, self.strategy,
                                               self.class_tokens)
        emitted = llava_num_image_tokens(
            vision.image_size, vision.patch_size, cfg.vision_feature_select_strategy,
            int(vision.model_type.startswith("clip")))
        if (self.per_tile, self.side) != (emitted, vision.image_size // vision.patch_size):
            raise CheckpointError(
                f"the processor expands a {self.tile}-pixel tile to {self.per_tile} tokens "
                f"({own.sources['patch_size']}={self.patch}, vision_feature_select_strategy="
                f"{given!r}, num_additional_image_tokens={self.class_tokens}), but the "
                f"model emits {emitted} features for its {vision.image_size}-pixel input "
                "(config.json: vision_config, vision_feature_select_strategy): transformers "
                "would fail on this checkpoint too")
        self.check_image_token(ctx, own)
        self.pinpoints = [tuple(p) for p in getattr(cfg, "image_grid_pinpoints", None) or []]
        if self.anyres and [tuple(p) for p in self.pre.image_grid_pinpoints] != self.pinpoints:
            raise CheckpointError(
                f"{pre.sources['image_grid_pinpoints']}: image_grid_pinpoints "
                f"{self.pre.image_grid_pinpoints} differ from config.json's "
                f"{self.pinpoints}: the processor would tile images differently from the model")
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def max_embeds_per_item(self) -> int:
        if not self.anyres:
            return self.per_tile
        # The grid's features bound the unpadded ones: every row kept, plus its newline.
        return self.per_tile + max(
            (h // self.tile * self.side) * (w // self.tile * self.side + 1)
            for h, w in self.pinpoints
        )

    def num_tokens(self, image_size: tuple[int, int]) -> int:
        """Tokens one image of (height, width) becomes."""
        if not self.anyres:
            return self.per_tile
        return llava_next_num_image_tokens(*image_size, self.pinpoints, self.tile, self.patch,
                                           self.strategy, self.class_tokens)

    def span_size(self, height: int, width: int) -> tuple[int, int]:
        n = self.num_tokens((height, width))
        return n, n

    def expansion(self, data: dict) -> Expansion:
        n = self.num_tokens(data["image_size"])
        parts = ()
        if self.anyres:
            rows, cols = data["grid"]
            parts = (("base", self.per_tile), (f"tiles {rows}x{cols}", n - self.per_tile))
        return Expansion([self.image_token_id] * n, parts=parts)

    def hash_options(self) -> dict[str, Any]:
        return {"anyres": self.anyres, "tile": self.tile}

    def preprocess(self, image) -> dict:
        size = (image.height, image.width)
        if not self.anyres:
            pixels = preprocess_clip(image, self.pre)[None]
            return {"pixel_values": pixels, "image_size": size, "grid": (1, 1)}
        pixels, size, grid = preprocess_llava_next(image, self.pre)
        return {"pixel_values": pixels, "image_size": tuple(size), "grid": tuple(grid)}
