"""Turn encoded image bytes (of an allowed format) or in-memory pixels into an upright, fully
loaded RGB PIL image within the pixel limits."""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.media.budget import RequestBudget
from engine.media.formats import IMAGE_FORMATS, allowed_image_formats, image_format_name
from engine.media.limits import MediaError, MediaLimits, decoder_errors

# Every header is checked against max_image_pixels, which makes Pillow's warning-level bomb
# guard redundant noise; its error-level guard still applies and becomes a MediaError.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_HIGH_DEPTH_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I", "F"})
# Enough of a file's start for every signature test.
_PREFIX_BYTES = 64


def decode_image(
    data: bytes, *, limits: MediaLimits, item: str, budget: RequestBudget | None = None
) -> Image.Image:
    """Decode ``data`` (the first frame of an animation) if it is one of ``IMAGE_FORMATS``.

    The pixel count is checked from the header, and the decoded RGB image reserved in
    ``budget`` (by default a budget of its own), before any pixel is decoded, so a small file
    declaring a huge canvas is refused without allocating it. Any other format is refused by
    name without being parsed; any decoder failure is a MediaError.
    """
    budget = budget or RequestBudget.for_limits(limits)
    with _decoder_errors(limits, item):
        with _open(data, item) as opened:
            check_image_size(opened.size, limits, item)
            budget.reserve_decoded(_rgb_bytes(opened.size), item)
            ImageOps.exif_transpose(opened, in_place=True)
            return to_rgb(opened)


def image_from_pixels(
    pixels: Image.Image | np.ndarray,
    *,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None = None,
) -> Image.Image:
    """An RGB copy of an in-memory image.

    ``pixels`` is a PIL image (its EXIF orientation is applied) or a uint8 array shaped
    [H, W], [H, W, C] or [C, H, W] with C in (1, 3, 4). The caller's object is not modified.
    """
    if isinstance(pixels, np.ndarray):
        pixels = Image.fromarray(_channels_last(pixels, item))
    with _decoder_errors(limits, item):
        check_image_size(pixels.size, limits, item)
        (budget or RequestBudget.for_limits(limits)).reserve_decoded(
            _rgb_bytes(pixels.size), item
        )
        return to_rgb(ImageOps.exif_transpose(pixels))


def _open(data: bytes, item: str) -> Image.Image:
    """Open (parse the header of) ``data`` with the allowed Pillow plugins only."""
    try:
        return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError as e:
        name = image_format_name(data[:_PREFIX_BYTES])
        if name is None or name in IMAGE_FORMATS:
            raise MediaError(
                f"{item}: could not decode the image (unrecognised, truncated or corrupted "
                f"data; accepted formats: {allowed_image_formats()})"
            ) from e
        raise MediaError(
            f"{item}: the data looks like {name}, an image format that is not accepted "
            f"(accepted formats: {allowed_image_formats()})"
        ) from e


def _rgb_bytes(size: tuple[int, int]) -> int:
    return size[0] * size[1] * 3


@contextmanager
def _decoder_errors(limits: MediaLimits, item: str) -> Iterator[None]:
    """Re-raise Pillow's failures, its decompression-bomb guard included, as MediaError."""
    with decoder_errors(item, "image"):
        try:
            yield
        except Image.DecompressionBombError as e:
            raise _too_many_pixels(item, limits, None) from e


def check_image_size(size: tuple[int, int], limits: MediaLimits, item: str) -> None:
    """Refuse a width x height outside ``max_image_pixels`` / ``min_image_side``."""
    width, height = size
    if width * height > limits.max_image_pixels:
        raise _too_many_pixels(item, limits, size)
    if min(width, height) < limits.min_image_side:
        raise MediaError(
            f"{item}: {width}x{height} pixels is below the minimum side of "
            f"{limits.min_image_side} pixels (MediaLimits.min_image_side)"
        )


def to_rgb(image: Image.Image) -> Image.Image:
    """A new RGB image: alpha composited on white, 16-bit and float data scaled to 8 bits."""
    if image.mode in _HIGH_DEPTH_MODES:
        return Image.fromarray(_to_uint8(np.asarray(image)), "L").convert("RGB")
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _to_uint8(values: np.ndarray) -> np.ndarray:
    """Map one-channel integer or float samples to uint8.

    Integer data ("I;16*", and "I", which Pillow uses for 16-bit sources) spans 0..65535
    and is scaled, rounding, by 255/65535. Float data ("F") within [0, 1] is scaled by 255;
    float data beyond that is taken as already being on the 0..255 scale and clipped.
    """
    if values.dtype.kind == "f":
        finite = np.nan_to_num(values.astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        scale = 255.0 if finite.size and finite.max() <= 1.0 else 1.0
        return np.clip(np.rint(finite * scale), 0, 255).astype(np.uint8)
    wide = np.clip(values.astype(np.int64), 0, 65535)
    return ((wide * 255 + 32767) // 65535).astype(np.uint8)


def _channels_last(array: np.ndarray, item: str) -> np.ndarray:
    if array.dtype != np.uint8:
        raise MediaError(f"{item}: image arrays must be uint8, got {array.dtype}")
    if array.ndim == 3 and array.shape[-1] not in (1, 3, 4) and array.shape[0] in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in (3, 4)):
        raise MediaError(
            f"{item}: image arrays must be shaped [H, W], [H, W, C] or [C, H, W] with C in "
            f"(1, 3, 4), got {list(array.shape)}"
        )
    return np.ascontiguousarray(array)


def _too_many_pixels(item: str, limits: MediaLimits, size: tuple[int, int] | None) -> MediaError:
    what = f"{size[0]}x{size[1]} pixels" if size else "the image's pixel count"
    return MediaError(
        f"{item}: {what} exceeds the limit of {limits.max_image_pixels} pixels "
        "(MediaLimits.max_image_pixels)"
    )
