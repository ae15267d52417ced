"""The paged KV cache's per-layer pools in the element type `kv_cache_dtype` chooses: their
bytes per block (what the KV budget divides by) and their allocation.

"auto" holds keys and values in the model dtype; "int8" holds each token's row of each KV head
as int8 values and a float32 scale (models/layers/kv_quant.py), about half a bfloat16 row and a
quarter of a float32 one, so the same budget holds that many more tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from models.layer_interfaces import KVCacheLayer
from models.layers import kv_quant


def bytes_per_token(layers: Sequence[KVCacheLayer], dtype: torch.dtype,
                    kv_cache_dtype: str) -> int:
    """Keys and values of one token in every layer holding a cache of its own."""
    return sum(2 * a.num_kv_heads * kv_quant.row_bytes(a.head_dim, dtype, kv_cache_dtype)
               for a in layers if a.kv_source is None)


def capacity_gain(layers: Sequence[KVCacheLayer], dtype: torch.dtype,
                  kv_cache_dtype: str) -> float:
    """How many times the tokens of a model-dtype cache the same bytes hold."""
    return bytes_per_token(layers, dtype, "auto") / max(
        bytes_per_token(layers, dtype, kv_cache_dtype), 1)


def allocate(layers: Sequence[KVCacheLayer], num_blocks: int, block_size: int,
             dtype: torch.dtype, kv_cache_dtype: str,
             device: torch.device) -> list[torch.Tensor]:
    """Bind a cache [2, Hkv, num_blocks, block_size, row] to every attention layer with keys
    and values of its own (row: head_dim in the model dtype, or head_dim + 4 int8 bytes); a
    layer reading another's (KV sharing) is bound to that cache. Returns the distinct caches."""
    caches: dict[int, torch.Tensor] = {}
    element = kv_quant.storage_dtype(dtype, kv_cache_dtype)
    for attn in layers:
        if attn.kv_source is not None:
            attn.kv_cache = caches[attn.kv_source]
            continue
        if kv_cache_dtype == "int8" and attn.head_dim % kv_quant.SCALE_BYTES:
            raise ValueError(f"kv_cache_dtype='int8' needs a head size that is a multiple of "
                             f"{kv_quant.SCALE_BYTES}, got {attn.head_dim}")
        row = kv_quant.row_elements(attn.head_dim, kv_cache_dtype)
        shape = (2, attn.num_kv_heads, num_blocks, block_size, row)
        attn.kv_cache = caches[attn.index] = pool(shape, element, device)
    return list(caches.values())


def pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's pool (the one place pools are made): reserved, not written, so that pages
    are taken as blocks are first used. Unwritten slots hold anything (NaN included); the
    padded gathers that read them zero those rows (models/layers/attention.py)."""
    return torch.empty(shape, dtype=dtype, device=device)
