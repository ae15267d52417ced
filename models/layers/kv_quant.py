"""Int8 keys and values in the paged KV cache: each token's row of each KV head quantized on its
own, with a float32 scale stored at the end of the row (`kv_cache_dtype="int8"`, engine/config.py).

An int8 cache is laid out as the model-dtype one ([2, Hkv, blocks, block_size, ...], see
models/layers/attention.py) with rows of `head_dim + SCALE_BYTES` int8 bytes: the row's
`head_dim` values, then the four bytes of its float32 scale. Scale and row travel together, so
everything that moves a cache's blocks (a prefix-cache tail's copy, KV sharing, a draft model's
cache) moves the scales with them, and the C decode kernel reads a row and its scale from one
cache line.

A row x [D] is stored as s = max|x| / 127 and q = round(x / s) in [-127, 127] (an all-zero row:
s = 0, q = 0), so |x - q * s| <= s / 2 = max|x| / 254 per element. The division and rounding
run in float32 (round half to even), as the C fused decode step does (cpu/decode_layers.c), so
both write the same bytes.
"""

from __future__ import annotations

import torch

from models.kernels.native_interface import KV_SCALE_BYTES

SCALE_BYTES = KV_SCALE_BYTES  # a float32 scale after each int8 row (as our kernels read it)
QMAX = 127.0


def is_quantized(kv_cache: torch.Tensor) -> bool:
    """Whether a paged cache holds int8 rows with their scales."""
    return kv_cache.dtype == torch.int8


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head size of a paged cache [2, Hkv, blocks, block_size, row]."""
    row = kv_cache.shape[-1]
    return row - SCALE_BYTES if is_quantized(kv_cache) else row


def row_elements(head_dim: int, kv_cache_dtype: str) -> int:
    """Elements of one cache row (one token's keys or values of one head)."""
    return head_dim + SCALE_BYTES if kv_cache_dtype == "int8" else head_dim


def row_bytes(head_dim: int, model_dtype: torch.dtype, kv_cache_dtype: str) -> int:
    """Bytes of one cache row: int8 values and a float32 scale, or the row in the model dtype."""
    if kv_cache_dtype == "int8":
        return head_dim + SCALE_BYTES
    return head_dim * torch.finfo(model_dtype).bits // 8


def storage_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    """The element type of the cache tensor."""
    return torch.int8 if kv_cache_dtype == "int8" else model_dtype


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [..., D + SCALE_BYTES] int8 rows (values, then the float32 scale's bytes)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True) / QMAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe).clamp_(-QMAX, QMAX).to(torch.int8)
    return torch.cat([q, scale.view(torch.int8)], dim=-1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 rows [..., D + SCALE_BYTES] -> [..., D] in `dtype` (values times their scale)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    scale = rows[..., head_dim:].view(torch.float32)  # [..., 1]
    return (rows[..., :head_dim].float() * scale).to(dtype)


def store(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """Write k, v [T, Hkv, D] into the cache's slots [T] (quantized for an int8 cache)."""
    num_kv_heads = k.shape[1]
    slots = kv_cache.view(2, num_kv_heads, -1, kv_cache.shape[-1])  # [2, Hkv, num_slots, row]
    if is_quantized(kv_cache):
        k, v = quantize_rows(k), quantize_rows(v)
    slots[0].index_copy_(1, slot_mapping, k.transpose(0, 1))
    slots[1].index_copy_(1, slot_mapping, v.transpose(0, 1))
