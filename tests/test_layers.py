"""models.kernels.linear.Linear runs the formulation planned for its input's row count; every
formulation must equal F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.kernels.choice import BUCKETS
from models.kernels.linear import Linear, prepack_onednn
from models.kernels.linear_choice import candidates


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 7, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_every_formulation_matches_f_linear(dtype, rows, bias):
    torch.manual_seed(rows)
    layer = Linear(96, 40, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    ref = F.linear(x.float(), layer.weight.float(), None if layer.bias is None else
                   layer.bias.float())
    tol = 1e-5 if dtype == torch.float32 else 0.05
    for name in [None, *candidates(layer, rows, dtype)]:
        layer.kernels = None if name is None else (name,) * len(BUCKETS)
        if name == "onednn":
            with torch.no_grad():
                prepack_onednn(layer)
        out = layer(x)
        assert out.shape == (rows, 40) and out.dtype == dtype, name
        torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_linear_on_a_3d_input_and_a_non_contiguous_row():
    layer = Linear(16, 8).to(torch.bfloat16)
    layer.kernels = ("mv", "matmul_t", "matmul_t", "F.linear")
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))
    row = torch.randn(16, 4, dtype=torch.bfloat16).t()[:1]  # [1, 16], strided
    torch.testing.assert_close(layer(row), F.linear(row, layer.weight, layer.bias),
                               atol=0.05, rtol=0.05)


def test_widened_bf16_weights_tile_by_tile(monkeypatch):
    """A bfloat16 weight of several tiles through the float32 GEMM: each tile widened into the
    reused buffer, the result equal to the float32 product of the bfloat16 values."""
    from models.kernels import linear as linear_kernels

    monkeypatch.setattr(linear_kernels, "TILE_BYTES", 64 * 96 * 4)
    monkeypatch.setattr(linear_kernels, "MIN_TILE_CHANNELS", 64)
    assert len(linear_kernels.dequantization_tiles(200, 96, torch.float32)) == 2
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=True).to(torch.bfloat16)
    layer.kernels = ("widened",) * len(BUCKETS)
    x = torch.randn(70, 96, dtype=torch.bfloat16)
    ref = F.linear(x.float(), layer.weight.float()).to(torch.bfloat16) + layer.bias
    torch.testing.assert_close(layer(x), ref, atol=0, rtol=0)


def test_the_scratch_buffer_outlives_inference_mode():
    """The widened GEMM's buffer, first made inside the engine's inference_mode, is written
    again by a call outside it (an inference tensor would refuse the in-place copy)."""
    from models.kernels import linear as linear_kernels

    linear_kernels._SCRATCH.__dict__.clear()  # this thread's buffers made afresh below
    layer = Linear(32, 16).to(torch.bfloat16)
    layer.kernels = ("widened",) * len(BUCKETS)
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        inside = layer(x)
    torch.testing.assert_close(layer(x), inside)
