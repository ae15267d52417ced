"""The routed experts' native call (models/kernels/native_experts.py, cpu/moe_experts.c): the
modules' result to the bit for dense, int8 and int4 experts in float32 and bfloat16, one token
and several, and the steps it declines."""

from __future__ import annotations

import pytest
import torch

from models.kernels import native
from models.kernels.choice import BUCKETS
from models.kernels.linear import Linear
from models.kernels.quantization import QuantizedLinear, quantize_linear
from models.layers.moe import MoEShape, SparseMoE

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels not built")


def block(dtype: torch.dtype, quantization: str | None, shared: bool = False) -> SparseMoE:
    torch.manual_seed(0)
    shape = MoEShape(num_experts=6, top_k=3, intermediate_size=64, normalize_top_k=True,
                     shared_expert_size=32 if shared else None)
    moe = SparseMoE(128, shape, "silu").eval()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    moe = moe.to(dtype)
    for expert in moe.experts:
        for name in ("gate_up_proj", "down_proj"):
            linear = getattr(expert, name)
            if quantization is not None:
                linear = quantize_linear(linear, quantization, 32)
                setattr(expert, name, linear)
            linear.kernels = ("native",) * len(BUCKETS)
    assert moe.prepare_decode()
    return moe


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_modules_result_to_the_bit(dtype, quantization, rows):
    moe = block(dtype, quantization)
    x = torch.randn(rows, 128).to(dtype)
    with torch.inference_mode():
        weights, experts = moe.gate(x)
        ours = moe.native.run(x, weights, experts)
        modules = moe._grouped_on_host(x, weights, experts)
    assert ours is not None and torch.equal(ours, modules)
    if quantization is not None:
        assert isinstance(moe.experts[0].down_proj, QuantizedLinear)


def test_the_block_takes_it_at_decode_rows_only(monkeypatch):
    moe = block(torch.float32, "int8", shared=True)
    calls = []
    run = moe.native.run
    monkeypatch.setattr(moe.native, "run", lambda *a: calls.append(a[0].shape[0]) or run(*a))
    with torch.inference_mode():
        moe(torch.randn(2, 128))
        moe(torch.randn(native.FUSED_ROWS + 1, 128))  # asked, declined: the modules run it
    assert calls == [2, native.FUSED_ROWS + 1]
    x = torch.randn(native.FUSED_ROWS + 1, 128)
    with torch.inference_mode():
        weights, experts = moe.gate(x)
        assert moe.native.run(x, weights, experts) is None


def test_declined_where_a_linear_is_planned_elsewhere_or_disabled(monkeypatch):
    moe = block(torch.float32, None)
    linear: Linear = moe.experts[2].down_proj
    linear.kernels = ("F.linear",) + ("native",) * (len(BUCKETS) - 1)
    assert moe.prepare_decode() and moe.native.buckets[0] is False
    x = torch.randn(1, 128)
    with torch.inference_mode():
        weights, experts = moe.gate(x)
        assert moe.native.run(x, weights, experts) is None
    monkeypatch.setenv("MMSERVE_NATIVE_DECODE", "0")
    assert not moe.prepare_decode()
