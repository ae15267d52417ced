"""Attention over the paged KV cache, and the per-step metadata that drives it.

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

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from models.kernels import native
from models.layers import kv_quant
from models.layers.attention_varlen import BACKENDS, VarlenBatch, build_varlen, varlen_attention
from models.layers.cross_metadata import CrossAttentionMetadata
from models.layers.lora import AdapterBatch
from models.layers.state_metadata import StateMetadata
from models.layers.transfer import to_device

# A decode bucket's padded work (longest context x members) stays within this factor of the
# sum of its members' contexts.
DECODE_PADDING = 1.25


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


@dataclass
class KeyView:
    """Where one group's keys come from, for the layers of one window size.

    `block_table` [B, nb] lists the blocks to gather (None: the chunk's own new keys, a prefill
    from position 0). `length` cuts the gathered keys when no mask is needed (one sequence);
    `mask` is additive [B, 1, q_len, L] in the model dtype, or None (`causal` says whether
    SDPA's causal kernel applies). Decode views also carry, for the paged kernel, `key0` [B]
    (the position of the first key in block_table[b, 0]) and `context` [B] (keys up to and
    including the query's), int64.
    """

    block_table: torch.Tensor | None
    length: int | None
    mask: torch.Tensor | None
    causal: bool = False
    key0: torch.Tensor | None = None
    context: torch.Tensor | None = None
    # Gathered keys and values [2, Hkv, B * nb, block_size, D], allocated by the first layer
    # and reused by the others (layers run one after another); `gathered_from` is the cache
    # whose blocks it holds (a layer reading another's cache after it finds them gathered).
    workspace: torch.Tensor | None = None
    gathered_from: int | None = None
    # An int8 cache's gathered rows [2, Hkv, B * nb, block_size, D + 4], before dequantizing.
    gathered_int8: torch.Tensor | None = None
    # [R] int64: the gathered rows (of B * nb * block_size) holding no key of their request
    # (past its last key, or in a padding block), zeroed in each gather (gather_blocks).
    unwritten: torch.Tensor | None = None


@dataclass
class AttentionGroup:
    """Queries that attend together: one multi-token chunk, or a bucket of decodes."""

    rows: slice | torch.Tensor  # the group's rows of the flat batch ([B] int64 for decodes)
    num_seqs: int
    q_len: int
    views: dict[int | None, KeyView] = field(default_factory=dict)


@dataclass
class AttentionMetadata:
    """Index tensors for one step (all on the model's device)."""

    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    groups: list[AttentionGroup]
    decode_kernel: str = "sdpa"  # how decode groups attend: one of KERNELS
    varlen: VarlenBatch | None = None  # requests attended by flash-attn's varlen kernel
    # The linear-attention layers' state work (hybrid models; None for the others).
    states: StateMetadata | None = None
    # Which rows the cross-attention layers attend with, to which items (None: no row does).
    cross: CrossAttentionMetadata | None = None
    # Which tokens' linears add which LoRA adapter (models/layers/lora.py; None: none does).
    adapters: AdapterBatch | None = None
    # This step's keys and values of the layers whose cache later layers read (KV sharing), by
    # layer index: filled by those layers during the forward (the decoder sets it to {}).
    shared_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None

    def mask_bytes(self) -> int:
        """Bytes held by the step's masks (distinct tensors counted once)."""
        return _nbytes(v.mask for g in self.groups for v in g.views.values())

    def nbytes(self) -> int:
        """Bytes held by all of the step's metadata tensors (distinct tensors counted once)."""
        tensors = [self.slot_mapping]
        for g in self.groups:
            if isinstance(g.rows, torch.Tensor):
                tensors.append(g.rows)
            for v in g.views.values():
                tensors += [v.mask, v.block_table, v.unwritten]
        if self.varlen is not None:
            tensors += [self.varlen.rows, self.varlen.key_slots]
        return _nbytes(tensors)


def _nbytes(tensors) -> int:
    seen = {id(t): t.numel() * t.element_size() for t in tensors if t is not None}
    return sum(seen.values())


def build_metadata(
    starts: list[int],
    q_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    windows: Sequence[int | None] = (None,),
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
    decode_kernel: str = "sdpa",
    backend: str = "sdpa",
    span_windows: Sequence[int | None] | None = None,
    decode_chunks: Sequence[bool] | None = None,
) -> AttentionMetadata:
    """Host-side construction of the step's attention indices (see the module docstring).

    `windows`: the distinct sliding windows of the model's layers (None for full attention).
    `bidirectional`: per chunk, the absolute [lo, hi) spans inside it whose tokens see each
    other both ways (each lies wholly inside its chunk); only the layers of `span_windows`
    (None: every window) attend them so, the others stay causal. `decode_kernel`: see
    `choose_decode_attention`. `backend` "flash_attn": every request without a bidirectional span
    goes through one varlen call (models/layers/attention_varlen.py), the rest through SDPA groups.
    `decode_chunks`: per chunk, whether its rows attend as decodes (a verification of drafts).
    """
    if decode_kernel not in KERNELS:
        raise ValueError(f"decode_kernel must be one of {KERNELS}, got {decode_kernel!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    slots: list[int] = []
    for start, n, blocks in zip(starts, q_lens, block_tables, strict=True):
        for pos in range(start, start + n):
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    slot_mapping = to_device(torch.tensor(slots, dtype=torch.int64), device)
    spans = bidirectional or [()] * len(starts)
    windows = tuple(dict.fromkeys(windows))
    shape = _Shape(block_size, device, dtype)

    varlen = None
    members = [backend == "flash_attn" and not s for s in spans]
    if any(members):
        varlen = build_varlen(starts, q_lens, block_tables, block_size, device, members)
    groups: list[AttentionGroup] = []
    decodes: list[tuple[int, int, list[int]]] = []  # (row, context length, blocks)
    alone: list[tuple[int, int, list[int]]] = []  # decodes attended as groups of their own
    as_decodes = decode_chunks or [False] * len(starts)
    row = 0
    for start, n, blocks, own_spans, member, verify in zip(
            starts, q_lens, block_tables, spans, members, as_decodes, strict=True):
        if member:  # attended by the varlen kernel
            row += n
            continue
        if n == 1:
            decodes.append((row, start + 1, blocks))
        elif verify:
            into = decodes if decode_kernel == "native" else alone
            into.extend((row + i, start + i + 1, blocks) for i in range(n))
        else:
            group = AttentionGroup(slice(row, row + n), 1, n)
            for w in windows:
                opened = span_windows is None or w in span_windows
                group.views[w] = _chunk_view(shape, start, n, blocks, w,
                                             own_spans if opened else ())
            groups.append(group)
        row += n
    buckets = [[decodes[i] for i in b] for b in _bucket_decodes([d[1] for d in decodes])]
    for members in buckets + [[d] for d in alone]:
        rows = torch.tensor([m[0] for m in members], dtype=torch.int64)
        group = AttentionGroup(to_device(rows, device), len(members), 1)
        for w in windows:
            group.views[w] = _decode_view(shape, [m[1] for m in members], [m[2] for m in members],
                                          w)
        groups.append(group)
    return AttentionMetadata(slot_mapping, row, groups, decode_kernel, varlen)


@dataclass(frozen=True)
class _Shape:
    block_size: int
    device: torch.device
    dtype: torch.dtype


def _first_block(first_query: int, window: int | None, block_size: int) -> int:
    """The first cache block holding a key that the query at `first_query` may see."""
    return 0 if window is None else max(first_query - window + 1, 0) // block_size


def _chunk_view(
    shape: _Shape, start: int, n: int, blocks: list[int], window: int | None,
    spans: Sequence[tuple[int, int]],
) -> KeyView:
    end, bs = start + n, shape.block_size
    binds = window is not None and window < end  # some query cannot see some earlier key
    if start == 0 and not binds and not spans:
        return KeyView(None, None, None, causal=True)
    first = 0 if start == 0 else _first_block(start, window, bs)
    key0 = first * bs
    table = None
    length = end - key0
    if start > 0:
        used = blocks[first : -(-end // bs)]
        table = to_device(torch.tensor(used, dtype=torch.int64)[None], shape.device)
        length = len(used) * bs
    keys = torch.arange(key0, key0 + length)[None, :]
    rows = torch.arange(start, end)[:, None]
    visible = keys <= rows
    for lo, hi in spans:
        if not start <= lo < hi <= end:
            raise ValueError(
                f"bidirectional span [{lo}, {hi}) is not inside chunk [{start}, {end})"
            )
        visible[lo - start : hi - start, lo - key0 : hi - key0] = True
    if window is not None:  # after the spans: a window limits how far back even they see
        visible &= rows - keys < window
    mask = _additive(visible, shape.dtype)[None, None]  # [1, 1, q, L]
    unwritten = None
    if table is not None and end - key0 < length:  # the last block's slots past the chunk
        unwritten = to_device(torch.arange(end - key0, length), shape.device)
    return KeyView(table, None, to_device(mask, shape.device), unwritten=unwritten)


def _decode_view(
    shape: _Shape, contexts: list[int], tables: list[list[int]], window: int | None
) -> KeyView:
    bs = shape.block_size
    firsts = [_first_block(c - 1, window, bs) for c in contexts]
    spans = [-(-c // bs) - f for c, f in zip(contexts, firsts, strict=True)]
    width = max(spans)
    table = torch.zeros(len(contexts), width, dtype=torch.int64)  # padding points at block 0
    for b, (blocks, f, s) in enumerate(zip(tables, firsts, spans, strict=True)):
        table[b, :s] = torch.tensor(blocks[f : f + s], dtype=torch.int64)
    table = to_device(table, shape.device)
    key0 = to_device(torch.tensor(firsts, dtype=torch.int64) * bs, shape.device)
    context = to_device(torch.tensor(contexts, dtype=torch.int64), shape.device)
    binds = window is not None and any(c > window for c in contexts)
    if len(contexts) == 1 and not binds:  # every key up to the query is visible
        return KeyView(table, contexts[0] - firsts[0] * bs, None, key0=key0, context=context)
    keys = torch.tensor(firsts)[:, None] * bs + torch.arange(width * bs)[None, :]
    query = torch.tensor(contexts)[:, None] - 1
    visible = keys <= query
    if window is not None:
        visible &= query - keys < window
    mask = _additive(visible, shape.dtype)[:, None, None]  # [B, 1, 1, L]
    unwritten = (keys > query).view(-1).nonzero().view(-1)  # past each request's last key
    return KeyView(table, None, to_device(mask, shape.device), key0=key0, context=context,
                   unwritten=to_device(unwritten, shape.device) if unwritten.numel() else None)


def _bucket_decodes(contexts: list[int]) -> list[list[int]]:
    """Indices of decodes grouped so each group's padded work stays within DECODE_PADDING."""
    order = sorted(range(len(contexts)), key=lambda i: -contexts[i])
    buckets: list[list[int]] = []
    longest = total = 0
    for i in order:
        c = contexts[i]
        if buckets and longest * (len(buckets[-1]) + 1) <= DECODE_PADDING * (total + c):
            buckets[-1].append(i)
            total += c
        else:
            buckets.append([i])
            longest = total = c
    return buckets


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # Additive, built once per step: a bool mask would be converted by SDPA in every layer.
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


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


KERNELS = ("sdpa", "matmul", "native")


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
