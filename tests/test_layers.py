"""models.kernels.linear.Linear runs the formulation planned for its input's row count; every
formulation must equal F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from models.kernels.choice import BUCKETS
from models.kernels.linear import Linear
from models.kernels.plan import _prepack, candidates


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
                _prepack(layer)
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
