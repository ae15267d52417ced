"""Gemma 4's pixels: an image (or a video frame) resized, keeping its aspect ratio, to the
largest size whose patches fit its soft-token budget (`max_soft_tokens` x k^2 patches, sides
multiples of k patches), rescaled to [0, 1] and cut into patches with their (column, row)
positions, as transformers' Gemma4ImageProcessorPil computes them. The settings each component
reads (image processor, video processor, processor), with the classes' own defaults.

Video frames are resized by PIL as images are; transformers' Gemma4VideoProcessor resizes with
torchvision (not installable here), whose antialiased bicubic differs from PIL's in the last
bits of some pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from models.checkpoint import Schema, Settings
from models.processing.image import resize

# The budgets Gemma4ImageProcessor and Gemma4VideoProcessor accept.
SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)

_PIXELS = {"do_convert_rgb": True, "do_resize": True, "resample": Image.Resampling.BICUBIC.value,
           "do_rescale": True, "rescale_factor": 1 / 255, "image_mean": [0.0, 0.0, 0.0],
           "image_std": [1.0, 1.0, 1.0], "patch_size": 16, "pooling_kernel_size": 3}
IMAGE_PROCESSOR = Schema("Gemma4ImageProcessor", {
    **_PIXELS, "do_normalize": False, "max_soft_tokens": 280})
# `size`, `default_to_square`, cropping and padding are the base class's settings (its to_dict
# writes them all), which Gemma 4's aspect-preserving resize does not read.
VIDEO_PROCESSOR = Schema("Gemma4VideoProcessor", {
    **_PIXELS, "do_normalize": True, "max_soft_tokens": 70, "num_frames": 32},
    fixed={"do_sample_frames": True, "fps": None},
    inert=frozenset({"size", "default_to_square", "video_metadata", "return_metadata",
                     "crop_size", "do_center_crop", "do_pad"}))
# Gemma4Processor's own fields: image_seq_length and audio_seq_length are stored but not what
# it expands by (each item's own count is), audio_ms_per_token is documentation.
PROCESSOR = Schema("Gemma4Processor", {
    "image_seq_length": 280, "audio_seq_length": 750, "audio_ms_per_token": 40})


@dataclass(frozen=True)
class PixelConfig:
    """An image or video processor's settings, as far as one frame's pixels go."""

    patch_size: int
    pooling: int
    max_soft_tokens: int
    resample: int
    rescale_factor: float
    do_rescale: bool
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    @classmethod
    def from_settings(cls, s: Settings) -> PixelConfig:
        return cls(int(s["patch_size"]), int(s["pooling_kernel_size"]),
                   int(s["max_soft_tokens"]), int(s["resample"]), float(s["rescale_factor"]),
                   bool(s["do_rescale"]), bool(s["do_normalize"]),
                   tuple(map(float, s["image_mean"])), tuple(map(float, s["image_std"])))


def target_size(height: int, width: int, patch: int, budget: int, k: int) -> tuple[int, int]:
    """The size an image is resized to: the largest with sides multiples of k patches whose
    patches number at most budget x k^2 (a side rounding to 0 becomes k patches, the other its
    aspect ratio's multiple within the budget), as transformers computes it."""
    max_patches = budget * k * k
    factor = math.sqrt(max_patches * patch**2 / (height * width))
    side = k * patch
    h = int(math.floor(factor * height / side)) * side
    w = int(math.floor(factor * width / side)) * side
    if h == 0 and w == 0:
        raise ValueError(f"a {height}x{width} image cannot be resized to a multiple of {side}")
    longest = (max_patches // k**2) * side
    if h == 0:
        h, w = side, min(int(math.floor(width / height)) * side, longest)
    elif w == 0:
        h, w = min(int(math.floor(height / width)) * side, longest), side
    return h, w


def soft_tokens(height: int, width: int, cfg: PixelConfig, budget: int) -> int:
    """Embeddings of an image of this size at `budget` (no pixel touched)."""
    h, w = target_size(height, width, cfg.patch_size, budget, cfg.pooling)
    return (h // cfg.patch_size) * (w // cfg.patch_size) // cfg.pooling**2


def patches(pixels: np.ndarray, cfg: PixelConfig, budget: int) -> dict:
    """uint8 RGB [H, W, 3] -> {"pixel_values" [n, p * p * 3] float32 (each patch's rows,
    columns, channels), "positions" [n, 2] int64 (column, row), "grid" (rows, columns)}."""
    height, width = pixels.shape[:2]
    h, w = target_size(height, width, cfg.patch_size, budget, cfg.pooling)
    if (h, w) != (height, width):
        pixels = resize(pixels, h, w, cfg.resample)
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)  # [3, H, W] uint8
    x = (x.double() * cfg.rescale_factor).float() if cfg.do_rescale else x.float()
    if cfg.do_normalize:
        mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(cfg.image_std, dtype=torch.float32).view(3, 1, 1)
        x = (x - mean) / std
    p = cfg.patch_size
    rows, cols = h // p, w // p
    flat = x.reshape(3, rows, p, cols, p).permute(1, 3, 2, 4, 0).reshape(rows * cols, -1)
    grid_y, grid_x = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    positions = torch.stack([grid_x.reshape(-1), grid_y.reshape(-1)], dim=-1)
    return {"pixel_values": flat.contiguous(), "positions": positions, "grid": (rows, cols)}
