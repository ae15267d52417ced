"""Our own CPU kernels (models/kernels/cpu/) against float64 references: matrix-vector
linears (float32, bfloat16, int8 and int4 weights), dequantizers, the fused small ops of a decode
step against the PyTorch ops they replace, paged decode attention (grouped-query heads,
sliding windows, soft-caps, tables that start past block 0), the build cache and the fallback
to PyTorch's kernels; then a whole model forced through them against transformers.

With CI set, a machine where the kernels do not build fails here instead of skipping: the
engine would silently run PyTorch's kernels only.
"""

from __future__ import annotations

import ctypes
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from models.kernels import native, native_build
from models.kernels.choice import BUCKETS
from models.kernels.int_formats import (
    dequantize_int4,
    dequantize_int8,
    fit_int4_torch,
    pack_int4,
    quantize_int4,
    quantize_int8,
)
from models.kernels.linear import Linear, float32_logits
from tests.model_fixtures import GEMMA3_1B_SHAPE


@pytest.fixture(scope="module")
def kernels():
    loaded = native.load()
    if loaded is None:
        reason = native.status().detail
        if os.environ.get("CI"):
            pytest.fail(f"native kernels unavailable on CI: {reason}")
        pytest.skip(reason)
    return loaded


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k", [(1, 77), (3, 256), (8, 96), (64, 160)])
def test_linear_matches_float64(kernels, weight_dtype, x_dtype, rows, k):
    gen = torch.Generator().manual_seed(rows * k)
    w = torch.randn(37, k, generator=gen).to(weight_dtype)
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    out = kernels.linear(x, w)
    assert out.dtype == x_dtype and out.shape == (rows, 37)
    ref = x.double() @ w.double().t()
    tol = 1e-5 if x_dtype == torch.float32 else 2 ** -8  # bfloat16 output: one rounding
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


TILED = ("linear_rows", "gemm")  # the register-tiled linear and the packed-panel GEMM


@pytest.mark.parametrize("tiled", TILED)
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
# rows: whole register tiles (4 rows; 6) and every remainder; n: whole blocks of 12 (strips of
# 16) and remainders; k: whole chunks of 256 and a part, whole vectors and a tail; the last
# case several blocks of rows (240) and of channels per thread (sums of 4 MiB)
@pytest.mark.parametrize("rows, n, k", [(4, 12, 256), (9, 37, 77), (66, 26, 520), (2, 25, 16),
                                        (1000, 2500, 24)])
def test_tiled_linear_matches_float64(kernels, tiled, weight_dtype, x_dtype, rows, n, k):
    gen = torch.Generator().manual_seed(rows * n + k)
    w = torch.randn(n, k, generator=gen)
    scales = None
    if weight_dtype == torch.int8:
        w, scales = quantize_int8(w)
        dense = dequantize_int8(w, scales, torch.float64)
    else:
        w = w.to(weight_dtype)
        dense = w.double()
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    out = getattr(kernels, tiled)(x, w, scales)
    assert out.dtype == x_dtype and out.shape == (rows, n)
    ref = x.double() @ dense.t()
    tol = 1e-5 if x_dtype == torch.float32 else 2 ** -8  # bfloat16 output: one rounding
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows, n, k", [(7, 64, 128), (250, 192, 640), (13, 192, 384)])
def test_int4_gemm_matches_its_dequantized_weight(kernels, x_dtype, group, rows, n, k):
    """The packed GEMM's int4 panels hold the dequantizer's float32 values: the product is x
    times that weight, within float32 summation order (chunks of 256 crossing groups)."""
    if k % group:
        pytest.skip("k not a multiple of the group")
    gen = torch.Generator().manual_seed(rows + group)
    q4, scales_and_zeros = quantize_int4(torch.randn(n, k, generator=gen), group)
    packed = pack_int4(q4)
    x = torch.randn(rows, k, generator=gen).to(x_dtype)
    out = kernels.gemm_int4(x, packed, scales_and_zeros, group)
    weight = kernels.dequantize_int4(packed, scales_and_zeros, group,
                                     torch.empty(n, k, dtype=torch.float32))
    ref = x.double() @ weight.double().t()
    tol = 1e-5 if x_dtype == torch.float32 else 2 ** -8
    assert out.dtype == x_dtype
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=tol)
    with pytest.raises(ValueError, match="does not take"):
        kernels.gemm_int4(x[:, :k - 4], packed[:, :(k - 4) // 2], scales_and_zeros, group)


@pytest.mark.parametrize("tiled", TILED)
def test_tiled_linear_takes_empty_shapes(kernels, tiled):
    fn = getattr(kernels, tiled)
    assert fn(torch.empty(0, 16), torch.randn(5, 16)).shape == (0, 5)
    assert torch.equal(fn(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))


@pytest.mark.parametrize("tiled", TILED)
def test_tiled_linear_puts_each_channel_and_row_in_its_place(kernels, tiled):
    """One-hot rows through a weight whose channels are distinct: a slip in the tiles' or the
    blocks' offsets (or the packing's transposes) would move a value to another row or
    column."""
    n, k = 29, 40
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    x = torch.eye(k)[:13]
    torch.testing.assert_close(getattr(kernels, tiled)(x, w), w[:, :13].t())


def test_bfloat16_output_rounds_as_pytorch(kernels):
    """A bfloat16 result is the float32 one rounded to nearest even, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(301, 64, generator=gen)
    x = torch.randn(2, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(kernels.linear(x, w), kernels.linear(x.float(), w).to(torch.bfloat16))


@pytest.mark.parametrize("k", [192, 100])  # 192: the VNNI path where the CPU has one
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_matches_the_dequantized_weight(kernels, k, rows):
    gen = torch.Generator().manual_seed(k + rows)
    q, scales = quantize_int8(torch.randn(64, k, generator=gen) * 0.05)
    x = torch.randn(rows, k, generator=gen)
    x[:, 3] *= 200  # an outlier channel: its 64-wide block's scale grows, the others' do not
    ref = x.double() @ dequantize_int8(q, scales, torch.float64).t()
    out = kernels.linear(x, q, scales)
    # With VDPBF16PS: two bfloat16 planes per float32 activation, within |x| / 2^16; with VNNI
    # alone: two int8 digits per 64-block, within max|x| / 65024.
    err = (out.double() - ref).norm() / ref.norm()
    assert err < 1e-4, err
    out_bf16 = kernels.linear(x.to(torch.bfloat16), q, scales)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.double(), ref, atol=0.01 * ref.abs().max().item(),
                               rtol=0.01)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group, rows", [(32, 1), (64, 5), (128, 7)])
def test_grouped_int8_linear_matches_the_dequantized_weight(kernels, x_dtype, group, rows):
    """A scale per group: a float32 x through widened weights, a bfloat16 x (a bfloat16
    model's) through VDPBF16PS where the build has it (each product exact, a group's sum scaled
    once): the exact product of the dequantized weight and x, to the output's rounding."""
    gen = torch.Generator().manual_seed(group + rows)
    q, scales = quantize_int8(torch.randn(96, 384, generator=gen) * 0.05, group)
    x = torch.randn(rows, 384, generator=gen).to(x_dtype)
    x[:, 3] *= 200
    ref = x.double() @ dequantize_int8(q, scales, torch.float64).t()
    out = kernels.linear(x, q, scales)
    assert out.dtype == x_dtype
    step = 2.0 ** -8 if x_dtype == torch.bfloat16 else 2.0 ** -20  # the output's rounding
    assert ((out.double() - ref).abs() <= step * ref.abs() + 1e-5 * ref.abs().max()).all()


@pytest.mark.parametrize("generic", [False, True])  # the VNNI path where the CPU has one
@pytest.mark.parametrize("group, rows", [(32, 1), (128, 3), (64, 6)])
def test_int4_linear_matches_the_dequantized_weight(kernels, generic, group, rows):
    """Read in place from our int4 pack. The VNNI path writes each group's activations
    as two int8 digits, each within max|x| / 65024 of the value, and computes exactly W . x'
    for the written x': an output's error is within that bound weighted by |w| (checked with a
    factor 3 of margin), plus float32 rounding of the scale and offset terms it is summed from,
    the plain-C path's only error."""
    gen = torch.Generator().manual_seed(group + rows)
    w = torch.randn(192, 256, generator=gen) * 0.05
    w[:, 7] *= 20
    q, scales_and_zeros = quantize_int4(w, group)
    packed = pack_int4(q)
    x = torch.randn(rows, 256, generator=gen)
    x[:, 3] *= 200  # an outlier channel: its group's scale grows, the others' do not
    weight = dequantize_int4(packed, scales_and_zeros, torch.float64)
    ref = x.double() @ weight.t()
    out = kernels.linear_int4(x, packed, scales_and_zeros, group, generic=generic)
    assert out.dtype == torch.float32 and out.shape == (rows, 192)
    top = x.double().abs().reshape(rows, -1, group).amax(-1).repeat_interleave(group, 1)
    digits = (top / 65024) @ weight.abs().t()
    # float32 rounding, relative to the two terms each output is summed from
    sz = scales_and_zeros.double().repeat_interleave(group, 0).transpose(0, 1)  # [N, K, 2]
    terms = q.double() * sz[..., 0] + (sz[..., 1] - 8 * sz[..., 0]).abs()
    bound = 1e-6 * (x.double().abs() @ terms.t()) + (0 if generic else 3 * digits)
    assert ((out.double() - ref).abs() <= bound).all()
    out_bf16 = kernels.linear_int4(x.to(torch.bfloat16), packed, scales_and_zeros, group,
                                   generic=generic)
    ref_bf16 = x.to(torch.bfloat16).double() @ weight.t()
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16.double(), ref_bf16, rtol=2 ** -8,
                               atol=0.005 * ref_bf16.abs().max().item())


def every_weight_kind(kernels, gen: torch.Generator, k: int, odd: bool = False) -> dict:
    """Each weight kind's matrix-vector call on random weights of `k` inputs (int8 and int4
    scales per 32): 128 output channels, or with `odd` 191 (float) and 193 (int8) where the
    kernel takes any count (int4 takes multiples of 64: 192)."""
    n, n8, n4 = (191, 193, 192) if odd else (128, 128, 128)
    w = torch.randn(n4, k, generator=gen)
    q, scales_and_zeros = quantize_int4(w, 32)
    packed = pack_int4(q)
    i8 = torch.randint(-127, 128, (n8, k), dtype=torch.int8, generator=gen)
    channel_scales = torch.rand(n8, generator=gen).to(torch.bfloat16)
    group_scales = torch.rand(n8, k // 32, generator=gen).to(torch.bfloat16)
    return {
        "float32": lambda x: kernels.linear(x, w[:n]),
        "bfloat16": lambda x: kernels.linear(x, w[:n].to(torch.bfloat16)),
        "int8": lambda x: kernels.linear(x, i8, channel_scales),
        "int8 grouped": lambda x: kernels.linear(x, i8, group_scales),
        "int4": lambda x: kernels.linear_int4(x, packed, scales_and_zeros, 32),
        "int4 plain": lambda x: kernels.linear_int4(x, packed, scales_and_zeros, 32,
                                                    generic=True)}


def test_a_small_linear_on_the_calling_thread_alone_gives_the_same_bits(kernels):
    """Under SOLO_BYTES of work (rows x weight bytes) a linear runs on the calling thread alone
    (kernels.h, team_threads; the tests otherwise put every call on a team): the same values
    to the bit as its team's, for every weight kind, and past the bound on a team again."""
    gen = torch.Generator().manual_seed(5)
    calls = every_weight_kind(kernels, gen, 256)
    for rows in (1, 3, 200):  # 200 rows x 128 KiB of float32 weight: past the bound
        x = torch.randn(rows, 256, generator=gen)
        try:
            kernels.set_solo_bytes(0)
            on_team = {name: call(x) for name, call in calls.items()}
            kernels.set_solo_bytes(native.SOLO_BYTES)
            alone = {name: call(x) for name, call in calls.items()}
        finally:
            kernels.set_solo_bytes(int(os.environ.get(native.SOLO_ENV, native.SOLO_BYTES)))
        for name in calls:
            assert torch.equal(alone[name], on_team[name]), (name, rows)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_each_row_of_a_call_is_the_one_row_calls_to_the_bit(kernels, x_dtype):
    """A verify's rows (a request's last token and its drafts) share one call of the
    matrix-vector kernels, whose tiles share the weights' loads and unpacking among rows: each
    row must still sum as a decode of its token alone does, for every weight kind, at row
    counts that fill the tiles and leave remainders, with an odd channel count where the
    kernel takes one, and 352 inputs (the bfloat16 kernel's 64s and a 32 left)."""
    gen = torch.Generator().manual_seed(11)
    calls = every_weight_kind(kernels, gen, 352, odd=True)
    for rows in (2, 3, 4, 5, 6, 9):
        x = torch.randn(rows, 352, generator=gen).to(x_dtype)
        for name, call in calls.items():
            alone = torch.cat([call(x[i:i + 1]) for i in range(rows)])
            assert torch.equal(call(x), alone), (name, rows)


def test_int4_linear_reads_pytorchs_channel_order(kernels):
    """Each output channel alone: a layout slip (a permuted block of 16 channels, a swapped
    nibble) would put its value in another column."""
    w = torch.zeros(128, 64)
    w[torch.arange(128), torch.arange(128) % 64] = torch.arange(1, 129, dtype=torch.float32)
    q, scales_and_zeros = quantize_int4(w, 32)
    packed = pack_int4(q)
    eye = torch.eye(64)
    for generic in (False, True):
        out = kernels.linear_int4(eye, packed, scales_and_zeros, 32, generic=generic)
        ref = eye.double() @ dequantize_int4(packed, scales_and_zeros, torch.float64).t()
        torch.testing.assert_close(out.double(), ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dequantizer_matches_the_reference(kernels, dtype):
    """What the `dequantized` formulations multiply by: exactly PyTorch's q * scale (one
    rounding either way)."""
    gen = torch.Generator().manual_seed(5)
    q, scales = quantize_int8(torch.randn(70, 100, generator=gen))  # 100: a vector tail
    out = kernels.dequantize_int8(q, scales, torch.empty(70, 100, dtype=dtype))
    assert torch.equal(out, dequantize_int8(q, scales, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_dequantizer_rounds_once_and_reads_any_block_range(kernels, dtype, group):
    """Rows of (q - 8) * scale + zero, as fma(q, scale, zero - 8 * scale) in float32 rounded
    once to `dtype`, to the bit; a range of blocks gives the same rows as the whole."""
    gen = torch.Generator().manual_seed(group)
    w = torch.randn(320, 384, generator=gen)
    q4, scales_and_zeros = quantize_int4(w, group)
    packed = pack_int4(q4)
    out = kernels.dequantize_int4(packed, scales_and_zeros, group,
                                  torch.empty(320, 384, dtype=dtype))
    sz = scales_and_zeros.float().transpose(0, 1).repeat_interleave(group, dim=1)  # [N, K, 2]
    scale, offset = sz[..., 0], sz[..., 1] - 8 * sz[..., 0]  # float32, as the kernel rounds
    exact = q4.double() * scale.double() + offset.double()  # exact: the fma before rounding
    assert torch.equal(out, exact.float().to(dtype))
    part = kernels.dequantize_int4(packed, scales_and_zeros, group,
                                   torch.empty(128, 384, dtype=dtype), first=128)
    assert torch.equal(part, out[128:256])


def _grid_error(x: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Each group's squared error on the grid low + q * step, in float64."""
    x, step, low = x.double(), step.double()[..., None], low.double()[..., None]
    return ((torch.round((x - low) / step).clamp(0, 15) * step + low - x) ** 2).sum(-1)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_fit_is_pytorchs_and_beats_the_min_max_grid(kernels, group):
    """Our kernel fits the grids PyTorch's steps fit (the same least squares; sums may round
    differently, so a rare rounding tie may go the other way), no group's error above its
    min-max grid's and the whole's clearly below; a group of one value keeps it, a group of two
    values fits both exactly."""
    gen = torch.Generator().manual_seed(group)
    x = torch.randn(300, 17, group, generator=gen) * torch.rand(300, 17, 1, generator=gen)
    x[0, 0] = 0.25  # one value
    x[0, 1, 3] = 40.0  # an outlier
    x[0, 2] = torch.arange(group) % 2  # two values
    step, low = kernels.fit_int4(x)
    step_t, low_t = fit_int4_torch(x)
    assert step.shape == low.shape == (300, 17)
    assert step[0, 0] == 0 and low[0, 0] == 0.25
    close = torch.isclose(step, step_t, rtol=1e-5, atol=0) & torch.isclose(low, low_t,
                                                                            rtol=1e-5, atol=1e-7)
    assert close.float().mean() > 0.999, (~close).sum()
    fitted, fitted_t = _grid_error(x[1:], step[1:], low[1:]), _grid_error(x[1:], step_t[1:],
                                                                          low_t[1:])
    torch.testing.assert_close(fitted.sum(), fitted_t.sum(), rtol=1e-5, atol=0)
    lo, hi = x[1:].amin(-1), x[1:].amax(-1)
    min_max = _grid_error(x[1:], (hi - lo) / 15, lo)
    assert (fitted <= min_max * (1 + 1e-5)).all() and (fitted_t <= min_max * (1 + 1e-5)).all()
    assert fitted.sum() < 0.9 * min_max.sum()  # about 0.86 on these
    outlier = x[0, 1]
    assert _grid_error(outlier, step[0, 1], low[0, 1]) <= _grid_error(
        outlier, (outlier.max() - outlier.min()) / 15, outlier.min())
    assert _grid_error(x[0, 2], step[0, 2], low[0, 2]) < 1e-9  # two values: exactly


def test_int4_quantizes_alike_without_our_kernels(kernels, monkeypatch):
    """MMSERVE_NATIVE=0 (no library) quantizes with PyTorch's steps: the same q but where a
    rounding tie went the other way."""
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(3))
    q, scales_and_zeros = quantize_int4(w, 64)
    monkeypatch.setattr(native, "load", lambda: None)
    q_t, scales_and_zeros_t = quantize_int4(w, 64)
    assert (q == q_t).float().mean() > 0.999
    assert (scales_and_zeros == scales_and_zeros_t).float().mean() > 0.99


@pytest.mark.parametrize("rows", [1, 40])
@pytest.mark.parametrize("plan", [None, "matmul_t", "native", "native_gemm"])
@pytest.mark.parametrize("mode", [None, "int8"])  # an int4 model keeps its head at int8
def test_head_logits_are_float32_sums_not_rounded(kernels, monkeypatch, rows, plan, mode):
    """A bfloat16 model's logits: x W^T summed in float32 and kept so, whichever formulation the
    plan gave the head (ours where it is not one of ours), dense or int8; PyTorch's rounded
    bfloat16 product without our library."""
    from models.kernels.quantization import QuantizedLinear

    gen = torch.Generator().manual_seed(rows)
    head = Linear(192, 320, bias=False)
    head.weight.data = torch.randn(320, 192, generator=gen).bfloat16()
    layer = QuantizedLinear(head.weight.data, None, mode, 64) if mode else head
    if mode and plan == "matmul_t":  # PyTorch's formulation of quantized layers
        plan = "dequantized"
    layer.kernels = None if plan is None else (plan,) * len(BUCKETS)
    x = torch.randn(rows, 192, generator=gen).bfloat16()
    weight = layer.dequantize(torch.float64) if mode else head.weight.double()
    exact = x.double() @ weight.t()
    logits = float32_logits(layer, x)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), exact, rtol=1e-5, atol=1e-4)
    rounded = layer(x).float().double()
    assert (rounded - exact).abs().max() > 10 * (logits.double() - exact).abs().max()
    if plan not in ("native", "native_gemm"):  # a plan names ours only with the library
        monkeypatch.setattr(native, "load", lambda: None)
        assert torch.equal(float32_logits(layer, x), rounded.float())


@pytest.mark.parametrize("mode, group", [(None, 0), ("int8", 64), ("int8", 0)])
def test_few_rows_of_logits_sum_each_row_as_its_one_row_call(kernels, mode, group):
    """A decode's and a verify's rows of an LM head (bfloat16 x): float32 sums within float32
    rounding of the exact product, and each row's logits the same bits whatever rows share the
    call (plain decoding and a verify of its tokens must pick alike), dense and int8 heads,
    grouped and per channel, at 352 inputs (a group's 64s and a 32 left over in the dense head's
    loop). Where the build has VDPBF16PS the LM-head kernel serves them (x taken as bfloat16,
    `native.logits`); elsewhere it declines and the matrix-vector kernels do."""
    from models.kernels.quantization import QuantizedLinear

    gen = torch.Generator().manual_seed(5)
    head = Linear(352, 200, bias=False)
    head.weight.data = torch.randn(200, 352, generator=gen).bfloat16()
    layer = QuantizedLinear(head.weight.data, None, mode, group or 352) if mode else head
    weight = layer.dequantize(torch.float64) if mode else head.weight.double()
    x = torch.randn(9, 352, generator=gen).bfloat16()
    taken = kernels.logits(x[:1], layer.qweight if mode else head.weight,
                           layer.scales if mode else None) is not None
    assert taken == (kernels.variant == "avx512-bf16"), kernels.variant
    for rows in range(1, 10):
        logits = float32_logits(layer, x[:rows])
        torch.testing.assert_close(logits.double(), x[:rows].double() @ weight.t(),
                                   rtol=1e-5, atol=1e-4)
        alone = torch.cat([float32_logits(layer, x[i:i + 1]) for i in range(rows)])
        assert torch.equal(logits, alone), rows
    assert kernels.logits(torch.zeros(2, 48).bfloat16(), torch.zeros(3, 48).bfloat16()) is None


def test_native_linear_is_a_planned_candidate_for_few_rows_only(kernels):
    """Dense and quantized weights up to the 9-64 bucket (a second turn's short prefill chunk:
    the rows come from cache again cheaper than a GEMM that widens or dequantizes the whole
    weight first), never past it (int4's: up to the 65-256 bucket); the tiled kernel past a
    decode's rows up to the 65-256 bucket, for dense and int8 weights; the packed GEMM past a
    decode's rows."""
    from models.kernels.linear_choice import candidates
    from models.kernels.quantization import QuantizedLinear

    layer = Linear(64, 32)
    probes = (1, 4, 32, 128, 512)  # the probe rows of the buckets 1, 2-8, 9-64, 65-256, 257+
    assert [("native" in candidates(layer, r, torch.bfloat16)) for r in probes] == [
        True, True, True, False, False]
    assert [("native_rows" in candidates(layer, r, torch.bfloat16)) for r in probes] == [
        False, False, True, True, False]
    assert [("native_gemm" in candidates(layer, r, torch.bfloat16)) for r in probes] == [
        False, False, True, True, True]
    for mode, group in (("int8", 32), ("int8", 64), ("int4", 32)):
        q = QuantizedLinear(torch.randn(64, 64), None, mode, group)
        # PyTorch's int8 kernel takes a scale per channel (int8 at group 64 = K) only
        torch_kernel = ["int_kernel"] if mode == "int4" or group == 64 else []
        assert candidates(q, 1, torch.bfloat16) == [*torch_kernel, "native"]
        assert "native" in candidates(q, 32, torch.bfloat16)
        # int4's integer kernel as far as the tiled one; int8's matrix-vector one not
        assert ("native" in candidates(q, 128, torch.bfloat16)) == (mode == "int4")
        assert "native" not in candidates(q, 512, torch.bfloat16)
        assert ("native_rows" in candidates(q, 32, torch.bfloat16)) == (mode == "int8")
        assert "native_gemm" in candidates(q, 512, torch.bfloat16)
        assert "native_gemm" in candidates(q, 32, torch.bfloat16)
        assert "native_gemm" not in candidates(q, 4, torch.bfloat16)
        q.kernels = ("native_gemm",) * len(BUCKETS)  # int8's scales, int4's panels
        xq = torch.randn(3, 64)
        torch.testing.assert_close(q(xq), F.linear(xq, q.dequantize(torch.float32)))
    x = torch.randn(3, 64)
    for name in ("native", "native_rows", "native_gemm"):
        layer.kernels = (name,) * len(BUCKETS)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_fused_norm_matches_the_pytorch_ops_it_replaces(kernels, dtype, unit_offset):
    """RMSNorm at a decode's rows (our kernel, the residual add fused) against the same module
    on more rows than FUSED_ROWS (PyTorch's operators): equal up to float32 summation order,
    i.e. at most one bfloat16 rounding step apart."""
    from models.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(96, 1e-6, unit_offset, fused_decode=True).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
    rows = native.FUSED_ROWS + 1
    h = (torch.randn(rows, 96, generator=gen) * 3).to(dtype)
    delta = torch.randn(rows, 96, generator=gen).to(dtype)
    reference = norm(h + delta)  # too many rows: PyTorch's ops
    summed, normed = norm.add_and_norm(h[:4].contiguous(), delta[:4].contiguous())
    assert torch.equal(summed, (h + delta)[:4])
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(normed, reference[:4], rtol=tol, atol=tol)
    torch.testing.assert_close(norm(summed), normed, rtol=0, atol=0)
    wrong = RMSNorm(96, 1.0, unit_offset, fused_decode=True).to(dtype)  # the bound can fail
    wrong.weight.data.copy_(norm.weight)
    assert not torch.allclose(wrong(summed), normed, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rotary_and_silu_match_the_pytorch_ops(kernels, dtype):
    """The rotation rounds exactly where PyTorch's elementwise ops round (bit-equal); SiLU and
    multiply within one rounding of the dtype (a different exp)."""
    from models.layers.mlp import GatedMLP
    from models.layers.rotary import apply_rotary

    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(3, 7 * 16 + 40, generator=gen).to(dtype)
    x = qkv[:, :7 * 16].view(3, 7, 16)  # tokens strided, as the fused projection's view
    angles = torch.randn(3, 1, 8, generator=gen)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), expected)
    assert torch.equal(kernels.rotary(x, cos, sin), expected)

    mlp = GatedMLP(16, 40, fused_decode=True).to(dtype)
    gate_up = (torch.randn(5, 80, generator=gen) * 4).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=tol,
                               atol=tol)
    x = torch.randn(2, 16, generator=gen).to(dtype)
    plain = GatedMLP(16, 40).to(dtype)
    plain.load_state_dict(mlp.state_dict())
    torch.testing.assert_close(mlp(x), plain(x), rtol=2 * tol, atol=2 * tol)


def _paged(gen, dtype, contexts, kv_heads, dim, block_size, num_blocks):
    """A cache whose blocks are handed out in a shuffled order: tables [B][blocks]."""
    cache = torch.randn(2, kv_heads, num_blocks, block_size, dim, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for c in contexts:
        n = -(-c // block_size)
        tables.append(free[:n])
        free = free[n:]
    return cache, tables


def _reference(q, cache, table, context, scale, window, softcap):
    """One sequence's decode attention in float64: [Hq, D]."""
    heads, dim = q.shape
    kv_heads, block_size = cache.shape[1], cache.shape[3]
    pos = torch.arange(context)
    slots = torch.tensor(table)[pos // block_size] * block_size + pos % block_size
    keys = cache[0].reshape(kv_heads, -1, dim)[:, slots].double()  # [Hkv, L, D]
    values = cache[1].reshape(kv_heads, -1, dim)[:, slots].double()
    group = heads // kv_heads
    scores = torch.einsum("hgd,hld->hgl", q.double().view(kv_heads, group, dim), keys) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if window:
        scores[..., pos < context - window] = float("-inf")
    out = torch.einsum("hgl,hld->hgd", scores.softmax(-1), values)
    return out.reshape(heads, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 24])  # 64: a specialised head size; 24: the generic loop
@pytest.mark.parametrize("window, softcap", [(None, None), (11, None), (None, 30.0)])
def test_decode_attention_matches_float64(kernels, dtype, dim, window, softcap):
    gen = torch.Generator().manual_seed(dim)
    heads, kv_heads, block_size = 6, 2, 4
    contexts = [1, 9, 37, 300]  # 300 keys: more than one chunk of keys converted at a time
    cache, tables = _paged(gen, dtype, contexts, kv_heads, dim, block_size, 120)
    q = torch.randn(len(contexts), heads, dim, generator=gen).to(dtype)
    # As the engine's decode views: a windowed layer's table starts at its first visible block.
    firsts = [0 if window is None else max(c - window, 0) // block_size for c in contexts]
    width = max(len(t) - f for t, f in zip(tables, firsts, strict=True))
    table = torch.zeros(len(contexts), width, dtype=torch.int64)
    for b, (t, f) in enumerate(zip(tables, firsts, strict=True)):
        table[b, : len(t) - f] = torch.tensor(t[f:])
    key0 = torch.tensor(firsts) * block_size
    out = kernels.decode_attention(q, cache, table, key0, torch.tensor(contexts), 0.2, window,
                                   softcap)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    for b, c in enumerate(contexts):
        ref = _reference(q[b], cache, tables[b], c, 0.2, window, softcap)
        torch.testing.assert_close(out[b].double(), ref, atol=tol, rtol=tol)


def test_paged_attention_takes_the_native_decode_kernel(kernels):
    """Through the engine's metadata: decodes in two buckets beside a chunk, sliding window."""
    from models.layers.attention import LayerAttention, paged_attention
    from models.layers.attention_metadata import build_metadata

    gen = torch.Generator().manual_seed(1)
    cpu = torch.device("cpu")
    kv_heads, dim, bs, window = 2, 16, 4, 6
    cache = torch.zeros(2, kv_heads, 40, bs, dim)
    contexts = [3, 9, 30]
    tables = [list(range(10 * i, 10 * i + 8)) for i in range(3)]
    seqs = [torch.randn(c, 3, kv_heads, dim, generator=gen) for c in contexts]
    for c, seq, table in zip(contexts, seqs, tables, strict=True):
        meta = build_metadata([0], [c - 1], [table], bs, cpu, windows=(None, window))
        paged_attention(seq[:-1, 0].repeat_interleave(2, 1), seq[:-1, 1], seq[:-1, 2], cache,
                        meta, 0.3, LayerAttention(window))
    outs = {}
    for kernel in ("matmul", "native"):
        meta = build_metadata([c - 1 for c in contexts], [1, 1, 1], tables, bs, cpu,
                              windows=(None, window), decode_kernel=kernel)
        q = torch.cat([s[-1:, 0].repeat_interleave(2, 1) for s in seqs])
        k = torch.cat([s[-1:, 1] for s in seqs])
        v = torch.cat([s[-1:, 2] for s in seqs])
        outs[kernel] = paged_attention(q, k, v, cache.clone(), meta, 0.3, LayerAttention(window))
    torch.testing.assert_close(outs["native"], outs["matmul"], atol=1e-5, rtol=0)


def test_the_forced_variant_is_the_one_loaded(kernels):
    """Under MMSERVE_CPU_ISA (tests/test_cpu_variants.py runs these tests so per variant) the
    library loaded is that variant's build; otherwise the best this CPU runs."""
    from models.kernels.cpu_variants import chosen

    forced = os.environ.get("MMSERVE_CPU_ISA")
    assert kernels.variant == (forced or chosen().name)
    assert kernels.variant in native.status().detail


def test_build_is_cached_and_keyed_by_variant_and_source(kernels, tmp_path, monkeypatch):
    """The cache's keying, on two small sources of the library's shape (a header and files
    named as ours): the library itself is built (and its kernels tested) by every other test."""
    from models.kernels.cpu_variants import BY_NAME

    monkeypatch.setenv("MMSERVE_KERNEL_CACHE", str(tmp_path / "cache"))
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "kernels.h").write_text("int mm_one(void);\n")
    (ours / "one.c").write_text('#include "kernels.h"\nint mm_one(void) { return 1; }\n')
    (ours / "two.c").write_text('#include "kernels.h"\nint mm_two(void) { return mm_one(); }\n')
    monkeypatch.setattr(native_build, "SOURCES", (ours / "one.c", ours / "two.c"))
    monkeypatch.setattr(native_build, "HEADER", ours / "kernels.h")
    compiler = os.environ.get("CC") or "cc"
    openmp = native_build.openmp_runtime()
    variant = BY_NAME[kernels.variant]
    path, seconds = native_build.build(variant, compiler, openmp, source_dir=ours)
    assert path.parent == tmp_path / "cache" and seconds > 0 and variant.name in path.name
    assert ctypes.CDLL(str(path)).mm_two() == 1  # compiled, linked, loadable
    # the second start reuses it
    assert native_build.build(variant, compiler, openmp, source_dir=ours) == (path, 0.0)
    other = next(v for v in BY_NAME.values() if v.arch == variant.arch and v != variant)
    assert native_build.build(other, compiler, openmp, source_dir=ours)[0] != path
    edited = tmp_path / "edited"  # another revision's sources: one file edited
    shutil.copytree(ours, edited)
    (edited / "one.c").write_text((ours / "one.c").read_text() + "\n/* edited */\n")
    assert native_build.build(variant, compiler, openmp, source_dir=edited)[0] != path
    header = tmp_path / "header"  # the header is part of the key too
    shutil.copytree(ours, header)
    (header / "kernels.h").write_text("int mm_one(void); /* edited */\n")
    assert native_build.build(variant, compiler, openmp, source_dir=header)[0] != path


def test_without_a_compiler_the_engine_keeps_pytorch_kernels(monkeypatch):
    from models.kernels.cpu_variants import chosen
    from models.kernels.linear_choice import candidates

    monkeypatch.setenv("CC", "/nonexistent/cc")
    kernels, detail = native._load(chosen())
    assert kernels is None and "no C compiler" in detail
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native._load(chosen()) == (None, f"disabled by {native.DISABLE_ENV}=0")
    monkeypatch.setattr(native, "load", lambda: None)
    assert "native" not in candidates(Linear(8, 8), 1, torch.float32)


# Gemma 3 1B's proportions as tests/test_text_families_vs_hf.py builds them, with a head of 64
# (a head size the attention kernel specialises).
GEMMA3_SHAPE = {**GEMMA3_1B_SHAPE, "head_dim": 64, "query_pre_attn_scalar": 64}


@pytest.fixture(scope="module", params=["qwen2", "gemma3_text"])
def text_model(request, tmp_path_factory):
    from testing.tiny import build_text_model

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2":
        return build_text_model(root / "m", "qwen2", num_layers=2)
    return build_text_model(root / "m", "gemma3_text", num_layers=6, num_heads=4,
                            num_kv_heads=1, tie_word_embeddings=True,
                            config_overrides=GEMMA3_SHAPE)


@pytest.fixture
def native_everywhere(kernels, monkeypatch):
    """Engines built in the test decode through our kernels wherever one exists: decode
    attention, and every linear's 1-row and 2-8-row buckets (int8 and int4 too)."""
    import engine.model_loading as loading
    import engine.runner_setup as runner
    from models.kernels.quantization import QuantizedLinear

    def plan(model, dtype, *args, **kwargs):
        for module in model.modules():
            if isinstance(module, QuantizedLinear):
                rest = "int_kernel" if module.has_torch_kernel else "dequantized"
            elif isinstance(module, Linear):
                rest = "F.linear"
            else:
                continue
            module.kernels = ("native", "native") + (rest,) * (len(BUCKETS) - 2)
        return {}

    monkeypatch.setattr(runner, "choose_decode_attention", lambda *args, **kwargs: "native")
    monkeypatch.setattr(loading, "choose_linear_kernels", plan)


def test_decode_logits_and_greedy_tokens_match_transformers(text_model, hf_models,
                                                            native_everywhere):
    from engine import LLM, SamplingParams
    from models.layers.attention_metadata import build_metadata

    hf = hf_models(text_model)
    llm = LLM(text_model, dtype="float32", max_model_len=256, block_size=4)
    model = llm.engine.runner.model
    assert llm.engine.runner.decode_kernel == "native"
    ids = torch.randint(0, llm.engine.runner.vocab_size, (24,),
                        generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    blocks, logits = [5, 0, 7, 2, 9, 1, 3], []
    for start, end in [(0, 16)] + [(p, p + 1) for p in range(16, 24)]:  # then 8 decodes
        meta = build_metadata([start], [end - start], [blocks], 4, torch.device("cpu"),
                              windows=model.attention_windows(), decode_kernel="native")
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta)
            logits.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(logits), ref, atol=3e-4, rtol=0)

    prompts = [list(range(4, 30)), list(range(9, 14))]  # two decodes share the steps
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_model_through_native_kernels_tracks_pytorchs(text_model, native_everywhere,
                                                                 mode, monkeypatch):
    """The same int8 / int4 weights through our kernels and through PyTorch's (its int kernel,
    or a GEMM on the dequantized weight for int8 with a scale per group, which it has no kernel
    for): the two runs may differ by what the formulations round differently (our activations
    carry 15 bits per block; PyTorch's int kernels take bfloat16 activations, its dequantized
    GEMM a bfloat16 weight), each a rounding no coarser than the bfloat16 rounding the model
    applies to every activation anyway. So the allowed drift is measured, not set: the same
    weights run once more in a float32 engine, and how far its log-probabilities move from the
    bfloat16 run's (the model's own activation rounding, on this CPU and this model) bounds how
    far ours may move from PyTorch's, step by step, and the margin of a near-tie that the two
    may break differently (two tokens each moving by up to that much). A kernel error moves
    them by far more. The head returns float32 logits through ours either way
    (float32_logits)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompt = [{"prompt_token_ids": list(range(4, 30))}]
    options = dict(max_model_len=256, quantization=mode, quantization_group_size=32,
                   enable_prefix_caching=False)
    ours = LLM(text_model, dtype="bfloat16", **options)
    first = ours.generate(prompt, params)[0].outputs[0]
    layers = [m for m in ours.engine.runner.model.modules() if getattr(m, "is_quantized", False)]
    assert layers and all(m.kernels[0] == "native" for m in layers)
    assert any(not m.has_torch_kernel for m in layers)  # int8 at group 32 (int4's head too)
    for layer in layers:
        theirs = "int_kernel" if layer.has_torch_kernel else "dequantized"
        layer.kernels = (theirs,) * len(BUCKETS)
    second = ours.generate(prompt, params)[0].outputs[0]

    # the float32 engine's weights are overwritten in place: read into memory, not mapped
    # read-only from the checkpoint (models/mapped_files.py)
    monkeypatch.setenv("MMSERVE_MAP_WEIGHTS", "0")
    noise = _activation_rounding_drift(ours, LLM(text_model, dtype="float32", **options),
                                       prompt, params, first)
    assert 0 < noise < 2, noise  # a real measurement, not a broken reference
    for step, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=True)):
        ours_top, theirs_top = first.logprobs[step], second.logprobs[step]
        drift = max((abs(ours_top[t] - theirs_top[t]) for t in ours_top if t in theirs_top),
                    default=0.0)
        assert drift <= noise, (step, drift, noise)
        if a != b:
            best, runner_up = sorted(ours_top.values(), reverse=True)[:2]
            assert b in ours_top and best - runner_up <= 2 * noise, (step, best, runner_up)
            break


def _activation_rounding_drift(bf16, f32, prompt, params, bf16_run) -> float:
    """The largest change of a top token's log-probability between `bf16_run` and the same
    prompt through `f32`, an engine given `bf16`'s very weights (quantized ones included) in
    float32, over the steps the two runs share (up to and including their first different
    token, whose context is still the same)."""
    source = bf16.engine.runner.model.state_dict()
    target = f32.engine.runner.model.state_dict()
    assert any(name.endswith("qweight") for name in source)
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(source[name].to(tensor.dtype))
    run = f32.generate(prompt, params)[0].outputs[0]
    drift = 0.0
    for a, b, top_a, top_b in zip(bf16_run.token_ids, run.token_ids, bf16_run.logprobs,
                                  run.logprobs, strict=True):
        drift = max([drift, *(abs(top_a[t] - top_b[t]) for t in top_a if t in top_b)])
        if a != b:
            break
    return drift


def test_the_engine_panel_says_which_kernels_run(qwen2_path, monkeypatch):
    from engine import LLM

    engine = LLM(qwen2_path, max_model_len=128).engine
    loaded = native.load()
    expected = f"own kernels ({loaded.variant})" if loaded else "PyTorch kernels"
    if engine.runner.native_decode:
        expected += ", decode in one native call"
    assert engine.stats()["weights"] == f"float32, cpu, {expected}"
    # as another machine would describe it (the engine reads it once: the weights stay)
    import engine.engine_report as engine_report

    monkeypatch.setattr(engine.runner, "native_decode", False)
    monkeypatch.setattr(native, "load", lambda: None)
    describe = engine_report.weights_description
    assert describe(engine.runner) == "float32, cpu, PyTorch kernels"
    monkeypatch.setattr(engine.runner, "dtype", torch.bfloat16)
    monkeypatch.setattr(engine_report, "cpu_has_native_bf16", lambda: False)
    assert describe(engine.runner) == (
        "bfloat16, cpu, PyTorch kernels, bfloat16 kept in memory, multiplied in float32 "
        "(no bfloat16 arithmetic)")


def test_argmax_is_torchs_including_ties_nans_and_infinities(kernels):
    gen = torch.Generator().manual_seed(4)
    cases = [
        torch.randn(3, 151936, generator=gen),  # a vocabulary: the vector path and a tail
        torch.tensor([[1.0, 3.0, 3.0, 2.0]]),  # ties: the first
        torch.full((2, 100), -float("inf")),
        torch.tensor([[1.0, float("nan"), 5.0, float("nan")], [0.0, 1.0, 2.0, 3.0]]),
        torch.randn(2, 37, generator=gen)[:, ::2],  # strided
    ]
    for x in cases:
        assert torch.equal(kernels.argmax(x), x.argmax(dim=-1)), x
