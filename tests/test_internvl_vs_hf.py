"""InternVL 2.5 / 3 / 3.5 through the whole engine, against transformers on tiny random checkpoints
(InternViT on 32-pixel tiles of 16 tokens, a locally trained tokenizer with InternVL's media
tokens and the converted checkpoints' chat template).

The reference's token ids and image pixels come from transformers' own InternVLProcessor over
the checkpoint's GotOcr2ImageProcessorPil; a video's text from InternVLProcessor's own
`replace_video_token` and its frames' pixels from ours (InternVLVideoProcessor needs
torchvision, absent here); transformers' model gets the pixel values in prompt order, as its
processor concatenates them. Greedy tokens identical and top log-probabilities within 1e-3 for
one image, two images with different tile grids, a video, text only, in one batch, for three
towers (LayerNorm with q/k/v biases; QK-norm, RMSNorm, no biases and a final norm; an earlier
hidden layer) and three decoders (Qwen2, Qwen3-MoE, Llama; Qwen3 in the layout matrix); then
chunk budgets that cut inside tiles and frames, an encoder budget of one tile, encoder-cache
and prefix-cache hits, the per-request options, the frame sampling and the grids against the
reference's own functions.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engine import LLM
from testing.internvl import TOKENS_PER_TILE as L
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    random_video,
    user,
)

N = 8
GREEDY = greedy(N)
LOGPROBS = greedy(N, logprobs=3)
VARIANTS = {  # name -> build_internvl_model options
    "qwen2": {},
    # InternViT-6B's shape (QK-norm, RMSNorm, no q/k/v biases, a final LayerNorm) before
    # InternVL3.5's mixture-of-experts decoder.
    "qwen3_moe-qknorm": {"text": "qwen3_moe", "qk_norm": True, "norm_type": "rms_norm",
                         "attention_bias": False, "mean_pooling": False},
    "llama-layer-2": {"text": "llama", "vision_feature_layer": -2, "vision_depth": 3},
}
CASES = {
    # Wide: a 3 x 1 grid and its thumbnail.
    "one_image": user(random_image(40, 110, 0), "Describe the image in detail."),
    # Tall and square-ish: other grids (1 x 3, 2 x 2).
    "two_images": user("Compare", random_image(120, 40, 1), "with", random_image(70, 60, 2),
                       "please."),
    "video": user("What happens in", random_video(3, 40, 60, 5), "this clip?"),
    "text_only": user("Hello there, how are you today?"),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    from testing.internvl import build_internvl_model

    path = build_internvl_model(tmp_path_factory.mktemp(request.param) / "m",
                                **VARIANTS[request.param])
    return request.param, path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from testing.internvl import build_internvl_model

    return build_internvl_model(tmp_path_factory.mktemp("internvl") / "m")


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=2048)


def reference_inputs(path, llm, messages, **mm_kwargs) -> dict:
    """transformers' inputs for `messages`, checked to be our token ids and image pixels."""
    import transformers

    from testing.internvl import reference_processor, reference_video_text

    ours, media = process_chat(llm, messages, mm_kwargs or None)
    text = llm.engine.processor.render_chat(messages).text
    proc = reference_processor(path)
    for video in media.get("video", []):
        text = text.replace("<video>", reference_video_text(proc, len(video.frames)), 1)
    if media.get("image"):
        out = proc(text=[text], images=media["image"], return_tensors="pt",
                   add_special_tokens=False, **mm_kwargs)
        images = [f.data["pixel_values"] for f in ours.mm_features if f.modality == "image"]
        torch.testing.assert_close(torch.cat(images), out["pixel_values"], atol=1e-6, rtol=0)
        ids = out["input_ids"]
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    assert ids[0].tolist() == ours.token_ids
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if ours.mm_features:  # the reference's order: every tile and frame in prompt order
        inputs["pixel_values"] = torch.cat([f.data["pixel_values"] for f in ours.mm_features])
    return inputs


def reference(path, llm, hf, messages, **mm_kwargs):
    inputs = reference_inputs(path, llm, messages, **mm_kwargs)
    return hf_greedy(hf, inputs, inputs["input_ids"].shape[1], N)


def test_each_case_matches_transformers(variant, hf_models):
    name, path = variant
    llm = LLM(path, max_model_len=2048)
    hf = hf_models(path)
    refs = {case: reference(path, llm, hf, msgs) for case, msgs in CASES.items()}
    outs = llm.chat(list(CASES.values()), LOGPROBS)  # one batch: text-only mate included
    for case, out in zip(CASES, outs, strict=True):
        assert_matches_reference(out, *refs[case], label=f"{name} {case}")
    assert_released(llm)


def test_every_tile_and_frame_is_an_item_with_its_own_span(llm):
    tok = llm.engine.tokenizer
    proc, _ = process_chat(llm, CASES["one_image"])
    tiles = proc.mm_features
    assert len(tiles) == 4 and len({f.item for f in tiles}) == 1  # 3 x 1 and the thumbnail
    assert [f.part for f in tiles] == ["tile 1 of 3", "tile 2 of 3", "tile 3 of 3", "thumbnail"]
    assert len({f.identifier for f in tiles}) == 4
    first, last = tiles[0].placeholder, tiles[-1].placeholder
    assert [f.placeholder.offset for f in tiles] == [first.offset + k * L for k in range(4)]
    assert all(f.placeholder.length == L and f.placeholder.is_embed is None for f in tiles)
    assert tok.convert_ids_to_tokens(proc.token_ids[first.offset - 1]) == "<img>"
    assert tok.convert_ids_to_tokens(proc.token_ids[last.end]) == "</img>"
    assert all(f.data["pixel_values"].shape == (1, 3, 32, 32) for f in tiles)
    video, _ = process_chat(llm, CASES["video"])
    frames = video.mm_features
    assert [f.part for f in frames] == ["frame 1", "frame 2", "frame 3"]
    text = tok.decode(video.token_ids)
    assert "</img>\nFrame2: <img>" in text and text.count("<IMG_CONTEXT>") == 3 * L


def test_pixels_and_grids_equal_transformers_image_processor(tmp_path):
    """Our tiles equal GotOcr2ImageProcessorPil's (cropping on, as InternVLProcessor asks),
    and our grids its get_optimal_tiled_canvas, ties included."""
    import transformers
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import (
        get_optimal_tiled_canvas,
    )

    from models.checkpoint import Found, read_settings
    from models.internvl.preprocess import (
        IMAGE_PROCESSORS,
        PixelConfig,
        TileLimits,
        best_grid,
        preprocess_image,
    )

    for limits in ((1, 12), (3, 5), (2, 2), (1, 1), (5, 3)):
        for h, w in ((40, 110), (120, 40), (70, 60), (33, 33), (7, 200), (301, 97), (64, 128)):
            ours = best_grid(h, w, 32, *limits)
            assert ours == get_optimal_tiled_canvas((h, w), (32, 32), *limits), (limits, h, w)
    schema = IMAGE_PROCESSORS["GotOcr2ImageProcessor"]
    for options in ({"max_patches": 6}, {"min_patches": 3, "max_patches": 5},
                    {"max_patches": 1}, {"resample": 2, "image_mean": [0.5] * 3}):
        hf = transformers.GotOcr2ImageProcessorPil(size={"height": 32, "width": 32}, **options)
        settings = read_settings(Found(hf.to_dict(), "test"), schema)
        cfg = PixelConfig.from_settings(settings, "pil")
        limits = TileLimits(settings["min_patches"], settings["max_patches"])
        for seed, (h, w) in enumerate(((40, 110), (120, 40), (33, 33), (301, 97))):
            image = random_image(h, w, seed)
            ref = hf([image], crop_to_patches=True, return_tensors="pt")
            pixels, _ = preprocess_image(image, cfg, limits)
            assert pixels.shape[0] == int(ref["num_patches"][0]), (options, h, w)
            torch.testing.assert_close(pixels, ref["pixel_values"], atol=1e-6, rtol=0)


def photo(width: int, height: int, seed: int):
    """A photo-like image: smooth gradients under noise (each pixel unlike its neighbours)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    base = np.stack([128 + 100 * np.sin(6 * x + seed), 128 + 90 * np.cos(5 * y),
                     128 + 80 * np.sin(4 * (x + y))], axis=-1)
    noisy = base + rng.normal(0, 20, (height, width, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


def test_the_default_backend_is_torchvisions_resizing():
    """Two photo-like images of different sizes on InternVL's real 448-pixel tiles: a checkpoint
    naming GotOcr2ImageProcessor (or its Fast name) gets transformers' default torchvision
    backend, whose antialiased uint8 resize differs from PIL's on some pixels (up to 2 levels:
    0.035 after normalization), and the PIL class's pixels stay PIL's. Against transformers'
    torchvision class where torchvision is installed (it is not in this project's venv: checked
    by hand with torchvision 0.28, max abs difference 0)."""
    import transformers

    from models.checkpoint import Found, read_settings
    from models.internvl.preprocess import (
        IMAGE_PROCESSORS,
        PixelConfig,
        TileLimits,
        backend_of,
        preprocess_image,
    )

    options = {"size": {"height": 448, "width": 448}, "image_mean": [0.485, 0.456, 0.406],
               "image_std": [0.229, 0.224, 0.225]}
    pil = transformers.GotOcr2ImageProcessorPil(**options)
    schema = IMAGE_PROCESSORS["GotOcr2ImageProcessor"]
    settings = read_settings(Found(pil.to_dict(), "test"), schema)
    assert [backend_of(n) for n in ("GotOcr2ImageProcessor", "GotOcr2ImageProcessorFast", None,
                                    "GotOcr2ImageProcessorPil")] == ["torchvision"] * 3 + ["pil"]
    images = [photo(640, 480, 0), photo(300, 500, 1)]
    limits = TileLimits(1, 12)

    def ours(backend):
        cfg = PixelConfig.from_settings(settings, backend)
        return torch.cat([preprocess_image(image, cfg, limits)[0] for image in images])

    fast = ours("torchvision")
    reference = pil(images, crop_to_patches=True, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(ours("pil"), reference, atol=1e-6, rtol=0)
    assert fast.shape == reference.shape == (13 + 7, 3, 448, 448)
    step = 1 / 255 / min(options["image_std"])
    assert 0 < (fast - reference).abs().max() <= 2 * step + 1e-6
    if transformers.utils.is_torchvision_available():
        tv = transformers.GotOcr2ImageProcessor(**options)
        expected = tv(images, crop_to_patches=True, return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(fast, expected, atol=1e-6, rtol=0)


def test_video_frames_are_those_the_reference_samples(tmp_path, monkeypatch):
    """With num_frames, frames are InternVLVideoProcessor.sample_frames' (the middle of equal
    segments), from an in-memory clip and an encoded file; without it, every frame."""
    import importlib.util
    import sys
    import types

    from transformers.utils import is_torchvision_available

    from testing.internvl import build_internvl_model
    from tests.media_fixtures import VideoSpec, encode_video, level

    # The reference module imports torchvision at its top (unused by sample_frames): load it
    # with a stand-in for this test only (transformers has already noted it absent).
    assert not is_torchvision_available()
    for name in ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                 "torchvision.transforms.v2.functional"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    module = "transformers.models.internvl.video_processing_internvl"
    spec = importlib.util.find_spec(module)
    ref = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, module, ref)
    spec.loader.exec_module(ref)
    from transformers.video_utils import VideoMetadata

    def picked(total, frames, fps):
        self = types.SimpleNamespace(num_frames=None, initial_shift=True)
        meta = VideoMetadata(total_num_frames=total, fps=fps)
        return ref.InternVLVideoProcessor.sample_frames(self, meta, num_frames=frames).tolist()

    path = build_internvl_model(tmp_path / "m", num_frames=4)  # the checkpoint samples 4
    llm = LLM(path, max_model_len=2048)
    for total, frames in ((7, 4), (30, 7), (13, 13), (100, 9)):
        clip = random_video(total, 8, 8, total)
        _, media = process_chat(llm, user(clip, "Go."), {"num_frames": frames})
        got = media["video"][0].frames
        assert np.array_equal(got, clip[picked(total, frames, 1.0)]), (total, frames)
    _, media = process_chat(llm, user(random_video(30, 8, 8, 0), "Go."))
    assert len(media["video"][0].frames) == 4  # the checkpoint's num_frames
    data = encode_video(VideoSpec(frames=60, fps=10, width=32, height=24))
    _, media = process_chat(llm, user(data, "Go."), {"num_frames": 6})
    grey = media["video"][0].frames.mean(axis=(1, 2, 3))
    assert np.abs(grey - [level(i) for i in picked(60, 6, 10.0)]).max() < 8
    every = LLM(build_internvl_model(tmp_path / "all"), max_model_len=2048)
    _, media = process_chat(every, user(data, "Go."))
    assert len(media["video"][0].frames) == 60  # no sampling: every frame, as the reference


def test_plans_agree_with_processing(llm):
    """Sizes-only plans equal processing, for text prompts and for token-id prompts mixing
    images and videos, one-tile images beside one-frame videos (whose runs look alike) in
    both orders."""
    p = llm.engine.processor
    msgs = user("See", random_image(33, 33, 3), random_video(1, 40, 60, 5), "and",
                random_image(150, 40, 4), random_video(2, 20, 20, 6), random_video(1, 9, 9, 7),
                random_image(20, 20, 8))
    parsed = p.render_chat(msgs)
    media = p.load_media_sync(parsed)
    mm = p.mm_processor
    expanded = llm.engine.tokenizer.encode(mm.expand_text(parsed.text, media, {}),
                                           add_special_tokens=False)
    raw = llm.engine.tokenizer.encode(parsed.text, add_special_tokens=False)
    for ids in (expanded, raw):
        plan = mm.plan(ids, media, {})
        out = mm.process(ids, media, {})
        assert plan.num_tokens == len(out.token_ids)
        assert plan.item_embeds == [(f.modality, f.placeholder.num_embeds)
                                    for f in out.mm_features]
        assert [f.modality for f in out.mm_features] == ["image", "video", *["image"] * 5,
                                                          "video", "video", "video", "image"]
    assert mm.process(raw, media, {}).token_ids == expanded


def test_chunk_budgets_cut_inside_tiles_and_frames(path, llm, hf_models):
    hf = hf_models(path)
    msgs = CASES["one_image"]
    tokens, logprobs = reference(path, llm, hf, msgs)
    span = process_chat(llm, msgs)[0].mm_features[0].placeholder
    for budget in (span.offset + L // 2, span.offset + L):  # inside a tile; between tiles
        small = LLM(path, max_model_len=2048, max_num_batched_tokens=budget)
        assert_matches_reference(small.chat(msgs, LOGPROBS)[0], tokens, logprobs,
                                 label=f"budget {budget}")
        assert_released(small)
    # Every request of a batch cut in many places, video and text-only mates included.
    small = LLM(path, max_model_len=2048, max_num_batched_tokens=9, max_num_seqs=8)
    outs = small.chat([msgs, CASES["video"], CASES["text_only"]], GREEDY)
    assert outs[0].outputs[0].token_ids == tokens
    full = llm.chat([CASES["video"], CASES["text_only"]], GREEDY)
    assert [o.outputs[0].token_ids for o in outs[1:]] == [o.outputs[0].token_ids for o in full]
    assert_released(small)


def test_an_encoder_budget_of_one_tile_runs_a_seven_tile_image(path, llm, hf_models):
    """Tiles are items: the encoder's compute budget and cache at one tile's embeddings still
    serve an image of six tiles and a thumbnail, over several steps."""
    msgs = user(random_image(64, 96, 7), "What is it?")  # a 3 x 2 grid
    tiny = LLM(path, max_model_len=2048, max_num_encoder_input_tokens=L, encoder_cache_size=L)
    assert len(process_chat(tiny, msgs)[0].mm_features) == 7
    tokens, logprobs = reference(path, llm, hf_models(path), msgs)
    assert_matches_reference(tiny.chat(msgs, LOGPROBS)[0], tokens, logprobs)
    assert_released(tiny)


def test_encoder_cache_and_prefix_cache_hits(path, llm, hf_models):
    hf = hf_models(path)
    refs = {case: reference(path, llm, hf, CASES[case]) for case in ("video", "one_image")}
    fresh = LLM(path, max_model_len=2048, enable_prefix_caching=False)
    tower = count_calls(fresh.engine.runner.model.vision_tower)
    fresh.chat(CASES["video"], GREEDY)
    again = fresh.chat(CASES["video"], GREEDY)[0]  # every frame from the encoder cache
    assert again.outputs[0].token_ids == refs["video"][0]
    assert tower[0] == 1 and all(p.cache_hit for p in again.multi_modal_placeholders)
    cached = LLM(path, max_model_len=2048, block_size=8)
    first = cached.chat(CASES["one_image"], GREEDY)[0]
    again = cached.chat(CASES["one_image"], GREEDY)[0]  # the image's blocks: prefix cache
    last = first.multi_modal_placeholders[-1]
    assert again.num_cached_tokens > last.offset + last.length
    assert again.outputs[0].token_ids == refs["one_image"][0]
    assert_released(cached)


def test_per_request_tile_limits_match_the_reference(path, llm, hf_models):
    hf = hf_models(path)
    msgs = CASES["one_image"]
    for options, tiles in (({"max_patches": 2}, 3), ({"min_patches": 4, "max_patches": 4}, 5),
                           ({"max_patches": 1}, 1)):
        assert len(process_chat(llm, msgs, options)[0].mm_features) == tiles, options
        tokens, logprobs = reference(path, llm, hf, msgs, **options)
        out = llm.chat(msgs, LOGPROBS, mm_processor_kwargs=options)[0]
        assert_matches_reference(out, tokens, logprobs, label=str(options))


@pytest.mark.parametrize(("options", "message"), [
    ({"max_patches": 0}, "mm_processor_kwargs max_patches=0 is not an integer in [1, 256]"),
    ({"min_patches": 257}, "mm_processor_kwargs min_patches=257 is not an integer in [1, 256]"),
    ({"num_frames": 2.5}, "mm_processor_kwargs num_frames=2.5 is not an integer in [1, 256]"),
    ({"min_patches": 5, "max_patches": 3}, "min_patches=5 must not exceed max_patches=3"),
    ({"min_patches": 7}, "min_patches=7 must not exceed max_patches=6"),
    ({"max_pixels": 100}, "unknown mm_processor_kwargs max_pixels (InternVL accepts"),
])
def test_options_outside_their_ranges_are_named(llm, options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        process_chat(llm, CASES["one_image"], options)
    assert_released(llm)


def test_checkpoints_the_model_cannot_serve_are_refused_at_load(tmp_path):
    import json
    import shutil

    from models.checkpoint import CheckpointError
    from testing.internvl import build_internvl_model

    base = build_internvl_model(tmp_path / "base")

    def edited(name: str, file: str, edit) -> object:
        copy = tmp_path / name
        shutil.copytree(base, copy)
        data = json.loads((copy / file).read_text())
        edit(data)
        (copy / file).write_text(json.dumps(data))
        return copy

    cases = [
        (edited("seq", "processor_config.json", lambda d: d.update(image_seq_length=64)),
         CheckpointError, "image_seq_length=64 but the model emits 16 embeddings per tile"),
        (edited("size", "processor_config.json",
                lambda d: d["image_processor"].update(size={"height": 64, "width": 64})),
         NotImplementedError, "image tiles of 64 pixels for a tower of 32"),
        (edited("fps", "processor_config.json",
                lambda d: d["video_processor"].update(do_sample_frames=True, fps=2)),
         CheckpointError, "fps=2 is not supported"),
        (edited("tok", "tokenizer_config.json", lambda d: d.pop("video_token")),
         CheckpointError, "the tokenizer has no video_token"),
        (edited("full", "config.json", lambda d: d.update(vision_feature_select_strategy="full")),
         NotImplementedError, "vision_feature_select_strategy='full'"),
    ]
    for path, error, message in cases:
        with pytest.raises(error, match=message):
            LLM(path, max_model_len=256)


def test_tower_and_projector_have_no_host_sync(llm):
    from tests.model_fixtures import SyncRecorder

    model = llm.engine.runner.model
    items = [("image", {"pixel_values": torch.randn(1, 3, 32, 32)}) for _ in range(3)]
    items.append(("video", {"pixel_values": torch.randn(1, 3, 32, 32)}))
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds = model.encode(items)
    assert rec.seen == []
    assert [e.shape[0] for e in embeds] == [L] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu_without_host_sync(path):
    """Tokens on CUDA equal the CPU's for images, a video and text in one batch, tiles cut by
    small chunks; the tower and projector run without a host sync."""
    cases = list(CASES.values())
    cpu = LLM(path, device="cpu", dtype="float32", max_model_len=2048)
    gpu = LLM(path, device="cuda", dtype="float32", max_model_len=2048,
              max_num_batched_tokens=24)
    expected = [o.outputs[0].token_ids for o in cpu.chat(cases, GREEDY)]
    assert [o.outputs[0].token_ids for o in gpu.chat(cases, GREEDY)] == expected
    model = gpu.engine.runner.model
    items = [("image", {"pixel_values": torch.randn(1, 3, 32, 32)}) for _ in range(3)]
    model.encode(items)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            model.encode(items)
    finally:
        torch.cuda.set_sync_debug_mode("default")
