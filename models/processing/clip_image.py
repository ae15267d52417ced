"""The CLIP / SigLIP image processor that LLaVA, Gemma 3 and Pixtral-towered models share: its
settings (`ClipPreprocessConfig`) and one image's pixels as transformers' PIL processors make them
(CLIPImageProcessor, SiglipImageProcessor, Gemma3ImageProcessor, LlavaImageProcessor): PIL
resizes, numpy crops and pads, torch rescales and normalizes. LLaVA-NeXT's anyres tiles are
models/llava/preprocess.py."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from models.processing.image import rescale_normalize, resize, triple

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
LLAVA_NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
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
    pixels = rgb_pixels(image, cfg)
    if cfg.pad_to_square:
        pixels = _pad_to_square(pixels, tuple(int(m * 255) for m in cfg.image_mean))
    return transform(pixels, cfg)


def rgb_pixels(image: Image.Image, cfg: ClipPreprocessConfig) -> np.ndarray:
    """uint8 [H, W, 3]; transparency is composited onto white, as HF's convert_to_rgb does."""
    if not cfg.do_convert_rgb:
        if image.mode != "RGB":
            raise ValueError(f"do_convert_rgb is off and the image is {image.mode!r}, not RGB")
        return np.array(image)
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(white, image.convert("RGBA"))
    return np.array(image.convert("RGB"))


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


def transform(pixels: np.ndarray, cfg: ClipPreprocessConfig) -> torch.Tensor:
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
