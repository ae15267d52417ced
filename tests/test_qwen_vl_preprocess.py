"""models/processing/qwen_vision.py against transformers' PIL/numpy Qwen2-VL image processor."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    smart_resize as hf_smart_resize,
)

from models.processing.qwen_vision import (
    VisionPreprocessConfig,
    preprocess_image,
    preprocess_video,
    smart_resize,
)
from tests.hf_references import CFG, hf_processor, hf_video_reference


def random_image(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def test_defaults_match_hf():
    hf = Qwen2VLImageProcessorPil()
    assert (CFG.min_pixels, CFG.max_pixels) == (hf.size["shortest_edge"], hf.size["longest_edge"])
    assert CFG.image_mean == tuple(hf.image_mean) and CFG.image_std == tuple(hf.image_std)
    assert (CFG.patch_size, CFG.temporal_patch_size, CFG.merge_size) == (14, 2, 2)


def test_smart_resize_matches_hf():
    rng = random.Random(0)
    for _ in range(3000):
        height, width = rng.randint(1, 4000), rng.randint(1, 4000)
        if max(height, width) / min(height, width) > 200:
            continue
        lo = rng.choice([56 * 56, 4 * 28 * 28, 256 * 28 * 28])
        hi = max(lo, rng.choice([28 * 28 * 16, 28 * 28 * 1280, 16384 * 28 * 28]))
        assert smart_resize(height, width, 28, lo, hi) == hf_smart_resize(height, width, 28, lo, hi)


def test_smart_resize_rounding_and_errors():
    assert smart_resize(42, 42) == (56, 56)  # 1.5 rounds to 2
    assert smart_resize(70, 70, min_pixels=28 * 28) == (56, 56)  # 2.5 rounds half to even
    assert smart_resize(1, 1) == (56, 56)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 201)
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10)
    with pytest.raises(ValueError, match="min_pixels"):
        smart_resize(10, 300, min_pixels=0)


SIZES = [
    (1, 1), (2, 2), (10, 300), (300, 10), (28, 28), (42, 42), (70, 70), (56, 300), (300, 56),
    (224, 224), (480, 640), (37, 1000), (1000, 37), (333, 517),
]


@pytest.mark.parametrize("size", SIZES)
def test_image_matches_hf(size):
    image = random_image(*size, seed=size[0] * 7 + size[1])
    expected = hf_processor()(image, return_tensors="pt")
    pixel_values, grid = preprocess_image(image, CFG)
    assert pixel_values.dtype == torch.float32
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(pixel_values, expected["pixel_values"], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "size, min_pixels, max_pixels",
    [
        ((1080, 1920), None, 28 * 28 * 64),  # downsized
        ((1080, 1920), 56 * 56, 28 * 28 * 200),
        ((60, 90), 28 * 28 * 300, None),  # upsized
        ((17, 23), 28 * 28 * 40, 28 * 28 * 80),
    ],
)
def test_image_per_call_budget_matches_hf(size, min_pixels, max_pixels):
    image = random_image(*size, seed=1)
    lo = CFG.min_pixels if min_pixels is None else min_pixels
    hi = CFG.max_pixels if max_pixels is None else max_pixels
    expected = hf_processor(lo, hi)(image, return_tensors="pt")
    pixel_values, grid = preprocess_image(image, CFG, min_pixels=min_pixels, max_pixels=max_pixels)
    assert [list(grid)] == expected["image_grid_thw"].tolist()
    torch.testing.assert_close(pixel_values, expected["pixel_values"], atol=1e-5, rtol=0)


def test_image_rejects_non_rgb():
    with pytest.raises(ValueError, match="RGB"):
        preprocess_image(random_image(28, 28).convert("RGBA"), CFG)


@pytest.mark.parametrize(
    "count, size, budget",
    [
        (4, (90, 160), None),
        (5, (90, 160), None),  # odd: last frame repeated
        (1, (37, 300), None),
        (3, (480, 640), (28 * 28 * 4, 28 * 28 * 48)),
        (6, (20, 20), (28 * 28 * 100, 28 * 28 * 200)),
    ],
)
def test_video_matches_hf_image_path(count, size, budget):
    rng = np.random.default_rng(count)
    frames = rng.integers(0, 256, (count, *size, 3), dtype=np.uint8)
    lo, hi = budget or (CFG.video_min_pixels, CFG.video_max_pixels)
    kwargs = {} if budget is None else dict(min_pixels=lo, max_pixels=hi)
    pixel_values, grid = preprocess_video(frames, CFG, **kwargs)
    h, w = smart_resize(*size, 28, lo, hi)
    assert grid == (math.ceil(count / 2), h // 14, w // 14)
    expected = hf_video_reference(frames, lo, hi)
    assert pixel_values.shape == expected.shape
    torch.testing.assert_close(pixel_values, expected, atol=1e-5, rtol=0)


def test_video_frame_pair_equals_image_when_frames_repeat():
    frame = np.asarray(random_image(100, 140, seed=3))
    budget = dict(min_pixels=CFG.min_pixels, max_pixels=CFG.max_pixels)
    video, video_grid = preprocess_video(np.stack([frame, frame]), CFG, **budget)
    image, image_grid = preprocess_image(Image.fromarray(frame), CFG)
    assert video_grid == image_grid
    assert torch.equal(video, image)


def test_video_rejects_bad_frames():
    with pytest.raises(ValueError, match="uint8"):
        preprocess_video(np.zeros((2, 28, 28, 3), dtype=np.float32), CFG)
    with pytest.raises(ValueError, match="uint8"):
        preprocess_video(np.zeros((0, 28, 28, 3), dtype=np.uint8), CFG)


def test_from_hf_config_dicts():
    legacy = {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "merge_size": 2,
              "temporal_patch_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    cfg = VisionPreprocessConfig.from_hf(legacy)
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)
    assert (cfg.video_min_pixels, cfg.video_max_pixels) == (3136, 12845056)  # HF's fallback
    assert cfg.image_mean == (0.5, 0.5, 0.5)

    sized = {"size": {"shortest_edge": 1000, "longest_edge": 2000}}
    video = {"size": {"shortest_edge": 3000, "longest_edge": 4000}, "fps": 1.0}
    cfg = VisionPreprocessConfig.from_hf(sized, video)
    assert (cfg.min_pixels, cfg.max_pixels) == (1000, 2000)
    assert (cfg.video_min_pixels, cfg.video_max_pixels, cfg.video_fps) == (3000, 4000, 1.0)
    assert cfg.image_mean == CFG.image_mean and cfg.patch_size == 14

    both = {"min_pixels": 10, "size": {"shortest_edge": 1000, "longest_edge": 2000}}
    assert VisionPreprocessConfig.from_hf(both).min_pixels == 10  # as HF's __init__

    cfg = VisionPreprocessConfig.from_hf({})
    assert (cfg.video_min_pixels, cfg.video_max_pixels) == (128 * 28 * 28, 768 * 28 * 28)
    assert cfg.video_fps == 2.0


def test_from_hf_processor_object():
    cfg = VisionPreprocessConfig.from_hf(hf_processor(4 * 28 * 28, 28 * 28 * 100).to_dict())
    assert (cfg.min_pixels, cfg.max_pixels) == (4 * 28 * 28, 28 * 28 * 100)
    assert cfg.image_mean == CFG.image_mean and cfg.merge_size == 2
    image = random_image(300, 500, seed=5)
    expected = hf_processor(4 * 28 * 28, 28 * 28 * 100)(image, return_tensors="pt")
    torch.testing.assert_close(preprocess_image(image, cfg)[0], expected["pixel_values"])
