"""Phi-4-multimodal's dynamic-HD image crops, as transformers' Phi4MultimodalImageProcessor
makes them (its torchvision backend, computed here with the same torch operations).

An image is fitted onto a grid of crops of `crop` pixels: as many as its size needs
(ceil(width / crop) x ceil(height / crop)), or, past `dynamic_hd` crops, the grid among those of
at most `dynamic_hd` crops whose aspect ratio is closest to the image's. It is resized (bilinear,
antialiased, on its uint8 pixels) to fill the grid's width or height keeping its aspect, padded
with white on the right or bottom, rescaled and normalized; the crops are cut row-major and a
global view (the whole padded image resized to one crop, bicubic) goes first. A patch mask per
crop marks the patches of padding (whole patches only), which the tower does not attend to.

The tokens of an image: the global view's pooled patches (crop / patch / 2 per side) with a
separator after each row, one separator between the two views, and the crops' pooled patches
that are not padding, again with a separator after each row. transformers' processor counts
the global view's as 256 + 16, right for crops of 32 x 32 patches (448-pixel crops of 14-pixel
patches in every Phi-4-MM checkpoint, or e.g. 128-pixel crops of 4-pixel patches);
models/phi4mm/processor.py refuses any other patch grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from models.processing.clip_image import rgb_pixels


@dataclass(frozen=True)
class HDConfig:
    """The image processor's settings (Phi4MultimodalImageProcessor's names)."""

    crop: int = 448  # size: {"height", "width"}
    patch: int = 14
    dynamic_hd: int = 36
    rescale_factor: float = 1 / 255
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    @property
    def mask_side(self) -> int:
        """Patches per crop side."""
        return self.crop // self.patch

    @property
    def pooled_side(self) -> int:
        """Embeddings per crop side after the 2 x 2 pooling."""
        return -(-self.mask_side // 2)


@dataclass(frozen=True)
class HDLayout:
    """Where an image goes: its grid of crops, the size it is resized to before padding, and the
    pooled patches of the crops that are not padding (rows, columns)."""

    grid: tuple[int, int]  # crops (rows, columns)
    resized: tuple[int, int]  # (height, width) before padding
    useful: tuple[int, int]  # pooled rows and columns that are not padding

    def num_tokens(self, cfg: HDConfig) -> int:
        return num_image_tokens(self.useful, cfg)


def num_image_tokens(useful: tuple[int, int], cfg: HDConfig) -> int:
    """An image's span: the global view (pooled patches and a separator per row), one
    separator, the crops' useful pooled patches (rows, columns) and a separator per row."""
    side = cfg.pooled_side
    rows, cols = useful
    return side * (side + 1) + 1 + rows * (cols + 1)


def hd_layout(width: int, height: int, cfg: HDConfig) -> HDLayout:
    """The grid, resized size and useful pooled patches of a (width x height) image, as
    transformers' `dynamic_preprocess` decides them. Raises ValueError for an aspect ratio so
    extreme that a side would be under 10 pixels (as it does)."""
    crop = cfg.crop
    cols, rows = math.ceil(width / crop), math.ceil(height / crop)
    if cols * rows > cfg.dynamic_hd:
        cols, rows = _closest_grid(width, height, cfg)
    target_w, target_h = crop * cols, crop * rows
    ratio_w, ratio_h = target_w / width, target_h / height
    if ratio_w < ratio_h:
        new_w, new_h = target_w, int(height * ratio_w)
    else:
        new_w, new_h = int(width * ratio_h), target_h
    if min(new_h, target_h) < 10 or min(new_w, target_w) < 10:
        raise ValueError(f"the aspect ratio is very extreme ({width}x{height} would be resized "
                         f"to {new_w}x{new_h})")
    mask = patch_mask((rows, cols), (new_h, new_w), cfg)
    pooled = mask[0::2, 0::2]
    return HDLayout((rows, cols), (new_h, new_w),
                    (int(pooled[:, 0].sum()), int(pooled[0, :].sum())))


def _closest_grid(width: int, height: int, cfg: HDConfig) -> tuple[int, int]:
    """(columns, rows) of the grid of at most dynamic_hd crops whose aspect is the image's
    closest; a tie goes to the larger grid when the image covers more than half of it."""
    top = cfg.dynamic_hd
    # Built and ordered as transformers does (a set sorted by area): its ties resolve alike.
    grids = sorted({(i, j) for n in range(1, top + 1) for i in range(1, n + 1)
                    for j in range(1, n + 1) if 1 <= i * j <= top}, key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for grid in grids:
        diff = abs(aspect - grid[0] / grid[1])
        if diff < best_diff:
            best, best_diff = grid, diff
        elif diff == best_diff and area > 0.5 * cfg.crop * cfg.crop * grid[0] * grid[1]:
            best = grid
    return best


def patch_mask(grid: tuple[int, int], resized: tuple[int, int], cfg: HDConfig) -> np.ndarray:
    """bool [rows * side, cols * side]: False on the whole patches of padding."""
    rows, cols = grid
    side = cfg.mask_side
    mask = np.ones((rows * side, cols * side), dtype=bool)
    pad_w = cols * cfg.crop - resized[1]
    pad_h = rows * cfg.crop - resized[0]
    if pad_w >= cfg.patch:
        mask[:, -(pad_w // cfg.patch):] = False
    if pad_h >= cfg.patch:
        mask[-(pad_h // cfg.patch):, :] = False
    return mask


def preprocess_hd(image: Image.Image, cfg: HDConfig) -> dict:
    """An image -> its encoder inputs: `pixel_values` float32 [1 + crops, 3, crop, crop] (the
    global view first), `patch_mask` bool [1 + crops, side, side], `position_ids` int64
    [1 + crops, side * side] (the tower's position of each patch), and its layout's `grid` and
    `useful` pooled patches."""
    layout = hd_layout(image.width, image.height, cfg)
    rows, cols = layout.grid
    crop = cfg.crop
    pixels = torch.from_numpy(rgb_pixels(image, cfg)).permute(2, 0, 1)  # uint8 [3, H, W]
    resized = _resize(pixels, layout.resized, "bilinear", antialias=True)
    height, width = layout.resized
    padded = F.pad(resized, (0, cols * crop - width, 0, rows * crop - height), value=255)
    normed = _normalize(padded, cfg)  # [3, rows * crop, cols * crop]
    glob = _resize(normed, (crop, crop), "bicubic", antialias=False)
    crops = normed.reshape(3, rows, crop, cols, crop).permute(1, 3, 0, 2, 4).reshape(-1, 3, crop,
                                                                                   crop)
    side = cfg.mask_side
    mask = torch.from_numpy(patch_mask(layout.grid, layout.resized, cfg))
    masks = mask.reshape(rows, side, cols, side).transpose(1, 2).reshape(-1, side, side)
    masks = torch.cat([torch.ones(1, side, side, dtype=torch.bool), masks])
    return {"pixel_values": torch.cat([glob[None], crops]).contiguous(), "patch_mask": masks,
            "position_ids": patch_positions(masks, side), "grid": layout.grid,
            "useful": layout.useful}


def _resize(x: torch.Tensor, size: tuple[int, int], mode: str, antialias: bool) -> torch.Tensor:
    """torchvision's resize of a [C, H, W] tensor: unchanged at its own size; uint8 resized as
    uint8 (PyTorch's native path on the CPU), float32 as float32."""
    if tuple(x.shape[-2:]) == tuple(size):
        return x
    return F.interpolate(x[None], size=size, mode=mode, align_corners=False,
                         antialias=antialias)[0]


def _normalize(x: torch.Tensor, cfg: HDConfig) -> torch.Tensor:
    """uint8 -> float32, rescale and normalize fused as transformers' torchvision backend does:
    (x - mean / factor) / (std / factor), in float32."""
    mean = torch.tensor(cfg.image_mean) * (1.0 / cfg.rescale_factor)
    std = torch.tensor(cfg.image_std) * (1.0 / cfg.rescale_factor)
    return (x.float() - mean[:, None, None]) / std[:, None, None]


def patch_positions(masks: torch.Tensor, side: int) -> torch.Tensor:
    """The tower's position embedding index of each patch [crops, side * side]: a crop's real
    patches spread over the whole side x side table (fractional coordinates bucketed, as the
    SigLIP-NaViT embeddings of transformers' Phi-4-MM tower compute them in float32), padding
    patches at 0."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    n_rows = masks[:, :, 0].sum(dim=1)
    n_cols = masks[:, 0, :].sum(dim=1)
    steps = torch.arange(side, dtype=torch.float32)
    frac_rows = (steps[None, :] * (1.0 / n_rows)[:, None]).clamp(max=1.0 - 1e-6)
    frac_cols = (steps[None, :] * (1.0 / n_cols)[:, None]).clamp(max=1.0 - 1e-6)
    rows = torch.bucketize(frac_rows, boundaries, right=True)
    cols = torch.bucketize(frac_cols, boundaries, right=True)
    ids = (rows[:, :, None] * side + cols[:, None, :]).reshape(len(masks), -1)
    return torch.where(masks.reshape(len(masks), -1), ids, torch.zeros_like(ids))
