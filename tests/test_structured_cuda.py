"""Structured output on CUDA: the grammar mask applied on the device as on the CPU, with no
host sync (CUDA's sync debug mode turns a synchronizing call into an error), and a constrained
greedy reply equal to the CPU's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import apply_bitmask
from engine.structured_outputs import StructuredOutputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "tag"],
          "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                         "tag": {"enum": ["a", "b", "c"]}}}


def test_the_mask_applies_on_the_device_without_a_sync():
    torch.manual_seed(0)
    logits = torch.randn(4, 1000)
    mask = torch.randint(-(2**31), 2**31 - 1, (2, 32), dtype=torch.int32)
    rows = torch.tensor([2, 0])
    want = logits.clone()
    apply_bitmask(want, mask, rows)
    got = logits.cuda()
    device_mask, device_rows = mask.cuda(), rows.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        apply_bitmask(got, device_mask, device_rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), want)


def test_a_constrained_reply_matches_the_cpu(qwen2_path):
    params = SamplingParams(max_tokens=48, temperature=0,
                            structured_outputs=StructuredOutputs(json=SCHEMA))
    messages = [{"role": "user", "content": "Describe the image in detail."}]
    cpu = LLM(qwen2_path, device="cpu", dtype="float32", max_model_len=256)
    gpu = LLM(qwen2_path, device="cuda", dtype="float32", max_model_len=256)
    want = cpu.chat(messages, params)[0].outputs[0]
    got = gpu.chat(messages, params)[0].outputs[0]
    assert got.finish_reason == "stop" and got.token_ids == want.token_ids
