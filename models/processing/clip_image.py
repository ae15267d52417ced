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

from models.checkpoint import (
    CheckpointError,
    Found,
    Schema,
    Settings,
    choose_schema,
    read_settings,
)
from models.processing.image import rescale_normalize, resize, triple

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
SIGLIP_MEAN = (0.5, 0.5, 0.5)
SIGLIP_STD = (0.5, 0.5, 0.5)
LLAVA_NEXT_PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
_SIZE_KEYS = ({"shortest_edge"}, {"height", "width"})

_COMMON = {
    "do_convert_rgb": True, "do_resize": True, "resample": Image.Resampling.BICUBIC.value,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
}
_CLIP = {**_COMMON, "do_center_crop": True, "size": {"shortest_edge": 224},
         "crop_size": {"height": 224, "width": 224}, "image_mean": list(CLIP_MEAN),
         "image_std": list(CLIP_STD)}
_SIGLIP = {**_COMMON, "size": {"height": 224, "width": 224}, "image_mean": list(SIGLIP_MEAN),
           "image_std": list(SIGLIP_STD)}
# Classes that resize to a fixed size never center-crop.
_NO_CROP = {"do_center_crop": False, "crop_size": None}
# The image processor classes these families' checkpoints name, with transformers' own
# defaults (tests/test_checkpoint_schemas.py compares them with the classes').
IMAGE_PROCESSORS = {
    "CLIPImageProcessor": Schema("CLIPImageProcessor", _CLIP),
    "SiglipImageProcessor": Schema("SiglipImageProcessor", _SIGLIP, _NO_CROP),
    "LlavaImageProcessor": Schema("LlavaImageProcessor", {**_CLIP, "do_pad": False}),
    # do_pad pads a batch's tile stacks to one count; each image is taken alone here.
    "LlavaNextImageProcessor": Schema(
        "LlavaNextImageProcessor", {**_CLIP, "image_grid_pinpoints": LLAVA_NEXT_PINPOINTS},
        inert=frozenset({"do_pad"})),
    # Pan-and-scan: transformers' Gemma3Processor passes its own defaults (off) to every call,
    # which override these; a request turns it on through mm_processor_kwargs.
    "Gemma3ImageProcessor": Schema(
        "Gemma3ImageProcessor", {**_SIGLIP, "resample": Image.Resampling.BILINEAR.value},
        _NO_CROP, inert=frozenset({"do_pan_and_scan", "pan_and_scan_min_crop_size",
                                   "pan_and_scan_max_num_crops",
                                   "pan_and_scan_min_ratio_to_activate"})),
}

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
    def from_settings(cls, s: Settings) -> ClipPreprocessConfig:
        """From one of IMAGE_PROCESSORS' settings, read from a checkpoint. Like transformers, an
        int `size` is a shortest edge (a square for classes that resize to a fixed size) and an
        int `crop_size` a square."""
        fixed = "shortest_edge" not in s.schema.defaults["size"]  # resizes to (height, width)
        size = s["size"]
        if isinstance(size, int):
            size = {"height": size, "width": size} if fixed else {"shortest_edge": size}
        elif isinstance(size, Sequence) and not isinstance(size, Mapping) and len(size) == 2:
            size = {"height": size[0], "width": size[1]}
        if not isinstance(size, Mapping) or set(size) not in _SIZE_KEYS:
            raise CheckpointError(f"{s.sources['size']}: size must be shortest_edge or "
                                  f"height/width, got {size!r}")
        crop = s.values.get("crop_size")
        if isinstance(crop, int):
            crop = (crop, crop)
        elif isinstance(crop, Mapping):
            if set(crop) != {"height", "width"}:
                raise CheckpointError(f"{s.sources['crop_size']}: crop_size must have height "
                                      f"and width, got {crop!r}")
            crop = (crop["height"], crop["width"])
        pinpoints = s.values.get("image_grid_pinpoints")
        return cls(
            shortest_edge=size.get("shortest_edge"),
            size=(size["height"], size["width"]) if "height" in size else None,
            crop_size=None if crop is None else (crop[0], crop[1]),
            resample=int(s["resample"]),
            do_resize=bool(s["do_resize"]),
            do_center_crop=bool(s.values.get("do_center_crop", False)),
            do_rescale=bool(s["do_rescale"]),
            rescale_factor=float(s["rescale_factor"]),
            do_normalize=bool(s["do_normalize"]),
            image_mean=triple(s["image_mean"]),
            image_std=triple(s["image_std"]),
            do_convert_rgb=bool(s["do_convert_rgb"]),
            # LlavaImageProcessor's do_pad pads to a square; LlavaNext's pads a batch (inert).
            pad_to_square=s.schema.cls == "LlavaImageProcessor" and bool(s["do_pad"]),
            image_grid_pinpoints=(
                None if pinpoints is None else tuple((p[0], p[1]) for p in pinpoints)
            ),
        )

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None,
                default_class: str = "CLIPImageProcessor") -> ClipPreprocessConfig:
        """From an image processor's settings dict (None: none saved), its class named by
        `image_processor_type`, else `default_class`."""
        found = None if d is None else Found(d, "image processor settings")
        return cls.from_settings(read_settings(found, choose_schema(
            found, IMAGE_PROCESSORS, default_class)))


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
