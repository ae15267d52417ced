"""What the engine reads and binds on a model's layers, and what it hands the model's forward.

`LanguageModel.attention_layers()` returns `KVCacheLayer`s (the KV pools, the memory plan and the
runner read their shapes and bind their caches), `state_layers()` returns `RecurrentStateLayer`s
(a hybrid model's linear-attention layers: the memory plan binds their state pools, the runner
keeps a verification's accepted state), and every step's forward takes a `ForwardMetadata`:
the paged-attention indices and, beside them, the state, cross-attention and LoRA batches.
The families' own classes (models/layers/decoder_attention.py's `Attention`, gated_deltanet.py's
`GatedDeltaNet`, attention_metadata.py's `AttentionMetadata`) satisfy them by their attributes;
nothing subclasses these. Like models/interfaces.py, which imports it, this module sits below
models/layers/ (it imports none of it) and imports without torch (the annotations are strings).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


class AttentionLayout(Protocol):
    """How one layer attends (models/layers/attention.py's `LayerAttention`)."""

    @property
    def sliding_window(self) -> int | None:
        """A query at position p sees keys k with p - k < sliding_window (None: all)."""
        ...

    @property
    def softcap(self) -> float | None:
        """Scores become softcap * tanh(scores / softcap) before the softmax (None: as
        they are)."""
        ...

    @property
    def bidirectional(self) -> bool:
        """Whether spans marked bidirectional are attended both ways inside themselves."""
        ...


@runtime_checkable
class KVCacheLayer(Protocol):
    """One attention layer over the paged KV cache, as the engine sees it."""

    index: int  # the layer's index in the decoder
    num_kv_heads: int
    head_dim: int
    layout: AttentionLayout
    # The layer whose keys and values it reads (KV sharing: bound to that layer's cache,
    # allocating none), or None: a cache of its own.
    kv_source: int | None
    kv_cache: torch.Tensor  # [2, Hkv, blocks, block_size, row], bound by engine/kv_pool.py


class StateShape(Protocol):
    """The per-sequence recurrent state of one linear-attention layer."""

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(convolution state, recurrent state) shapes of one sequence, without the slot
        dimension the pools add in front."""
        ...

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state (the convolution state in `dtype`, the recurrent
        state in float32)."""
        ...


@runtime_checkable
class RecurrentStateLayer(Protocol):
    """One layer that keeps a recurrent state per sequence instead of KV blocks (a hybrid
    model's linear attention), as the engine sees it. Its pools are [slots or snapshots,
    *shape]; which rows a step uses comes in `ForwardMetadata.states`."""

    shape: StateShape
    recurrence: str  # how decodes step it: one of models.layers.delta_rule.RECURRENCES
    conv_states: torch.Tensor
    recurrent_states: torch.Tensor
    conv_snapshots: torch.Tensor
    recurrent_snapshots: torch.Tensor
    conv_backups: torch.Tensor  # empty until bind_backups
    recurrent_backups: torch.Tensor

    def bind_state(self, conv_states: torch.Tensor, recurrent_states: torch.Tensor,
                   conv_snapshots: torch.Tensor, recurrent_snapshots: torch.Tensor) -> None:
        """Take the slot pools (one row per running sequence) and the prefix-snapshot pools."""
        ...

    def bind_backups(self, conv_backups: torch.Tensor, recurrent_backups: torch.Tensor) -> None:
        """Take the pools where verifications of drafts keep their slots' states before the
        step (speculative decoding)."""
        ...

    def keep_verified(self, kept: list[int]) -> None:
        """After a step that verified drafts: each verification's slot keeps the state after
        its first `kept[i]` tokens (its accepted drafts and the token after them)."""
        ...


@runtime_checkable
class ForwardMetadata(Protocol):
    """One step's metadata, built by the runner on the host from models/layers/' builders and
    read by the layers in the forward (models/layers/attention_metadata.py's `AttentionMetadata`
    is the one implementation; the layers read it by that type). Its parts, each built by its own
    module there and None where the model or the step has none:"""

    # The attention batch (attention.py's build_metadata): where each of the step's T tokens'
    # keys and values go, and which rows attend together over which blocks (`groups`, `varlen`:
    # the layers' business), and how decodes attend.
    slot_mapping: torch.Tensor  # [T] int64
    num_tokens: int
    decode_kernel: str
    # The state batch (state_metadata.py's StateMetadata): the linear-attention layers' slots,
    # snapshots to restore and save, verifications.
    states: object | None
    # The cross-attention batch (cross_metadata.py's CrossAttentionMetadata): which rows
    # attend to which media items' keys and values.
    cross: object | None
    # The LoRA batch (lora.py's AdapterBatch): which tokens' linears add which adapter.
    adapters: object | None
