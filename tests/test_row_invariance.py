"""models/kernels/row_invariance.py on the CPU: which linears are padded (a layer whose rows
depend on their count, measured once per kind of layer), and the padding itself off the CPU
(on PyTorch's meta device: the shapes the library is given). The padded rows' bits on a GPU:
tests/test_cuda_features.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import row_invariance
from models.kernels.linear import Linear


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"a": Linear(16, 8), "b": Linear(16, 8), "c": Linear(8, 16),
                          "norm": nn.LayerNorm(8)})


def test_only_the_kinds_whose_rows_vary_are_padded(monkeypatch):
    calls = []

    def by_row_count(layer, x):  # a library whose sums depend on how many rows there are
        calls.append(layer.in_features)  # for 16 inputs, and sums each row alike for 8
        if layer.in_features == 16:
            return F.linear(x, layer.weight, layer.bias) + x.shape[0] * 1e-3
        return torch.stack([layer.weight @ row for row in x]) + layer.bias

    monkeypatch.setattr(row_invariance, "run_kernel", by_row_count)
    model = _model()
    assert row_invariance.pad_device_rows(model, torch.float32, rows=8) == 2
    assert [model[k].pad_rows for k in "abc"] == [8, 8, None]
    # one layer of each kind measured: 8 rows, then each count below 8 until one differs
    assert calls.count(16) == 2 and calls.count(8) == 8
    assert row_invariance.pad_device_rows(model, torch.float32, rows=8, measure=False) == 3
    assert [model[k].pad_rows for k in "abc"] == [8, 8, 8]
    assert row_invariance.pad_device_rows(model, torch.float32, rows=None) == 0
    assert [model[k].pad_rows for k in "abc"] == [None, None, None]


def test_a_layer_summing_each_row_alike_is_left_unpadded(monkeypatch):
    def rowwise(layer, x):  # every row by itself: the same operations at any row count
        return torch.stack([layer.weight @ row for row in x]) + layer.bias

    monkeypatch.setattr(row_invariance, "run_kernel", rowwise)
    layer = Linear(32, 24)
    assert not row_invariance.rows_vary(layer, 6, torch.float32)
    layer.pad_rows = 6  # measured unpadded, and left as it was
    assert not row_invariance.rows_vary(layer, 6, torch.float32)
    assert layer.pad_rows == 6


def test_few_rows_run_padded_off_the_cpu(monkeypatch):
    """The library sees the padded shape; the caller gets its own rows."""
    seen = []
    linear = F.linear

    def record(x, w, b=None):
        seen.append(tuple(x.shape))
        return linear(x, w, b)

    monkeypatch.setattr(F, "linear", record)
    layer = Linear(16, 8, device="meta")
    for rows, want in ((None, [(5, 16)]), (64, [(64, 16)])):
        layer.pad_rows, seen[:] = rows, []
        assert layer(torch.empty(5, 16, device="meta")).shape == (5, 8)
        assert seen == want
    seen[:] = []
    assert layer(torch.empty(70, 16, device="meta")).shape == (70, 8)  # past it: as it is
    assert seen == [(70, 16)]


def test_lora_products_of_few_rows_run_padded_off_the_cpu(monkeypatch):
    """An adapter's two products see the padded rows; the output keeps the caller's rows,
    updated on the rows the adapter targets (every row, or the batch's listed ones)."""
    from pathlib import Path

    from models.adapters import LoraAdapter, LoraPart
    from models.layers import lora

    seen = []
    product = lora._product

    def record(x, w):
        seen.append(tuple(x.shape))
        return product(x, w)

    monkeypatch.setattr(lora, "_product", record)
    layer = nn.Module()
    layer.self_attn = nn.Module()
    layer.self_attn.qkv_proj = Linear(16, 24, device="meta")
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    part = LoraPart("layers.0.self_attn.qkv_proj", 8, torch.empty(4, 16), torch.empty(8, 4))
    adapters = lora.AdapterSet(model, [LoraAdapter("a", Path("a"), (part,), None)],
                               torch.device("meta"), torch.float32)
    linear = layer.self_attn.qkv_proj
    for rows, pad, want in ((None, None, [(5, 16), (5, 4)]), (None, 64, [(64, 16), (64, 4)]),
                            (torch.tensor([0, 3], device="meta"), 64, [(64, 16), (64, 4)])):
        adapters.step = lora.AdapterBatch(((1, rows),))
        adapters.pad_rows, seen[:] = pad, []
        assert linear(torch.empty(5, 16, device="meta")).shape == (5, 24)
        assert seen == want
    adapters.pad_rows, seen[:] = 4, []  # past it: as it is
    adapters.step = lora.AdapterBatch(((1, None),))
    assert linear(torch.empty(5, 16, device="meta")).shape == (5, 24)
    assert seen == [(5, 16), (5, 4)]
