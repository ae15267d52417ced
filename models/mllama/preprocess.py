"""Llama 3.2 Vision's image processor (transformers' MllamaImageProcessor, PIL flavour): an image
resized onto a canvas of whole tiles and cut into them.

The canvas is the tile arrangement (rows x columns of `size` pixels, at most `max_image_tiles`
tiles) that needs the least upscaling, or, if every arrangement shrinks the image, the least
shrinking; ties go to the smallest area. The image is resized (PIL, bilinear by default) to fit
the canvas keeping its aspect ratio, padded with zeros on the bottom and right, rescaled and
normalized, and cut into tiles in row-major order. An encoder item always carries
`max_image_tiles` tiles: the ones past the image's own are zeros (as transformers packs them),
and its aspect ratio id is the arrangement's index in `supported_aspect_ratios` plus one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from models.checkpoint import Schema, Settings
from models.processing.image import rescale_normalize, resize, triple

_HALF = [0.5, 0.5, 0.5]  # transformers' IMAGENET_STANDARD_MEAN and _STD
# MllamaImageProcessor's settings and defaults; it refuses do_resize / do_pad false itself, and
# its tower takes three channels.
IMAGE_PROCESSORS = {"MllamaImageProcessor": Schema("MllamaImageProcessor", {
    "size": {"height": 224, "width": 224}, "resample": Image.Resampling.BILINEAR.value,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": _HALF,
    "image_std": _HALF, "max_image_tiles": 4,
}, fixed={"do_resize": True, "do_pad": True, "do_convert_rgb": True})}


@dataclass(frozen=True)
class MllamaPreprocessConfig:
    """The image processor's settings, validated."""

    tile_size: int
    max_image_tiles: int
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.tile_size < 1 or self.max_image_tiles < 1:
            raise ValueError(f"tile size {self.tile_size} and max_image_tiles "
                             f"{self.max_image_tiles} must be positive")

    @classmethod
    def from_settings(cls, s: Settings) -> MllamaPreprocessConfig:
        size = s["size"]
        if not isinstance(size, dict) or set(size) != {"height", "width"} or (
                size["height"] != size["width"]):
            raise ValueError(f"{s.sources['size']}: size={size} must be a square "
                             "{height, width} (MllamaImageProcessor refuses other sizes too)")
        return cls(size["height"], s["max_image_tiles"], s["resample"], s["do_rescale"],
                   s["rescale_factor"], s["do_normalize"],
                   triple(s["image_mean"]), triple(s["image_std"]))


@lru_cache(maxsize=16)
def tile_arrangements(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (a, b) with a * b <= max_tiles, a major: the order aspect ratio ids follow."""
    return tuple((a, b) for a in range(1, max_tiles + 1) for b in range(1, max_tiles + 1)
                 if a * b <= max_tiles)


def canvas_tiles(height: int, width: int, max_tiles: int, tile: int) -> tuple[int, int]:
    """(tile rows, tile columns) of the canvas an image of this size goes onto."""
    arrangements = tile_arrangements(max_tiles)
    # The smaller of the two scales fits the image inside that canvas.
    scales = [min(rows * tile / height, cols * tile / width) for rows, cols in arrangements]
    up = [s for s in scales if s >= 1]
    chosen = min(up) if up else max(scales)
    candidates = [a for a, s in zip(arrangements, scales, strict=True) if s == chosen]
    return min(candidates, key=lambda a: a[0] * a[1])  # first of the smallest area


def fit_to_canvas(height: int, width: int, canvas_h: int, canvas_w: int,
                  tile: int) -> tuple[int, int]:
    """The resized (height, width): aspect ratio kept, within the canvas, at least a tile on the
    side that decides the scale (transformers' get_image_size_fit_to_canvas)."""
    target_w = min(max(width, tile), canvas_w)
    target_h = min(max(height, tile), canvas_h)
    scale_h, scale_w = target_h / height, target_w / width
    if scale_w < scale_h:
        return min(math.floor(height * scale_w) or 1, target_h), target_w
    return target_h, min(math.floor(width * scale_h) or 1, target_w)


def num_tiles(height: int, width: int, cfg: MllamaPreprocessConfig) -> int:
    """How many tiles of its own an image of this size gets."""
    rows, cols = canvas_tiles(height, width, cfg.max_image_tiles, cfg.tile_size)
    return rows * cols


def preprocess_mllama(image: Image.Image, cfg: MllamaPreprocessConfig) -> dict:
    """One image -> {"pixel_values" float32 [max_image_tiles, 3, S, S], "aspect_ratio_id",
    "num_tiles"}."""
    if image.mode != "RGB":
        image = image.convert("RGB")
    tile = cfg.tile_size
    rows, cols = canvas_tiles(image.height, image.width, cfg.max_image_tiles, tile)
    h, w = fit_to_canvas(image.height, image.width, rows * tile, cols * tile, tile)
    pixels = resize(np.asarray(image), h, w, cfg.resample)
    canvas = np.zeros((rows * tile, cols * tile, pixels.shape[2]), dtype=pixels.dtype)
    canvas[:h, :w] = pixels
    x = rescale_normalize(torch.from_numpy(canvas).permute(2, 0, 1), cfg)  # [3, rows*S, cols*S]
    tiles = x.view(3, rows, tile, cols, tile).permute(1, 3, 0, 2, 4).reshape(-1, 3, tile, tile)
    out = torch.zeros(cfg.max_image_tiles, 3, tile, tile)
    out[: rows * cols] = tiles
    ratio_id = tile_arrangements(cfg.max_image_tiles).index((rows, cols)) + 1
    return {"pixel_values": out, "aspect_ratio_id": ratio_id, "num_tiles": rows * cols}
