"""The same code on CUDA: tokens equal to the CPU run, and no host sync inside the forward
(CUDA's sync debug mode turns any synchronizing call into an error). Skipped without a GPU."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from PIL import Image

from engine import LLM, SamplingParams
from models.attention import build_metadata

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
