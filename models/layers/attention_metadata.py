"""The per-step attention metadata (built on the host, before the forward): a step's flat batch
split into attention groups, each with a key view per sliding window (the cache blocks it reads,
its mask, the rows of its gathered blocks that hold no key), as models/layers/attention.py
describes and consumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from models.layers.attention_varlen import BACKENDS, VarlenBatch, build_varlen
from models.layers.cross_metadata import CrossAttentionMetadata
from models.layers.lora import AdapterBatch
from models.layers.state_metadata import StateMetadata
from models.layers.transfer import to_device

# How decode groups may attend (models/layers/attention.py's `attend`, and our paged kernel).
KERNELS = ("sdpa", "matmul", "native")
# A decode bucket's padded work (longest context x members) stays within this factor of the
# sum of its members' contexts.
DECODE_PADDING = 1.25


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
