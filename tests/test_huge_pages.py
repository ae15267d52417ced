"""Weights moved into a huge-page mapping (models/kernels/huge_pages.py): values, ties between
parameters and the model's outputs unchanged, quantized buffers included; the switch that turns it
off."""

from __future__ import annotations

import pytest
import torch

from models.kernels import huge_pages
from models.kernels.quantization import quantize_language_model
from models.layers.decoder import CausalLM
from tests.model_fixtures import tiny_tied_model


def _model(seed: int = 0) -> CausalLM:
    torch.manual_seed(seed)
    model = tiny_tied_model()
    for p in model.parameters():
        p.requires_grad_(False)
        p.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_weights_move_with_values_and_ties_kept(monkeypatch, quantization):
    if not huge_pages.available()[0]:
        pytest.skip(huge_pages.available()[1])
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1024)  # the tiny model's tensors qualify
    model = _model()
    if quantization:
        quantize_language_model(model, quantization)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    pointers = {name: t.data_ptr() for name, t in model.state_dict().items()}
    x = torch.randn(3, 64)
    mlp = model.layers[0].mlp
    out = mlp.down_proj(mlp.gate_up_proj(x)[:, :128])
    moved = huge_pages.place_weights(model)
    assert moved > 0
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert torch.equal(mlp.down_proj(mlp.gate_up_proj(x)[:, :128]), out)
    if quantization is None:
        assert model.lm_head.weight is model.embed_tokens.weight  # the tie survives
        assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    big = {name for name, t in after.items() if t.nbytes >= 1024}
    assert big and all(after[name].data_ptr() != pointers[name] for name in big)
    starts = sorted(after[name].data_ptr() for name in big)
    assert starts[-1] - starts[0] < moved  # all inside the one mapping


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv(huge_pages.DISABLE_ENV, "0")
    model = _model()
    pointers = [p.data_ptr() for p in model.parameters()]
    assert huge_pages.place_weights(model) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers
    assert huge_pages.available() == (False, f"disabled by {huge_pages.DISABLE_ENV}=0")


def test_a_weight_made_in_huge_pages_stays_where_it_is():
    """A tensor made by empty_in_huge_pages (a repacked GGUF weight) is not copied again by
    place_weights; its mapping goes with its last view; a small one is regular memory."""
    import gc

    if not huge_pages.available()[0]:
        pytest.skip(huge_pages.available()[1])
    made = huge_pages.empty_in_huge_pages(3 * huge_pages.HUGE_PAGE + 100)
    assert made.dtype == torch.uint8 and made.numel() == 3 * huge_pages.HUGE_PAGE + 100
    made.fill_(7)
    model = _model()
    model.register_buffer("made", made)
    at = made.data_ptr()
    assert huge_pages.place_weights(model) > 0
    assert model.made.data_ptr() == at and bool((model.made == 7).all())
    live = dict(huge_pages._PLACED)
    assert any(start <= at < end for start, end in live.items())
    del model, made
    gc.collect()
    assert not any(start <= at < end for start, end in huge_pages._PLACED.items())
    small = huge_pages.empty_in_huge_pages(1000)
    assert small.numel() == 1000 and not huge_pages._in_huge_pages(small)
