"""Pixtral's image preprocessing (Pixtral-12B, Mistral Small 3.1), matching transformers'
PixtralImageProcessorPil as PixtralProcessor drives it: an image larger than the longest edge
is scaled down to fit (sides floored), then each side is rounded up to a whole number of
`unit`-pixel cells (unit = patch size x spatial merge size) and the image resized to that with
PIL; rescale and normalize as CLIP does (models/processing/clip_image.py does the pixel work)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from models.checkpoint import CheckpointError, Found, Schema, Settings, choose_schema, read_settings
from models.processing.clip_image import (
    CLIP_MEAN,
    CLIP_STD,
    ClipPreprocessConfig,
    preprocess_clip,
)

# transformers' PixtralImageProcessor with its own defaults. `patch_size`: PixtralProcessor
# passes its own patch_size x spatial_merge_size on every call, which overrides this one; do_pad
# pads a batch's images to one size, and each image is taken alone here.
IMAGE_PROCESSORS = {"PixtralImageProcessor": Schema("PixtralImageProcessor", {
    "do_convert_rgb": True, "do_resize": True, "resample": Image.Resampling.BICUBIC.value,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
    "size": {"longest_edge": 1024}, "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
}, fixed={"do_resize": True}, inert=frozenset({"patch_size", "do_pad"}))}


@dataclass(frozen=True)
class PixtralPreprocessConfig:
    """The settings of one PixtralImageProcessor (preprocessor_config.json)."""

    longest_edge: int = 1024
    resample: int = Image.Resampling.BICUBIC.value
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.longest_edge, bool) or not isinstance(self.longest_edge, int) or (
                self.longest_edge <= 0):
            raise ValueError(f"longest_edge must be a positive int, got {self.longest_edge!r}")

    @classmethod
    def from_settings(cls, s: Settings) -> PixtralPreprocessConfig:
        """From PixtralImageProcessor's settings, read from a checkpoint."""
        size = s["size"]
        if not isinstance(size, Mapping) or "longest_edge" not in size:
            raise CheckpointError(f"{s.sources['size']}: Pixtral size {size!r} is not "
                                  "supported (longest_edge only)")
        return cls(
            longest_edge=int(size["longest_edge"]),
            resample=int(s["resample"]),
            do_rescale=bool(s["do_rescale"]),
            rescale_factor=float(s["rescale_factor"]),
            do_normalize=bool(s["do_normalize"]),
            image_mean=tuple(map(float, s["image_mean"])),
            image_std=tuple(map(float, s["image_std"])),
            do_convert_rgb=bool(s["do_convert_rgb"]),
        )

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None) -> PixtralPreprocessConfig:
        """From an image processor's settings dict (e.g. a transformers processor's
        `to_dict()`)."""
        found = None if d is None else Found(d, "image processor settings")
        return cls.from_settings(read_settings(found, choose_schema(
            found, IMAGE_PROCESSORS, "PixtralImageProcessor")))


def pixtral_resized_size(height: int, width: int, longest_edge: int, unit: int) -> tuple[int, int]:
    """(height, width) an image is resized to: fit within longest_edge (sides floored), then
    each side rounded up to a multiple of `unit`."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = math.floor(height / ratio), math.floor(width / ratio)
    return -(-height // unit) * unit, -(-width // unit) * unit


def preprocess_pixtral(image: Image.Image, cfg: PixtralPreprocessConfig,
                       unit: int) -> torch.Tensor:
    """float32 [3, H, W] pixels of one image, H and W multiples of `unit`."""
    size = pixtral_resized_size(image.height, image.width, cfg.longest_edge, unit)
    clip = ClipPreprocessConfig(
        shortest_edge=None, size=size, crop_size=None, resample=cfg.resample,
        do_center_crop=False, do_rescale=cfg.do_rescale, rescale_factor=cfg.rescale_factor,
        do_normalize=cfg.do_normalize, image_mean=cfg.image_mean, image_std=cfg.image_std,
        do_convert_rgb=cfg.do_convert_rgb,
    )
    return preprocess_clip(image, clip)
