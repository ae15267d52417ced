"""Attention over the paged KV cache (its metadata: models/layers/attention_metadata.py).

Cache layout per layer: [2, num_kv_heads, num_blocks, block_size, head_dim] (keys, values); an
int8 cache (`kv_cache_dtype="int8"`) has rows of head_dim int8 values and their float32 scale
(models/layers/kv_quant.py), quantized as they are stored and dequantized only in the blocks a
group gathers (our decode kernel reads them in place).
Token t of a request lives in slot `block_ids[t // block_size] * block_size + t % block_size`
of every head. Heads outermost, so that a request's gathered keys are contiguous per head
([Hkv, B, L, D]): the matrix products of attention then read them in place (with tokens
outermost, a strided [L, D] operand measured several times slower on the CPU).

A step's batch is flat: T tokens from B requests, each request contributing a contiguous chunk
of `q_len` tokens that starts at its `start` (tokens before `start` are already in the cache).
The step's cost is the sum of its requests' costs: nothing is padded to another request's
length. `build_metadata` splits the step, on the host, into attention groups:
- every multi-token chunk is a group of its own: its queries against its context, with a mask
  no larger than its own [q_len, context] (none at all for a plain prefill, which runs SDPA's
  causal kernel on the chunk's own keys);
- the single-token chunks (decodes) are batched, bucketed by context length so that padding a
  decode to its bucket's longest context stays within `DECODE_PADDING` of the useful work;
- the chunks of draft tokens a step verifies (speculative decoding: `decode_chunks`) attend as
  that many decodes, row i seeing the keys up to its own position, so that each row's result
  is, to the bit, the one a decode step of that token would compute (with our paged kernel,
  which attends each row by itself, they are batched with the decodes; with the others each
  row is a group of its own, as a lone decode is).
Each group reads only the cache blocks its layers can see: a sliding-window layer starts at the
block holding its first visible key. Keys are gathered from those blocks per layer (PyTorch has
no paged kernel on the CPU); the gather is bounded by the group's own context. Decodes may
instead take our own paged kernel (models.kernels.native), which reads the keys in place, where it
measured faster on this machine (models.layers.decode_attention_choice).

Layers differ in how they attend (`LayerAttention`: sliding window, logit soft-cap), so the
metadata holds one key view per distinct window. Bidirectional spans (media whose tokens see
each other both ways, as Gemma 3's images do) open the mask inside the span; the scheduler keeps
every such span inside one chunk. The forward only slices, gathers and scatters with index
tensors built here (no host sync, no data-dependent Python control flow).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from models.kernels import native
from models.layers import kv_quant
from models.layers.attention_metadata import AttentionGroup, AttentionMetadata, KeyView
from models.layers.attention_varlen import varlen_attention


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends. `sliding_window`: a query at position p sees keys k with
    p - k < sliding_window (transformers' convention; it bounds bidirectional spans too, as
    transformers' Gemma 3 masks do); `softcap`: scores become softcap * tanh(scores / softcap)
    before the softmax."""

    sliding_window: int | None = None
    softcap: float | None = None
    # Whether the layer attends spans marked bidirectional both ways (Gemma 3: every layer;
    # Gemma 4: its sliding-window layers only, the global ones stay causal).
    bidirectional: bool = True

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.softcap is not None and self.softcap <= 0:
            raise ValueError(f"softcap must be > 0, got {self.softcap}")


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: LayerAttention = LayerAttention(),
    store: bool = True,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D], storing k/v in the cache first (unless
    `store` is False: a layer reading the keys and values another layer stored)."""
    num_tokens, num_heads, head_dim = q.shape
    if store:  # quantized for an int8 cache (models/layers/kv_quant.py)
        kv_quant.store(kv_cache, meta.slot_mapping, k, v)

    one = len(meta.groups) == 1 and meta.groups[0].num_seqs == 1 and meta.varlen is None
    if one:  # one request: no scatter
        out = _attend_group(q, k, v, kv_cache, meta.groups[0], scale, layer, meta.decode_kernel)
        return out.reshape(num_tokens, num_heads * head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    if meta.varlen is not None:
        result = varlen_attention(q, kv_cache, meta.varlen, scale, layer.sliding_window,
                                  layer.softcap)
        out.index_copy_(0, meta.varlen.rows, result)
    for group in meta.groups:
        result = _attend_group(q, k, v, kv_cache, group, scale, layer, meta.decode_kernel)
        if isinstance(group.rows, slice):
            out[group.rows] = result
        else:
            out.index_copy_(0, group.rows, result)
    return out.view(num_tokens, num_heads * head_dim)


def _attend_group(q, k, v, kv_cache, group: AttentionGroup, scale: float,
                  layer: LayerAttention, decode_kernel: str) -> torch.Tensor:
    """One group's attention -> [B * q_len, Hq, D] in the order of its rows."""
    view = group.views[layer.sliding_window]
    b, n = group.num_seqs, group.q_len
    num_heads, head_dim = q.shape[1], q.shape[2]
    if n == 1 and decode_kernel == "native" and view.context is not None:
        # Our paged kernel: keys read in place through the block table, no gather.
        return native.load().decode_attention(q[group.rows], kv_cache, view.block_table,
                                              view.key0, view.context, scale,
                                              layer.sliding_window, layer.softcap)
    # [B, Hq, q_len, D]; 4-D inputs let SDPA take its flash kernel on the CPU too (the 3-D
    # form falls back to the math path, ~3x slower with GQA).
    queries = q[group.rows].view(b, n, num_heads, head_dim).transpose(1, 2)
    if view.block_table is None:  # a prefill from position 0: the chunk's own keys
        keys, values = k[group.rows].transpose(0, 1)[None], v[group.rows].transpose(0, 1)[None]
    else:
        keys, values = gather_blocks(kv_cache, view, b, q.dtype)
    kernel = decode_kernel if n == 1 else "sdpa"
    out = attend(queries, keys, values, view.mask, view.causal, scale, layer.softcap, kernel)
    return out.transpose(1, 2).reshape(b * n, num_heads, head_dim)


def gather_blocks(kv_cache: torch.Tensor, view: KeyView, b: int,
                  dtype: torch.dtype | None = None):
    """The view's blocks out of the paged cache -> keys, values [B, Hkv, L, D] (views of a
    head-major [Hkv, B, L, D] workspace) in `dtype` (default: the cache's).

    `index_select` along the block dimension copies whole blocks (several times faster than
    advanced indexing on the CPU), one head at a time, into a workspace the step's layers share.
    A layer reading a cache whose blocks are already there (KV sharing: the cache's own layer
    stored its keys, then gathered them, earlier in this step) gathers nothing. An int8 cache's
    gathered blocks are dequantized to `dtype` there: only the blocks the view reads widen.

    The rows of `view.unwritten` are then zeroed: slots never written hold anything (the pools
    are reserved, not filled: engine/kv_pool.py), NaN included, and a masked score's zero
    probability times a NaN value is NaN. The masks keep them out of the softmax; this keeps
    them out of the products.
    """
    blocks = view.block_table.view(-1)
    _, num_kv_heads, _, block_size, row = kv_cache.shape
    quantized = kv_quant.is_quantized(kv_cache)
    dtype = dtype or kv_cache.dtype
    head_dim = kv_quant.head_dim_of(kv_cache)
    shape = (2, num_kv_heads, blocks.numel(), block_size, head_dim)
    if (view.workspace is None or view.workspace.shape != shape
            or view.workspace.dtype != dtype):
        view.workspace = kv_cache.new_empty(shape, dtype=dtype)
        view.gathered_from = None
    if view.gathered_from != kv_cache.data_ptr():
        into = view.workspace
        if quantized:
            raw = shape[:-1] + (row,)
            if view.gathered_int8 is None or view.gathered_int8.shape != raw:
                view.gathered_int8 = kv_cache.new_empty(raw)
            into = view.gathered_int8
        for i in range(2):
            for h in range(num_kv_heads):
                torch.index_select(kv_cache[i, h], 0, blocks, out=into[i, h])
        if quantized:
            view.workspace.copy_(kv_quant.dequantize_rows(into, dtype))
        if view.unwritten is not None:
            view.workspace.view(2, num_kv_heads, -1, head_dim).index_fill_(2, view.unwritten, 0)
        view.gathered_from = kv_cache.data_ptr()
    keys, values = view.workspace.view(2, num_kv_heads, b, -1, head_dim).transpose(1, 2)
    if view.length is not None:
        keys, values = keys[:, :, : view.length], values[:, :, : view.length]
    return keys, values


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    softcap: float | None = None,
    kernel: str = "sdpa",
) -> torch.Tensor:
    """q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (Hq a multiple of Hkv) -> [B, Hq, Lq, D].

    `mask`: additive, broadcastable to [B, 1, Lq, Lk]; `causal` (without a mask): query i sees
    keys up to i + Lk - Lq. "sdpa" is PyTorch's fused attention; "matmul" is two batched
    matmuls with the query heads of each KV head stacked as rows (no KV copies for GQA) and
    the softmax in float32. Soft-capped scores always take "matmul" (SDPA has no soft-cap).
    """
    if softcap is None and kernel == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
    b, num_heads, lq, d = q.shape
    num_kv_heads, lk = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # Head-major [Hkv, B, ...]: gathered keys are contiguous in that order (see gather_blocks).
    queries = q.reshape(b, num_kv_heads, group * lq, d).transpose(0, 1)
    scores = torch.matmul(queries, k.transpose(0, 1).transpose(-1, -2))
    scores = scores.float() * scale  # [Hkv, B, G * Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(num_kv_heads, b, group, lq, lk)
    if mask is not None:
        scores = scores + mask.transpose(0, 1)[:, :, None]  # [1, B, 1, Lq, Lk]
    elif causal:
        hidden = torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(lk - lq + 1)
        scores = scores.masked_fill(hidden, float("-inf"))
    probs = scores.softmax(-1).to(v.dtype).view(num_kv_heads, b, group * lq, lk)
    out = torch.matmul(probs, v.transpose(0, 1))  # [Hkv, B, G * Lq, D]
    return out.transpose(0, 1).reshape(b, num_heads, lq, d)
