"""Attention over the paged KV cache, and the per-step metadata that drives it.

Cache layout per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (keys, values).
Token t of a request lives in slot `block_ids[t // block_size] * block_size + t % block_size`.

A step's batch is flat: T tokens from B requests, each request contributing a contiguous chunk
of `q_len` tokens that starts at its `start` (tokens before `start` are already in the cache).
`build_metadata` turns that into index tensors on the host, moved to the device once; the forward
then only gathers and scatters with them (no host sync, no data-dependent Python control flow).
The chunk's keys and values are first written into their slots (`index_copy_`), then:
- one request with an empty cache (a plain prefill): SDPA's causal kernel on the chunk itself;
- one request with one new token (single-stream decode): its blocks gathered and cut to its
  exact context length, so every key is visible and no mask is needed;
- anything else: each request's blocks gathered into a padded [B, Hkv, L, D] context, the
  queries padded to [B, Hq, max_q, D], SDPA with an additive mask (built once per step, causal
  inside each chunk and open to its cached prefix), rows scattered back to the flat order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.device import to_device


@dataclass
class AttentionMetadata:
    """Index tensors for one step (all on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor | None  # [B, max_blocks] int64 (None on the causal fast path)
    query_pad_index: torch.Tensor | None  # [B * max_q] int64: padded row -> flat token
    output_index: torch.Tensor | None  # [T] int64: flat token -> padded row
    mask: torch.Tensor | None  # [B, 1, max_q, L] additive (0 or -inf), in the model dtype
    num_seqs: int
    max_q: int
    context_len: int | None = None  # single-stream decode: keys to attend, no mask


def build_metadata(
    starts: list[int],
    q_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> AttentionMetadata:
    """Host-side construction of the step's attention indices (see the module docstring)."""
    slots: list[int] = []
    for start, n, blocks in zip(starts, q_lens, block_tables, strict=True):
        for pos in range(start, start + n):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slot_mapping = to_device(torch.tensor(slots, dtype=torch.int64), device)
    num_seqs, max_q = len(q_lens), max(q_lens)
    if num_seqs == 1 and starts[0] == 0:
        return AttentionMetadata(slot_mapping, None, None, None, None, 1, max_q)
    if num_seqs == 1 and max_q == 1:
        length = starts[0] + 1
        table = torch.tensor(block_tables[0][: -(-length // block_size)], dtype=torch.int64)
        return AttentionMetadata(slot_mapping, to_device(table[None], device), None, None, None,
                                 1, 1, context_len=length)

    max_blocks = max(-(-(s + n) // block_size) for s, n in zip(starts, q_lens, strict=True))
    table = torch.zeros(num_seqs, max_blocks, dtype=torch.int64)  # padding points at block 0
    pad_index = torch.zeros(num_seqs, max_q, dtype=torch.int64)
    out_index = torch.empty(sum(q_lens), dtype=torch.int64)
    offset = 0
    for b, (n, blocks) in enumerate(zip(q_lens, block_tables, strict=True)):
        used = blocks[:max_blocks]
        table[b, : len(used)] = torch.tensor(used, dtype=torch.int64)
        pad_index[b, :n] = torch.arange(offset, offset + n)
        out_index[offset : offset + n] = torch.arange(b * max_q, b * max_q + n)
        offset += n
    # Row i of request b may see keys 0..start_b + i. Padded rows see a finite prefix too
    # (never an all-masked row, which would produce NaN) and are discarded afterwards.
    key = torch.arange(max_blocks * block_size)
    row = torch.tensor(starts, dtype=torch.int64)[:, None] + torch.arange(max_q)[None, :]
    visible = (key[None, None, :] <= row[:, :, None])[:, None]  # [B, 1, max_q, L]
    # Additive, built once here: a bool mask would be converted by SDPA in every layer.
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=to_device(table, device),
        query_pad_index=to_device(pad_index.view(-1), device),
        output_index=to_device(out_index, device),
        mask=to_device(mask, device),
        num_seqs=num_seqs,
        max_q=max_q,
    )



def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D], storing k/v in the cache first."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    gqa = num_heads != num_kv_heads

    if meta.block_tables is None:  # one request, empty cache: causal attention on the chunk
        # 4-D inputs: with a batch dimension SDPA takes its flash kernel on the CPU too (the
        # 3-D form falls back to the math path, ~3x slower with GQA).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            is_causal=True, scale=scale, enable_gqa=gqa,
        )  # [1, Hq, T, D]
        return out[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)

    b, max_q = meta.num_seqs, meta.max_q
    ctx_shape = (b, -1, num_kv_heads, head_dim)
    keys = k_cache[meta.block_tables].view(ctx_shape).transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[meta.block_tables].view(ctx_shape).transpose(1, 2)
    if meta.context_len is not None:  # one sequence, one query: every key up to it is visible
        keys, values = keys[:, :, : meta.context_len], values[:, :, : meta.context_len]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, scale=scale, enable_gqa=gqa
        )  # [1, Hq, 1, D]
        return out.reshape(1, num_heads * head_dim)
    queries = q[meta.query_pad_index].view(b, max_q, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=gqa
    )  # [B, Hq, max_q, D]
    out = out.transpose(1, 2).reshape(b * max_q, num_heads * head_dim)
    return out[meta.output_index]
