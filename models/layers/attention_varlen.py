"""CUDA with flash-attn installed: every request of a step in one variable-length kernel call.

The step's queries stay flat [T, Hq, D]; each request's context is read from the paged cache
into one flat key/value sequence [total_k, Hkv, D] (one index_select per layer over
`key_slots`), and flash-attn's varlen kernel attends request by request from the cumulative
lengths, causally with bottom-right alignment (a chunk's queries see its whole cached prefix),
with the layer's sliding window and soft-cap. No padding, no masks. Chunks holding a
bidirectional span are left to the SDPA groups (flash-attn has no such mask).

Chosen once at start-up (`choose_backend`); SDPA is the portable fallback.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from models.layers import kv_quant
from models.layers.transfer import to_device

log = logging.getLogger(__name__)

BACKENDS = ("sdpa", "flash_attn")


@dataclass
class VarlenBatch:
    """Host-built indices of the requests that go through the varlen kernel."""

    rows: torch.Tensor  # [Tq] int64: their rows of the flat batch, in order
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    cu_seqlens_k: torch.Tensor  # [B + 1] int32
    max_seqlen_q: int
    max_seqlen_k: int
    key_slots: torch.Tensor  # [total_k] int64: cache slots of every request's context, in order


def build_varlen(
    starts: list[int],
    q_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    members: list[bool],
) -> VarlenBatch | None:
    """The varlen batch of the requests marked in `members` (None when there are none)."""
    rows: list[int] = []
    slots: list[int] = []
    cu_q, cu_k = [0], [0]
    row = 0
    for start, n, blocks, member in zip(starts, q_lens, block_tables, members, strict=True):
        if member:
            rows.extend(range(row, row + n))
            context = start + n
            slots.extend(blocks[p // block_size] * block_size + p % block_size
                         for p in range(context))
            cu_q.append(cu_q[-1] + n)
            cu_k.append(cu_k[-1] + context)
        row += n
    if len(cu_q) == 1:
        return None
    as_device = lambda values, dtype: to_device(torch.tensor(values, dtype=dtype), device)  # noqa: E731
    return VarlenBatch(
        rows=as_device(rows, torch.int64),
        cu_seqlens_q=as_device(cu_q, torch.int32),
        cu_seqlens_k=as_device(cu_k, torch.int32),
        max_seqlen_q=max(b - a for a, b in zip(cu_q, cu_q[1:], strict=False)),
        max_seqlen_k=max(b - a for a, b in zip(cu_k, cu_k[1:], strict=False)),
        key_slots=as_device(slots, torch.int64),
    )


def gather_context(kv_cache: torch.Tensor, batch: VarlenBatch,
                   dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """Every member's context out of the head-major cache -> keys, values [total_k, Hkv, D] in
    `dtype` (an int8 cache's gathered rows dequantized: models/layers/kv_quant.py)."""
    _, num_kv_heads, _, _, row = kv_cache.shape
    flat = kv_cache.view(2, num_kv_heads, -1, row)
    gathered = [flat[i].index_select(1, batch.key_slots).transpose(0, 1) for i in range(2)]
    if kv_quant.is_quantized(kv_cache):
        return tuple(kv_quant.dequantize_rows(g, dtype or torch.float32) for g in gathered)
    return tuple(g.contiguous() for g in gathered)


def varlen_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: VarlenBatch, scale: float,
    sliding_window: int | None, softcap: float | None,
) -> torch.Tensor:
    """The members' queries (rows of q [T, Hq, D]) -> [Tq, Hq, D] through flash-attn."""
    from flash_attn import flash_attn_varlen_func

    keys, values = gather_context(kv_cache, batch, q.dtype)
    # flash-attn's window (left, right): keys at most `left` positions back are visible.
    window = (sliding_window - 1, 0) if sliding_window is not None else (-1, -1)
    return flash_attn_varlen_func(
        q[batch.rows], keys, values, batch.cu_seqlens_q, batch.cu_seqlens_k,
        batch.max_seqlen_q, batch.max_seqlen_k, softmax_scale=scale, causal=True,
        window_size=window, softcap=softcap or 0.0,
    )


def choose_backend(device: torch.device, dtype: torch.dtype) -> str:
    """flash-attn's varlen kernel on CUDA in half precision when it is installed, else SDPA."""
    usable = (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
              and importlib.util.find_spec("flash_attn") is not None)
    backend = "flash_attn" if usable else "sdpa"
    log.info("attention backend: %s", backend)
    return backend
