"""Prompt processing for Llama 3.2 Vision (transformers' MllamaProcessor): images -> tiles, and
which tokens attend to which image.

An image stays one `<|image|>` token in the prompt (it keeps its text embedding: nothing is
spliced); the model sees the image through its cross-attention layers. Which rows see which
image follows transformers' `get_cross_attention_token_mask`: an image is attended from its
token up to the next image's token; images whose tokens follow each other form a group, all
attended up to where the group's last one stops; the last group is attended to the end of the
sequence, generated tokens included. Rows before the first image attend to nothing (see
models/layers/cross_metadata.py for how the engine treats them).

A text prompt without the tokenizer's BOS gets one, after any images that open it, as
transformers' processor writes it (`build_string_from_input`), before the tokenizer adds its
own: the ids are the reference's.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Schema, choose_schema, read_settings
from models.interfaces import (
    CrossRows,
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.mllama.preprocess import (
    IMAGE_PROCESSORS,
    MllamaPreprocessConfig,
    num_tiles,
    preprocess_mllama,
    tile_arrangements,
)
from models.processing.base import (
    ProcessedCache,
    ProcessorDefaults,
    check_mm_kwargs,
    check_placeholder_count,
    hashed_and_processed,
    special_token_id,
)
from models.processing.hashing import hash_image

# MllamaProcessor has no settings of its own (its image token comes from the tokenizer).
PROCESSOR_SCHEMA = Schema("MllamaProcessor", {})
IMAGE_TOKEN = "<|image|>"  # MllamaProcessor's, unless the tokenizer names one


def cross_rows(locations: list[int]) -> list[tuple[int, int | None]]:
    """Each image's attending rows [start, end) from its token's position (end None: to the end
    of the sequence); see the module docstring."""
    ends: list[int | None] = [*locations[1:], None][: len(locations)]
    following: int | None = None
    for i in range(len(locations) - 1, -1, -1):
        if ends[i] == locations[i] + 1:  # the next token is an image too: its group's end
            ends[i] = following
        following = ends[i]
    return list(zip(locations, ends, strict=True))


class MllamaProcessor(ProcessorDefaults):
    modalities = ("image",)

    def __init__(self, ctx: ProcessorContext) -> None:
        tok, vision = ctx.tokenizer, ctx.hf_config.vision_config
        self.model_id = ctx.model_id
        self.tokenizer = tok
        found = ctx.files.component("image_processor")
        pre = read_settings(found, choose_schema(found, IMAGE_PROCESSORS, "MllamaImageProcessor"))
        own = read_settings(ctx.files.processor_fields(), PROCESSOR_SCHEMA)
        self.read = {"image_processor": pre, "processor": own}
        try:
            self.pre = MllamaPreprocessConfig.from_settings(pre)
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        self._check_tower(pre, vision)
        self.positions = (vision.image_size // vision.patch_size) ** 2 + 1  # per tile
        named = getattr(tok, "image_token", None)
        self.image_token = named or IMAGE_TOKEN
        self.image_id = special_token_id(
            tok, self.image_token, "tokenizer_config.json: image_token" if named
            else f"{PROCESSOR_SCHEMA.cls}'s default image token")
        self.bos = tok.bos_token
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def _check_tower(self, pre, vision) -> None:
        """The tiles must be what the tower embeds: its tile size, its tile count (transformers
        would fail on this checkpoint otherwise), aspect ratio ids within its tables."""
        problems = []
        if self.pre.tile_size != vision.image_size:
            problems.append(f"{pre.sources['size']}: tiles of {self.pre.tile_size} pixels, but "
                            f"the tower's image_size is {vision.image_size}")
        if self.pre.max_image_tiles != vision.max_num_tiles:
            problems.append(f"{pre.sources['max_image_tiles']}: max_image_tiles="
                            f"{self.pre.max_image_tiles}, but the tower embeds max_num_tiles="
                            f"{vision.max_num_tiles} tiles per image")
        arrangements = len(tile_arrangements(self.pre.max_image_tiles))
        if arrangements > len(vision.supported_aspect_ratios):
            problems.append(f"{arrangements} tile arrangements but the tower has embeddings for "
                            f"{len(vision.supported_aspect_ratios)} aspect ratios")
        if problems:
            raise CheckpointError("; ".join(problems))

    def _hash_options(self) -> dict[str, int]:
        return {"tile_size": self.pre.tile_size, "max_image_tiles": self.pre.max_image_tiles}

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        check_mm_kwargs(mm_kwargs, (), "Llama 3.2 Vision")
        return {}

    def max_embeds_per_item(self) -> int:
        """Key positions of the largest image: every tile its own."""
        return self.pre.max_image_tiles * self.positions

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        """A BOS after the images that open the prompt, unless it has one (see the module
        docstring)."""
        if not self.bos or self.bos in text:
            return text
        rest = text
        while rest.startswith(self.image_token):
            rest = rest[len(self.image_token):]
        return self.image_token * ((len(text) - len(rest)) // len(self.image_token)) + (
            self.bos + rest)

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        items = [("image", num_tiles(i.height, i.width, self.pre) * self.positions)
                 for i in media.get("image", [])]
        return PromptPlan(len(token_ids), items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        check_mm_kwargs(mm_kwargs, (), "Llama 3.2 Vision")
        images = media.get("image", [])
        check_placeholder_count(token_ids, {self.image_id: "image"}, media)
        locations = [i for i, t in enumerate(token_ids) if t == self.image_id]
        stages: dict[str, float] = {}
        features = []
        for image, (start, end) in zip(images, cross_rows(locations), strict=True):
            identify = partial(hash_image, image, model_id=self.model_id,
                               processor_kwargs=self._hash_options())
            compute = partial(preprocess_mllama, image, self.pre)
            identifier, data = hashed_and_processed(self.cache, identify, compute, stages)
            tiles = data["num_tiles"]
            features.append(MultiModalFeature(
                "image", identifier, PlaceholderRange(start, 1, is_embed=(False,)), data,
                part=f"{tiles} tile{'s' if tiles > 1 else ''}, cross-attended",
                cross=CrossRows(start, end, tiles * self.positions)))
        return ProcessedPrompt(None, list(token_ids), features, None, stages)
