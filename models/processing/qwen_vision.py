"""Turn RGB images and video frames into the flattened patch rows (plus their t/h/w grid) that the
Qwen2-VL / Qwen2.5-VL vision tower consumes, with PIL for resizing and torch for the rest."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from models.checkpoint import CheckpointError, Found, Schema, Settings, choose_schema, read_settings

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
MAX_ASPECT_RATIO = 200
# Frames per second sampled from a video whose processor names no rate: qwen-vl-utils' rate
# (and Qwen3VLVideoProcessor's default); transformers' Qwen2VLVideoProcessor samples no frames.
SAMPLED_FPS = 2.0

# What our preprocessing implements of the rest: PIL bicubic resize, rescale by 1 / 255, then
# normalize, RGB.
_FIXED = {"do_resize": True, "resample": Image.Resampling.BICUBIC.value, "do_rescale": True,
          "rescale_factor": 1 / 255, "do_normalize": True, "do_convert_rgb": True}
# transformers' classes with their own defaults; `min_pixels` / `max_pixels` are transformers
# 4's names for the budget (None: `size` holds it).
IMAGE_PROCESSORS = {"Qwen2VLImageProcessor": Schema("Qwen2VLImageProcessor", {
    "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
    "min_pixels": None, "max_pixels": None, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
}, _FIXED)}
# Frame sampling (fps aside, which the engine's loader takes) is the loader's, and a
# per-frame cap only applies with cap_pixels_per_frame, which is not implemented.
_SAMPLING = frozenset({"do_sample_frames", "min_frames", "max_frames", "num_frames",
                       "max_duration", "max_video_tokens", "max_image_size", "video_metadata",
                       "default_to_square"})
VIDEO_PROCESSORS = {
    "Qwen2VLVideoProcessor": Schema("Qwen2VLVideoProcessor", {
        "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768},
        "min_pixels": None, "max_pixels": None, "patch_size": 14, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
        "fps": None,
    }, {**_FIXED, "cap_pixels_per_frame": False}, _SAMPLING),
    "Qwen3VLVideoProcessor": Schema("Qwen3VLVideoProcessor", {
        "size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768},
        "min_pixels": None, "max_pixels": None, "patch_size": 16, "temporal_patch_size": 2,
        "merge_size": 2, "image_mean": list(IMAGENET_STANDARD),
        "image_std": list(IMAGENET_STANDARD), "fps": 2,
    }, {**_FIXED, "cap_pixels_per_frame": False}, _SAMPLING),
}


def smart_resize(
    height: int,
    width: int,
    factor: int = 28,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
) -> tuple[int, int]:
    """The (height, width) Qwen resizes an image to: both multiples of ``factor``, area within
    [min_pixels, max_pixels] where possible, aspect ratio kept as closely as possible.

    Each side is rounded to the nearest multiple (Python's round-half-to-even); if the area is
    then too large both sides are scaled down and floored (never below ``factor``), if too small
    scaled up and ceiled. Tiny images are accepted (1x1 becomes 56x56 with the defaults).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {height}x{width} has aspect ratio {ratio:.1f}, "
            f"above the {MAX_ASPECT_RATIO} the Qwen vision tower accepts"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar == 0 or w_bar == 0:
        raise ValueError(
            f"image of {height}x{width} rounds to {h_bar}x{w_bar}: a side is below the "
            f"patch factor {factor}; raise min_pixels (now {min_pixels})"
        )
    return h_bar, w_bar


def smart_resize_clip(
    num_frames: int, height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
    temporal_factor: int = 2,
) -> tuple[int, int]:
    """Qwen3-VL's video resize: like `smart_resize`, but the budget bounds frames x height x
    width over the whole clip (frames rounded to the temporal factor), and sides below the
    factor are first scaled up to it."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"video of {height}x{width} has aspect ratio {ratio:.1f}, "
            f"above the {MAX_ASPECT_RATIO} the Qwen vision tower accepts"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass(frozen=True)
class VisionPreprocessConfig:
    """Patch geometry, pixel budgets and normalization of a Qwen2-VL-family processor.

    Image budgets default to HF's Qwen2-VL image processor (56*56 to 28*28*1280 pixels), video
    budgets to its video processor (128*28*28 to 768*28*28 per frame). ``video_fps`` is the
    frame sampling rate that qwen-vl-utils uses (HF's video processor leaves it unset).
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_fps: float = 2.0
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    # Qwen3-VL: a video's pixel budget covers all of its frames together, not each frame.
    video_budget_per_clip: bool = False

    @property
    def factor(self) -> int:
        """Side granularity in pixels: one merged patch."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_settings(cls, image: Settings, video: Settings) -> VisionPreprocessConfig:
        """From the image and video processors' settings, read from a checkpoint against
        IMAGE_PROCESSORS / VIDEO_PROCESSORS. Pixel budgets come from `min_pixels` /
        `max_pixels` when given (transformers 4's names), which win over `size`'s
        `shortest_edge` / `longest_edge`, as in transformers."""
        for key in ("patch_size", "temporal_patch_size", "merge_size"):
            if video[key] != image[key]:
                raise CheckpointError(
                    f"{video.sources[key]}: {key}={video[key]} differs from the image "
                    f"processor's {image[key]} ({image.sources[key]}): images and videos share "
                    "one tower")
        min_pixels, max_pixels = _pixel_budget(image)
        video_min, video_max = _pixel_budget(video)
        return cls(
            patch_size=int(image["patch_size"]),
            temporal_patch_size=int(image["temporal_patch_size"]),
            merge_size=int(image["merge_size"]),
            min_pixels=min_pixels,
            max_pixels=max_pixels,
            video_min_pixels=video_min,
            video_max_pixels=video_max,
            video_fps=float(video["fps"] if video["fps"] is not None else SAMPLED_FPS),
            image_mean=tuple(map(float, image["image_mean"])),
            image_std=tuple(map(float, image["image_std"])),
            video_budget_per_clip=video.schema.cls == "Qwen3VLVideoProcessor",
        )

    @classmethod
    def from_hf(cls, image_config: Mapping[str, Any] | None,
                video_config: Mapping[str, Any] | None = None,
                video_class: str = "Qwen2VLVideoProcessor") -> VisionPreprocessConfig:
        """From image and video processor settings dicts (e.g. transformers processors'
        `to_dict()`); without a video dict, the video processor reads the image one, as
        transformers' does when a checkpoint has no video processor file."""
        image = None if image_config is None else Found(image_config, "image settings")
        video = image if video_config is None else Found(video_config, "video settings")
        return cls.from_settings(
            read_settings(image, choose_schema(image, IMAGE_PROCESSORS,
                                               "Qwen2VLImageProcessor")),
            read_settings(video, choose_schema(video, VIDEO_PROCESSORS, video_class,
                                               "video_processor_type")))


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def _pixel_budget(s: Settings) -> tuple[int, int]:
    size = s["size"] or {}
    lo = s["min_pixels"] if s["min_pixels"] is not None else size.get("shortest_edge")
    hi = s["max_pixels"] if s["max_pixels"] is not None else size.get("longest_edge")
    if lo is None or hi is None:
        raise CheckpointError(f"{s.sources['size']}: size {size!r} has no shortest_edge / "
                              "longest_edge pixel budget")
    return int(lo), int(hi)


def preprocess_image(
    image: Image.Image,
    cfg: VisionPreprocessConfig,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Patch rows float32 [grid_t*grid_h*grid_w, 3*temporal_patch_size*patch_size**2] and
    grid (1, grid_h, grid_w) of an RGB image; the image fills every temporal slot of its patch.

    ``min_pixels``/``max_pixels`` override the config's image budget for this call.
    """
    if image.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {image.mode!r}")
    h, w = smart_resize(
        image.height,
        image.width,
        cfg.factor,
        _first(min_pixels, cfg.min_pixels),
        _first(max_pixels, cfg.max_pixels),
    )
    pixels = torch.from_numpy(_resize(np.asarray(image)[None], h, w))  # [1, h, w, 3] uint8
    return _patchify(pixels.expand(cfg.temporal_patch_size, -1, -1, -1), cfg)


def preprocess_video(
    frames: np.ndarray,
    cfg: VisionPreprocessConfig,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """Patch rows and grid (grid_t, grid_h, grid_w) of uint8 RGB frames [N, H, W, 3].

    All frames get one smart_resize size (the video budget unless overridden); consecutive
    frames share a temporal patch, an odd tail padded by repeating the last frame.
    """
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8 or not len(frames):
        raise ValueError(
            f"expected uint8 frames [N>0, H, W, 3], got {frames.dtype} {tuple(frames.shape)}"
        )
    budget = (_first(min_pixels, cfg.video_min_pixels), _first(max_pixels, cfg.video_max_pixels))
    if cfg.video_budget_per_clip:
        h, w = smart_resize_clip(len(frames), frames.shape[1], frames.shape[2], cfg.factor,
                                 *budget, cfg.temporal_patch_size)
    else:
        h, w = smart_resize(frames.shape[1], frames.shape[2], cfg.factor, *budget)
    video = torch.from_numpy(_resize(frames, h, w))  # [N, h, w, 3] uint8
    if pad := -len(video) % cfg.temporal_patch_size:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])  # [N + pad, h, w, 3]
    return _patchify(video, cfg)


def _resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [N, H, W, 3] -> uint8 [N, height, width, 3] with PIL's bicubic filter (HF's)."""
    if frames.shape[1:3] == (height, width):
        return frames.copy()
    out = np.empty((len(frames), height, width, 3), dtype=np.uint8)
    for i, frame in enumerate(frames):
        out[i] = Image.fromarray(frame).resize((width, height), Image.Resampling.BICUBIC)
    return out


def _patchify(
    frames: torch.Tensor, cfg: VisionPreprocessConfig
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """uint8 [T, H, W, 3] (T a multiple of temporal_patch_size) -> normalized patch rows.

    Rows run over (t, h-block, w-block, h-in-block, w-in-block) so each merge_size**2 group of
    patches is contiguous; a row holds (channel, temporal slot, y, x).
    """
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    t, h, w, c = frames.shape
    grid = (t // tp, h // p, w // p)
    blocks = frames.reshape(grid[0], tp, grid[1] // m, m, p, grid[2] // m, m, p, c)
    blocks = blocks.permute(0, 2, 5, 3, 6, 8, 1, 4, 7)  # [gt, gh/m, gw/m, m, m, c, tp, p, p]
    x = blocks.to(torch.float32, memory_format=torch.contiguous_format)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(c, 1, 1, 1)
    std = torch.tensor(cfg.image_std, dtype=torch.float32).view(c, 1, 1, 1)
    x.mul_(1 / 255).sub_(mean).div_(std)
    return x.reshape(grid[0] * grid[1] * grid[2], c * tp * p * p), grid
