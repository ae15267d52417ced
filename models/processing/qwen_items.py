"""Encoder items of the Qwen-VL pixel path, shared by the Qwen-VL and Qwen-Omni processors: the
pixel budget a request's options give an image or a video, the ranges of those options (and the
check that their minimum does not exceed their maximum), an
image or a video hashed and preprocessed through the processed-inputs cache, and a processed
video split into one encoder item per temporal patch."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from PIL import Image

from models.media_inputs import MAX_FPS, VideoFrames
from models.processing.base import ProcessedCache, hashed_and_processed
from models.processing.hashing import hash_image, hash_video
from models.processing.options import OptionRange
from models.processing.qwen_vision import (
    VisionPreprocessConfig,
    preprocess_image,
    preprocess_video,
)


def pixel_budget(cfg: VisionPreprocessConfig, options: Mapping[str, Any], *,
                 video: bool) -> dict[str, int]:
    """min_pixels / max_pixels of an image or a video frame: the request's options, else the
    checkpoint's settings."""
    return {
        "min_pixels": options.get("min_pixels",
                                  cfg.video_min_pixels if video else cfg.min_pixels),
        "max_pixels": options.get("max_pixels",
                                  cfg.video_max_pixels if video else cfg.max_pixels),
    }


def checked_vision_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options` (checked against vision_options' ranges), refused when its min_pixels exceeds
    its max_pixels."""
    low, high = options.get("min_pixels"), options.get("max_pixels")
    if low is not None and high is not None and low > high:
        raise ValueError(
            f"mm_processor_kwargs min_pixels={low} must not exceed max_pixels={high}")
    return options


def vision_options(cfg: VisionPreprocessConfig, max_item_embeds: int) -> dict[str, OptionRange]:
    """Per-request options and their ranges: pixel budgets from one merged patch up to the
    largest item the encoder budget can take, so that no option makes an item that could never
    be scheduled (or that allocates past what the engine could encode); the video sampling rate
    and frame cap."""
    pixels = OptionRange(
        cfg.factor**2,
        max_item_embeds * cfg.factor**2,
        integer=True,
        why=f"pixels per image or video frame: at least one {cfg.factor}x{cfg.factor} patch, at "
        f"most {max_item_embeds} of them, min(encoder_cache_size, max_num_encoder_input_tokens)",
    )
    return {
        "min_pixels": pixels,
        "max_pixels": pixels,
        "fps": OptionRange(0, MAX_FPS, low_open=True, why="video frames sampled per second"),
        "max_frames": OptionRange(
            1, integer=True, why="frames per video, at most MediaLimits.max_video_frames"
        ),
    }


def image_item(cache: ProcessedCache, image: Image.Image, cfg: VisionPreprocessConfig,
               budget: dict[str, int], model_id: str,
               stages: dict[str, float]) -> tuple[str, dict]:
    """(content hash, {"pixel_values", "grid_thw"}) of an image at `budget`."""

    def compute():
        pixels, grid = preprocess_image(image, cfg, **budget)
        return {"pixel_values": pixels, "grid_thw": grid}

    identify = partial(hash_image, image, model_id=model_id, processor_kwargs=budget)
    return hashed_and_processed(cache, identify, compute, stages)


def video_item(cache: ProcessedCache, video: VideoFrames, cfg: VisionPreprocessConfig,
               budget: dict[str, int], model_id: str,
               stages: dict[str, float]) -> tuple[str, dict]:
    """(content hash, {"pixel_values", "grid_thw", "second_per_grid_t"}) of a video's frames
    at `budget`; `second_per_grid_t` is the seconds one temporal patch covers."""

    def compute():
        pixels, grid = preprocess_video(video.frames, cfg, **budget)
        per_grid = cfg.temporal_patch_size / video.sampled_fps
        return {"pixel_values": pixels, "grid_thw": grid, "second_per_grid_t": per_grid}

    identify = partial(hash_video, video, model_id=model_id, processor_kwargs=budget)
    return hashed_and_processed(cache, identify, compute, stages)


def temporal_patches(identifier: str, data: dict) -> list[tuple[str, dict]]:
    """Split a processed video into one encoder item per temporal patch (views, no copies)."""
    t, h, w = data["grid_thw"]
    rows = h * w  # patch rows per temporal patch
    return [
        (f"{identifier}:t{i}",
         {"pixel_values": data["pixel_values"][i * rows : (i + 1) * rows], "grid_thw": (1, h, w)})
        for i in range(t)
    ]
