"""The same code on CUDA: tokens equal to the CPU run, and no host sync inside the forward
(CUDA's sync debug mode turns any synchronizing call into an error). Skipped without a GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from models.layers.attention_metadata import build_metadata

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


def test_text_generation_matches_cpu(qwen2_path):
    prompts = [[5, 17, 99, 3] * k for k in (1, 5, 11)]
    cpu = LLM(qwen2_path, device="cpu", dtype="float32", max_model_len=256)
    gpu = LLM(qwen2_path, device="cuda", dtype="float32", max_model_len=256,
              max_num_batched_tokens=16)
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY)] == expected


def test_image_generation_matches_cpu(qwen2_vl_path):
    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))
    msgs = [{"role": "user", "content": [{"type": "image", "image": img},
                                         {"type": "text", "text": "Describe."}]}]
    cpu = LLM(qwen2_vl_path, device="cpu", dtype="float32", max_model_len=512)
    gpu = LLM(qwen2_vl_path, device="cuda", dtype="float32", max_model_len=512)
    assert (gpu.chat(msgs, GREEDY)[0].outputs[0].token_ids
            == cpu.chat(msgs, GREEDY)[0].outputs[0].token_ids)


def test_forward_does_not_synchronize(qwen2_path):
    model = LLM(qwen2_path, device="cuda", max_model_len=256).engine.runner.model
    device = torch.device("cuda")
    starts, lens, tables = [20, 0], [1, 9], [[0, 1], [2]]
    ids = torch.arange(10, device=device)
    pos = torch.tensor([20] + list(range(9)), device=device)
    meta = build_metadata(starts, lens, tables, 16, device, model.embed_tokens.weight.dtype)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, meta))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_device_timer_measures_the_kernels_not_their_launch():
    from engine.device import DeviceTimer

    device = torch.device("cuda")
    x = torch.randn(4096, 4096, device=device)
    torch.cuda.synchronize()
    timer = DeviceTimer(device).start()
    for _ in range(20):
        x = x @ x / 64
    timer.stop()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        x = x @ x / 64
    torch.cuda.synchronize()
    assert timer.seconds() > 0.5 * (time.perf_counter() - t0)


@pytest.fixture(scope="module")
def gemma_text_path(tmp_path_factory):
    """Gemma 3 text: 5 sliding-window layers to 1 global, sandwich norms, two rope bases."""
    from testing.tiny import build_text_model

    config = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
              "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
              "hidden_activation": "gelu_pytorch_tanh"}
    return build_text_model(tmp_path_factory.mktemp("gemma") / "m", "gemma3_text", num_layers=6,
                            num_kv_heads=1, tie_word_embeddings=True, config_overrides=config)


def test_sliding_windows_and_mixed_steps_match_cpu(gemma_text_path):
    """Windowed layers, chunks reading the cache, decodes of different contexts in buckets."""
    prompts = [[5, 17, 99, 3] * k for k in (1, 5, 11, 30)]
    cpu = LLM(gemma_text_path, device="cpu", dtype="float32", max_model_len=256)
    gpu = LLM(gemma_text_path, device="cuda", dtype="float32", max_model_len=256,
              max_num_batched_tokens=24, block_size=8)
    expected = [o.outputs[0].token_ids for o in cpu.generate(prompts, GREEDY)]
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, GREEDY)] == expected


def test_attention_features_match_the_cpu_on_cuda():
    """Soft-capping, a window and a bidirectional span, in a step mixing a chunk and decodes."""
    from models.layers.attention import LayerAttention, paged_attention

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(14, h, 8, generator=gen) for h in (4, 2, 2))
    starts, tables = [0, 5, 14], [[0, 1, 2], [3, 4], [5, 6, 7, 8]]
    lens = [12, 1, 1]
    out = {}
    for device in ("cpu", "cuda"):
        dev = torch.device(device)
        cache = torch.randn(2, 2, 12, 4, 8, generator=torch.Generator().manual_seed(1)).to(dev)
        meta = build_metadata(starts, lens, tables, 4, dev, windows=(None, 5),
                              bidirectional=[[(3, 8)], [], []])
        layer = LayerAttention(sliding_window=5, softcap=2.0)
        out[device] = paged_attention(q.to(dev), k.to(dev), v.to(dev), cache, meta, 0.3, layer)
    torch.testing.assert_close(out["cuda"].cpu(), out["cpu"], atol=1e-5, rtol=0)


def test_windowed_mixed_forward_does_not_synchronize(gemma_text_path):
    model = LLM(gemma_text_path, device="cuda", max_model_len=256).engine.runner.model
    device = torch.device("cuda")
    starts, lens = [40, 3, 0, 100], [1, 1, 9, 1]
    tables = [[0, 1, 2], [3], [4], [5, 6, 7, 8, 9, 10, 11]]
    ids = torch.arange(12, device=device)
    pos = torch.tensor([40, 3, *range(9), 100], device=device)
    meta = build_metadata(starts, lens, tables, 16, device, model.embed_tokens.weight.dtype,
                          windows=model.attention_windows())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, meta))
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(scope="module")
def gemma4_paths(tmp_path_factory):
    """Gemma 4: the E-size model (per-layer inputs, shared KV, vision and audio towers, image
    spans attended both ways on its sliding layers) and the mixture-of-experts one."""
    from testing.gemma4 import build_gemma4_model

    root = tmp_path_factory.mktemp("gemma4")
    return {"e": build_gemma4_model(root / "e"),
            "moe": build_gemma4_model(root / "moe", experts=True, audio=False)}


def test_gemma4_matches_cpu(gemma4_paths):
    """Every modality of the E-size model in one chunked batch, and the experts' model (every
    expert run on every token on an accelerator, weighted by its routing)."""
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (64, 70, 3), dtype=np.uint8))
    video = rng.integers(0, 256, (4, 40, 48, 3), dtype=np.uint8)
    tone = (0.3 * np.sin(np.arange(24000) / 16000 * 2 * np.pi * 440)).astype(np.float32)
    chats = [
        [{"role": "user", "content": [{"type": "image", "image": image},
                                      {"type": "text", "text": "Describe."}]}],
        [{"role": "user", "content": [{"type": "video", "video": video},
                                      {"type": "audio", "audio": (tone, 16000)},
                                      {"type": "text", "text": "What happens?"}]}],
        [{"role": "user", "content": "Hello there, how are you?"}],
    ]
    for name, path in gemma4_paths.items():
        msgs = chats if name == "e" else [chats[0], chats[2]]
        cpu = LLM(path, device="cpu", dtype="float32", max_model_len=1024)
        gpu = LLM(path, device="cuda", dtype="float32", max_model_len=1024,
                  max_num_batched_tokens=80, max_num_encoder_input_tokens=70, block_size=8)
        expected = [o.outputs[0].token_ids for o in cpu.chat(msgs, GREEDY)]
        assert [o.outputs[0].token_ids for o in gpu.chat(msgs, GREEDY)] == expected, name


def test_gemma4_forward_does_not_synchronize(gemma4_paths):
    """Per-layer inputs, KV read from another layer's cache, experts: no host sync."""
    for path in gemma4_paths.values():
        model = LLM(path, device="cuda", max_model_len=256).engine.runner.model
        device = torch.device("cuda")
        starts, lens = [40, 0, 100], [1, 9, 1]
        tables = [[0, 1, 2], [4], [5, 6, 7, 8, 9, 10, 11]]
        ids = torch.arange(11, device=device)
        pos = torch.tensor([40, *range(9), 100], device=device)
        meta = build_metadata(starts, lens, tables, 16, device, model.embed_tokens.weight.dtype,
                              windows=model.attention_windows(),
                              bidirectional=[[], [(2, 6)], []])
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with torch.inference_mode():
                model.compute_logits(model(ids, pos, meta))
        finally:
            torch.cuda.set_sync_debug_mode("default")
