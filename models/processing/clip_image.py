"""Turn PIL images into the pixel tensors that CLIP / SigLIP vision towers take in LLaVA-1.5 and
LLaVA-NeXT (anyres tiles), and count the image tokens their processors expand to, matching
transformers' PIL image processors; PIL resizes, numpy crops and pads, torch scales."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
STRATEGIES = ("default", "full")
_SIZE_KEYS = ({"shortest_edge"}, {"height", "width"})

Pinpoints = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ClipPreprocessConfig:
    """Resize, crop and normalization settings of one CLIP-family image processor.

    Exactly one resize mode is set: ``shortest_edge`` (CLIP: scale the short side to it, keep the
    aspect ratio, then usually center crop) or ``size`` (SigLIP: (height, width), no crop).
    ``crop_size`` is (height, width). ``pad_to_square`` is LlavaImageProcessor's ``do_pad``
    (pad to a square of the mean color first); ``image_grid_pinpoints`` holds LLaVA-NeXT's
    (height, width) anyres resolutions.
    """

    shortest_edge: int | None = 224
    size: tuple[int, int] | None = None
    crop_size: tuple[int, int] | None = (224, 224)
    resample: int = Image.Resampling.BICUBIC.value
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True
    pad_to_square: bool = False
    image_grid_pinpoints: Pinpoints | None = None

    def __post_init__(self) -> None:
        if (self.shortest_edge is None) == (self.size is None):
            raise ValueError(
                "ClipPreprocessConfig needs exactly one of shortest_edge / size, got "
                f"shortest_edge={self.shortest_edge}, size={self.size}"
            )
        if self.shortest_edge is not None:
            _check_positive("shortest_edge", self.shortest_edge)
        for name in ("size", "crop_size"):
            value = getattr(self, name)
            if value is not None:
                _check_pair(name, value)
        if self.do_center_crop and self.crop_size is None:
            raise ValueError("ClipPreprocessConfig.crop_size is needed when do_center_crop is set")
        if self.resample not in {r.value for r in Image.Resampling}:
            raise ValueError(f"ClipPreprocessConfig.resample is no PIL filter: {self.resample}")
        if not (math.isfinite(self.rescale_factor) and self.rescale_factor > 0):
            raise ValueError(
                f"ClipPreprocessConfig.rescale_factor must be positive, got {self.rescale_factor}"
            )
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if len(value) != 3 or not all(math.isfinite(v) for v in value):
                raise ValueError(f"ClipPreprocessConfig.{name} must be 3 finite floats: {value}")
        if any(v == 0 for v in self.image_std):
            raise ValueError(f"ClipPreprocessConfig.image_std has a zero: {self.image_std}")
        if self.image_grid_pinpoints is not None:
            if not self.image_grid_pinpoints:
                raise ValueError("ClipPreprocessConfig.image_grid_pinpoints is empty")
            for pinpoint in self.image_grid_pinpoints:
                _check_pair("image_grid_pinpoints", pinpoint)

    @property
    def base_size(self) -> tuple[int, int]:
        """(height, width) LLaVA-NeXT resizes the whole image to for its base tile."""
        return self.size or (self.shortest_edge, self.shortest_edge)

    @property
    def tile_size(self) -> int:
        """Side of the square LLaVA-NeXT anyres tiles: the crop height, else the resize height."""
        return (self.crop_size or self.size or (self.shortest_edge,))[0]

    @classmethod
    def from_hf(cls, d: Mapping[str, Any]) -> ClipPreprocessConfig:
        """Read a preprocessor_config.json dict (CLIP, SigLIP, Gemma 3, LLaVA or LLaVA-NeXT).

        Missing keys take the defaults of the class named by ``image_processor_type``; like HF,
        an int ``size`` is a shortest edge and an int ``crop_size`` a square.
        """
        kind = str(d.get("image_processor_type") or "")
        # SigLIP's and Gemma 3's processors resize to a fixed size and never center-crop.
        siglip = kind.startswith(("Siglip", "Gemma3"))
        size = _first(d.get("size"), {"height": 224, "width": 224} if siglip else 224)
        if isinstance(size, int):
            size = {"shortest_edge": size}
        elif isinstance(size, Sequence):
            size = {"height": size[0], "width": size[1]} if len(size) == 2 else size
        if not isinstance(size, Mapping) or set(size) not in _SIZE_KEYS:
            raise ValueError(f"size must be shortest_edge or height/width, got {size!r}")
        crop = d.get("crop_size", None if siglip else 224)
        if isinstance(crop, int):
            crop = (crop, crop)
        elif isinstance(crop, Mapping):
            if set(crop) != {"height", "width"}:
                raise ValueError(f"crop_size must have height and width, got {crop!r}")
            crop = (crop["height"], crop["width"])
        pinpoints = d.get("image_grid_pinpoints")
        if pinpoints is None and kind.startswith("LlavaNext"):
            pinpoints = LLAVA_NEXT_PINPOINTS
        mean = _first(d.get("image_mean"), SIGLIP_MEAN if siglip else CLIP_MEAN)
        std = _first(d.get("image_std"), SIGLIP_STD if siglip else CLIP_STD)
        return cls(
            shortest_edge=size.get("shortest_edge"),
            size=(size["height"], size["width"]) if "height" in size else None,
            crop_size=None if crop is None else (crop[0], crop[1]),
            resample=int(_first(d.get("resample"), Image.Resampling.BICUBIC)),
            do_resize=bool(_first(d.get("do_resize"), True)),
            do_center_crop=bool(_first(d.get("do_center_crop"), not siglip)),
            do_rescale=bool(_first(d.get("do_rescale"), True)),
            rescale_factor=float(_first(d.get("rescale_factor"), 1 / 255)),
            do_normalize=bool(_first(d.get("do_normalize"), True)),
            image_mean=triple(mean),
            image_std=triple(std),
            do_convert_rgb=bool(_first(d.get("do_convert_rgb"), True)),
            pad_to_square=kind.startswith("LlavaImageProcessor") and bool(d.get("do_pad")),
            image_grid_pinpoints=(
                None if pinpoints is None else tuple((p[0], p[1]) for p in pinpoints)
            ),
        )


def _first(*values: Any) -> Any:
    return next(v for v in values if v is not None)


def triple(value: Any) -> tuple[float, ...]:
    """A per-channel setting: a scalar repeated for the three channels, or the three values."""
    return (float(value),) * 3 if isinstance(value, int | float) else tuple(map(float, value))


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"ClipPreprocessConfig.{name} must be a positive int, got {value!r}")


def _check_pair(name: str, value: Any) -> None:
    if not isinstance(value, tuple) or len(value) != 2:
        raise ValueError(f"ClipPreprocessConfig.{name} must be a (height, width) tuple: {value!r}")
    for v in value:
        _check_positive(name, v)


def preprocess_clip(image: Image.Image, cfg: ClipPreprocessConfig) -> torch.Tensor:
    """float32 [3, H, W] pixels of one image, as CLIP/SigLIP/LlavaImageProcessorPil make them."""
    pixels = _rgb(image, cfg)
    if cfg.pad_to_square:
        pixels = _pad_to_square(pixels, tuple(int(m * 255) for m in cfg.image_mean))
    return _transform(pixels, cfg)


def preprocess_llava_next(
    image: Image.Image, cfg: ClipPreprocessConfig
) -> tuple[torch.Tensor, tuple[int, int], tuple[int, int]]:
    """LLaVA-NeXT anyres pixels of one image: float32 [1 + rows*cols, 3, S, S] (the whole image
    first, then the tiles of its best-fit resolution row by row), its (height, width) and the
    tile grid (rows, cols)."""
    if cfg.image_grid_pinpoints is None:
        raise ValueError("preprocess_llava_next needs ClipPreprocessConfig.image_grid_pinpoints")
    pixels = _rgb(image, cfg)
    height, width = pixels.shape[:2]
    best_h, best_w = select_best_resolution((height, width), cfg.image_grid_pinpoints)
    fit_h, fit_w = _fit_within(height, width, best_h, best_w)
    canvas = np.zeros((best_h, best_w, 3), dtype=np.uint8)
    top, left = (best_h - fit_h) // 2, (best_w - fit_w) // 2
    canvas[top : top + fit_h, left : left + fit_w] = resize(pixels, fit_h, fit_w, cfg.resample)
    s = cfg.tile_size
    tiles = [canvas[y : y + s, x : x + s] for y in range(0, best_h, s) for x in range(0, best_w, s)]
    base = resize(pixels, *cfg.base_size, cfg.resample)
    pixel_values = torch.stack([_transform(tile, cfg) for tile in (base, *tiles)])
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


def _rgb(image: Image.Image, cfg: ClipPreprocessConfig) -> np.ndarray:
    """uint8 [H, W, 3]; transparency is composited onto white, as HF's convert_to_rgb does."""
    if not cfg.do_convert_rgb:
        if image.mode != "RGB":
            raise ValueError(f"do_convert_rgb is off and the image is {image.mode!r}, not RGB")
        return np.array(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.array(image.convert("RGB"))


def resize(pixels: np.ndarray, height: int, width: int, resample: int) -> np.ndarray:
    """uint8 [H, W, C] resized by PIL with `resample` (a PIL.Image.Resampling value)."""
    resized = Image.fromarray(pixels).resize((width, height), Image.Resampling(resample))
    return np.array(resized)


def _fit_within(height: int, width: int, target_h: int, target_w: int) -> tuple[int, int]:
    """Size of an image scaled to fit target_h x target_w, the short fit rounded up."""
    scale_w, scale_h = target_w / width, target_h / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_h), target_w
    return target_h, min(math.ceil(width * scale_h), target_w)


def _pad_to_square(pixels: np.ndarray, fill: tuple[int, ...]) -> np.ndarray:
    height, width = pixels.shape[:2]
    if height == width:
        return pixels
    side = max(height, width)
    out = np.empty((side, side, 3), dtype=np.uint8)
    out[:] = fill
    top, left = (side - height) // 2, (side - width) // 2
    out[top : top + height, left : left + width] = pixels
    return out


def _center_crop(pixels: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """Center crop; a side shorter than the crop is centered on black, any odd pad pixel first."""
    height, width = pixels.shape[:2]
    top, left = (height - crop_h) // 2, (width - crop_w) // 2  # if negative, -top = ceil(pad / 2)
    if top >= 0 and left >= 0:
        return pixels[top : top + crop_h, left : left + crop_w]
    out = np.zeros((crop_h, crop_w, 3), dtype=np.uint8)
    rows, cols = min(height, crop_h), min(width, crop_w)
    out[max(-top, 0) : max(-top, 0) + rows, max(-left, 0) : max(-left, 0) + cols] = pixels[
        max(top, 0) : max(top, 0) + rows, max(left, 0) : max(left, 0) + cols
    ]
    return out


def _transform(pixels: np.ndarray, cfg: ClipPreprocessConfig) -> torch.Tensor:
    """uint8 [H, W, 3] -> resize, center crop, rescale, normalize -> float32 [3, h, w]."""
    if cfg.do_resize:
        height, width = pixels.shape[:2]
        if cfg.size is not None:
            pixels = resize(pixels, *cfg.size, cfg.resample)
        else:
            short, long = sorted((height, width))
            new_long = int(cfg.shortest_edge * long / short)
            new_h, new_w = (new_long, cfg.shortest_edge) if width <= height else (
                cfg.shortest_edge, new_long
            )
            pixels = resize(pixels, new_h, new_w, cfg.resample)
    if cfg.do_center_crop:
        pixels = _center_crop(pixels, *cfg.crop_size)
    return rescale_normalize(torch.from_numpy(np.ascontiguousarray(pixels)).permute(2, 0, 1),
                             cfg)


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
