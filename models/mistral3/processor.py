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

import json
from collections.abc import Mapping
from functools import partial
from typing import Any

from models.interfaces import (
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.mistral3.preprocess import (
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


class PixtralProcessor(ProcessorDefaults):
    modalities = ("image",)

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg = ctx.hf_config
        self.model_id = ctx.model_id
        self.image_token_id = cfg.image_token_index
        # The merge size from the model's config (Mistral 3); LLaVA-Pixtral has no merger.
        self.unit = cfg.vision_config.patch_size * (getattr(cfg, "spatial_merge_size", None) or 1)
        path = ctx.model_path / "processor_config.json"
        names = json.loads(path.read_text()) if path.exists() else {}
        self.break_id = _token_id(ctx.tokenizer, names.get("image_break_token", "[IMG_BREAK]"))
        self.end_id = _token_id(ctx.tokenizer, names.get("image_end_token", "[IMG_END]"))
        path = ctx.model_path / "preprocessor_config.json"
        self.pre = PixtralPreprocessConfig.from_hf(
            json.loads(path.read_text()) if path.exists() else {})
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
