"""LLaVA-1.5 and LLaVA-NeXT image processing beyond the shared CLIP processor
(models/processing/clip_image.py): LLaVA-NeXT's anyres tiles (the best-fit resolution among the
pinpoints, the image scaled into it and cut into tiles, plus the whole image as the base tile), and
the image-token counts LlavaProcessor and LlavaNextProcessor expand each image to."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from PIL import Image

from models.processing.clip_image import ClipPreprocessConfig, rgb_pixels, transform
from models.processing.image import resize

STRATEGIES = ("default", "full")


def preprocess_llava_next(
    image: Image.Image, cfg: ClipPreprocessConfig
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """LLaVA-NeXT anyres pixels of one image: float32 [1 + rows*cols, 3, S, S] (the whole image
    first, then the tiles of its best-fit resolution row by row), its (height, width) and the
    tile grid (rows, cols)."""
    if cfg.image_grid_pinpoints is None:
        raise ValueError("preprocess_llava_next needs ClipPreprocessConfig.image_grid_pinpoints")
    pixels = rgb_pixels(image, cfg)
    height, width = pixels.shape[:2]
    best_h, best_w = select_best_resolution((height, width), cfg.image_grid_pinpoints)
    fit_h, fit_w = _fit_within(height, width, best_h, best_w)
    canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
    top, left = (best_h - fit_h) // 2, (best_w - fit_w) // 2
    canvas[top : top + fit_h, left : left + fit_w] = resize(pixels, fit_h, fit_w, cfg.resample)
    s = cfg.tile_size
    tiles = [canvas[y : y + s, x : x + s] for y in range(0, best_h, s) for x in range(0, best_w, s)]
    base = resize(pixels, *cfg.base_size, cfg.resample)
    pixel_values = torch.stack([transform(tile, cfg) for tile in (base, *tiles)])
    return pixel_values, (height, width), (-(-best_h // s), -(-best_w // s))


def select_best_resolution(
    orig_size: tuple[int, int], pinpoints: Sequence[Sequence[int]]
) -> tuple[int, int]:
    """The (height, width) pinpoint keeping the most of the image's pixels when it is scaled to fit,
    ties going to the least padding, then to the earliest listed."""
    orig_h, orig_w = orig_size
    best, best_kept, best_wasted = None, 0, math.inf
    for height, width in pinpoints:
        scale = min(width / orig_w, height / orig_h)
        kept = min(int(orig_w * scale) * int(orig_h * scale), orig_w * orig_h)
        wasted = width * height - kept
        if kept > best_kept or (kept == best_kept and wasted < best_wasted):
            best, best_kept, best_wasted = (height, width), kept, wasted
    if best is None:
        raise ValueError(f"no pinpoint fits an image of {orig_h}x{orig_w}: {list(pinpoints)}")
    return best


def unpad_bounds(image_size: tuple[int, int], height: int, width: int) -> tuple[int, ...]:
    """(top, bottom, left, right) of the part of a [height, width] anyres feature grid that
    holds the image (LLaVA-NeXT's unpad_image): the image was scaled to fit the grid's
    resolution and centred, so whole rows (a wide image) or columns (a tall one) on both sides
    are padding. The model cuts its features and the processor counts tokens with this."""
    orig_h, orig_w = image_size
    if orig_w / orig_h > width / height:
        fitted = int(round(orig_h * (width / orig_w), 7))
        pad = (height - fitted) // 2
        return pad, height - pad, 0, width
    fitted = int(round(orig_w * (height / orig_h), 7))
    pad = (width - fitted) // 2
    return 0, height, pad, width - pad


def llava_next_num_image_tokens(
    orig_height: int,
    orig_width: int,
    pinpoints: ClipPreprocessConfig | Sequence[Sequence[int]],
    image_size: int,
    patch_size: int,
    strategy: str = "default",
    num_additional_image_tokens: int = 1,
) -> int:
    """Image tokens LlavaNextProcessor expands one image of orig_height x orig_width to: the base
    tile's patches (+ CLS), the unpadded tile-grid patches and one newline per grid row; strategy
    "default" drops one (the CLS). ``image_size`` is the vision tower's input side."""
    if isinstance(pinpoints, ClipPreprocessConfig):
        if pinpoints.image_grid_pinpoints is None:
            raise ValueError("the config has no image_grid_pinpoints")
        pinpoints = pinpoints.image_grid_pinpoints
    _check_strategy(strategy)
    best_h, best_w = select_best_resolution((orig_height, orig_width), pinpoints)
    side = image_size // patch_size
    top, bottom, left, right = unpad_bounds(
        (orig_height, orig_width), best_h // image_size * side, best_w // image_size * side
    )
    grid_h, grid_w = bottom - top, right - left
    base = side * side + num_additional_image_tokens
    return grid_h * grid_w + grid_h + base - (strategy == "default")


def llava_num_image_tokens(
    image_size: int | tuple[int, int],
    patch_size: int,
    strategy: str = "default",
    num_additional_image_tokens: int = 1,
) -> int:
    """Image tokens LlavaProcessor (LLaVA-1.5) expands one image to: its patches plus CLS, less one
    (the CLS) with strategy "default"."""
    _check_strategy(strategy)
    height, width = (image_size, image_size) if isinstance(image_size, int) else image_size
    patches = (height // patch_size) * (width // patch_size)
    return patches + num_additional_image_tokens - (strategy == "default")


def _check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ValueError(f"vision_feature_select_strategy {strategy!r} is not one of {STRATEGIES}")


def _fit_within(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """Size of an image scaled to fit target_h x target_w, the short fit rounded up."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)
