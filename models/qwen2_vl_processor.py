"""Prompt processing for Qwen2-VL / Qwen2.5-VL / Qwen3-VL: media -> patches, spans, mRoPE.

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

import json
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.hashing import hash_image, hash_video
from models.interfaces import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
)
from models.mrope import mrope_positions, window_positions
from models.processor_base import (
    ProcessedCache,
    ProcessorDefaults,
    check_mm_kwargs,
    hashed_and_processed,
)
from models.qwen_vl_preprocess import VisionPreprocessConfig, preprocess_image, preprocess_video

_KWARGS = ("min_pixels", "max_pixels", "fps", "max_frames")


@dataclass(frozen=True)
class MRopePositions:
    """A request's mRoPE positions: its prompt's [3, P] and the decode delta."""

    prompt: torch.Tensor
    delta: int

    def window(self, start: int, end: int) -> torch.Tensor:
        """Positions [3, end - start] of sequence indices [start, end)."""
        return window_positions(self.prompt, self.delta, start, end)


class QwenVLProcessor(ProcessorDefaults):
    modalities = ("image", "video")

    def __init__(self, ctx: ProcessorContext) -> None:
        hf_config = ctx.hf_config
        self.model_id = ctx.model_id
        self.image_token_id = hf_config.image_token_id
        self.video_token_id = hf_config.video_token_id
        self.vision_start_token_id = hf_config.vision_start_token_id
        self.vision_end_token_id = hf_config.vision_end_token_id
        # Qwen3-VL writes each temporal group of a video as its own "<t seconds>" + vision span.
        self.video_timestamps = hf_config.model_type == "qwen3_vl"
        self.tokenizer = ctx.tokenizer
        vision = hf_config.vision_config
        self.tokens_per_second = (
            getattr(vision, "tokens_per_second", None)
            if hf_config.model_type == "qwen2_5_vl" else None
        )
        self.cfg = VisionPreprocessConfig.from_hf(*_preprocessor_configs(ctx.model_path))
        self.cache = ProcessedCache(ctx.processed_cache_items)

    def loader_kwargs(self, mm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Options for engine.media: how many frames to sample from a video."""
        check_mm_kwargs(mm_kwargs, _KWARGS, "Qwen-VL")
        video = {"fps": float(mm_kwargs.get("fps", self.cfg.video_fps))}
        if "max_frames" in mm_kwargs:
            video["max_frames"] = int(mm_kwargs["max_frames"])
        return {"video_kwargs": video}


    def max_embeds_per_item(self) -> int:
        """The largest encoder item in embeddings (an image at max_pixels, or one temporal patch
        of a video at its max_pixels), for the start-up budget check."""
        return max(self.cfg.max_pixels, self.cfg.video_max_pixels) // self.cfg.factor**2

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        check_mm_kwargs(mm_kwargs, _KWARGS, "Qwen-VL")
        images, videos = media.get("image", []), media.get("video", [])
        for name, token, items in (("image", self.image_token_id, images),
                                   ("video", self.video_token_id, videos)):
            found = token_ids.count(token)
            if found != len(items):
                raise ValueError(
                    f"the prompt has {found} {name} placeholder(s) but {len(items)} {name}(s) "
                    f"were given; each {name} needs one placeholder (the chat template adds it)"
                )
        stages = {"hashing": 0.0, "preprocess": 0.0}
        encoded = {
            "image": [self._image(img, mm_kwargs, stages) for img in images],
            "video": [self._video(vid, mm_kwargs, stages) for vid in videos],
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

    def _image(self, image, kw, stages) -> tuple[str, dict]:
        options = {"min_pixels": int(kw.get("min_pixels", self.cfg.min_pixels)),
                   "max_pixels": int(kw.get("max_pixels", self.cfg.max_pixels))}

        def compute():
            pixels, grid = preprocess_image(image, self.cfg, **options)
            return {"pixel_values": pixels, "grid_thw": grid}

        identify = partial(hash_image, image, model_id=self.model_id, processor_kwargs=options)
        return hashed_and_processed(self.cache, identify, compute, stages)

    def _video(self, video, kw, stages) -> tuple[str, dict]:
        options = {"min_pixels": int(kw.get("min_pixels", self.cfg.video_min_pixels)),
                   "max_pixels": int(kw.get("max_pixels", self.cfg.video_max_pixels))}

        def compute():
            pixels, grid = preprocess_video(video.frames, self.cfg, **options)
            # Seconds covered by one temporal patch (Qwen2.5-VL's temporal positions).
            per_grid = self.cfg.temporal_patch_size / video.sampled_fps
            return {"pixel_values": pixels, "grid_thw": grid, "second_per_grid_t": per_grid,
                    "group_seconds": _group_seconds(video.timestamps, self.cfg)}

        identify = partial(hash_video, video, model_id=self.model_id, processor_kwargs=options)
        return hashed_and_processed(self.cache, identify, compute, stages)

    def _expand(self, token_ids: list[int], encoded: dict[str, list]):
        """Repeat each pad token to its item's embedding count; one feature per image and per
        temporal patch of a video."""
        merge = self.cfg.merge_size**2
        pads = {self.image_token_id: "image", self.video_token_id: "video"}
        queues = {m: iter(items) for m, items in encoded.items()}
        ids: list[int] = []
        features: list[MultiModalFeature] = []
        for token in token_ids:
            modality = pads.get(token)
            if modality is None:
                ids.append(token)
                continue
            identifier, data = next(queues[modality])
            t, h, w = data["grid_thw"]
            parts = [(identifier, data)] if modality == "image" else _temporal_patches(
                identifier, data)
            for i, (part_id, part) in enumerate(parts):
                n = h * w // merge * part["grid_thw"][0]
                if modality == "video" and self.video_timestamps:
                    head = self.tokenizer.encode(f"<{data['group_seconds'][i]:.1f} seconds>",
                                                 add_special_tokens=False)
                    head.append(self.vision_start_token_id)
                    # One span per group: its timestamp text and vision tokens sit inside it
                    # as text (is_embed False), the pads take the embeddings.
                    mask = (False,) * len(head) + (True,) * n + (False,)
                    span = PlaceholderRange(len(ids), len(mask), mask)
                    ids.extend([*head, *[token] * n, self.vision_end_token_id])
                else:
                    span = PlaceholderRange(len(ids), n)
                    ids.extend([token] * n)
                features.append(MultiModalFeature(modality, part_id, span, part))
        return ids, features


def _temporal_patches(identifier: str, data: dict) -> list[tuple[str, dict]]:
    """Split a processed video into one encoder item per temporal patch (views, no copies)."""
    t, h, w = data["grid_thw"]
    rows = h * w  # patch rows per temporal patch
    return [
        (f"{identifier}:t{i}",
         {"pixel_values": data["pixel_values"][i * rows : (i + 1) * rows], "grid_thw": (1, h, w)})
        for i in range(t)
    ]


def _group_seconds(timestamps, cfg: VisionPreprocessConfig) -> list[float]:
    """Per temporal group, the mean of its first and last frames' times (an odd tail repeats
    the last frame, as the frames do)."""
    times = [float(t) for t in timestamps]
    times += [times[-1]] * (-len(times) % cfg.temporal_patch_size)
    k = cfg.temporal_patch_size
    return [(times[i] + times[i + k - 1]) / 2 for i in range(0, len(times), k)]


def _preprocessor_configs(path: Path) -> tuple[dict, dict | None]:
    """The checkpoint's preprocessor_config.json (empty if absent) and video config, if any."""
    image = path / "preprocessor_config.json"
    video = path / "video_preprocessor_config.json"
    return (
        json.loads(image.read_text()) if image.exists() else {},
        json.loads(video.read_text()) if video.exists() else None,
    )
