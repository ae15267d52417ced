"""What the processors of image-only families whose one placeholder per image becomes one span
share (LLaVA, Pixtral): the image token checked against the processor's own field, no
per-request options, the plan from each image's size, and `process` (count check, each image
hashed and preprocessed through the processed-inputs cache, each placeholder expanded).

A family says, per image, the span its size gives (`span_size`), how its pixels are prepared
(`preprocess`, with the settings that change them in `hash_options`) and the span its
processed inputs become (`expansion`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Settings
from models.interfaces import ProcessedPrompt, ProcessorContext, PromptPlan
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


class ImageSpanProcessor(ProcessorDefaults):
    """One `image_token_id` placeholder per image, one span per image; no options."""

    modalities = ("image",)
    family = ""  # named in option errors
    model_id: str
    image_token_id: int
    cache: ProcessedCache

    def check_image_token(self, ctx: ProcessorContext, own: Settings) -> None:
        """The processor's `image_token` field must name config.json's image_token_index."""
        if ctx.tokenizer.convert_tokens_to_ids(own["image_token"]) != self.image_token_id:
            raise CheckpointError(
                f"{own.sources['image_token']}: image_token {own['image_token']!r} is not the "
                f"token config.json's image_token_index={self.image_token_id} names")

    # ---- what a family says ---------------------------------------------------------------------

    def span_size(self, height: int, width: int) -> tuple[int, int]:
        """(tokens, embeddings) of the span an image of height x width pixels becomes."""
        raise NotImplementedError

    def hash_options(self) -> dict[str, Any]:
        """The settings that change an image's encoder inputs (part of its content hash)."""
        raise NotImplementedError

    def preprocess(self, image) -> dict:
        """An image's encoder inputs."""
        raise NotImplementedError

    def expansion(self, data: dict) -> Expansion:
        """The span an image's encoder inputs become."""
        raise NotImplementedError

    # ---- the processor interface ----------------------------------------------------------------

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        check_mm_kwargs(mm_kwargs, (), self.family)
        return {}

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """Each image's span and embeddings from its size alone (nothing resized)."""
        check_mm_kwargs(mm_kwargs, (), self.family)
        sizes = [self.span_size(i.height, i.width) for i in media.get("image", [])]
        placeholders = token_ids.count(self.image_token_id)
        return PromptPlan(len(token_ids) - placeholders + sum(n for n, _ in sizes),
                          [("image", embeds) for _, embeds in sizes])

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        check_mm_kwargs(mm_kwargs, (), self.family)
        images = media.get("image", [])
        check_placeholder_count(token_ids, {self.image_token_id: "image"}, media)
        stages: dict[str, float] = {}
        encoded = [self._image(image, stages) for image in images]
        ids, features = expand_placeholders(
            token_ids, {self.image_token_id: "image"}, {"image": encoded},
            lambda _, item: [self._span(*item)])
        return ProcessedPrompt(None, ids, features, None, stages)

    def _span(self, identifier: str, data: dict) -> Expansion:
        run = self.expansion(data)
        return Expansion(run.tokens, run.is_embed, run.parts, identifier, data)

    def _image(self, image, stages: dict[str, float]) -> tuple[str, dict]:
        identify = partial(hash_image, image, model_id=self.model_id,
                           processor_kwargs=self.hash_options())
        return hashed_and_processed(self.cache, identify, partial(self.preprocess, image),
                                    stages)
