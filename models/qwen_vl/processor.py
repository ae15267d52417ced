"""Prompt processing for Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5: media -> patches, spans,
mRoPE (Qwen3.5 checkpoints name transformers' Qwen3VLProcessor).

The chat template writes `<|vision_start|><|image_pad|><|vision_end|>` per image (`<|video_pad|>`
per video). Each pad token becomes t*h*w / merge^2 pad tokens, the number of embeddings the
vision tower emits for that item, and the span gets a PlaceholderRange. The i-th placeholder of a
modality takes the i-th item of that modality.

A video becomes one encoder item per temporal patch (two frames), with consecutive spans: the
tower never attends across temporal patches, so each one's embeddings are the same whether
encoded alone or with the rest. The scheduler can then spread a long video's encoder work over
its prefill chunks instead of stalling every running stream for one huge encoder step. The
video's mRoPE positions are still computed from its whole grid. Qwen3-VL writes every temporal
group as "<t seconds><|vision_start|>" + pads + "<|vision_end|>" (t: the mean time of the group's
frames); each group's span covers that text too, with `is_embed` marking the pads.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from models.checkpoint import Schema, choose_schema, read_settings
from models.interfaces import ProcessedPrompt, ProcessorContext, PromptPlan
from models.layers.mrope import MRopePositions, mrope_positions
from models.processing.base import (
    Expansion,
    ProcessedCache,
    ProcessorDefaults,
    check_placeholder_count,
    expand_placeholders,
)
from models.processing.options import check_mm_kwargs
from models.processing.qwen_items import (
    checked_vision_options,
    image_item,
    pixel_budget,
    temporal_patches,
    video_item,
    vision_options,
)
from models.processing.qwen_vision import (
    IMAGE_PROCESSORS,
    VIDEO_PROCESSORS,
    VisionPreprocessConfig,
    smart_resize,
    smart_resize_clip,
)
from models.qwen_vl.family import base_family

# transformers' processors take no fields of their own (their tokens come from the tokenizer).
PROCESSORS = {kind: Schema(name, {}) for kind, name in (
    ("qwen2_vl", "Qwen2VLProcessor"), ("qwen2_5_vl", "Qwen2_5_VLProcessor"),
    ("qwen3_vl", "Qwen3VLProcessor"), ("qwen3_5", "Qwen3VLProcessor"))}
# The video processor class transformers picks for each model type (its defaults apply to a
# checkpoint whose video settings do not name one).
VIDEO_CLASSES = {"qwen2_vl": "Qwen2VLVideoProcessor", "qwen2_5_vl": "Qwen2VLVideoProcessor",
                 "qwen3_vl": "Qwen3VLVideoProcessor", "qwen3_5": "Qwen3VLVideoProcessor"}


class QwenVLProcessor(ProcessorDefaults):
    modalities = ("image", "video")

    def __init__(self, ctx: ProcessorContext) -> None:
        hf_config = ctx.hf_config
        self.model_id = ctx.model_id
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = hf_config.video_token_id
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = hf_config.vision_end_token_id
        # Qwen3-VL and Qwen3.5 write each temporal group of a video as its own "<t seconds>" +
        # vision span.
        family = base_family(hf_config.model_type)
        self.video_timestamps = family in ("qwen3_vl", "qwen3_5")
        self.tokenizer = ctx.tokenizer
        vision = hf_config.vision_config
        self.tokens_per_second = (
            getattr(vision, "tokens_per_second", None)
            if family == "qwen2_5_vl" else None
        )
        files = ctx.files
        image, video = files.component("image_processor"), files.component("video_processor")
        image_settings = read_settings(image, choose_schema(image, IMAGE_PROCESSORS,
                                                            "Qwen2VLImageProcessor"))
        video_settings = read_settings(video, choose_schema(
            video, VIDEO_PROCESSORS, VIDEO_CLASSES[family], "video_processor_type"))
        own = read_settings(files.processor_fields(), PROCESSORS[family])
        self.read = {"image_processor": image_settings, "video_processor": video_settings,
                     "processor": own}
        self.cfg = VisionPreprocessConfig.from_settings(image_settings, video_settings)
        self.cache = ProcessedCache(ctx.processed_cache_items)
        self.option_ranges = vision_options(self.cfg, ctx.max_item_embeds)

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Options for engine.media: how many frames to sample from a video (the media layer
        bounds max_frames by MediaLimits.max_video_frames)."""
        options = self._options(mm_kwargs)
        video = {"fps": options.get("fps", self.cfg.video_fps)}
        if "max_frames" in options:
            video["max_frames"] = options["max_frames"]
        return {"video_kwargs": video}

    def max_embeds_per_item(self) -> int:
        """The largest encoder item in embeddings (an image at max_pixels, or one temporal patch
        of a video at its max_pixels), for the start-up budget check."""
        return max(self.cfg.max_pixels, self.cfg.video_max_pixels) // self.cfg.factor**2

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """The expanded prompt's length and each encoder item's embeddings, from the items'
        sizes alone (no pixel is resized or normalized)."""
        options = self._options(mm_kwargs)
        check_placeholder_count(token_ids, self._pads(), media)
        merge = self.cfg.factor**2
        items: list[tuple[str, int]] = []
        extra = 0  # Qwen3-VL: per temporal group, its timestamp text and vision tokens
        for image in media.get("image", []):
            h, w = self._size(image.height, image.width, 1, options, video=False)
            items.append(("image", h * w // merge))
        for video in media.get("video", []):
            count, height, width = video.frames.shape[:3]
            h, w = self._size(height, width, count, options, video=True)
            groups = -(-count // self.cfg.temporal_patch_size)
            items.extend([("video", h * w // merge)] * groups)
            if self.video_timestamps:
                extra += sum(len(self._timestamp_head(t))
                             for t in _group_seconds(video.timestamps, self.cfg)) + groups
        placeholders = sum(token_ids.count(t) for t in self._pads())
        num_tokens = len(token_ids) - placeholders + extra + sum(n for _, n in items)
        return PromptPlan(num_tokens, items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        options = self._options(mm_kwargs)
        check_placeholder_count(token_ids, self._pads(), media)
        images, videos = media.get("image", []), media.get("video", [])
        stages = {"hashing": 0.0, "preprocess": 0.0}
        encoded = {
            "image": [self._image(img, options, stages) for img in images],
            "video": [self._video(vid, options, stages) for vid in videos],
        }
        t0 = time.perf_counter()
        ids, features = self._expand(token_ids, encoded)
        videos = [data for _, data in encoded["video"]]
        if self.video_timestamps:  # every temporal group is a span of its own
            videos = [{**d, "grid_thw": (1, *d["grid_thw"][1:])}
                      for d in videos for _ in range(d["grid_thw"][0])]
        positions, delta = mrope_positions(
            ids,
            image_grid_thw=[data["grid_thw"] for _, data in encoded["image"]],
            video_grid_thw=[d["grid_thw"] for d in videos],
            second_per_grid_ts=[d["second_per_grid_t"] for d in videos],
            spatial_merge_size=self.cfg.merge_size,
            image_token_id=self.image_token_id,
            video_token_id=self.video_token_id,
            vision_start_token_id=self.vision_start_token_id,
            tokens_per_second=self.tokens_per_second,
        )
        stages["preprocess"] += time.perf_counter() - t0
        return ProcessedPrompt(None, ids, features, MRopePositions(positions, delta), stages)

    def _options(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return checked_vision_options(check_mm_kwargs(mm_kwargs, self.option_ranges, "Qwen-VL"))

    def _pads(self) -> dict[int, str]:
        return {self.image_token_id: "image", self.video_token_id: "video"}

    def _size(self, height: int, width: int, frames: int, options: dict[str, Any], *,
              video: bool) -> tuple[int, int]:
        """(height, width) an item is resized to (as preprocess_image / preprocess_video)."""
        budget = pixel_budget(self.cfg, options, video=video)
        if video and self.cfg.video_budget_per_clip:
            return smart_resize_clip(frames, height, width, self.cfg.factor, **budget,
                                     temporal_factor=self.cfg.temporal_patch_size)
        return smart_resize(height, width, self.cfg.factor, **budget)

    def _timestamp_head(self, seconds: float) -> list[int]:
        """The tokens before a Qwen3-VL temporal group's pads: "<t seconds><|vision_start|>"."""
        head = self.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False)
        return [*head, self.vision_start_token_id]

    def _image(self, image, kw, stages) -> tuple[str, dict]:
        budget = pixel_budget(self.cfg, kw, video=False)
        return image_item(self.cache, image, self.cfg, budget, self.model_id, stages)

    def _video(self, video, kw, stages) -> tuple[str, dict]:
        budget = pixel_budget(self.cfg, kw, video=True)
        identifier, data = video_item(self.cache, video, self.cfg, budget, self.model_id, stages)
        # Qwen3-VL's timestamps (the processed inputs, cached, are shared with other prompts).
        return identifier, {**data, "group_seconds": _group_seconds(video.timestamps, self.cfg)}

    def _expand(self, token_ids: list[int], encoded: dict[str, list]):
        """Repeat each pad token to its item's embedding count; one feature per image and per
        temporal patch of a video."""
        return expand_placeholders(token_ids, self._pads(), encoded, self._spans)

    def _spans(self, modality: str, item: tuple[str, dict]) -> list[Expansion]:
        identifier, data = item
        token = self.image_token_id if modality == "image" else self.video_token_id
        merge = self.cfg.merge_size**2
        _, h, w = data["grid_thw"]
        parts = [item] if modality == "image" else temporal_patches(identifier, data)
        spans = []
        for i, (part_id, part) in enumerate(parts):
            n = h * w // merge * part["grid_thw"][0]
            if modality == "video" and self.video_timestamps:
                head = self._timestamp_head(data["group_seconds"][i])
                # One span per group: its timestamp text and vision tokens sit inside it as
                # text (is_embed False), the pads take the embeddings.
                mask = (False,) * len(head) + (True,) * n + (False,)
                spans.append(Expansion([*head, *[token] * n, self.vision_end_token_id], mask,
                                       identifier=part_id, data=part))
            else:
                spans.append(Expansion([token] * n, identifier=part_id, data=part))
        return spans


def _group_seconds(timestamps, cfg: VisionPreprocessConfig) -> list[float]:
    """Per temporal group, the mean of its first and last frames' times (an odd tail repeats
    the last frame, as the frames do)."""
    times = [float(t) for t in timestamps]
    times += [times[-1]] * (-len(times) % cfg.temporal_patch_size)
    k = cfg.temporal_patch_size
    return [(times[i] + times[i + k - 1]) / 2 for i in range(0, len(times), k)]
