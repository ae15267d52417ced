"""Our quantized GEMM for a prefill's rows (models/kernels/cpu/gemm_quantized.c: int8 / int4 weights
dequantized a panel at a time in cache) against float64 references, at the edges of its
blocking (rows past a register tile and past a packed chunk, inputs past a panel, channels
past a tile), as a planned candidate, and through the engine against the dequantized
formulation on the same weights.

Bounds: the products of bfloat16 x and the panel's bfloat16 weights are exact; the sums run in
float32 over k / 2 pair steps, each rounding within 2^-24 of the running sum (at most
sum |x w|), so |error| <= (k / 2 + 2) 2^-24 sum_k |x w| (one more rounding for the scale), plus
half a unit of a bfloat16 output. A slip of layout or scale moves outputs by a sizeable part of
|ref| and fails these.
"""

from __future__ import annotations

import os

import pytest
import torch

from models.kernels import native
from models.kernels.choice import BUCKETS
from models.kernels.int_formats import pack_int4, quantize_int4, quantize_int8
from models.kernels.linear import QUANTIZED_KERNELS
from models.kernels.linear_choice import candidates, panel_gemm_takes
from models.kernels.quantization import QuantizedLinear


@pytest.fixture(scope="module")
def kernels():
    loaded = native.load()
    if loaded is None:
        reason = native.status().detail
        if os.environ.get("CI") and loaded is None:
            pytest.fail(f"native kernels unavailable on CI: {reason}")
        pytest.skip(reason)
    return loaded


def _check(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> None:
    """out against x (rounded to bfloat16) . weight^T in float64, within the bound above."""
    xb = x.to(torch.bfloat16).double()
    ref = xb @ weight.double().t()
    k = x.shape[1]
    bound = (k / 2 + 2) * 2.0 ** -24 * (xb.abs() @ weight.double().abs().t())
    if out.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ref.abs()
    assert out.dtype == x.dtype and out.shape == ref.shape
    excess = (out.double() - ref).abs() - bound
    assert (excess <= 0).all(), f"worst excess {excess.max().item():.3g}"


# rows: a partial register tile (17), whole tiles (64), past a packed chunk of 256 (300);
# k: one partial panel (64), one whole panel (896), two and a tail (1856)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k", [(17, 64), (64, 896), (300, 96), (9, 1856)])
def test_int8_matches_float64(kernels, x_dtype, rows, k):
    gen = torch.Generator().manual_seed(rows + k)
    q, scales = quantize_int8(torch.randn(70, k, generator=gen) * 0.05)  # 70: a partial tile
    x = (torch.randn(rows, k, generator=gen) * 3).to(x_dtype)
    out = kernels.gemm_quantized(x, q, scales)
    # The panel holds q exactly; the scale multiplies the float32 sum.
    _check(out, x, q.double() * scales.double()[:, None])


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, rows, k", [(32, 5, 128), (64, 130, 1024), (128, 300, 256),
                                            (128, 40, 1920)])
def test_int4_matches_float64(kernels, x_dtype, group, rows, k):
    gen = torch.Generator().manual_seed(group + rows + k)
    w = torch.randn(192, k, generator=gen) * 0.05
    q, scales_and_zeros = quantize_int4(w, group)
    packed = pack_int4(q)
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    out = kernels.gemm_quantized(x, packed, scales_and_zeros, group)
    # The panel holds (q - 8) * scale + zero rounded once to bfloat16, as our dequantizer
    # writes it (tests/test_native.py checks that against the reference).
    weight = kernels.dequantize_int4(packed, scales_and_zeros, group,
                                     torch.empty(192, k, dtype=torch.bfloat16))
    _check(out, x, weight)


@pytest.mark.parametrize("threads", [2, 3])
def test_fewer_channel_blocks_than_threads_split_the_rows(kernels, threads):
    """One block of 64 channels: the rows are split between the threads instead (the plan
    times a huge layer on such a slice)."""
    gen = torch.Generator().manual_seed(threads)
    q, scales = quantize_int8(torch.randn(64, 128, generator=gen))
    x = torch.randn(200, 128, generator=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = kernels.gemm_quantized(x, q, scales)
    finally:
        torch.set_num_threads(before)
    _check(out, x, q.double() * scales.double()[:, None])


def test_int4_reads_pytorchs_channel_order(kernels):
    """Each output channel alone: a permuted block of channels or a swapped nibble would put
    its value in another column."""
    w = torch.zeros(128, 64)
    w[torch.arange(128), torch.arange(128) % 64] = torch.arange(1, 129, dtype=torch.float32)
    q, scales_and_zeros = quantize_int4(w, 32)
    packed = pack_int4(q)
    eye = torch.eye(64)
    weight = kernels.dequantize_int4(packed, scales_and_zeros, 32,
                                     torch.empty(128, 64, dtype=torch.bfloat16))
    _check(kernels.gemm_quantized(eye, packed, scales_and_zeros, 32), eye, weight)


def test_shapes_it_does_not_take_are_refused(kernels):
    q, scales = quantize_int8(torch.randn(8, 48))
    assert not kernels.gemm_quantized_takes(8, 48)
    with pytest.raises(ValueError, match="K=48"):
        kernels.gemm_quantized(torch.randn(4, 48), q, scales)
    assert kernels.gemm_quantized_takes(8, 64)
    assert not kernels.gemm_quantized_takes(96, 256, int4_group=64)  # N % 64
    assert kernels.gemm_quantized_takes(128, 256, int4_group=64)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_planned_candidate_for_a_prefills_rows_only(kernels, mode):
    # int8: a scale per channel (group 256 = K); with a scale per group it is no candidate
    layer = QuantizedLinear(torch.randn(128, 256), None, mode,
                            group_size=64 if mode == "int4" else 256)
    assert panel_gemm_takes(layer)
    assert "panel_gemm" not in candidates(layer, 4, torch.bfloat16)
    for rows in (32, 128, 512):
        assert "panel_gemm" in candidates(layer, rows, torch.bfloat16)
    odd = QuantizedLinear(torch.randn(128, 48), None, "int8")
    assert "panel_gemm" not in candidates(odd, 128, torch.bfloat16)
    x = torch.randn(100, 256, dtype=torch.bfloat16)
    out = QUANTIZED_KERNELS["panel_gemm"](layer, x)
    _check(out, x, layer.dequantize(torch.float64) if mode == "int8"
           else layer.dequantize(torch.float32).to(torch.bfloat16))


def test_int8_with_a_scale_per_group_in_the_plain_build_only(kernels):
    """The plain build's float32 panels hold q times its group's scale (exact); the AVX-512
    BF16 build's bfloat16 panels could not, so there it is no candidate."""
    layer = QuantizedLinear(torch.randn(128, 256), None, "int8", group_size=64)
    assert not layer.per_channel
    plain = kernels.variant != "avx512-bf16"
    assert panel_gemm_takes(layer) == plain
    assert ("panel_gemm" in candidates(layer, 512, torch.bfloat16)) == plain
    if plain:
        x = torch.randn(100, 256, dtype=torch.bfloat16)
        _check(QUANTIZED_KERNELS["panel_gemm"](layer, x), x, layer.dequantize(torch.float64))


def _force_prefill(runner, monkeypatch, name: str) -> None:
    """Engines built from here run `name` for every quantized linear's prefill buckets."""

    def plan(model, dtype, *args, **kwargs):
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                # int8 at a scale per group (int4's head): PyTorch has no int kernel, our
                # panel GEMM takes none
                decode = "int_kernel" if module.has_torch_kernel else "dequantized_t"
                prefill = name if panel_gemm_takes(module) else "dequantized_t"
                module.kernels = (decode, decode) + (prefill,) * (len(BUCKETS) - 2)
        return {}

    monkeypatch.setattr(runner, "choose_linear_kernels", plan)


def _prefill_logits(path, mode: str | None, prompts, params) -> tuple[torch.Tensor, list]:
    """The prefill step's logits (both prompts) and the greedy tokens of an engine (int8 at
    group 128, which the tiny model's 64 and 128 inputs make one scale per channel)."""
    from engine import LLM

    llm = LLM(path, dtype="bfloat16", max_model_len=128, quantization=mode,
              quantization_group_size=128 if mode == "int8" else 32)
    model = llm.engine.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits
    model.compute_logits = lambda hidden: seen.append(original(hidden)) or seen[-1]
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    return seen[0].float(), tokens


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_engine_prefill_through_it_is_as_accurate_as_the_dequantized_gemm(
        kernels, qwen2_path, mode, monkeypatch):
    """The same quantized tiny model prefilled through our GEMM and through the dequantized
    formulation: against the unquantized model, first-token logits as close (within 1.25x +
    0.5% of the logit range: measured 2.85% vs 2.84% for int8, 14.8% vs 15.3% for int4; the
    two differ from each other by about 1%, as int8's scale is applied to the float32 sum
    instead of to each bfloat16 weight), and the same first token (the prefill's argmax: later
    tokens come from decode steps, which run other kernels, where a 1% difference in the cache
    can flip a near-tie of this random model)."""
    import engine.model_loading as runner
    from engine import SamplingParams

    calls = []
    gemm = QUANTIZED_KERNELS["panel_gemm"]
    monkeypatch.setitem(QUANTIZED_KERNELS, "panel_gemm",
                        lambda layer, x: calls.append(x.shape[0]) or gemm(layer, x))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 13)]
    dense, _ = _prefill_logits(qwen2_path, None, prompts, params)
    errors, tokens = {}, {}
    for name in ("dequantized_t", "panel_gemm"):
        _force_prefill(runner, monkeypatch, name)
        logits, tokens[name] = _prefill_logits(qwen2_path, mode, prompts, params)
        errors[name] = ((logits - dense).abs().max() / (dense.max() - dense.min())).item()
    assert calls and min(calls) > 8, calls  # it ran, for the prefill only
    assert errors["panel_gemm"] <= 1.25 * errors["dequantized_t"] + 0.005, errors
    assert [t[0] for t in tokens["panel_gemm"]] == [t[0] for t in tokens["dequantized_t"]]
