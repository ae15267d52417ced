"""The int8 and int4 weight formats: quantizing a weight, our int4 pack, and back.

int8: symmetric, one scale per `group_size` inputs of each output channel, w ~= q * scale with
q in [-127, 127], scales [N, K / group_size]; where the group does not divide K, one scale per
output channel (scales [N]), the layout PyTorch's int8 kernel (`aten._weight_int8pack_mm`)
takes, which only such a layer offers the plan. With a scale per channel one large weight sets
the step of its whole row: on real weights that rounding alone cost about llama.cpp's q8_0 (a
scale per 32) in KL divergence, a scale per 64 inputs about half of q8_0's (bench.quality).

int4: asymmetric, one scale and zero per `group_size` inputs of each output channel,
w ~= (q - 8) * scale + zero with q in [0, 15], in our own pack (below), the one layout every
build of our kernels reads. Each group's grid is fitted to its weights (fit_int4: least squares
from the min-max grid and a narrower one), not just spread from its minimum to its maximum: on
real weights at group 64 that cut the KL divergence by 22-27% (bench.quality). Scales and
zeros are stored in bfloat16 and q is computed against the rounded values, so dequantizing
reproduces exactly what the kernels compute with.

Our int4 pack: output channels in blocks of 64, each block's inputs in steps of 4,
[N / 64, K / 4, 32, 4] bytes (stored as [N, K / 2]): byte (b, s, d, j) holds q of channel 64b + d
for input 4s + j in its low nibble and of channel 64b + 32 + d in its high one. A channel's four
inputs that an integer dot product sums per 32-bit lane are adjacent, and a vector load covers
consecutive channels, so every build of our kernels (AVX-512 VNNI, AVX2, NEON dot products, plain
C) reads it as stored (models/kernels/cpu/linear_int4.c). PyTorch's own int4 kernel
(`aten._weight_int4pack_mm_for_cpu`) is timed as a candidate where its pack fits the plan's
memory budget (models.kernels.linear_policy); that pack, whose layout PyTorch chooses per CPU
and does not document, is made from q by PyTorch's own `aten._convert_weight_to_int4pack_for_cpu`
when that kernel first runs, and read only by it.
"""

from __future__ import annotations

import torch

from models.kernels import native
from models.kernels.native_interface import FIT_ROUNDS

INT4_BLOCK_N = 64  # our int4 pack interleaves output channels in blocks of 64


def int8_group(in_features: int, group_size: int) -> int:
    """The inputs per int8 scale for a weight of `in_features` inputs: `group_size` where it
    divides them, else the whole row (one scale per output channel)."""
    return group_size if in_features % group_size == 0 else in_features


def quantize_int8(w: torch.Tensor, group_size: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scales bfloat16 [N, K / group_size]); group_size None or K:
    one scale per channel, scales [N]."""
    n, k = w.shape
    g = k if group_size is None else group_size
    if k % g:
        raise ValueError(f"int8 groups of {g} inputs do not divide a row of {k}")
    groups = w.float().reshape(n, k // g, g)
    scales = (groups.abs().amax(dim=-1) / 127).clamp(min=1e-10).to(torch.bfloat16)  # [N, G]
    q = torch.round(groups / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(n, k), (scales[:, 0].contiguous() if g == k else scales)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [N, K] times scales [N] or [N, K / g] -> [N, K] in `dtype`."""
    n, k = q.shape
    s = scales.to(dtype).reshape(n, -1, 1)
    return (q.to(dtype).reshape(n, s.shape[1], -1) * s).reshape(n, k)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 [N, K] in [0, 15], scales_and_zeros bfloat16 [K / g, N, 2]) on the
    grid fit_int4 fits to each group."""
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    step, low = fit_int4(groups)  # [N, G]
    scales = step.clamp(min=1e-10).to(torch.bfloat16)
    zeros = (low + 8 * scales.float()).to(torch.bfloat16)
    s, z = scales.float()[..., None], zeros.float()[..., None]
    q = torch.round((groups - z) / s + 8).clamp(0, 15).to(torch.int32).reshape(n, k)
    scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
    return q, scales_and_zeros


def fit_int4(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """groups [..., g] float32 -> (step, low) [...]: the grid low + q * step (q in [0, 15]) fitted
    to each group by alternating rounding and least squares (models/kernels/cpu/fit_int4.c says
    how), its squared error at most the min-max grid's. By our kernel where it is loaded, else by
    fit_int4_torch."""
    kernels = native.load()
    return kernels.fit_int4(groups) if kernels is not None else fit_int4_torch(groups)


FIT_STARTS = (15.0, 16.0)  # steps range / 15 (the min-max grid) and range / 16
FIT_CHUNK = 1 << 19  # weights fitted at once by fit_int4_torch: its temporaries stay in cache


def fit_int4_torch(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fit_int4 in PyTorch: fit_int4.c's steps, vectorized over groups."""
    g = groups.shape[-1]
    flat = groups.float().reshape(-1, g)
    step, low = torch.empty(flat.shape[0]), torch.empty(flat.shape[0])
    rows = max(1, FIT_CHUNK // g)
    for first in range(0, flat.shape[0], rows):
        x = flat[first:first + rows]
        lo, hi, sx = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), x.sum(-1, keepdim=True)
        extent = hi - lo
        best_s, best_m = extent / FIT_STARTS[0], lo
        best_e = _grid_error(x, best_s, best_m)  # NaN where the extent is 0: nothing beats it
        for start in FIT_STARTS:
            s, m = extent / start, lo
            for _ in range(FIT_ROUNDS):
                q = _grid_q(x, s, m)
                sq, sqq, sqx = q.sum(-1, True), (q * q).sum(-1, True), (q * x).sum(-1, True)
                det = g * sqq - sq * sq  # 0 when every q is equal
                s1 = (g * sqx - sq * sx) / det
                refit = (det > 0) & (s1 > 0)
                s, m = torch.where(refit, s1, s), torch.where(refit, (sx - s1 * sq) / g, m)
            e = _grid_error(x, s, m)
            better = e < best_e
            best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
            best_e = torch.where(better, e, best_e)
        step[first:first + rows], low[first:first + rows] = best_s[:, 0], best_m[:, 0]
    return step.reshape(groups.shape[:-1]), low.reshape(groups.shape[:-1])


def _grid_q(x: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return torch.round((x - low) / step).clamp_(0, 15)


def _grid_error(x: torch.Tensor, step: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    return (_grid_q(x, step, low) * step + low - x).square().sum(-1, True)


def dequantize_int4_values(
    q: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """q [N, K] in [0, 15] -> (q - 8) * scale + zero, [N, K] in `dtype`."""
    n, k = q.shape
    g = k // scales_and_zeros.shape[0]
    sz = scales_and_zeros.transpose(0, 1).to(dtype)  # [N, G, 2]
    values = (q.to(dtype).reshape(n, -1, g) - 8) * sz[..., :1] + sz[..., 1:]
    return values.reshape(n, k)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] in [0, 15] (N a multiple of 64, K of 4) -> our int4 pack [N, K / 2] uint8."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n // INT4_BLOCK_N, 2, INT4_BLOCK_N // 2, k // 4, 4)
    packed = blocks[:, 0] | (blocks[:, 1] << 4)  # [N / 64, 32, K / 4, 4]
    # reshape copies here (the permuted order is not a view of [N, K / 2]): a tensor of its own,
    # not a view whose base would keep the storage alive when the weights move (huge pages).
    return packed.permute(0, 2, 1, 3).reshape(n, k // 2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Our int4 pack [N, K / 2] uint8 back to q [N, K] int32."""
    return _nibbles(packed).reshape(packed.shape[0], -1).to(torch.int32)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Our pack's q values as [N / 64, 2, 32, K] uint8 (channel 64b + 32h + d at [b, h, d])."""
    n, k = packed.shape[0], packed.shape[1] * 2
    steps = packed.reshape(n // INT4_BLOCK_N, k // 4, INT4_BLOCK_N // 2, 4)  # [b, s, d, j]
    halves = torch.stack([steps & 15, steps >> 4], dim=1)  # [b, 2, s, d, j]
    return halves.permute(0, 1, 3, 2, 4).reshape(n // INT4_BLOCK_N, 2, INT4_BLOCK_N // 2, k)


def torch_int4_pack(packed: torch.Tensor) -> torch.Tensor:
    """PyTorch's int4 pack of the same q, made by PyTorch's own op (for its own kernel only)."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_int4(packed), 2)


def dequantize_int4(
    packed: torch.Tensor, scales_and_zeros: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Our int4 pack and its scales straight to (q - 8) * scale + zero, [N, K] in `dtype` (the
    same operations, in the same order, as dequantize_int4_values(unpack_int4(...)), in place
    on one output buffer)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    groups = scales_and_zeros.shape[0]
    out = _nibbles(packed).to(dtype)
    sz = scales_and_zeros.to(dtype).permute(1, 0, 2)  # [N, G, 2]
    values = out.view(n, groups, k // groups)
    values.sub_(8).mul_(sz[..., :1]).add_(sz[..., 1:])
    return values.view(n, k)


def int4_supported(out_features: int, in_features: int, group_size: int) -> bool:
    return out_features % INT4_BLOCK_N == 0 and in_features % group_size == 0  # groups of 4 k
