"""Prompt processing for Pixtral-towered models (Mistral Small 3.1, LLaVA-Pixtral): images ->
tower inputs, `[IMG]` spans with row breaks inside.

The chat template writes one `[IMG]` per image. An image resized to rows x cols cells (a cell
is patch x merge pixels, one embedding) becomes, row by row, cols `[IMG]` tokens and an
`[IMG_BREAK]`, the last break replaced by `[IMG_END]`, as transformers' PixtralProcessor
expands it. That whole run is ONE span per image; `is_embed` marks its `[IMG]` positions,
which take the image's embeddings in order, while the break and end tokens keep their text
embeddings.
"""

from __future__ import annotations

from typing import Any

from models.checkpoint import PROCESSOR, CheckpointError, Schema, choose_schema, read_settings
from models.interfaces import ProcessorContext
from models.mistral3.preprocess import (
    IMAGE_PROCESSORS,
    PixtralPreprocessConfig,
    pixtral_resized_size,
    preprocess_pixtral,
)
from models.processing.base import Expansion, ProcessedCache, special_token_id
from models.processing.image_spans import ImageSpanProcessor

# transformers' PixtralProcessor's own fields (processor_config.json), with its defaults.
PROCESSOR_SCHEMA = Schema("PixtralProcessor", {
    "patch_size": 16, "spatial_merge_size": 1, "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})


class PixtralProcessor(ImageSpanProcessor):
    family = "Pixtral"

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg = ctx.hf_config
        self.model_id = ctx.model_id
        self.image_token_id = cfg.image_token_index
        files = ctx.files
        image = files.component("image_processor")
        pre = read_settings(image, choose_schema(image, IMAGE_PROCESSORS, "PixtralImageProcessor"))
        own = read_settings(files.processor_fields(), PROCESSOR_SCHEMA)
        self.read = {"image_processor": pre, "processor": own}
        # An image is cut into cells of patch x merge pixels, one embedding each: the
        # processor's fields must say what the model's config does (Mistral 3 merges 2 x 2;
        # LLaVA-Pixtral has no merger).
        self.unit = own["patch_size"] * own["spatial_merge_size"]
        model_unit = cfg.vision_config.patch_size * (getattr(cfg, "spatial_merge_size", None) or 1)
        if self.unit != model_unit:
            raise CheckpointError(
                f"{PROCESSOR}: patch_size={own['patch_size']} x spatial_merge_size="
                f"{own['spatial_merge_size']} ({own.sources['patch_size']}, "
                f"{own.sources['spatial_merge_size']}) cut images into {self.unit}-pixel cells, "
                f"but the model embeds {model_unit}-pixel cells (config.json: vision_config."
                "patch_size, spatial_merge_size): transformers would fail on this checkpoint too")
        self.check_image_token(ctx, own)
        self.break_id, self.end_id = (
            special_token_id(ctx.tokenizer, own[k], own.sources[k])
            for k in ("image_break_token", "image_end_token"))
        self.pre = PixtralPreprocessConfig.from_settings(pre)
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of embeddings an image of height x width pixels becomes."""
        h, w = pixtral_resized_size(height, width, self.pre.longest_edge, self.unit)
        return h // self.unit, w // self.unit

    def max_embeds_per_item(self) -> int:
        side = -(-self.pre.longest_edge // self.unit)
        return side * side

    def span_size(self, height: int, width: int) -> tuple[int, int]:
        rows, cols = self.grid(height, width)
        return rows * (cols + 1), rows * cols

    def expansion(self, data: dict) -> Expansion:
        rows, cols = data["grid"]
        run = ([self.image_token_id] * cols + [self.break_id]) * rows
        run[-1] = self.end_id
        return Expansion(run, is_embed=tuple(t == self.image_token_id for t in run))

    def hash_options(self) -> dict[str, Any]:
        return {"longest_edge": self.pre.longest_edge, "unit": self.unit}

    def preprocess(self, image) -> dict:
        pixels = preprocess_pixtral(image, self.pre, self.unit)
        grid = (pixels.shape[1] // self.unit, pixels.shape[2] // self.unit)
        return {"pixel_values": pixels, "image_size": tuple(pixels.shape[1:]), "grid": grid}
