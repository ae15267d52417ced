"""Pixel operations every image processor here shares, each as transformers' PIL image
processors compute it: PIL resizing, per-channel settings, and rescale + normalize."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image


def resize(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 [H, W, C] resized by PIL with `resample` (a PIL.Image.Resampling value)."""
    resized = Image.fromarray(pixels).resize((width, height), Image.Resampling(resample))
    return np.array(resized)


def triple(value: Any) -> tuple[float, ...]:
    """A per-channel setting: a scalar repeated for the three channels, or the three values."""
    return (float(value),) * 3 if isinstance(value, int | float) else tuple(map(float, value))


class RescaleNormalize(Protocol):
    """The pixel-value settings every image processor config carries."""

    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]


def rescale_normalize(x: torch.Tensor, cfg: RescaleNormalize) -> torch.Tensor:
    """uint8 [..., 3, H, W] -> float32, as transformers does: rescaled in float64 and rounded to
    float32 once, then normalized in float32."""
    x = (x.double() * cfg.rescale_factor).float() if cfg.do_rescale else x.float()
    if cfg.do_normalize:
        mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(3, 1, 1)
        std = torch.tensor(cfg.image_std, dtype=torch.float32).view(3, 1, 1)
        x = (x - mean) / std
    return x.contiguous()
