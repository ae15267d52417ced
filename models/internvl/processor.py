"""Prompt processing for InternVL 2.5 / 3 / 3.5: images and videos -> tiles and frames, their
spans, and the text transformers' InternVLProcessor writes around them (models/internvl/layout.py).

Settings are read where transformers reads them: the media tokens from the tokenizer
(`start_image_token`, `end_image_token`, `context_image_token`, `video_token`), the tile size,
tile counts and pixel settings from the image processor (GotOcr2ImageProcessor; InternVLProcessor
always asks it to crop to tiles), frame sampling and pixels from InternVLVideoProcessor, the
tokens per tile from the processor's `image_seq_length` (checked against what the tower emits).

Every tile of an image and every frame of a video is its own encoder item, with its own span
(its L context tokens), its own cache key (the item's content hash and its index) and the
item's hash as `item` for the panels: the tower never attends across tiles, so a tile's
embeddings are the same encoded alone, and a large image (up to max_patches + 1 tiles) can be
encoded over several steps within the encoder budget instead of in one, and evicted tile by
tile. `<img>`, `</img>` and the frame labels stay outside the spans as plain text.

Per-request options (mm_processor_kwargs): `max_patches` and `min_patches` (the grid's tile
count, as GotOcr2's kwargs), `num_frames` (frames sampled from a video, as InternVL's video
processor samples them: the middle frame of each of num_frames equal segments).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Schema, Settings, choose_schema, read_settings
from models.encoders.internvit import InternViTConfig
from models.interfaces import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.internvl.layout import Placed, PromptLayout, SpecialTokens
from models.internvl.model import tokens_per_tile
from models.internvl.preprocess import (
    IMAGE_PROCESSORS,
    VIDEO_PROCESSORS,
    PixelConfig,
    TileLimits,
    backend_of,
    image_grid,
    preprocess_frames,
    preprocess_image,
    settings_dict,
    tile_count,
    tile_limits,
)
from models.media_inputs import MAX_FPS
from models.processing.base import (
    ProcessedCache,
    ProcessorDefaults,
    hashed_and_processed,
    tokenizer_special_tokens,
)
from models.processing.hashing import hash_image, hash_video
from models.processing.options import OptionRange, check_mm_kwargs

# transformers' processor's own field (processor_config.json), with its default.
PROCESSORS = {"internvl": Schema("InternVLProcessor", {"image_seq_length": 256})}
_TOKENS = ("start_image_token", "end_image_token", "context_image_token", "video_token")


class InternVLProcessor(ProcessorDefaults):
    modalities = ("image", "video")

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg, tok = ctx.hf_config, ctx.tokenizer
        self.model_id = ctx.model_id
        self.per_tile = tokens_per_tile(cfg)
        tokens = special_tokens(tok)
        token_settings = Settings(  # for the inspector: where the processor found its tokens
            Schema("tokenizer", dict.fromkeys(_TOKENS)), {n: getattr(tok, n) for n in _TOKENS},
            dict.fromkeys(_TOKENS, "tokenizer_config.json (the tokenizer's extra special tokens)"))
        if tokens.context_id != cfg.image_token_id:
            raise CheckpointError(
                f"tokenizer: context_image_token {tokens.context!r} is id {tokens.context_id}, "
                f"but config.json image_token_id={cfg.image_token_id}: the model would not find "
                "the embeddings' places")
        self.layout = PromptLayout(tokens, self.per_tile,
                                   lambda text: tok.encode(text, add_special_tokens=False),
                                   tok.decode)
        files = ctx.files
        image, video = files.component("image_processor"), files.component("video_processor")
        image_settings = read_settings(image, choose_schema(image, IMAGE_PROCESSORS,
                                                            "GotOcr2ImageProcessor"))
        video_settings = read_settings(video, choose_schema(
            video, VIDEO_PROCESSORS, "InternVLVideoProcessor", "video_processor_type"))
        own = read_settings(files.processor_fields(), PROCESSORS["internvl"])
        self.read = {"image_processor": image_settings, "video_processor": video_settings,
                     "processor": own, "tokenizer": token_settings}
        if own["image_seq_length"] != self.per_tile:
            raise CheckpointError(
                f"{own.sources['image_seq_length']}: image_seq_length={own['image_seq_length']} "
                f"but the model emits {self.per_tile} embeddings per tile (config.json: "
                "vision_config image_size / patch_size, downsample_ratio): transformers would "
                "fail on this checkpoint too")
        named = image.data.get("image_processor_type") if image is not None else None
        self.image_cfg = PixelConfig.from_settings(image_settings, backend_of(named))
        self.video_cfg = PixelConfig.from_settings(video_settings, "torchvision")  # its only
        tower = InternViTConfig.from_hf(cfg.vision_config).image_size
        for name, pixels, settings in (("image", self.image_cfg, image_settings),
                                       ("video", self.video_cfg, video_settings)):
            if pixels.tile != tower:
                raise NotImplementedError(
                    f"{settings.sources['size']}: {name} tiles of {pixels.tile} pixels for a "
                    f"tower of {tower}: only tiles of the tower's own size are supported")
        self.limits = tile_limits(image_settings)
        self.sampled_frames = _sampled_frames(video_settings)
        context = cfg.get_text_config().max_position_embeddings
        most = max(1, context // self.per_tile)
        why = (f"tiles or frames of {self.per_tile} tokens each must fit the model's context of "
               f"{context} positions (text_config.max_position_embeddings)")
        count = OptionRange(1, most, integer=True, why=why)
        self.option_ranges = {"max_patches": count, "min_patches": count,
                              "num_frames": OptionRange(1, most, integer=True, why=why)}
        self.cache = ProcessedCache(ctx.processed_cache_items)

    # ---- options ------------------------------------------------------------------------------

    def _options(self, mm_kwargs: Mapping[str, Any]) -> tuple[TileLimits, dict[str, Any]]:
        """The request's tile limits (its options over the checkpoint's) and checked options."""
        options = check_mm_kwargs(mm_kwargs, self.option_ranges, "InternVL")
        low = options.get("min_patches", self.limits.min_patches)
        high = options.get("max_patches", self.limits.max_patches)
        if low > high and ("min_patches" in options or "max_patches" in options):
            raise ValueError(f"mm_processor_kwargs min_patches={low} must not exceed "
                             f"max_patches={high}")
        return TileLimits(low, high), options

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Videos: `num_frames` (the request's, else the video processor's when it samples)
        frames at segment centers; without one, every frame (transformers' video processor
        samples none then), up to MediaLimits.max_video_frames."""
        _, options = self._options(mm_kwargs)
        frames = options.get("num_frames", self.sampled_frames)
        if frames is None:
            return {"video_kwargs": {"fps": MAX_FPS}}
        return {"video_kwargs": {"fps": MAX_FPS, "max_frames": frames,
                                 "spread": "segment_centers"}}

    def max_embeds_per_item(self) -> int:
        return self.per_tile

    # ---- text ---------------------------------------------------------------------------------

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        limits, _ = self._options(mm_kwargs)
        tiles, frames = self._counts(media, limits)
        return self.layout.expand_text(text, tiles, frames)

    def _counts(self, media: dict[str, list], limits: TileLimits) -> tuple[list[int], list[int]]:
        """Tower inputs per image (from its size alone) and frames per video."""
        tiles = [tile_count(image_grid(i.height, i.width, self.image_cfg.tile, limits))
                 for i in media.get("image", [])]
        return tiles, [len(v.frames) for v in media.get("video", [])]

    def _placed(self, ids: list[int], tiles: list[int], frames: list[int]
                ) -> tuple[list[int], list[Placed]]:
        if not self.layout.is_expanded(ids):  # a token-id prompt: expand here
            ids = self.layout.expand_ids(ids, tiles, frames)
        return ids, self.layout.locate(ids, tiles, frames)

    # ---- planning and processing --------------------------------------------------------------

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """The expanded length and one item per tile and frame, from the media's sizes."""
        limits, _ = self._options(mm_kwargs)
        tiles, frames = self._counts(media, limits)
        ids, placed = self._placed(token_ids, tiles, frames)
        counts = {"image": tiles, "video": frames}
        items = [(p.modality, self.per_tile)
                 for p in placed for _ in range(counts[p.modality][p.index])]
        return PromptPlan(len(ids), items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        limits, _ = self._options(mm_kwargs)
        stages: dict[str, float] = {}
        encoded = {"image": [self._image(i, limits, stages) for i in media.get("image", [])],
                   "video": [self._video(v, stages) for v in media.get("video", [])]}
        tiles = [data["pixel_values"].shape[0] for _, data in encoded["image"]]
        frames = [data["pixel_values"].shape[0] for _, data in encoded["video"]]
        ids, placed = self._placed(token_ids, tiles, frames)
        features = []
        for p in placed:
            identifier, data = encoded[p.modality][p.index]
            pixels = data["pixel_values"]
            if p.modality == "image":
                offsets = [p.runs[0] + k * self.per_tile for k in range(len(pixels))]
                labels = _tile_labels(len(pixels))
            else:
                offsets, labels = list(p.runs), [f"frame {k + 1}" for k in range(len(pixels))]
            for k, (offset, label) in enumerate(zip(offsets, labels, strict=True)):
                features.append(MultiModalFeature(
                    p.modality, f"{identifier}:{k}", PlaceholderRange(offset, self.per_tile),
                    {"pixel_values": pixels[k:k + 1]}, item=identifier, part=label))
        return ProcessedPrompt(None, ids, features, None, stages)

    def _image(self, image, limits: TileLimits, stages: dict[str, float]) -> tuple[str, dict]:
        def compute() -> dict:
            pixels, grid = preprocess_image(image, self.image_cfg, limits)
            return {"pixel_values": pixels, "grid": grid}

        options = {**settings_dict(self.image_cfg), "min_patches": limits.min_patches,
                   "max_patches": limits.max_patches}
        identify = partial(hash_image, image, model_id=self.model_id, processor_kwargs=options)
        return hashed_and_processed(self.cache, identify, compute, stages)

    def _video(self, video, stages: dict[str, float]) -> tuple[str, dict]:
        def compute() -> dict:
            return {"pixel_values": preprocess_frames(video.frames, self.video_cfg)}

        identify = partial(hash_video, video, model_id=self.model_id,
                           processor_kwargs=settings_dict(self.video_cfg))
        return hashed_and_processed(self.cache, identify, compute, stages)


def special_tokens(tokenizer) -> SpecialTokens:
    """The media tokens InternVLProcessor reads from the tokenizer, each one token."""
    found = tokenizer_special_tokens(tokenizer, _TOKENS, "transformers' InternVLProcessor")
    texts = {name: text for name, (text, _) in found.items()}
    ids = {name: token for name, (_, token) in found.items()}
    return SpecialTokens(
        texts["start_image_token"], texts["end_image_token"], texts["context_image_token"],
        texts["video_token"], ids["start_image_token"], ids["end_image_token"],
        ids["context_image_token"], ids["video_token"])


def _sampled_frames(video) -> int | None:
    """The frames InternVLVideoProcessor samples by itself (do_sample_frames), else None."""
    if not video["do_sample_frames"]:
        return None
    frames = video["num_frames"]
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise CheckpointError(
            f"{video.sources['num_frames']}: do_sample_frames is set but num_frames="
            f"{frames!r} is not a positive integer (sampling by fps is not built)")
    return frames


def _tile_labels(count: int) -> list[str]:
    """Panel labels of an image's tower inputs: its grid's tiles, then the thumbnail."""
    if count == 1:
        return [""]
    return [f"tile {k + 1} of {count - 1}" for k in range(count - 1)] + ["thumbnail"]
