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

from collections.abc import Mapping
from functools import partial
from typing import Any

from models.checkpoint import PROCESSOR, CheckpointError, Schema, choose_schema, read_settings
from models.interfaces import (
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.mistral3.preprocess import (
    IMAGE_PROCESSORS,
    PixtralPreprocessConfig,
    pixtral_resized_size,
    preprocess_pixtral,
)
from models.processing.base import (
    Expansion,
    ProcessedCache,
    ProcessorDefaults,
    check_mm_kwargs,
    check_placeholder_count,
    expand_placeholders,
    hashed_and_processed,
)
from models.processing.hashing import hash_image

# transformers' PixtralProcessor's own fields (processor_config.json), with its defaults.
PROCESSOR_SCHEMA = Schema("PixtralProcessor", {
    "patch_size": 16, "spatial_merge_size": 1, "image_token": "[IMG]",
    "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"})


class PixtralProcessor(ProcessorDefaults):
    modalities = ("image",)

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
        if _token_id(ctx.tokenizer, own["image_token"]) != self.image_token_id:
            raise CheckpointError(
                f"{own.sources['image_token']}: image_token {own['image_token']!r} is not the "
                f"token config.json's image_token_index={self.image_token_id} names")
        self.break_id = _token_id(ctx.tokenizer, own["image_break_token"])
        self.end_id = _token_id(ctx.tokenizer, own["image_end_token"])
        self.pre = PixtralPreprocessConfig.from_settings(pre)
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        check_mm_kwargs(mm_kwargs, (), "Pixtral")
        return {}

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, cols) of embeddings an image of height x width pixels becomes."""
        h, w = pixtral_resized_size(height, width, self.pre.longest_edge, self.unit)
        return h // self.unit, w // self.unit

    def max_embeds_per_item(self) -> int:
        side = -(-self.pre.longest_edge // self.unit)
        return side * side

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """Each image's span and embeddings from its size alone (nothing resized)."""
        check_mm_kwargs(mm_kwargs, (), "Pixtral")
        grids = [self.grid(i.height, i.width) for i in media.get("image", [])]
        placeholders = token_ids.count(self.image_token_id)
        spans = sum(rows * (cols + 1) for rows, cols in grids)
        return PromptPlan(len(token_ids) - placeholders + spans,
                          [("image", rows * cols) for rows, cols in grids])

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        check_mm_kwargs(mm_kwargs, (), "Pixtral")
        images = media.get("image", [])
        check_placeholder_count(token_ids, self.image_token_id, len(images), "image")
        stages: dict[str, float] = {}
        encoded = [self._image(image, stages) for image in images]
        ids, features = expand_placeholders(token_ids, self.image_token_id, "image", encoded,
                                            self._expansion)
        return ProcessedPrompt(None, ids, features, None, stages)

    def _expansion(self, data: dict) -> Expansion:
        rows, cols = data["grid"]
        run = ([self.image_token_id] * cols + [self.break_id]) * rows
        run[-1] = self.end_id
        return Expansion(run, is_embed=tuple(t == self.image_token_id for t in run))

    def _image(self, image, stages: dict[str, float]) -> tuple[str, dict]:
        options = {"longest_edge": self.pre.longest_edge, "unit": self.unit}

        def compute() -> dict:
            pixels = preprocess_pixtral(image, self.pre, self.unit)
            grid = (pixels.shape[1] // self.unit, pixels.shape[2] // self.unit)
            return {"pixel_values": pixels, "image_size": tuple(pixels.shape[1:]), "grid": grid}

        identify = partial(hash_image, image, model_id=self.model_id, processor_kwargs=options)
        return hashed_and_processed(self.cache, identify, compute, stages)


def _token_id(tokenizer, token: str) -> int:
    """The id of a special token the tokenizer must know."""
    found = tokenizer.convert_tokens_to_ids(token)
    if found is None or found == tokenizer.unk_token_id:
        raise ValueError(f"the tokenizer has no {token!r} token (Pixtral's image prompts need it)")
    return found
