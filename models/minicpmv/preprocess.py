"""Pixels of MiniCPM-V 4.6 pictures (an image, or one video frame), as transformers'
MiniCPMV4_6ImageProcessorPil makes them, and their layout from (height, width) alone.

A picture larger than `scale_resolution` squared is cut into a rows x cols grid of slices, the
grid whose aspect ratio is closest to the picture's among the slice counts next to its area in
slices (capped by `max_slice_nums`). The picture itself, resized to about that area (the
"overview"), comes first; then the picture resized to the grid is cut into its slices, row by
row. Every side is rounded to a multiple of patch_size x the merge factor (4 in the "16x" mode:
the tower's window merger and the downsampling MLP each halve both sides; 2 in "4x"). Each
slice becomes NaViT-packed rows [3, patch, h * w * patch] (patch (i, j) of its h x w grid at
columns (i * w + j) * patch), and h * w / (merge factor)^2 embeddings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from models.checkpoint import CheckpointError, Schema, Settings
from models.processing.clip_image import rgb_pixels
from models.processing.image import rescale_normalize, resize, triple

MODES = ("16x", "4x")  # downsample_mode: embeddings per 4 x 4 patches, or per 2 x 2

# transformers' classes with their own defaults. `use_image_id` is the processor's (it writes
# the `<image_id>` tag); do_resize is popped as "the model resizes", so only True works.
_PIXELS = {
    "resample": Image.Resampling.BICUBIC.value, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_convert_rgb": True, "max_slice_nums": 9, "scale_resolution": 448, "patch_size": 14,
    "slice_mode": True, "downsample_mode": "16x", "use_image_id": True,
}
IMAGE_PROCESSORS = {"MiniCPMV4_6ImageProcessor": Schema(
    "MiniCPMV4_6ImageProcessor", _PIXELS, {"do_resize": True})}
# Its frame sampling (a frame per second, `max_num_frames` at most) reads neither `fps` nor
# `num_frames`; the engine's loader samples (do_sample_frames); stacking sub-second frames into
# composite pictures (stack_frames > 1) is not implemented.
VIDEO_PROCESSORS = {"MiniCPMV4_6VideoProcessor": Schema(
    "MiniCPMV4_6VideoProcessor", {**_PIXELS, "max_num_frames": 128},
    {"do_resize": True, "stack_frames": 1, "do_sample_frames": True},
    inert=frozenset({"fps", "num_frames"}))}


@dataclass(frozen=True)
class SliceConfig:
    """One image or video processor's settings (read from a checkpoint by `from_settings`)."""

    scale_resolution: int = 448
    patch_size: int = 14
    max_slice_nums: int = 9
    slice_mode: bool = True
    downsample_mode: str = "16x"
    resample: int = Image.Resampling.BICUBIC.value
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True

    def __post_init__(self) -> None:
        for name in ("scale_resolution", "patch_size", "max_slice_nums"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MiniCPM-V preprocessing: {name} must be a positive int, "
                                 f"got {value!r}")
        if self.downsample_mode not in MODES:
            raise ValueError(f"MiniCPM-V preprocessing: downsample_mode must be one of {MODES}, "
                             f"got {self.downsample_mode!r}")

    @property
    def merge(self) -> int:
        """Patches per embedding along each side: 4 ("16x") or 2 ("4x")."""
        return 2 if self.downsample_mode == "4x" else 4

    def with_options(self, max_slice_nums: int | None = None,
                     downsample_mode: str | None = None) -> SliceConfig:
        """The settings a request's options change."""
        return SliceConfig(**{**self.__dict__,
                              "max_slice_nums": max_slice_nums or self.max_slice_nums,
                              "downsample_mode": downsample_mode or self.downsample_mode})

    @classmethod
    def from_settings(cls, s: Settings) -> SliceConfig:
        """From an image or video processor's settings read against PROCESSOR_SCHEMAS."""
        for name in ("scale_resolution", "patch_size", "max_slice_nums"):
            value = s[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CheckpointError(f"{s.sources[name]}: {name}={value!r} is not a positive "
                                      "integer")
        mode = s["downsample_mode"]
        if mode not in MODES:
            raise CheckpointError(f"{s.sources['downsample_mode']}: downsample_mode={mode!r} is "
                                  f"not one of {', '.join(MODES)}")
        return cls(scale_resolution=int(s["scale_resolution"]), patch_size=int(s["patch_size"]),
                   max_slice_nums=int(s["max_slice_nums"]), slice_mode=bool(s["slice_mode"]),
                   downsample_mode=mode, resample=int(s["resample"]),
                   do_rescale=bool(s["do_rescale"]), rescale_factor=float(s["rescale_factor"]),
                   do_normalize=bool(s["do_normalize"]), image_mean=triple(s["image_mean"]),
                   image_std=triple(s["image_std"]), do_convert_rgb=bool(s["do_convert_rgb"]))


@dataclass(frozen=True)
class PictureLayout:
    """Where a picture's pixels go: the overview's size, the grid (rows, cols; (0, 0) without
    slices), the size the picture is resized to before cutting, and each part's patch grid."""

    overview: tuple[int, int]
    grid: tuple[int, int]
    refine: tuple[int, int] | None
    patch_grids: tuple[tuple[int, int], ...]  # (h, w) in patches: overview, then each slice

    def embeddings(self, merge: int) -> tuple[int, ...]:
        """Embeddings of each part (overview first)."""
        return tuple(h * w // merge**2 for h, w in self.patch_grids)


def _to_multiple(length: float, step: int) -> int:
    """`length` rounded to the nearest multiple of `step` (ties to even), at least `step`."""
    return max(round(length / step) * step, step)


def fit_area(height: float, width: float, cfg: SliceConfig, upscale: bool) -> tuple[int, int]:
    """(height, width) brought to about scale_resolution^2 pixels at the same aspect ratio when
    larger (or always, with `upscale`), each side then rounded to a multiple of
    patch_size x merge."""
    if upscale or height * width > cfg.scale_resolution**2:
        ratio = width / height
        height = int(cfg.scale_resolution / math.sqrt(ratio))
        width = int(height * ratio)
    step = cfg.patch_size * cfg.merge
    return _to_multiple(height, step), _to_multiple(width, step)


def slice_grid(height: int, width: int, cfg: SliceConfig) -> tuple[int, int] | None:
    """(rows, cols) of the slices, or None for a picture taken whole: among the slice counts
    one below, at and one above its area in slices (at most max_slice_nums, never 1), the
    factorisation whose cols / rows is nearest its aspect ratio in log scale; on a tie, the
    one with more rows."""
    if not cfg.slice_mode:
        return None
    wanted = min(math.ceil(width * height / cfg.scale_resolution**2), cfg.max_slice_nums)
    if wanted <= 1:
        return None
    aspect = math.log(width / height)
    best, best_error = (1, 1), math.inf
    for count in (wanted - 1, wanted, wanted + 1):
        if count == 1 or count > cfg.max_slice_nums:
            continue
        for rows in range(1, count + 1):
            if count % rows:
                continue
            error = abs(aspect - math.log((count // rows) / rows))
            if error < best_error or (error == best_error and rows > best[0]):
                best, best_error = (rows, count // rows), error
    return best


def picture_layout(height: int, width: int, cfg: SliceConfig) -> PictureLayout:
    """A picture's layout from its size alone."""
    grid = slice_grid(height, width, cfg)
    overview = fit_area(height, width, cfg, upscale=grid is None)
    p = cfg.patch_size
    parts = [(overview[0] // p, overview[1] // p)]
    if grid is None:
        return PictureLayout(overview, (0, 0), None, tuple(parts))
    rows, cols = grid
    cell = fit_area(_to_multiple(height, rows) / rows, _to_multiple(width, cols) / cols, cfg,
                    upscale=True)
    parts += [(cell[0] // p, cell[1] // p)] * (rows * cols)
    return PictureLayout(overview, grid, (cell[0] * rows, cell[1] * cols), tuple(parts))


def preprocess_picture(pixels: np.ndarray, cfg: SliceConfig
                       ) -> tuple[torch.Tensor, PictureLayout]:
    """uint8 RGB [H, W, 3] -> (float32 [3, patch, sum(h * w) * patch], its layout): the
    overview's patch rows, then each slice's."""
    layout = picture_layout(pixels.shape[0], pixels.shape[1], cfg)
    parts = [resize(pixels, *layout.overview, cfg.resample)]
    if layout.refine is not None:
        refined = resize(pixels, *layout.refine, cfg.resample)
        rows, cols = layout.grid
        h, w = layout.refine[0] // rows, layout.refine[1] // cols
        parts += [refined[r * h:(r + 1) * h, c * w:(c + 1) * w]
                  for r in range(rows) for c in range(cols)]
    packed = [_patch_rows(rescale_normalize(
        torch.from_numpy(np.ascontiguousarray(part)).permute(2, 0, 1), cfg), cfg.patch_size)
        for part in parts]
    return torch.cat(packed, dim=-1), layout


def image_pixels(image: Image.Image, cfg: SliceConfig) -> np.ndarray:
    """An image's uint8 RGB pixels [H, W, 3], as transformers converts it."""
    return rgb_pixels(image, cfg)


def _patch_rows(x: torch.Tensor, patch: int) -> torch.Tensor:
    """[3, H, W] -> [3, patch, (H / patch) * (W / patch) * patch]: NaViT packing."""
    c, height, width = x.shape
    x = x.view(c, height // patch, patch, width // patch, patch).permute(0, 2, 1, 3, 4)
    return x.reshape(c, patch, -1)
