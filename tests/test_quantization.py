"""Weight-only int8 / int4 quantization: the int4 pack round trip, dequantization against an
independent group-wise reference, both formulations against F.linear on the dequantized weight,
and accuracy against the unquantized model (a real-shaped linear, the tiny models through the
engine) with calibrated bounds that a deliberately wrong scale breaks.

Bounds are the values measured on the seeded inputs below plus headroom (about 15-25%); the
quantization error dominates them, so they hold across CPUs. For Gaussian weights the expected
relative output error is step / sqrt(12) / std: ~0.9% for int8, ~8-10% for int4 (group 32-128).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from models.kernels import linear as linear_kernels
from models.kernels import native, quantization
from models.kernels.choice import BUCKETS
from models.kernels.int_formats import (
    dequantize_int4,
    dequantize_int4_values,
    fit_int4,
    pack_int4,
    unpack_int4,
)
from models.kernels.linear_choice import candidates
from models.kernels.quantization import QuantizedLinear, quantize_language_model
from models.layers.decoder import CausalLM
from tests.model_fixtures import tiny_tied_model

# Relative error bounds (||out - ref|| / ||ref||) and the lowest row cosine on a 896x4864
# linear (Qwen2-0.5B's down_proj) with N(0, 0.02) weights; measured int8 per channel (group
# 4864) 0.0091, at groups 32 / 128 0.0056 / 0.0067, int4 0.078 / 0.089 / 0.099, and cosine
# >= 0.9947.
LINEAR_BOUNDS = {("int8", 4864): 0.012, ("int8", 128): 0.008, ("int8", 32): 0.007,
                 ("int4", 32): 0.09, ("int4", 64): 0.10, ("int4", 128): 0.115}
LINEAR_COSINE = 0.993


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    """(relative error, lowest row cosine similarity, max error / max |ref|)."""
    out, ref = out.float(), ref.float()
    rel = ((out - ref).norm() / ref.norm()).item()
    cos = F.cosine_similarity(out, ref, dim=-1).min().item()
    return rel, cos, ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture(scope="module")
def real_linear():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(896, 4864, generator=gen) * 0.02
    x = torch.randn(16, 4864, generator=gen)
    return w, x, F.linear(x, w)


def test_int4_pack_round_trip():
    q = torch.randint(0, 16, (192, 256), generator=torch.Generator().manual_seed(1),
                      dtype=torch.int32)
    packed = pack_int4(q)
    assert packed.shape == (192, 128) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    # the layout the C kernels read (tests/native/harness.c packs the same):
    # byte (b, s, d, j) = q[64b + d, 4s + j] | q[64b + 32 + d, 4s + j] << 4
    steps = packed.view(3, 64, 32, 4)
    for b, k, d in [(0, 0, 0), (1, 17, 5), (2, 255, 31)]:
        assert steps[b, k // 4, d, k % 4] == q[64 * b + d, k] | (q[64 * b + 32 + d, k] << 4)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_dequantize_equals_reference_group_quantization(group):
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(2))
    layer = QuantizedLinear(w, None, "int4", group)
    for dtype in (torch.float32, torch.bfloat16):  # the in-place path = unpack, then dequantize
        slow = dequantize_int4_values(unpack_int4(layer.qweight), layer.scales, dtype)
        assert torch.equal(dequantize_int4(layer.qweight, layer.scales, dtype), slow)
    # Reference: per group of `group` inputs, 16 levels on fit_int4's grid (its step and low end
    # rounded to bfloat16 as stored), each weight at its nearest level.
    g = w.reshape(128, -1, group)
    step, low = fit_int4(g)
    scale = step[..., None].to(torch.bfloat16).float()
    zero = (low[..., None] + 8 * scale).to(torch.bfloat16).float()
    q = torch.round((g - zero) / scale + 8).clamp(0, 15)
    expected = ((q - 8) * scale + zero).reshape(128, 256)
    dequantized = layer.dequantize(torch.float32)
    torch.testing.assert_close(dequantized, expected, rtol=0, atol=1e-6)
    # Every weight within the grid's span lies within half a step of its level; the fitted grid
    # is nearer the weights than the min-max one (16 levels spanning [min, max]).
    err = (dequantized - w).reshape(128, -1, group).abs()
    inside = (g >= zero - 8 * scale) & (g <= zero + 7 * scale)
    assert (err <= scale * 0.5 * (1 + 1e-3))[inside].all() and inside.float().mean() > 0.95
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    min_max = (torch.round((g - lo) / ((hi - lo) / 15)) * (hi - lo) / 15 + lo).reshape(128, 256)
    assert (dequantized - w).square().sum() < 0.95 * (min_max - w).square().sum()


@pytest.mark.parametrize("group, per_channel", [(32, False), (64, False), (128, True)])
def test_int8_dequantize_within_half_a_step(group, per_channel):
    """A scale per `group` inputs (largest |w| / 127, in bfloat16), or per channel where the
    group does not divide the inputs (96 x 192: 128 does not)."""
    w = torch.randn(96, 192, generator=torch.Generator().manual_seed(3))
    w[5, 70] = 40.0  # an outlier widens its own group's step only (or its channel's)
    layer = QuantizedLinear(w, None, "int8", group)
    assert layer.per_channel == per_channel
    g = 192 if per_channel else group
    assert layer.group_size == g and layer.format == ("int8" if per_channel else f"int8g{g}")
    assert layer.scales.shape == ((96,) if per_channel else (96, 192 // g))
    groups = w.reshape(96, -1, g)
    expected = (groups.abs().amax(-1) / 127).to(torch.bfloat16)
    assert torch.equal(layer.scales.reshape(96, -1), expected)
    step = expected.float()[..., None]
    err = (layer.dequantize(torch.float32) - w).reshape(96, -1, g).abs()
    assert (err <= step * 0.5 + 1e-6).all()
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127
    # the outlier's step is confined to its group: the rest of row 5 keeps a fine step
    others = torch.ones(192, dtype=torch.bool)
    others[70] = False
    if not per_channel:
        others[70 // g * g:(70 // g + 1) * g] = False
    coarse = (layer.dequantize(torch.float32)[5, others] - w[5, others]).abs().max()
    assert (coarse > 0.05) == per_channel


@pytest.mark.parametrize("mode, group", [("int8", 32), ("int8", 128), ("int4", 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 40, 96])
def test_both_formulations_match_the_dequantized_weight(mode, group, dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 128, generator=gen) * 0.1
    bias = torch.randn(192, generator=gen).to(dtype)
    layer = QuantizedLinear(w, bias, mode, group)  # int8 at 128 = K: a scale per channel
    x = torch.randn(rows, 128, generator=gen).to(dtype)
    ref = F.linear(x.to(torch.bfloat16).float(), layer.dequantize(torch.float32), bias.float())
    for name in _formulations(layer):
        layer.kernels = (name,) * len(BUCKETS)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (rows, 192)
        # bfloat16 activations (and bfloat16 outputs) round at ~0.4%.
        torch.testing.assert_close(out.float(), ref, atol=0.03, rtol=0.02)
        # a transposed view (what a (W x^T)^T formulation hands the next layer) runs too
        strided = layer(x.t().contiguous().t())
        torch.testing.assert_close(strided.float(), ref, atol=0.03, rtol=0.02)
    assert layer(x[None]).shape == (1, rows, 192)  # leading dims are flattened and restored


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_in_tiles_computes_what_one_tile_does(monkeypatch, mode, dtype):
    """Several tiles of output channels (a large weight) give the one-tile result, in either
    GEMM formulation (to the GEMM's summation order, which may depend on its width)."""
    gen = torch.Generator().manual_seed(9)
    layer = QuantizedLinear(torch.randn(320, 128, generator=gen), None, mode, 32)
    x = torch.randn(24, 128, generator=gen).to(dtype)
    whole = {}
    for name in ("dequantized", "dequantized_t"):
        layer.kernels = (name,) * len(BUCKETS)
        whole[name] = layer(x)
    monkeypatch.setattr(linear_kernels, "TILE_BYTES", 64 * 128 * dtype.itemsize)
    monkeypatch.setattr(linear_kernels, "MIN_TILE_CHANNELS", 64)
    assert len(linear_kernels.dequantization_tiles(320, 128, dtype)) == 5
    for name in ("dequantized", "dequantized_t"):
        layer.kernels = (name,) * len(BUCKETS)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
        torch.testing.assert_close(layer(x), whole[name], rtol=tol, atol=tol)


def test_dequantization_tiles_cover_the_weight_in_whole_blocks():
    tiles = linear_kernels.dequantization_tiles
    for n, k in [(9728, 896), (151936, 896), (896, 4864), (100, 64), (4096, 4096)]:
        found = tiles(n, k, torch.bfloat16)
        assert found[0][0] == 0 and found[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(found[:-1], found[1:], strict=True))
        assert all(first % linear_kernels.TILE_CHANNEL_BLOCK == 0 for first, _ in found)
        rows = [last - first for first, last in found]
        assert len(found) == 1 or min(rows[:-1]) >= linear_kernels.MIN_TILE_CHANNELS
        assert len(found) == 1 or (max(rows) * k * 2 < 2 * linear_kernels.TILE_BYTES
                                   or max(rows) < linear_kernels.MIN_TILE_CHANNELS + 64)
    assert len(tiles(9728, 896, torch.bfloat16)) > 1  # a large weight is tiled
    assert len(tiles(896, 4864, torch.bfloat16)) == 1  # too few channels for tiles


@pytest.mark.parametrize("mode, group", list(LINEAR_BOUNDS))
def test_real_shaped_linear_accuracy(real_linear, mode, group):
    w, x, ref = real_linear
    layer = QuantizedLinear(w, None, mode, group)
    for name in _formulations(layer):
        layer.kernels = (name,) * len(BUCKETS)
        for dtype in (torch.float32, torch.bfloat16):
            rel, cos, _ = _errors(layer(x.to(dtype)), ref)
            bound = LINEAR_BOUNDS[mode, group]
            assert rel < bound and cos > LINEAR_COSINE, (name, dtype, rel, cos)


@pytest.mark.parametrize("inputs, torch_kernel", [(8, False), (40, False), (64, True)])
def test_torch_int8_kernel_only_over_whole_vectors(inputs, torch_kernel):
    """PyTorch's int8 kernel crashed the process for inputs not a multiple of 16 on an AVX-512
    CPU: a per-channel int8 layer of such a width is neither planned to it nor run by it by
    default, and still computes its product."""
    w = torch.randn(64, inputs, generator=torch.Generator().manual_seed(inputs))
    layer = QuantizedLinear(w, None, "int8", inputs)
    assert layer.per_channel
    assert layer.has_torch_kernel == torch_kernel
    for rows in (1, 4, 32):
        assert ("int_kernel" in candidates(layer, rows, torch.bfloat16)) == torch_kernel
    x = torch.randn(4, inputs, generator=torch.Generator().manual_seed(1))
    ref = x @ layer.dequantize(torch.float32).t()
    torch.testing.assert_close(layer(x), ref, rtol=1e-2, atol=1e-2 * ref.abs().max().item())


def _formulations(layer: QuantizedLinear) -> tuple[str, ...]:
    """Every formulation a quantized layer may be planned to run (ours where it builds,
    PyTorch's int kernel where it has one)."""
    ours = ("native", "native_gemm") if native.load() is not None else ()
    if ours and layer.mode == "int8":
        ours += ("native_rows",)
    torch_kernel = ("int_kernel",) if layer.has_torch_kernel else ()
    return ("dequantized", "dequantized_t", "dequantized_bf16", "dequantized_t_bf16",
            "dequantized_f32", "dequantized_t_f32", *torch_kernel, *ours)


@pytest.mark.parametrize("mode, group", [("int8", 4864), ("int8", 32), ("int4", 128)])
def test_a_wrong_scale_breaks_the_bound(real_linear, mode, group):
    """The bounds above can fail: every other channel's scale 20% off breaks them."""
    w, x, ref = real_linear
    layer = QuantizedLinear(w, None, mode, group)
    with torch.no_grad():
        if mode == "int8":
            layer.scales[::2] *= 1.2
        else:
            layer.scales[:, ::2, 0] *= 1.2
    rel, _, _ = _errors(layer(x), ref)
    assert rel > LINEAR_BOUNDS[mode, group]


def test_quantize_language_model_covers_layers_and_a_tied_head():
    model = tiny_tied_model()
    embed = model.embed_tokens.weight.detach().clone()
    assert quantize_language_model(model, "int4", 32) == 2 * 4 + 1
    assert isinstance(model.lm_head, QuantizedLinear)
    assert isinstance(model.layers[0].mlp.down_proj, QuantizedLinear)
    assert torch.equal(model.embed_tokens.weight, embed)  # the table stays in the model dtype
    assert model.embed_tokens.weight.dtype == torch.float32


def test_config_validates_quantization():
    assert EngineConfig(quantization="int4", quantization_group_size=64).quantization == "int4"
    with pytest.raises(ValueError, match="None, int8, int4"):
        EngineConfig(quantization="fp8")
    with pytest.raises(ValueError, match="32, 64, 128"):
        EngineConfig(quantization="int4", quantization_group_size=96)


# ---- the tiny models through the engine ----------------------------------------------------

# Over 32 prompts, first-token logits of the quantized engine against the unquantized one
# (tiny Qwen2, in groups of 32 since hidden is 64; the int4 model's head stays int8: 600 rows do
# not pack). Its N(0, 0.25) weights make activations grow through the layers, so small weight
# errors move logits much more than in a trained model: the tight bounds are the linear's
# above. The cosine is the mean over prompts: the least one of int4 swings from 0.13 to 0.66
# with the prompts drawn. Measured: int8 top-1 agreement 1.0, mean cosine 0.9993, max error
# 3.0% of the logit range; int4 0.44, 0.913, 36%; int8 with wrong scales 0.16, 0.788, 50%.
# Bounds: (least agreement, least mean cosine, most max error).
ENGINE_BOUNDS = {"int8": (0.9, 0.995, 0.05), "int4": (0.35, 0.85, 0.45)}


def _first_token_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Float32 logits [prompts, V] of each prompt's first sampled token, through the engine."""
    model = llm.engine.runner.model
    seen: list[torch.Tensor] = []
    original = model.compute_logits

    def record(hidden):
        logits = original(hidden)
        seen.append(logits.clone())
        return logits

    model.compute_logits = record
    try:
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    finally:
        model.compute_logits = original
    return torch.cat(seen)


@pytest.fixture(scope="module")
def engine_prompts(qwen2_path):
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 500, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 40, (32,), generator=gen)]


@pytest.fixture(scope="module")
def dense_logits(qwen2_path, engine_prompts):
    return _first_token_logits(LLM(qwen2_path, max_model_len=128), engine_prompts)


def _engine_errors(path, prompts, ref, mode) -> tuple[float, float, float]:
    llm = LLM(path, max_model_len=128, quantization=mode, quantization_group_size=32)
    logits = _first_token_logits(llm, prompts)
    agree = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    cos = F.cosine_similarity(logits, ref, dim=-1).mean().item()
    err = ((logits - ref).abs().max() / (ref.max() - ref.min())).item()
    return agree, cos, err


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_tiny_model_accuracy_through_the_engine(qwen2_path, engine_prompts, dense_logits, mode):
    agree, cos, err = _engine_errors(qwen2_path, engine_prompts, dense_logits, mode)
    low_agree, low_cos, high_err = ENGINE_BOUNDS[mode]
    assert agree >= low_agree and cos >= low_cos and err <= high_err, (agree, cos, err)


def test_tiny_model_bound_fails_with_wrong_scales(
    qwen2_path, engine_prompts, dense_logits, monkeypatch
):
    """int8 with every other channel's scale 20% off falls outside the int8 bounds."""
    right = quantization.quantize_int8

    def wrong(w, group_size=None):
        q, scales = right(w, group_size)
        scales = scales.clone()
        scales[::2] *= 1.2
        return q, scales

    monkeypatch.setattr(quantization, "quantize_int8", wrong)
    agree, cos, err = _engine_errors(qwen2_path, engine_prompts, dense_logits, "int8")
    low_agree, low_cos, high_err = ENGINE_BOUNDS["int8"]
    assert not (agree >= low_agree and cos >= low_cos and err <= high_err), (agree, cos, err)


@pytest.mark.parametrize("fused", [False, True])
def test_quantized_while_loading_equals_after_and_stays_small(tmp_path, fused):
    """QuantizeOnLoad: the decoder's linears wait on the meta device and are quantized as the
    checkpoint fills them; the result equals quantizing the loaded dense model, and at no time
    are more than a couple of linears dense (per-expert and fused experts layouts)."""
    from transformers import AutoConfig

    from models.kernels.quantization import QuantizeOnLoad
    from models.loader import build_on_meta, iter_checkpoint, load_weights
    from testing.tiny import build_text_model

    path = build_text_model(
        tmp_path / "m", "qwen3_moe", num_layers=3, config_overrides={
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "norm_topk_prob": True, "head_dim": 16},
        **({"save_original_format": False} if fused else {}))
    hf_config = AutoConfig.from_pretrained(path)
    cpu = torch.device("cpu")

    def load(streamed: bool):
        quantizer = QuantizeOnLoad("int4", 32) if streamed else None
        model = build_on_meta(lambda: CausalLM.from_hf_config(hf_config, 64, cpu), cpu,
                              torch.float32, defer=quantizer.defer if quantizer else None)
        load_weights(model, model.checkpoint_tensors(iter_checkpoint(path)),
                     model.checkpoint_map(), quantizer)
        quantize_language_model(model, "int4", 32)
        return model, quantizer

    after, _ = load(streamed=False)
    during, quantizer = load(streamed=True)
    assert quantizer.count == 3 * (2 + 8 * 2)  # per layer: qkv, o, and 8 experts' two
    theirs = dict(after.named_buffers()) | dict(after.named_parameters())
    ours = dict(during.named_buffers()) | dict(during.named_parameters())
    assert sorted(theirs) == sorted(ours)
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    assert not any(t.is_meta for t in ours.values())
    sizes = [m.out_features * m.in_features * 4 for m in during.layers.modules()
             if isinstance(m, QuantizedLinear)]
    assert 0 < quantizer.peak_dense_bytes <= 2 * max(sizes) < sum(sizes) / 10, (
        quantizer.peak_dense_bytes, max(sizes), sum(sizes))


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_weights_own_their_storage(mode):
    """qweight and scales are tensors of their own, not views: a view's base would keep the
    old storage alive when the weights move into huge pages (the model resident twice)."""
    layer = QuantizedLinear(torch.randn(4 * 64, 256), None, mode, 32)
    assert layer.qweight._base is None and layer.scales._base is None
    # Quantized a block of rows at a time, the same as all at once.
    big = torch.randn(3 * 64, 128)
    original = quantization.QUANTIZE_BLOCK_BYTES
    try:
        quantization.QUANTIZE_BLOCK_BYTES = 64 * 128 * 4  # one 64-row block at a time
        blocked = QuantizedLinear(big, None, mode, 32)
    finally:
        quantization.QUANTIZE_BLOCK_BYTES = original
    whole = QuantizedLinear(big, None, mode, 32)
    assert torch.equal(blocked.qweight, whole.qweight)
    assert torch.equal(blocked.scales, whole.scales)
