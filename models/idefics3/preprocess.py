"""Image and video-frame pixels for Idefics3 / SmolVLM, as transformers' PIL image processors
make them: resize the longest edge, grow each side to a multiple of the tile, cut the tiles
row-major and add the whole image downscaled to one tile (the global image), then rescale and
normalize. Sizes are also computed from (height, width) alone, for counting tokens up front.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from PIL import Image

from models.processing.image import rescale_normalize, resize, triple

MAX_IMAGE_SIDE = 4096  # the reference's absolute cap on a resized side
IMAGENET_STANDARD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Idefics3PreprocessConfig:
    """Settings of one Idefics3/SmolVLM image processor (preprocessor_config.json), plus the
    video settings of SmolVLM's video processor."""

    longest_edge: int = 4 * 364  # `size`: the image's longest edge after the first resize
    tile: int = 364  # `max_image_size`: side of a tile and of the global image
    do_resize: bool = True
    do_image_splitting: bool = True
    resample: int = Image.Resampling.LANCZOS.value
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = IMAGENET_STANDARD
    image_std: tuple[float, ...] = IMAGENET_STANDARD
    video_longest_edge: int = 4 * 364
    video_fps: float = 1.0
    video_max_frames: int = 64

    def __post_init__(self) -> None:
        for name in ("longest_edge", "tile", "video_longest_edge", "video_max_frames"):
            if getattr(self, name) < 1:
                raise ValueError(f"Idefics3 preprocessing: {name} must be >= 1")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"Idefics3 preprocessing: image_std has a zero: {self.image_std}")

    @classmethod
    def from_hf(cls, image: Mapping[str, Any], video: Mapping[str, Any] | None = None
                ) -> Idefics3PreprocessConfig:
        """From preprocessor_config.json (and video_preprocessor_config.json) dicts."""
        video = video or {}
        base = cls()
        sampling = video.get("video_sampling") or {}
        longest = _longest(image.get("size"), base.longest_edge)
        return cls(
            longest_edge=longest,
            tile=_longest(image.get("max_image_size"), base.tile),
            do_resize=bool(image.get("do_resize", True)),
            do_image_splitting=bool(image.get("do_image_splitting", True)),
            resample=int(image.get("resample", base.resample)),
            do_rescale=bool(image.get("do_rescale", True)),
            rescale_factor=float(image.get("rescale_factor", base.rescale_factor)),
            do_normalize=bool(image.get("do_normalize", True)),
            image_mean=triple(image.get("image_mean", base.image_mean)),
            image_std=triple(image.get("image_std", base.image_std)),
            # The video processor's `size` overrides its sampling's `video_size`.
            video_longest_edge=_longest(video.get("size") or sampling.get("video_size"),
                                        base.video_longest_edge),
            video_fps=float(sampling.get("fps", video.get("fps") or base.video_fps)),
            video_max_frames=int(sampling.get("max_frames",
                                              video.get("num_frames") or base.video_max_frames)),
        )


def _longest(size: Any, default: int) -> int:
    if size is None:
        return default
    if isinstance(size, int):
        return size
    if isinstance(size, Mapping) and "longest_edge" in size:
        return int(size["longest_edge"])
    raise NotImplementedError(f"Idefics3 preprocessing needs a longest_edge size, got {size!r}")


def fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """(height, width) with the longest edge at `longest`, the other rounded up to even, then
    both kept under MAX_IMAGE_SIDE."""
    ratio = width / height
    if width >= height:
        width, height = longest, int(longest / ratio)
        height += height % 2
    else:
        height, width = longest, int(longest * ratio)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / (width / height))
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * (width / height))
    return max(height, 1), max(width, 1)


def tile_multiple(height: int, width: int, tile: int) -> tuple[int, int]:
    """(height, width) grown to multiples of `tile`: the long side first, the short side from
    the aspect ratio, then up to a multiple too."""
    ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / ratio) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * ratio) / tile) * tile
    return height, width


def image_layout(height: int, width: int, cfg: Idefics3PreprocessConfig
                 ) -> tuple[tuple[int, int] | None, int, int]:
    """From an image's size alone: the size it is cut from (None: resized straight to one
    tile) and its tile grid (rows, cols); (0, 0) means the global image only."""
    if cfg.do_resize:
        height, width = fit_longest_edge(height, width, cfg.longest_edge)
    if not cfg.do_image_splitting:
        return None, 0, 0
    height, width = tile_multiple(height, width, cfg.tile)
    if height > cfg.tile or width > cfg.tile:
        return (height, width), height // cfg.tile, width // cfg.tile
    return (height, width), 0, 0


def preprocess_image(image: Image.Image, cfg: Idefics3PreprocessConfig
                     ) -> tuple[torch.Tensor, int, int]:
    """float32 [rows * cols + 1, 3, tile, tile]: the tiles row-major, then the global image;
    with its grid (rows, cols)."""
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    pixels = np.array(rgb)
    if cfg.do_resize:
        pixels = _resize(pixels, *fit_longest_edge(*pixels.shape[:2], cfg.longest_edge), cfg)
    cut, rows, cols = image_layout(rgb.height, rgb.width, cfg)
    t = cfg.tile
    if cut is None:
        return normalize(_resize(pixels, t, t, cfg)[None], cfg), 0, 0
    pixels = _resize(pixels, *cut, cfg)
    tiles = [pixels[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
    if rows or cols:
        pixels = _resize(pixels, t, t, cfg)
    return normalize(np.stack([*tiles, pixels]), cfg), rows, cols


def preprocess_frames(frames: np.ndarray, cfg: Idefics3PreprocessConfig) -> torch.Tensor:
    """uint8 frames [N, H, W, 3] -> float32 [N, 3, tile, tile]: the longest edge resized to
    the video size, then each frame resized to one tile (videos are never split)."""
    height, width = frames.shape[1:3]
    size = fit_longest_edge(height, width, min(cfg.video_longest_edge, MAX_IMAGE_SIDE))
    out = [_resize(_resize(f, *size, cfg), cfg.tile, cfg.tile, cfg) for f in frames]
    return normalize(np.stack(out), cfg)


def normalize(pixels: np.ndarray, cfg: Idefics3PreprocessConfig) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W], rescaled and normalized."""
    return rescale_normalize(torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2),
                             cfg)


def _resize(pixels: np.ndarray, height: int, width: int, cfg: Idefics3PreprocessConfig
            ) -> np.ndarray:
    return resize(pixels, height, width, cfg.resample)


def frame_count_words(n: int) -> str:
    """A frame count in English words, as the reference writes it ("twenty-one", "one hundred
    and five")."""
    ones = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
            "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen",
            "seventeen", "eighteen", "nineteen"]
    tens = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty",
            "ninety"]
    if not 0 <= n < 10000:
        raise NotImplementedError(f"frame counts up to 9999 are spelled out, got {n}")
    if n < 20:
        return ones[n]
    if n < 100:
        return tens[n // 10] + ("-" + ones[n % 10] if n % 10 else "")
    if n < 1000:
        head = ones[n // 100] + " hundred"
        return head + (" and " + frame_count_words(n % 100) if n % 100 else "")
    head = frame_count_words(n // 1000) + " thousand"
    rest = n % 1000
    if not rest:
        return head
    return head + (", " if rest >= 100 else " and ") + frame_count_words(rest)


def video_clock(seconds: float) -> str:
    """The video's duration as "H:MM:SS" (whole seconds)."""
    return str(timedelta(seconds=int(seconds)))


def frame_clock(seconds: float) -> str:
    """A frame's timestamp as "MM:SS"."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"
