"""Our own CPU kernels (the C sources under models/kernels/cpu/) as typed Python calls:
`load()` builds the library for this CPU (models.kernels.native_build), opens it with ctypes
and binds its functions once (models.kernels.native_interface, the table of every C signature);
`NativeKernels` wraps each kernel for tensors.

The library is built for the variant models.kernels.cpu_variants chooses for this CPU (or
$MMSERVE_CPU_ISA forces). Where that cannot be done (no compiler, a failed build, no variant for
this architecture, MMSERVE_NATIVE=0) `load()` returns None and says why once; every caller then
keeps PyTorch's kernels. Nothing here decides whether a native linear or attention kernel runs:
models/kernels/linear_choice.py and models/layers/attention.py time it against PyTorch's first.
The fused small ops (norm, rotary, SiLU-and-multiply) replace several PyTorch operators each
and run in decoders at up to FUSED_ROWS tokens (`for_small_ops`).
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from models.kernels import cpu_variants, native_build
from models.kernels import native_interface as c
from models.kernels.cpu_variants import Variant

log = logging.getLogger(__name__)

DISABLE_ENV = "MMSERVE_NATIVE"  # "0" keeps PyTorch's kernels only
SOLO_ENV = "MMSERVE_SOLO_BYTES"
SOLO_BYTES = 1 << 20  # kernels.h team_threads: below it a new team costs more than it saves
DTYPES = {torch.float32: c.DTYPE_F32, torch.bfloat16: c.DTYPE_BF16}
FUSED_ROWS = 64  # fused small ops serve inputs up to this many tokens: a decode step's
NORM_MODES = {"float32": c.NORM_FLOAT32, "reduced": c.NORM_REDUCED,
              "unit_offset": c.NORM_UNIT_OFFSET}
ACTIVATIONS = {"sigmoid": c.ACT_SIGMOID, "silu": c.ACT_SILU, "softplus": c.ACT_SOFTPLUS,
               "exp": c.ACT_EXP, "tanh": c.ACT_TANH, "gelu_tanh": c.ACT_GELU_TANH,
               "gelu": c.ACT_GELU}  # mm_activation's kinds
WEIGHT_KERNELS = {torch.float32: "mm_linear_f32", torch.bfloat16: "mm_linear_bf16",
                  torch.int8: "mm_linear_i8"}  # the int8 one takes a group after the scales


def _scales_group(weight: torch.Tensor, scales: torch.Tensor | None) -> int:
    """The inputs per scale of an int8 weight [N, K] with bfloat16 scales [N] or [N, K / g]."""
    assert scales is not None and scales.dtype == torch.bfloat16, "int8 takes bfloat16 scales"
    assert scales.is_contiguous(), "int8 scales contiguous"
    n, k = weight.shape
    groups = scales.numel() // max(n, 1)
    assert scales.shape[0] == n and groups * n == scales.numel() and groups and k % groups == 0, \
        f"int8 scales {tuple(scales.shape)} for a weight [{n}, {k}]"
    return k // groups


@dataclass(frozen=True)
class NativeStatus:
    """Whether the native kernels are loaded, and how they were built or why not."""

    available: bool
    detail: str


class NativeKernels:
    """Typed calls into the loaded library. Inputs must be contiguous CPU tensors; the kernels
    accumulate in float32."""

    def __init__(self, lib: ctypes.CDLL, build_id: str) -> None:
        """`lib`: the library just opened; its functions are bound here, once."""
        c.bind(lib)
        self.build_id = build_id  # the variant and digest naming the shared object
        self.variant: str = lib.mm_variant().decode()  # the one the library was compiled as
        # A linear whose rows x weight bytes are under this runs on the calling thread alone
        # (kernels.h, team_threads); $MMSERVE_SOLO_BYTES sets it (0: every call on a team).
        self.set_solo_bytes = lib.mm_set_solo_bytes
        self.set_solo_bytes(int(os.environ.get(SOLO_ENV, SOLO_BYTES)))
        self._linear = {dtype: getattr(lib, name) for dtype, name in WEIGHT_KERNELS.items()}
        self._rows, self._gemm, self._gemm_i4 = lib.mm_linear_rows, lib.mm_gemm_dense, \
            lib.mm_gemm_int4
        self._int4 = lib.mm_linear_i4
        self._logits = lib.mm_logits_bf16
        self._dequant_i8, self._dequant_i4 = lib.mm_dequantize_i8, lib.mm_dequantize_i4
        self._gemm_q, self._gemm_q_takes = lib.mm_gemm_quantized, lib.mm_gemm_quantized_takes
        self._norm, self._rotary, self._silu_mul = lib.mm_rms_norm, lib.mm_rotary, lib.mm_silu_mul
        self._activation, self._fit_int4 = lib.mm_activation, lib.mm_fit_int4
        self._argmax, self._read_sum = lib.mm_argmax, lib.mm_read_sum
        self._attention = lib.mm_decode_attention
        self._attention_i8 = lib.mm_decode_attention_i8  # an int8 cache (layers/kv_quant.py)
        self._delta_step = lib.mm_delta_rule_step
        # A decoder's layers in one call, a sparse block's routed experts in one call
        # (models.layers.native_decode and native_experts wrap them).
        self.decode_layers, self.moe_experts = lib.mm_decode_layers, lib.mm_moe_experts
        # Weights in a GGUF file's ggml blocks (cpu/ggml_blocks.c; models.kernels.ggml_blocks
        # wraps them): the integer decode path (x's digits per input, 1 or 2; then nonzero for
        # the plain path even where a vector one is built), the float one it replaced (kept
        # for bench/), the dequantizer.
        self.ggml_linear, self.ggml_dequantize = lib.mm_ggml_linear, lib.mm_ggml_dequantize
        self.ggml_linear_float = lib.mm_ggml_linear_float
        # Q4_K repacked in groups of 8 channels (cpu/ggml_x8.c): whether it pays in this build,
        # and the repacking (the kernels above take GGML_Q4_K_X8 as one more type)
        self.ggml_repack_takes, self.ggml_repack = lib.mm_ggml_repack_takes, lib.mm_ggml_repack

    @staticmethod
    def supports_linear(x_dtype: torch.dtype, weight_dtype: torch.dtype) -> bool:
        return x_dtype in DTYPES and weight_dtype in WEIGHT_KERNELS

    def linear(self, x: torch.Tensor, weight: torch.Tensor,
               scales: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (float32 / bfloat16) . weight [N, K]^T -> [M, N] in x's dtype. An int8
        weight takes bfloat16 `scales`, [N] (one per output channel) or [N, K / group] (one per
        group of inputs, a multiple of 32)."""
        m, k = x.shape
        n = weight.shape[0]
        assert weight.is_contiguous() and weight.shape[1] == k, "weight [N, K], contiguous"
        x = x.contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        weight_args: tuple = (weight.data_ptr(), None if scales is None else scales.data_ptr())
        if weight.dtype == torch.int8:
            weight_args += (_scales_group(weight, scales),)
        status = self._linear[weight.dtype](x.data_ptr(), DTYPES[x.dtype], *weight_args,
                                            y.data_ptr(), m, n, k, torch.get_num_threads())
        if status == 2:
            raise ValueError(f"native linear does not take int8 scales {tuple(scales.shape)} "
                             f"for a weight [{n}, {k}]")
        if status:
            raise MemoryError("native linear: out of memory for the input's float32 copy")
        return y

    def logits(self, x: torch.Tensor, weight: torch.Tensor,
               scales: torch.Tensor | None = None) -> torch.Tensor | None:
        """An LM head's few rows: x [M, K] bfloat16 . weight [N, K]^T (bfloat16, or int8 with
        bfloat16 `scales` as `linear` takes them) -> float32 [M, N], each product exact and the
        sums float32 (models/kernels/cpu/dot_bf16.c); each row's logits the same whatever
        rows share the call. None where this build does not take it (no VDPBF16PS, or K or the
        group not a multiple of 32): the caller runs another formulation."""
        m, k = x.shape
        n = weight.shape[0]
        assert x.dtype == torch.bfloat16, "logits take a bfloat16 x"
        assert weight.is_contiguous() and weight.shape[1] == k, "weight [N, K], contiguous"
        if weight.dtype == torch.bfloat16:
            args: tuple = (weight.data_ptr(), c.DTYPE_BF16, None, k)
        elif weight.dtype == torch.int8:
            args = (weight.data_ptr(), c.DTYPE_I8, scales.data_ptr(),
                    _scales_group(weight, scales))
        else:
            return None
        x = x.contiguous()
        y = torch.empty(m, n, dtype=torch.float32)
        status = self._logits(x.data_ptr(), *args, y.data_ptr(), m, n, k,
                              torch.get_num_threads())
        return None if status else y

    def linear_rows(self, x: torch.Tensor, weight: torch.Tensor,
                    scales: torch.Tensor | None = None) -> torch.Tensor:
        """As `linear`, through register tiles that share their loads among rows of x
        (models/kernels/cpu/linear_rows.c): for tens to hundreds of rows, where `linear`'s
        matrix-vector loop is bound by its loads."""
        return self._tiled(self._rows, "linear_rows", x, weight, scales)

    def gemm(self, x: torch.Tensor, weight: torch.Tensor,
             scales: torch.Tensor | None = None) -> torch.Tensor:
        """As `linear`, through packed panels and register tiles of 6 rows x 2 vectors of
        channels (models/kernels/cpu/gemm_dense.c): for hundreds to thousands of rows."""
        return self._tiled(self._gemm, "gemm", x, weight, scales)

    def gemm_int4(self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
        """As `gemm`, for int4 weights in our pack (models.kernels.int_formats.pack_int4),
        each panel dequantized to float32 as it is packed: x [M, K] -> [M, N] in x's dtype."""
        assert packed.dtype == torch.uint8 and packed.shape[1] * 2 == x.shape[1]
        assert scales_and_zeros.dtype == torch.bfloat16 and scales_and_zeros.is_contiguous()
        return self._product(self._gemm_i4, f"gemm_int4 (group {group_size})", x,
                             packed.shape[0], (packed.data_ptr(), scales_and_zeros.data_ptr(),
                                               group_size))

    def _tiled(self, fn, name: str, x: torch.Tensor, weight: torch.Tensor,
               scales: torch.Tensor | None) -> torch.Tensor:
        assert weight.dtype in WEIGHT_KERNELS, f"weights float32, bfloat16 or int8: {weight.dtype}"
        assert weight.is_contiguous() and weight.shape[1] == x.shape[1], "weight [N, K]"
        int8 = weight.dtype == torch.int8
        return self._product(fn, name, x, weight.shape[0], (
            weight.data_ptr(), DTYPES.get(weight.dtype, c.DTYPE_I8),
            None if scales is None else scales.data_ptr(),
            _scales_group(weight, scales) if int8 else 0))

    @staticmethod
    def _product(fn, name: str, x: torch.Tensor, n: int, weight_args: tuple) -> torch.Tensor:
        """y [M, N] = x [M, K] . W^T through `fn(x, x dtype, *weight_args, y, m, n, k, threads)`
        (our GEMM-like kernels' common signature): 0 done, 1 out of memory, 2 a shape it does
        not take."""
        m, k = x.shape
        x = x.contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        status = fn(x.data_ptr(), DTYPES[x.dtype], *weight_args, y.data_ptr(), m, n, k,
                    torch.get_num_threads())
        if status == 2:
            raise ValueError(f"native {name} does not take a weight [{n}, {k}]")
        if status:
            raise MemoryError(f"native {name}: out of memory for its buffers")
        return y

    def linear_int4(self, x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group_size: int, generic: bool = False) -> torch.Tensor:
        """x [M, K] (float32 / bfloat16) through int4 weights read in place from our pack
        (models.kernels.int_formats.pack_int4): packed [N, K / 2] uint8, scales_and_zeros
        [K / group_size, N, 2] bfloat16. -> [M, N] in x's dtype. `generic` runs the plain-C
        path even where the VNNI one is built (for tests)."""
        m, k = x.shape
        n = packed.shape[0]
        assert packed.dtype == torch.uint8 and packed.shape[1] * 2 == k and n % c.I4_BLOCK_N == 0
        assert packed.is_contiguous() and scales_and_zeros.is_contiguous()
        assert scales_and_zeros.dtype == torch.bfloat16
        assert scales_and_zeros.shape == (k // group_size, n, 2), "scales [K / g, N, 2]"
        x = x.contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        status = self._int4(x.data_ptr(), DTYPES[x.dtype], packed.data_ptr(),
                            scales_and_zeros.data_ptr(), y.data_ptr(), m, n, k, group_size,
                            int(generic), torch.get_num_threads())
        if status:
            raise MemoryError("native int4 linear: out of memory for its activation copies")
        return y

    def gemm_quantized(self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       group_size: int = 0) -> torch.Tensor:
        """x [M, K] (float32 / bfloat16) . W^T for many rows, W int8 [N, K] with bfloat16
        scales [N] or [N, K / group], or int4 in our pack (see linear_int4) with group_size,
        dequantized a cached panel at a time (cpu/gemm_quantized.c). -> [M, N] in x's dtype.
        Raises ValueError for a shape it does not take (`gemm_quantized_takes`)."""
        m, k = x.shape
        assert qweight.dtype in (torch.int8, torch.uint8), "int8, or the uint8 int4 pack"
        int8 = qweight.dtype == torch.int8
        if int8:
            group_size = _scales_group(qweight, scales)
        n = qweight.shape[0]
        assert qweight.is_contiguous() and scales.is_contiguous()
        assert scales.dtype == torch.bfloat16 and qweight.shape[1] * (1 if int8 else 2) == k
        x = x.contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        if m == 0:
            return y
        status = self._gemm_q(x.data_ptr(), DTYPES[x.dtype], qweight.data_ptr(),
                              c.QUANT_INT8 if int8 else c.QUANT_INT4, scales.data_ptr(),
                              group_size, y.data_ptr(), n, m, n, k, torch.get_num_threads())
        if status == 1:
            raise MemoryError("native quantized GEMM: out of memory for its packed rows")
        if status:
            raise ValueError(f"native quantized GEMM does not take K={k}, N={n}, "
                             f"group {group_size}")
        return y

    def gemm_quantized_takes(self, n: int, k: int, int4_group: int | None = None,
                             int8_group: int | None = None) -> bool:
        """Whether gemm_quantized takes a weight [N, K] on this build: int4 of `int4_group`
        inputs per scale, else int8 of `int8_group` (None: one scale per channel)."""
        if int4_group is None:
            return bool(self._gemm_q_takes(n, k, c.QUANT_INT8,
                                           k if int8_group is None else int8_group))
        return bool(self._gemm_q_takes(n, k, c.QUANT_INT4, int4_group))

    def dequantize_int8(self, q: torch.Tensor, scales: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
        """q [N, K] int8 * scales [N] or [N, K / group] (bfloat16) into `out` [N, K]
        (float32 / bfloat16), computed in float32 and rounded once."""
        n, k = q.shape
        assert q.is_contiguous() and out.is_contiguous() and out.shape == (n, k)
        self._dequant_i8(q.data_ptr(), scales.data_ptr(), _scales_group(q, scales),
                         out.data_ptr(), DTYPES[out.dtype], n, k, torch.get_num_threads())
        return out

    def dequantize_int4(self, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                        group_size: int, out: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Output channels first .. first + len(out) - 1 of our int4 pack (see
        linear_int4) into `out` [rows, K] (float32 / bfloat16): (q - 8) * scale + zero computed
        in float32 and rounded once. `first` and the rows are multiples of 64."""
        n, k = packed.shape[0], packed.shape[1] * 2
        rows = out.shape[0]
        assert packed.dtype == torch.uint8 and packed.is_contiguous() and n % c.I4_BLOCK_N == 0
        assert scales_and_zeros.shape == (k // group_size, n, 2)
        assert scales_and_zeros.dtype == torch.bfloat16 and scales_and_zeros.is_contiguous()
        assert out.is_contiguous() and out.shape[1] == k and out.dtype in DTYPES
        block = c.I4_BLOCK_N
        assert first % block == 0 and rows % block == 0 and 0 <= first and first + rows <= n
        self._dequant_i4(packed.data_ptr(), scales_and_zeros.data_ptr(), out.data_ptr(),
                         DTYPES[out.dtype], n, k, group_size, first // block, rows // block,
                         torch.get_num_threads())
        return out

    def fit_int4(self, groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """groups [..., g] float32 -> (scale, low) [...] float32: the int4 grid
        low + q * scale fitted to each group (models/kernels/cpu/fit_int4.c)."""
        x = groups.float().contiguous()
        scale, low = torch.empty(x.shape[:-1]), torch.empty(x.shape[:-1])
        self._fit_int4(x.data_ptr(), scale.numel(), x.shape[-1], scale.data_ptr(),
                       low.data_ptr(), torch.get_num_threads())
        return scale, low

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, mode: str,
                 delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMS norm over x's last dim, in one call; with `delta`, of h = x + delta (rounded to
        the dtype). Returns (h, normed); h is x itself without delta. `mode` (NORM_MODES):
        "float32" scales in float32, "reduced" multiplies the weight by the normed value
        rounded to the dtype, "unit_offset" scales by (1 + weight) in float32, then rounds."""
        assert x.is_contiguous() and weight.dtype == x.dtype and weight.is_contiguous()
        dim = x.shape[-1]
        out = torch.empty_like(x)
        h = x
        if delta is not None:
            assert delta.shape == x.shape and delta.dtype == x.dtype and delta.is_contiguous()
            h = torch.empty_like(x)
        if self._norm(x.data_ptr(), None if delta is None else delta.data_ptr(), h.data_ptr(),
                      weight.data_ptr(), out.data_ptr(), DTYPES[x.dtype], x.numel() // dim, dim,
                      eps, NORM_MODES[mode]):
            raise MemoryError("native rms norm: out of memory for one row in float32")
        return h, out

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] (tokens may be strided, heads contiguous), cos / sin [T, 1, D / 2]
        contiguous in x's dtype -> x rotated, [T, H, D] contiguous."""
        tokens, heads, dim = x.shape
        assert x.stride(2) == 1 and x.stride(1) == dim
        assert cos.shape == sin.shape == (tokens, 1, dim // 2) and cos.dtype == x.dtype
        assert cos.is_contiguous() and sin.is_contiguous()
        out = torch.empty(tokens, heads, dim, dtype=x.dtype)
        self._rotary(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
                     DTYPES[x.dtype], tokens, heads, dim, x.stride(0))
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [rows, 2 * inner] contiguous (gate first)."""
        rows, both = gate_up.shape
        assert gate_up.is_contiguous()
        out = torch.empty(rows, both // 2, dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), DTYPES[gate_up.dtype], rows,
                       both // 2)
        return out

    def activation(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """ACTIVATIONS[kind] of x (contiguous, float32 or bfloat16), each value from its input
        alone (small_ops.c: a row's result does not depend on the rows beside it)."""
        assert x.is_contiguous()
        out = torch.empty_like(x)
        self._activation(x.data_ptr(), out.data_ptr(), DTYPES[x.dtype], x.numel(),
                         ACTIVATIONS[kind])
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, n] float32 -> [rows] int64, as x.argmax(dim=-1) (first of equal values; a
        NaN counts as the largest), on one thread: a greedy step's pick over the vocabulary."""
        assert x.dtype == torch.float32 and x.dim() == 2
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def read_sum(self, x: torch.Tensor) -> float:
        """The sum of a contiguous float32 tensor, read once in a plain streaming loop (a
        memory-bandwidth ruler for the benchmarks)."""
        assert x.dtype == torch.float32 and x.is_contiguous()
        return self._read_sum(x.data_ptr(), x.numel(), torch.get_num_threads())

    def decode_attention(
        self, q: torch.Tensor, kv_cache: torch.Tensor, table: torch.Tensor, key0: torch.Tensor,
        context: torch.Tensor, scale: float, window: int | None, softcap: float | None,
    ) -> torch.Tensor:
        """One query per sequence against its keys in the paged cache (read in place).

        q [B, Hq, D]; kv_cache [2, Hkv, blocks, block_size, D] in q's dtype, or int8 rows
        [..., D + 4] with their scales (models/layers/kv_quant.py); table [B, width] int64 block
        ids, the first holding key position key0[b]; context [B]: keys up to and including the
        query's. Returns [B, Hq, D]."""
        batch, heads, dim = q.shape
        _, kv_heads, num_blocks, block_size, row = kv_cache.shape
        quantized = kv_cache.dtype == torch.int8
        assert kv_cache.is_contiguous() and (quantized or kv_cache.dtype == q.dtype)
        assert row == (dim + 4 if quantized else dim)
        q = q.contiguous()
        out = torch.empty_like(q)
        call = self._attention_i8 if quantized else self._attention
        status = call(
            q.data_ptr(), kv_cache.data_ptr(), out.data_ptr(), DTYPES[q.dtype],
            table.data_ptr(), key0.data_ptr(), context.data_ptr(), batch, heads, kv_heads, dim,
            table.shape[1], num_blocks, block_size, window or 0, scale, softcap or 0.0,
            torch.get_num_threads())
        if status:
            raise MemoryError(f"native decode attention failed (status {status}): out of memory "
                              "for its scores, or a head size over 8192")
        return out


    def delta_rule_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        g: torch.Tensor, beta: torch.Tensor, states: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """One decode step of the gated delta rule, each sequence's state updated in place in
        the pool: q, k [B, H, dk], v [B, H, dv], g, beta [B, H] float32; states [S, H, dk, dv]
        float32; slots [B] int64 -> o [B, H, dv] (models.layers.delta_rule.recurrent_step)."""
        assert states.dtype == torch.float32 and states.is_contiguous()
        q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
        slots = slots.to(torch.int64).contiguous()
        batch, heads, dk = q.shape
        out = torch.empty_like(v)
        status = self._delta_step(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
            states.data_ptr(), slots.data_ptr(), out.data_ptr(), batch, heads, dk, v.shape[-1],
            torch.get_num_threads())
        if status:
            raise ValueError(f"native delta rule step: value heads of {v.shape[-1]} exceed "
                             f"{c.DELTA_MAX_DV}")
        return out


def for_small_ops(x: torch.Tensor) -> NativeKernels | None:
    """The kernels, if x (tokens first: [T, ...]) is an input the fused small ops take: on the
    CPU, float32 or bfloat16, at most FUSED_ROWS tokens (where the operators' dispatch
    outweighs their work)."""
    if x.device.type != "cpu" or x.dtype not in DTYPES or x.shape[0] > FUSED_ROWS:
        return None
    return load()


def load() -> NativeKernels | None:
    """The native kernels of this CPU's variant (or $MMSERVE_CPU_ISA's), built if needed; None
    (logged once, see `status`) when unavailable. A forced variant this CPU cannot run is a
    ValueError that says why."""
    variant = cpu_variants.chosen()
    return load_variant(variant.name if variant else None)


@functools.cache
def load_variant(name: str | None) -> NativeKernels | None:
    """The kernels built for the variant `name` (None: none for this CPU); cached per name."""
    kernels, detail = _load(cpu_variants.BY_NAME[name] if name else None)
    _STATUS[name] = NativeStatus(kernels is not None, detail)
    (log.info if kernels is not None else log.warning)("native CPU kernels: %s", detail)
    return kernels


_STATUS: dict[str | None, NativeStatus] = {}


def status() -> NativeStatus:
    """What `load()` found (loading first if it has not run)."""
    load()
    variant = cpu_variants.chosen()
    return _STATUS[variant.name if variant else None]


def _load(variant: Variant | None) -> tuple[NativeKernels | None, str]:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"disabled by {DISABLE_ENV}=0"
    if variant is None:
        return None, (f"no kernel variant for this CPU ({cpu_variants.machine_arch()}): "
                      "PyTorch's kernels only")
    compiler = native_build.find_compiler()
    if compiler is None:
        return None, "no C compiler found (install gcc, or set CC): PyTorch's kernels only"
    openmp = native_build.openmp_runtime()
    try:
        path, seconds = native_build.build(variant, compiler, openmp)
        kernels = NativeKernels(ctypes.CDLL(str(path)), path.stem.removeprefix("native-"))
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        return None, f"{variant.name} build with {compiler} failed ({e}): PyTorch's kernels only"
    threads = "OpenMP shared with PyTorch" if openmp else "one thread (no OpenMP runtime found)"
    built = f"built in {seconds:.1f} s" if seconds else "cached"
    return kernels, f"{variant.name} variant, {Path(compiler).name}, {threads}, {built}"
