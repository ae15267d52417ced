"""models/processing/clip_image.py and models/llava/preprocess.py against transformers' PIL CLIP /
SigLIP / LLaVA / LLaVA-NeXT image processors and the LLaVA / LLaVA-NeXT processors' image-token
expansion."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlavaNextProcessor, LlavaProcessor, PreTrainedTokenizerFast
from transformers.image_processing_utils import select_best_resolution as hf_select_best_resolution
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.llava_next.image_processing_pil_llava_next import (
    LlavaNextImageProcessorPil,
)
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from models.llava.preprocess import (
    llava_next_num_image_tokens,
    llava_num_image_tokens,
    preprocess_llava_next,
    select_best_resolution,
    unpad_bounds,
)
from models.processing.clip_image import CLIP_MEAN, ClipPreprocessConfig, preprocess_clip

PINPOINTS = [[28, 56], [56, 28], [56, 56], [84, 28], [28, 84]]
SIZES = [(1, 1), (28, 28), (17, 45), (45, 17), (33, 100), (100, 33), (7, 3), (301, 299)]
MODES = ["RGBA", "L", "P", "P+transparency", "LA", "CMYK"]


def draw_image(height: int, width: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    """Noise with a drawn ellipse and line; alpha modes get noisy alpha, P a 16-color palette."""
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 4, height // 4, 3 * width // 4, 3 * height // 4), fill=(250, 30, 90))
    draw.line((0, height - 1, width - 1, 0), fill=(10, 200, 40), width=2)
    if mode in ("RGBA", "LA"):
        alpha = Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8))
        image = image.convert(mode[:-1])
        image.putalpha(alpha)
        return image
    if mode.startswith("P"):
        image = image.quantize(16)
        if mode == "P+transparency":
            image.info["transparency"] = 3
        return image
    return image.convert(mode)


def images() -> list[Image.Image]:
    out = [draw_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES)]
    for i, mode in enumerate(MODES):
        out += [draw_image(19, 41, mode, seed=i), draw_image(64, 23, mode, seed=i + 9)]
    return out


IMAGES = images()

CLIP_PROCESSORS = {
    "clip": lambda: CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}
    ),
    "clip-crop-pads": lambda: CLIPImageProcessorPil(
        size={"shortest_edge": 25}, crop_size={"height": 28, "width": 20}
    ),
    "clip-bilinear-offset-crop": lambda: CLIPImageProcessorPil(
        size={"shortest_edge": 31}, crop_size={"height": 28, "width": 26}, resample=2
    ),
    "clip-no-rescale": lambda: CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, do_rescale=False
    ),
    "clip-no-normalize": lambda: CLIPImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, do_normalize=False,
        resample=1,
    ),
    "siglip": lambda: SiglipImageProcessorPil(size={"height": 32, "width": 32}),
    "siglip-nonsquare-nearest": lambda: SiglipImageProcessorPil(
        size={"height": 24, "width": 40}, resample=0, image_mean=0.4, image_std=0.3
    ),
    "llava-pad-to-square": lambda: LlavaImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, do_pad=True
    ),
}

LLAVA_NEXT_PROCESSORS = {
    "crop28": lambda: LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28},
        image_grid_pinpoints=PINPOINTS,
    ),
    "resize32-crop28": lambda: LlavaNextImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28},
        image_grid_pinpoints=[[28, 28], *PINPOINTS, [84, 56]],
    ),
}


def assert_pixels(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref.to(torch.float32), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CLIP_PROCESSORS))
def test_preprocess_clip_matches_hf(name):
    hf = CLIP_PROCESSORS[name]()
    cfg = ClipPreprocessConfig.from_hf(hf.to_dict())
    for image in IMAGES:
        ref = hf(image, return_tensors="pt")["pixel_values"][0]
        assert_pixels(preprocess_clip(image, cfg), ref)


@pytest.mark.parametrize("name", list(LLAVA_NEXT_PROCESSORS))
def test_preprocess_llava_next_matches_hf(name):
    hf = LLAVA_NEXT_PROCESSORS[name]()
    cfg = ClipPreprocessConfig.from_hf(hf.to_dict())
    extra = [draw_image(h, w, seed=h) for h, w in [(10, 200), (200, 10), (37, 53), (56, 28)]]
    for image in IMAGES + extra:
        out = hf(image, return_tensors="pt")
        pixels, image_size, (rows, cols) = preprocess_llava_next(image, cfg)
        assert_pixels(pixels, out["pixel_values"][0])
        assert image_size == tuple(out["image_sizes"][0].tolist()) == (image.height, image.width)
        best = select_best_resolution(image_size, cfg.image_grid_pinpoints)
        assert (rows, cols) == (best[0] // 28, best[1] // 28)
        assert len(pixels) == 1 + rows * cols


def test_llava_next_batch_padding_real_tiles_only():
    hf = LLAVA_NEXT_PROCESSORS["crop28"]()
    cfg = ClipPreprocessConfig.from_hf(hf.to_dict())
    batch = [draw_image(20, 20, seed=1), draw_image(30, 90, seed=2), draw_image(50, 60, seed=3)]
    ref = hf(batch, return_tensors="pt")["pixel_values"]  # [3, most tiles, 3, 28, 28]
    counts = []
    for image, padded in zip(batch, ref, strict=True):
        pixels = preprocess_llava_next(image, cfg)[0]
        counts.append(len(pixels))
        assert_pixels(pixels, padded[: len(pixels)])
        assert not padded[len(pixels) :].any()
    assert len(set(counts)) > 1


def test_select_best_resolution_matches_hf():
    rng = random.Random(0)
    pinpoint_sets = [PINPOINTS, LlavaNextImageProcessorPil.image_grid_pinpoints]
    for _ in range(3000):
        size = (rng.randint(1, 2000), rng.randint(1, 2000))
        for pinpoints in pinpoint_sets:
            assert select_best_resolution(size, pinpoints) == tuple(
                hf_select_best_resolution(size, pinpoints)
            )


@pytest.fixture(scope="module")
def tokenizer():
    vocab = {"<unk>": 0, "<image>": 1, "hi": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    return tok


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_next_token_count_matches_processor(tokenizer, strategy):
    image_processor = LLAVA_NEXT_PROCESSORS["crop28"]()
    proc = LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=7,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
    )
    for h, w in [(1, 1), (30, 70), (70, 30), (28, 28), (45, 17), (101, 37), (10, 200)]:
        ids = proc(images=draw_image(h, w), text="hi <image> hi")["input_ids"][0]
        expected = llava_next_num_image_tokens(h, w, PINPOINTS, 28, 7, strategy)
        assert ids.count(1) == expected, (h, w)
    cfg = ClipPreprocessConfig.from_hf(image_processor.to_dict())
    assert llava_next_num_image_tokens(30, 70, cfg, 28, 7, strategy) == (
        llava_next_num_image_tokens(30, 70, PINPOINTS, 28, 7, strategy)
    )


def test_llava_next_token_arithmetic_matches_processor(tokenizer):
    rng = random.Random(1)
    setups = [  # (pinpoints, vision image_size, patch_size)
        (LlavaNextImageProcessorPil.image_grid_pinpoints, 336, 14),  # llava-v1.6
        (PINPOINTS, 28, 7),
        ([[384, 768], [768, 384], [768, 768], [1152, 384], [384, 1152]], 384, 16),
    ]
    for pinpoints, image_size, patch in setups:
        proc = LlavaNextProcessor(
            image_processor=LlavaNextImageProcessorPil(image_grid_pinpoints=pinpoints),
            tokenizer=tokenizer, patch_size=patch, num_additional_image_tokens=1,
        )
        side = image_size // patch
        for _ in range(1500):
            h, w = rng.randint(1, 3000), rng.randint(1, 3000)
            ref = proc._get_number_of_features(h, w, image_size, image_size)
            assert llava_next_num_image_tokens(h, w, pinpoints, image_size, patch, "full") == ref
            best = select_best_resolution((h, w), pinpoints)
            rows, cols = best[0] // image_size, best[1] // image_size
            feats, newlines = proc._get_unpadded_features(h, w, side, side, rows, cols)
            top, bottom, left, right = unpad_bounds((h, w), rows * side, cols * side)
            assert ((bottom - top) * (right - left), bottom - top) == (feats, newlines)


@pytest.mark.parametrize("strategy", ["default", "full"])
def test_llava_token_count_matches_processor(tokenizer, strategy):
    proc = LlavaProcessor(
        image_processor=CLIP_PROCESSORS["clip"](), tokenizer=tokenizer, patch_size=7,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
    )
    ids = proc(images=draw_image(40, 30), text="hi <image>")["input_ids"][0]
    assert ids.count(1) == llava_num_image_tokens(28, 7, strategy) == 16 + (strategy == "full")
    assert llava_num_image_tokens(336, 14) == 576 and llava_num_image_tokens((336, 336), 14, "full")


def test_from_hf_reads_checkpoint_configs():
    llava15 = {  # llava-hf/llava-1.5-7b-hf
        "crop_size": {"height": 336, "width": 336}, "do_center_crop": True,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": list(CLIP_MEAN), "image_std": [0.26862954, 0.26130258, 0.27577711],
        "image_processor_type": "CLIPImageProcessor", "resample": 3,
        "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 336},
    }
    cfg = ClipPreprocessConfig.from_hf(llava15)
    assert (cfg.shortest_edge, cfg.size, cfg.crop_size) == (336, None, (336, 336))
    assert cfg.tile_size == 336
    assert cfg.image_grid_pinpoints is None and not cfg.pad_to_square
    old_style = ClipPreprocessConfig.from_hf({"size": 224, "crop_size": 224})
    assert (old_style.shortest_edge, old_style.crop_size) == (224, (224, 224))
    siglip = ClipPreprocessConfig.from_hf({"image_processor_type": "SiglipImageProcessor"})
    assert (siglip.size, siglip.do_center_crop) == ((224, 224), False)
    assert siglip.image_mean == siglip.image_std == (0.5, 0.5, 0.5)
    nxt = ClipPreprocessConfig.from_hf({"image_processor_type": "LlavaNextImageProcessor"})
    assert nxt.image_grid_pinpoints[0] == (336, 672) and nxt.base_size == (224, 224)
    # LLaVA-NeXT's do_pad pads the batch, not the image
    assert not ClipPreprocessConfig.from_hf(
        {"image_processor_type": "LlavaNextImageProcessor", "do_pad": True}
    ).pad_to_square


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"shortest_edge": None}, "shortest_edge / size"),
        ({"size": (32, 32)}, "shortest_edge / size"),
        ({"shortest_edge": 0}, "shortest_edge"),
        ({"crop_size": (28, -1)}, "crop_size"),
        ({"crop_size": None}, "crop_size"),
        ({"resample": 9}, "resample"),
        ({"rescale_factor": 0.0}, "rescale_factor"),
        ({"image_mean": (0.5, 0.5)}, "image_mean"),
        ({"image_std": (0.5, 0.0, 0.5)}, "image_std"),
        ({"image_grid_pinpoints": ()}, "image_grid_pinpoints"),
        ({"image_grid_pinpoints": ((28, 56), (28,))}, "image_grid_pinpoints"),
    ],
)
def test_config_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ClipPreprocessConfig(**kwargs)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="size"):
        ClipPreprocessConfig.from_hf({"size": {"longest_edge": 100}})
    with pytest.raises(ValueError, match="crop_size"):
        ClipPreprocessConfig.from_hf({"crop_size": {"shortest_edge": 100}})
    with pytest.raises(ValueError, match="image_grid_pinpoints"):
        preprocess_llava_next(draw_image(8, 8), ClipPreprocessConfig())
    with pytest.raises(ValueError, match="RGB"):
        preprocess_clip(draw_image(8, 8, "L"), ClipPreprocessConfig(do_convert_rgb=False))
    with pytest.raises(ValueError, match="strategy"):
        llava_num_image_tokens(336, 14, "cls")
