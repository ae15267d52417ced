"""Pixels for InternVL, as transformers makes them: images as GotOcr2ImageProcessor cuts them
under InternVLProcessor (which always asks for `crop_to_patches`), video frames as
InternVLVideoProcessor resizes them. Tile grids are also computed from (height, width) alone,
for counting tokens before any pixel is touched.

An image's grid (cols x rows tiles of the configured size) is the one whose aspect ratio is
closest to the image's among every grid of min_patches..max_patches tiles; a tie goes to the
grid met later in the order of increasing tile count as long as the image's area exceeds half of
that grid's. The image is resized to the grid, cut into its tiles row-major, and, when there
is more than one tile, followed by the whole image resized to one tile (the thumbnail).
Rescaling and normalizing go tile by tile. A video frame is resized to one tile.

Two backends resize differently (by up to 2 levels of 255 on some pixels of a photo):
transformers' default, torchvision (GotOcr2ImageProcessor or its Fast name; InternVL's video
processor has no other), resizes the uint8 tensor with PyTorch's antialiased interpolation and
fuses rescaling into normalization; GotOcr2ImageProcessorPil resizes with PIL and rescales in
float64 first. The class the checkpoint names chooses (`backend_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from models.checkpoint import CheckpointError, Schema, Settings
from models.processing.clip_image import CLIP_MEAN, CLIP_STD, rgb_pixels
from models.processing.image import rescale_normalize, resize, triple

_PIXELS = {
    "do_convert_rgb": True, "resample": Image.Resampling.BICUBIC.value, "do_rescale": True,
    "rescale_factor": 1 / 255, "do_normalize": True, "size": {"height": 384, "width": 384},
    "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
}
# Every frame or tile is resized to the tower's size; a processor that keeps its input's size
# would need the reference's interpolated position embeddings, which are not built.
_FIXED = {"do_resize": True, "do_center_crop": False}
BACKENDS = ("torchvision", "pil")
# transformers' torchvision backend's modes for PIL's filters (the ones implemented here).
_TORCH_MODES = {Image.Resampling.BILINEAR.value: "bilinear",
                Image.Resampling.BICUBIC.value: "bicubic"}
# transformers' classes with their own defaults.
IMAGE_PROCESSORS = {
    "GotOcr2ImageProcessor": Schema(
        "GotOcr2ImageProcessor", {**_PIXELS, "min_patches": 1, "max_patches": 12}, _FIXED,
        # crop_to_patches: InternVLProcessor passes its own (true) to every call, which wins.
        # The rest are resizing options of other classes GotOcr2 never reads.
        inert=frozenset({"crop_to_patches", "crop_size", "default_to_square", "do_pad"})),
}
VIDEO_PROCESSORS = {
    "InternVLVideoProcessor": Schema(
        "InternVLVideoProcessor", {**_PIXELS, "do_sample_frames": False, "num_frames": None},
        # Sampling by a rate, or without the half-segment shift, is not built.
        {**_FIXED, "fps": None, "initial_shift": True},
        # do_pad pads a batch's videos to one size (each is taken alone here); an older
        # checkpoint without a video file lends it the image processor's (crop_to_patches ...).
        inert=frozenset({"crop_size", "default_to_square", "do_pad", "video_metadata",
                         "crop_to_patches", "min_patches", "max_patches"})),
}


@dataclass(frozen=True)
class PixelConfig:
    """How one processor turns a tile or a frame into pixel values."""

    tile: int  # `size`: height = width of a tile (the tower's input)
    resample: int
    do_rescale: bool
    rescale_factor: float
    do_normalize: bool
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    do_convert_rgb: bool
    backend: str  # "torchvision" or "pil": how transformers' class resizes and rescales

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"InternVL preprocessing: backend must be one of {BACKENDS}, got "
                             f"{self.backend!r}")
        if self.backend == "torchvision" and self.resample not in _TORCH_MODES:
            raise NotImplementedError(
                f"InternVL preprocessing: resample={self.resample} with transformers' "
                f"torchvision backend: only {sorted(_TORCH_MODES)} (bilinear, bicubic) are "
                "implemented")
        if self.tile < 1:
            raise ValueError(f"InternVL preprocessing: tile must be >= 1, got {self.tile}")
        if any(s == 0 for s in self.image_std):
            raise ValueError(f"InternVL preprocessing: image_std has a zero: {self.image_std}")

    @classmethod
    def from_settings(cls, s: Settings, backend: str) -> PixelConfig:
        size = s["size"]
        if isinstance(size, int) and not isinstance(size, bool):  # transformers: a square
            size = {"height": size, "width": size}
        if not isinstance(size, Mapping) or set(size) != {"height", "width"}:
            raise CheckpointError(f"{s.sources['size']}: size must be a height and a width, "
                                  f"got {size!r}")
        if size["height"] != size["width"]:
            raise NotImplementedError(f"{s.sources['size']}: tiles of {size['height']} x "
                                      f"{size['width']} pixels: only square tiles are supported")
        return cls(tile=int(size["height"]), resample=int(s["resample"]),
                   do_rescale=bool(s["do_rescale"]), rescale_factor=float(s["rescale_factor"]),
                   do_normalize=bool(s["do_normalize"]), image_mean=triple(s["image_mean"]),
                   image_std=triple(s["image_std"]), do_convert_rgb=bool(s["do_convert_rgb"]),
                   backend=backend)


def backend_of(named: str | None) -> str:
    """The backend of the image processor class a checkpoint names (`image_processor_type`;
    none: transformers' default, torchvision)."""
    return "pil" if named is not None and str(named).endswith("Pil") else "torchvision"


@dataclass(frozen=True)
class TileLimits:
    """How many tiles an image's grid may have (GotOcr2's min_patches / max_patches)."""

    min_patches: int
    max_patches: int


def tile_limits(s: Settings) -> TileLimits:
    """The image processor's min_patches / max_patches, checked."""
    values = {}
    for key in ("min_patches", "max_patches"):
        value = s[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{s.sources[key]}: {key}={value!r} is not a positive integer")
        values[key] = value
    return TileLimits(**values)


def grids(min_tiles: int, max_tiles: int) -> tuple[tuple[int, int], ...]:
    """Every (cols, rows) with min_tiles <= cols * rows <= max_tiles, by increasing tile count,
    grids of one count in order of cols then rows (the reference's order: it matters for
    ties). Built in O(max log max), not by testing every pair."""
    found = [(cols, rows) for cols in range(1, max_tiles + 1)
             for rows in range(1, max_tiles // cols + 1) if cols * rows >= min_tiles]
    return tuple(sorted(found, key=lambda g: g[0] * g[1]))  # stable: keeps cols, rows order


@lru_cache(maxsize=256)
def best_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int
              ) -> tuple[int, int]:
    """(cols, rows) of an image's tile grid (see the module docstring); (1, 1) when no grid of
    min_tiles..max_tiles tiles exists."""
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grids(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile * tile * cols * rows:
            best = (cols, rows)
    return best


def image_grid(height: int, width: int, tile: int, limits: TileLimits) -> tuple[int, int]:
    """(cols, rows) the image is cut into; (1, 1): the whole image resized to one tile (no
    thumbnail). InternVLProcessor always crops, but a cap of one tile never does."""
    if limits.max_patches <= 1:
        return 1, 1
    return best_grid(height, width, tile, limits.min_patches, limits.max_patches)


def tile_count(grid: tuple[int, int]) -> int:
    """Tower inputs of an image: its grid's tiles, plus the thumbnail when there are several."""
    cols, rows = grid
    return cols * rows + (1 if cols * rows > 1 else 0)


def preprocess_image(image: Image.Image, cfg: PixelConfig, limits: TileLimits
                     ) -> tuple[torch.Tensor, tuple[int, int]]:
    """float32 [tiles, 3, S, S]: the grid's tiles row-major, then the thumbnail; and the grid
    (cols, rows)."""
    pixels = rgb_pixels(image, cfg)
    height, width = pixels.shape[:2]
    cols, rows = image_grid(height, width, cfg.tile, limits)
    t = cfg.tile
    whole = _resize(pixels, rows * t, cols * t, cfg)
    tiles = [whole[r * t:(r + 1) * t, c * t:(c + 1) * t] for r in range(rows) for c in range(cols)]
    if len(tiles) > 1:
        tiles.append(_resize(pixels, t, t, cfg))
    return normalize(np.stack(tiles), cfg), (cols, rows)


def preprocess_frames(frames: np.ndarray, cfg: PixelConfig) -> torch.Tensor:
    """uint8 frames [N, H, W, 3] -> float32 [N, 3, S, S], each resized to one tile."""
    return normalize(np.stack([_resize(f, cfg.tile, cfg.tile, cfg) for f in frames]), cfg)


def _resize(pixels: np.ndarray, height: int, width: int, cfg: PixelConfig) -> np.ndarray:
    """uint8 [H, W, 3] resized as cfg's backend does it on the CPU: torchvision (antialiased)
    resizes a uint8 tensor natively for bicubic, and for bilinear where the CPU has AVX2, else
    in float32, clamped and rounded back; unchanged at its own size."""
    if cfg.backend == "pil":
        return resize(pixels, height, width, cfg.resample)
    if pixels.shape[:2] == (height, width):
        return pixels
    mode = _TORCH_MODES[cfg.resample]
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1)[None]
    native = mode == "bicubic" or "AVX2" in torch.backends.cpu.get_cpu_capability()
    y = F.interpolate(x if native else x.float(), size=(height, width), mode=mode,
                      align_corners=False, antialias=True)
    if not native:
        y = y.clamp_(0, 255).round_().to(torch.uint8)
    return y[0].permute(1, 2, 0).numpy()


def normalize(pixels: np.ndarray, cfg: PixelConfig) -> torch.Tensor:
    """uint8 [N, H, W, 3] -> float32 [N, 3, H, W], rescaled and normalized as cfg's backend
    does: torchvision fuses both, (x - mean / factor) / (std / factor) in float32."""
    x = torch.from_numpy(np.ascontiguousarray(pixels)).permute(0, 3, 1, 2)
    if cfg.backend == "pil" or not (cfg.do_rescale and cfg.do_normalize):
        return rescale_normalize(x, cfg)
    scale = 1.0 / cfg.rescale_factor
    mean = (torch.tensor(cfg.image_mean) * scale).view(3, 1, 1)
    std = (torch.tensor(cfg.image_std) * scale).view(3, 1, 1)
    return ((x.float() - mean) / std).contiguous()


def settings_dict(cfg: PixelConfig) -> dict[str, Any]:
    """What of `cfg` changes the pixels, for content hashes."""
    return {"tile": cfg.tile, "resample": cfg.resample, "backend": cfg.backend,
            "mean": list(cfg.image_mean),
            "std": list(cfg.image_std), "rescale": cfg.do_rescale and cfg.rescale_factor,
            "normalize": cfg.do_normalize}
