"""Image decoding: formats, modes, orientation, in-memory inputs and refused inputs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine.media import MediaLimits, load_image_sync
from tests.media_fixtures import (
    bomb_png,
    encode_image,
    exif_rotated_jpeg,
    gradient,
    palette_png_with_transparency,
    refused,
)

GOOD_PNG = encode_image(gradient(), "PNG")


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image).astype(int)


def assert_loader_still_works() -> None:
    image = load_image_sync(GOOD_PNG)
    assert np.array_equal(np.asarray(image), np.asarray(gradient()))


@pytest.mark.parametrize(
    ("fmt", "options", "tolerance"),
    [
        ("PNG", {}, 0),
        ("WEBP", {"lossless": True}, 0),
        ("BMP", {}, 0),
        ("TIFF", {}, 0),
        ("JPEG", {"quality": 95}, 12),
        ("GIF", {}, 40),
    ],
)
def test_formats_decode_to_rgb(fmt: str, options: dict, tolerance: int) -> None:
    source = gradient()
    image = load_image_sync(encode_image(source, fmt, **options))
    assert image.mode == "RGB" and image.size == source.size
    assert np.abs(pixels(image) - pixels(source)).max() <= tolerance


def test_exif_orientation_is_applied() -> None:
    image = load_image_sync(exif_rotated_jpeg())
    # Stored as 64x32 with red at the top left; shown rotated 90° clockwise.
    assert image.size == (32, 64)
    top_right = pixels(image)[4, 28]
    assert top_right[0] > 200 and top_right[1:].max() < 60
    assert abs(pixels(image)[4, 4] - 128).max() < 10


def test_palette_transparency_is_composited_on_white() -> None:
    image = load_image_sync(palette_png_with_transparency())
    assert [tuple(p) for p in pixels(image)[0]] == [
        (255, 0, 0),
        (255, 255, 255),
        (0, 255, 0),
        (127, 127, 255),
    ]


def test_palette_without_transparency() -> None:
    source = gradient().quantize(16)
    image = load_image_sync(encode_image(source, "PNG"))
    assert np.array_equal(np.asarray(image), np.asarray(source.convert("RGB")))


@pytest.mark.parametrize(
    ("mode", "values", "expected"),
    [
        ("L", [0, 128, 255], [0, 128, 255]),
        ("1", [0, 255, 0], [0, 255, 0]),
        ("I;16", [0, 257, 65535], [0, 1, 255]),
        ("I;16", [32896, 1000, 65280], [128, 4, 254]),
    ],
)
def test_grey_and_high_depth_modes(mode: str, values: list[int], expected: list[int]) -> None:
    dtype = np.uint16 if mode == "I;16" else np.uint8
    source = Image.fromarray(np.array([values], dtype=dtype))
    if mode == "1":
        source = source.convert("1")
    assert source.mode == mode
    image = load_image_sync(encode_image(source, "PNG"))
    assert pixels(image)[0].tolist() == [[v, v, v] for v in expected]


def test_32_bit_integer_and_float_modes() -> None:
    integer = Image.fromarray(np.array([[0, 65535, 257]], dtype=np.int32), "I")
    assert pixels(load_image_sync(encode_image(integer, "TIFF")))[0, :, 0].tolist() == [0, 255, 1]
    floats = Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F")
    assert pixels(load_image_sync(encode_image(floats, "TIFF")))[0, :, 0].tolist() == [0, 128, 255]


def test_alpha_modes_are_composited_on_white() -> None:
    la = Image.fromarray(np.array([[[0, 0], [0, 255], [100, 128]]], dtype=np.uint8), "LA")
    assert pixels(load_image_sync(encode_image(la, "PNG")))[0, :, 0].tolist() == [255, 0, 177]
    rgba = Image.new("RGBA", (2, 1), (255, 0, 0, 0))
    rgba.putpixel((1, 0), (0, 0, 255, 255))
    result = pixels(load_image_sync(encode_image(rgba, "PNG")))[0].tolist()
    assert result == [[255, 255, 255], [0, 0, 255]]


def test_cmyk() -> None:
    cmyk = Image.new("CMYK", (2, 1), (0, 0, 0, 0))
    cmyk.putpixel((1, 0), (255, 0, 0, 0))
    result = pixels(load_image_sync(encode_image(cmyk, "TIFF")))[0].tolist()
    assert result == [[255, 255, 255], [0, 255, 255]]


@pytest.mark.parametrize(("fmt", "options"), [("GIF", {}), ("WEBP", {"lossless": True})])
def test_animation_gives_its_first_frame(fmt: str, options: dict) -> None:
    first = Image.new("RGB", (8, 8), (255, 0, 0))
    second = Image.new("RGB", (8, 8), (0, 0, 255))
    data = encode_image(first, fmt, save_all=True, append_images=[second], duration=100, **options)
    assert pixels(load_image_sync(data))[0, 0].tolist() == [255, 0, 0]


def test_one_pixel_image_is_accepted_and_min_side_applies() -> None:
    tiny = encode_image(Image.new("RGB", (1, 1), (1, 2, 3)), "PNG")
    assert load_image_sync(tiny).size == (1, 1)
    refused(
        lambda: load_image_sync(tiny, limits=MediaLimits(min_image_side=2)),
        "image 1: 1x1 pixels",
        "minimum side of 2 pixels (MediaLimits.min_image_side)",
    )


def test_in_memory_images() -> None:
    source = gradient()
    array = np.asarray(source)
    for given in (source, source.convert("RGBA"), array, array.transpose(2, 0, 1).copy()):
        assert np.array_equal(np.asarray(load_image_sync(given)), array)
    grey = load_image_sync(np.full((4, 5), 7, np.uint8))
    assert grey.size == (5, 4) and pixels(grey)[0, 0].tolist() == [7, 7, 7]


def test_in_memory_image_is_copied_not_modified() -> None:
    source = gradient()
    image = load_image_sync(source)
    image.putpixel((0, 0), (1, 2, 3))
    assert source.getpixel((0, 0)) != (1, 2, 3)


def test_torch_tensor_image() -> None:
    torch = pytest.importorskip("torch")
    array = np.asarray(gradient())
    image = load_image_sync(torch.from_numpy(array.transpose(2, 0, 1).copy()))
    assert np.array_equal(np.asarray(image), array)


def test_bad_arrays_are_refused() -> None:
    refused(lambda: load_image_sync(np.zeros((4, 4, 3), np.float32)), "image 1", "uint8")
    refused(lambda: load_image_sync(np.zeros((2, 4, 4, 3), np.uint8)), "image 1", "[H, W]")
    assert_loader_still_works()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="zero-bytes"),
        pytest.param(b"just some text, not an image\n" * 4, id="text"),
        pytest.param(np.random.default_rng(0).bytes(4096), id="random-bytes"),
        pytest.param(b"\x89PNG\r\n\x1a\n" + np.random.default_rng(1).bytes(512), id="png-magic"),
    ],
)
def test_undecodable_bytes(data: bytes) -> None:
    refused(lambda: load_image_sync(data, item="image 3"), "image 3: could not decode")
    assert_loader_still_works()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_truncated_files(fmt: str) -> None:
    noise = np.random.default_rng(2).integers(0, 256, (128, 128, 3), dtype=np.uint8)
    data = encode_image(Image.fromarray(noise), fmt)
    refused(lambda: load_image_sync(data[: len(data) // 2]), "image 1: could not decode")
    assert_loader_still_works()


def test_decompression_bomb_is_refused_from_the_header() -> None:
    bomb = bomb_png(9000, 9000)
    assert len(bomb) < 200
    started = time.perf_counter()
    refused(
        lambda: load_image_sync(bomb),
        "image 1: 9000x9000 pixels exceeds the limit of 33177600 pixels",
        "(MediaLimits.max_image_pixels)",
    )
    # Pillow's own guard triggers first on truly absurd canvases; still a clean MediaError.
    refused(
        lambda: load_image_sync(bomb_png(40000, 40000)),
        "image 1:",
        "exceeds the limit of 33177600 pixels (MediaLimits.max_image_pixels)",
    )
    assert time.perf_counter() - started < 1.0
    assert_loader_still_works()


def test_pillow_bomb_warning_does_not_leak() -> None:
    # pytest resets warning filters around each test, so check in a fresh interpreter.
    # 100 million pixels: past Pillow's warning threshold, below its error threshold.
    script = (
        "from engine.media import MediaError, load_image_sync\n"
        "from tests.media_fixtures import bomb_png\n"
        "try:\n"
        "    load_image_sync(bomb_png(10000, 10000))\n"
        "except MediaError as e:\n"
        "    print(e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "image 1: 10000x10000 pixels exceeds the limit" in run.stdout
    assert run.stderr == ""


def test_pixel_limit_is_configurable() -> None:
    limits = MediaLimits(max_image_pixels=1000)
    refused(
        lambda: load_image_sync(GOOD_PNG, limits=limits, item="image 2"),
        "image 2: 64x48 pixels exceeds the limit of 1000 pixels",
    )
    assert_loader_still_works()
