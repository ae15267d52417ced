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

from models.checkpoint import CheckpointError, Found, Schema, Settings, choose_schema, read_settings
from models.processing.image import rescale_normalize, resize, triple

MAX_IMAGE_SIDE = 4096  # the reference's absolute cap on a resized side
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
# Frames sampled from a video whose processor names no rate or count: transformers' video
# processor samples none itself (do_sample_frames is off), so these are the engine's, the
# published SmolVLM2 checkpoints' `video_sampling`.
SAMPLED_FPS, SAMPLED_FRAMES = 1.0, 64

_PIXELS = {
    "do_convert_rgb": True, "do_resize": True, "resample": Image.Resampling.LANCZOS.value,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "max_image_size": {"longest_edge": 364}, "size": {"longest_edge": 4 * 364},
    "image_mean": list(IMAGENET_STANDARD), "image_std": list(IMAGENET_STANDARD),
}
_SHARED_PIXEL_KEYS = ("do_convert_rgb", "do_resize", "resample", "do_rescale", "rescale_factor",
                      "do_normalize", "image_mean", "image_std", "max_image_size")
# transformers' classes with their own defaults. do_pad pads a batch's images (or frames) to
# one size; each item is taken alone here. do_sample_frames: the engine's loader samples.
_IMAGE = {**_PIXELS, "do_image_splitting": True}
IMAGE_PROCESSORS = {
    name: Schema(name, _IMAGE, inert=frozenset({"do_pad"}))
    for name in ("Idefics3ImageProcessor", "SmolVLMImageProcessor")
}
VIDEO_PROCESSORS = {
    "SmolVLMVideoProcessor": Schema(
        "SmolVLMVideoProcessor",
        {**_PIXELS, "video_sampling": None, "fps": None, "num_frames": None},
        inert=frozenset({"do_pad", "do_sample_frames", "default_to_square"})),
}


@dataclass(frozen=True)
class Idefics3PreprocessConfig:
    """Settings of one Idefics3/SmolVLM image processor, plus the video settings of SmolVLM's
    video processor (the defaults here are only for building one by hand: a checkpoint's are
    read through `from_settings`)."""

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
    def from_settings(cls, image: Settings, video: Settings | None = None
                      ) -> Idefics3PreprocessConfig:
        """From the image processor's settings (and SmolVLM's video processor's), read from a
        checkpoint against IMAGE_PROCESSORS / VIDEO_PROCESSORS."""
        longest = _longest(image["size"], image.sources["size"])
        values = dict(
            longest_edge=longest,
            tile=_longest(image["max_image_size"], image.sources["max_image_size"]),
            do_resize=bool(image["do_resize"]),
            do_image_splitting=bool(image["do_image_splitting"]),
            resample=int(image["resample"]),
            do_rescale=bool(image["do_rescale"]),
            rescale_factor=float(image["rescale_factor"]),
            do_normalize=bool(image["do_normalize"]),
            image_mean=triple(image["image_mean"]),
            image_std=triple(image["image_std"]),
        )
        if video is None:
            return cls(**values)
        for key in _SHARED_PIXEL_KEYS:  # frames go through the image path
            if video[key] != image[key]:
                raise CheckpointError(
                    f"{video.sources[key]}: {key}={video[key]!r} differs from the image "
                    f"processor's {image[key]!r} ({image.sources[key]}); mmserve processes "
                    "video frames with the image settings")
        # transformers 4 wrote the video's sampling as `video_sampling` (its `video_size`
        # overridden by the processor's `size`), transformers 5 as `fps` / `num_frames`.
        sampling = video["video_sampling"] or {}
        fps = sampling.get("fps", video["fps"])
        frames = sampling.get("max_frames", video["num_frames"])
        return cls(
            **values,
            video_longest_edge=_longest(
                video["size"] if video.given("size") or "video_size" not in sampling
                else sampling["video_size"], video.sources["size"]),
            video_fps=float(fps if fps is not None else SAMPLED_FPS),
            video_max_frames=int(frames if frames is not None else SAMPLED_FRAMES),
        )


def from_hf_dicts(image: Mapping[str, Any] | None, video: Mapping[str, Any] | None = None,
                  default_class: str = "Idefics3ImageProcessor") -> Idefics3PreprocessConfig:
    """From an image processor's settings dict (and a video processor's), e.g. a
    transformers processor's `to_dict()`."""
    found = None if image is None else Found(image, "image processor settings")
    image_settings = read_settings(found, choose_schema(found, IMAGE_PROCESSORS, default_class))
    if video is None:
        return Idefics3PreprocessConfig.from_settings(image_settings)
    video_found = Found(video, "video processor settings")
    return Idefics3PreprocessConfig.from_settings(image_settings, read_settings(
        video_found, choose_schema(video_found, VIDEO_PROCESSORS, "SmolVLMVideoProcessor",
                                   "video_processor_type")))


def _longest(size: Any, where: str) -> int:
    if isinstance(size, int):
        return size
    if isinstance(size, Mapping) and "longest_edge" in size:
        return int(size["longest_edge"])
    raise CheckpointError(f"{where}: Idefics3 preprocessing needs a longest_edge size, got "
                          f"{size!r}")


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
