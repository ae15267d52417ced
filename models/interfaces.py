"""The seams between the engine and a model family: what each side may ask of the other.

Both sides import this module and nothing of each other's internals. A family provides:
- a **model** (`LanguageModel`, an `nn.Module`) that builds from a Hugging Face config, maps
  checkpoint names to its parameters, runs the decoder over the paged KV cache, declares its
  attention layout per layer, how many rows its positions have (1, or 3 for mRoPE), and, when it
  takes media, `encode`s processed items into embeddings;
- a **processor** (`MultimodalProcessor`, built from a `ProcessorContext`) that turns a
  tokenized prompt and its decoded media (PIL images, `VideoFrames`, `AudioClip`s:
  models/media_inputs.py, as engine.media's loaders make them) into final token ids, one
  `MultiModalFeature` per encoder item (its encoder inputs, its `PlaceholderRange`, its
  content hash) and, for multi-row positions, a `PositionInfo`.
The registry (models/registry.py) pairs them by `architectures[0]`. What the engine reads and
binds on the model's attention and recurrent-state layers, and the metadata a step's forward
takes, are declared in models/layer_interfaces.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from models.checkpoint import CheckpointFiles, Settings
from models.layer_interfaces import ForwardMetadata, KVCacheLayer, RecurrentStateLayer

if TYPE_CHECKING:  # this module stays importable without torch (the bookkeeping uses it)
    import torch

# ---- what a processor hands the engine ---------------------------------------------------------


@dataclass(frozen=True)
class PlaceholderRange:
    """Where one media item sits in the prompt: `length` token positions from `offset`.

    `is_embed` is None when every position receives an encoder embedding; otherwise a mask of
    `length` booleans (structure tokens such as row breaks sit inside the span but keep their
    text embedding). `bidirectional` spans are attended both ways inside themselves (Gemma 3's
    images); the scheduler never cuts a prefill chunk inside one.
    """

    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None
    bidirectional: bool = False
    # For display: labelled consecutive parts of the span, e.g. LLaVA-NeXT's base image then
    # its tiles ((label, length), ...; their lengths add up to `length`), or empty.
    parts: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.is_embed is not None and len(self.is_embed) != self.length:
            raise ValueError(f"is_embed has {len(self.is_embed)} entries for length {self.length}")
        if self.parts and sum(n for _, n in self.parts) != self.length:
            raise ValueError(f"parts {self.parts} do not add up to length {self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        return self.length if self.is_embed is None else sum(self.is_embed)

    def text_offsets(self) -> tuple[int, ...]:
        """Offsets inside the span of the positions that keep their text embeddings."""
        if self.is_embed is None:
            return ()
        return tuple(i for i, embed in enumerate(self.is_embed) if not embed)

    def embeds_before(self, pos: int) -> int:
        """Embed positions of this span that lie before absolute position `pos`."""
        k = min(max(pos - self.offset, 0), self.length)
        return k if self.is_embed is None else sum(self.is_embed[:k])


@dataclass(frozen=True)
class CrossRows:
    """How a cross-attention item is used: token rows [start, end) of the sequence attend to
    its encoder output, `num_keys` key positions, through the model's cross-attention layers
    (`end` None: through the end of the sequence, generated tokens included)."""

    start: int
    end: int | None
    num_keys: int

    def __post_init__(self) -> None:
        if self.num_keys < 1 or self.start < 0 or (self.end is not None and self.end <= self.start):
            raise ValueError(f"invalid cross-attention rows [{self.start}, {self.end}) or "
                             f"key count {self.num_keys}")


@dataclass
class MultiModalFeature:
    """One encoder item of a request: its span, its content hash and its encoder inputs.

    `data` holds the processed encoder inputs (tensors), passed back to the model's `encode`
    as they are. They stay until the request ends, as in vLLM: a request preempted after its
    prompt was computed recomputes it, and its embeddings may have been evicted from the
    encoder cache meanwhile.

    An item's encoder output is either spliced into the prompt (its span's embed positions) or,
    for a model with cross-attention layers, attended by the rows `cross` names: then the
    output is those layers' keys and values, and the span is the item's placeholder token,
    which keeps its text embedding.
    """

    modality: str
    identifier: str
    placeholder: PlaceholderRange
    data: dict[str, Any] | None = None
    # Filled by the engine for the UI: did this item hit the encoder cache?
    cache_hit: bool | None = None
    # For display: the media item this encoder item is part of (the features of one item share
    # it: a video's temporal patches, the frames and sound of a video heard with its sound;
    # None: the identifier's part before ":") and this part's label ("sound 0-2 s"; "": none).
    item: str | None = None
    part: str = ""
    # Cross-attention items: the rows that attend to the item (from its placeholder on), and
    # its key count.
    cross: CrossRows | None = None

    def __post_init__(self) -> None:
        if self.cross is not None and self.cross.start != self.placeholder.offset:
            raise ValueError(f"cross-attention rows start at {self.cross.start}, not at the "
                             f"item's placeholder {self.placeholder.offset}")

    @property
    def encoder_size(self) -> int:
        """What the item's encoder output holds: its embeddings (spliced items) or its key
        positions (cross-attention items); the unit of the encoder cache and budget."""
        return self.placeholder.num_embeds if self.cross is None else self.cross.num_keys

    @property
    def needed_from(self) -> int:
        """The first token whose computation needs the encoder output."""
        return self.placeholder.offset if self.cross is None else self.cross.start

    @property
    def needed_until(self) -> int | None:
        """The token before which the encoder output is last needed (None: while the request
        runs); once its computed tokens pass it, the KV cache holds what the item gave."""
        return self.placeholder.end if self.cross is None else self.cross.end


@runtime_checkable
class PositionInfo(Protocol):
    """Per-request positions of a model whose positions have several rows (mRoPE)."""

    def window(self, start: int, end: int) -> torch.Tensor:
        """Positions int64 [rows, end - start] of sequence indices [start, end), prompt or
        generated."""
        ...


@dataclass
class ProcessedPrompt:
    """What a request needs from processing: final token ids, media items, position data."""

    text: str | None
    token_ids: list[int]
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    position_info: PositionInfo | None = None
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage
    # Token offsets where a chat message starts (prefixes likely to be reused), if known.
    message_starts: tuple[int, ...] = ()


@dataclass(frozen=True)
class PromptPlan:
    """What a prompt will become, computed from the media's sizes before any encoder input is
    built: its length after placeholder expansion, and each encoder item's embeddings."""

    num_tokens: int
    item_embeds: list[tuple[str, int]] = field(default_factory=list)  # (modality, embeddings)


@dataclass(frozen=True)
class ProcessorContext:
    """What a processor is built from."""

    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers tokenizer
    model_path: Path
    model_id: str  # part of every content hash: one model's embeddings never serve another
    processed_cache_items: int  # LRU size for processed encoder inputs (0: off)
    # The most embeddings one item may have: min(encoder_cache_size, max_num_encoder_input_tokens)
    # (per-request options must not make an item that could never be scheduled).
    max_item_embeds: int = 1 << 30
    # The checkpoint's settings files, read where transformers reads them (models/checkpoint.py).
    files: CheckpointFiles = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.files is None:
            object.__setattr__(self, "files", CheckpointFiles(self.model_path))


@runtime_checkable
class MultimodalProcessor(Protocol):
    """Turns a tokenized prompt and its decoded media into what the engine schedules."""

    modalities: tuple[str, ...]

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Options for engine.media's loaders (e.g. how many video frames to sample),
        validated; unknown mm_processor_kwargs are a ValueError."""
        ...

    def max_embeds_per_item(self) -> int:
        """The largest encoder item in embeddings, for the start-up budget check."""
        ...

    def settings(self) -> Mapping[str, Settings]:
        """Every setting read from the checkpoint, by component ("image_processor",
        "processor", ...): its value and the file and field (or class default) it came from."""
        ...

    def max_bidirectional_span(self) -> int:
        """The longest span attended both ways (0: every span is causal)."""
        ...

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        """A text prompt with its placeholders already written out, before tokenizing (for
        families whose reference expands text, so that tokens merge alike); else `text`."""
        ...

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan | None:
        """The expanded prompt's length and items' sizes from the decoded media's sizes alone
        (nothing resized or extracted), so the engine can refuse an oversized prompt before the
        processor allocates; None when the family cannot tell beforehand."""
        ...

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        """Expand each placeholder to its item's token count; one feature per encoder item,
        sorted by offset; position info for multi-row positions."""
        ...


# ---- what the engine asks of a model -----------------------------------------------------------


@dataclass(frozen=True)
class ChunkState:
    """What one chunk of the step does with its request's state (the engine's plan for a
    hybrid model's linear-attention layers; see engine/state_cache.py).

    `slot`: the request's state slot; `restore`: a snapshot id copied into the slot before the
    chunk (a prefix-cache hit), else None; `saves`: (tokens into the chunk, snapshot id) pairs,
    the state after that many of the chunk's tokens is copied to the snapshot."""

    slot: int
    restore: int | None = None
    saves: tuple[tuple[int, int], ...] = ()


EncoderItem = tuple[str, dict[str, Any]]  # (modality, MultiModalFeature.data)
WeightMap = Callable[[str], "tuple[str, Any] | None"]  # checkpoint name -> (ours, row shard)


class TextShape(Protocol):
    """The decoder shape the engine sizes the KV cache and the sampler with."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    embedding_rows: int | None  # token ids with embeddings, when more than vocab_size


@runtime_checkable
class LanguageModel(Protocol):
    """A decoder over the paged KV cache (an nn.Module), optionally fed by encoders."""

    cfg: TextShape
    position_rows: int  # 1, or 3 for mRoPE (then every request carries a PositionInfo)
    deepstack_layers: int  # K: each encoder output is [1 + K, n, H] (DeepStack) when K > 0

    @classmethod
    def from_hf_config(cls, hf_config: Any, max_positions: int, device: torch.device) -> Any:
        """Build the module (on the meta device; weights come from `checkpoint_map`)."""
        ...

    @classmethod
    def tied_head(cls, hf_config: Any) -> tuple[bool, str]:
        """Whether the LM head is tied to the token embeddings as transformers' class decides
        it, and the flag (or rule) that says so."""
        ...

    def checkpoint_map(self) -> WeightMap:
        """Checkpoint tensor name -> (our parameter name, row shard) or None (skip)."""
        ...

    def checkpoint_tensors(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's (name, tensor) pairs as `checkpoint_map` reads them (a tensor that
        holds several of our parameters, such as fused experts, split into views)."""
        ...

    def attention_layers(self) -> Sequence[KVCacheLayer]:
        """One per attention layer, in order: their shapes, how they attend and which cache
        they read; the runner binds each one's `kv_cache` (models/layer_interfaces.py)."""
        ...

    def per_layer_table_bytes(self) -> int:
        """Bytes of weights a step reads only a few rows of besides the token embeddings (a
        per-layer embedding table; 0: none), counted apart in the memory figures."""
        ...

    def state_layers(self) -> Sequence[RecurrentStateLayer]:
        """The layers that keep a recurrent state per sequence instead (a hybrid model's
        linear-attention layers; empty for the others): the runner binds their state pools,
        and they read `meta.states` in the forward (models/layer_interfaces.py)."""
        ...

    def cross_attention_layers(self) -> Sequence[object]:
        """The layers that attend to media items' encoder outputs (empty for the others; the
        engine reads only how many there are): then `encode` returns, per item, their keys and
        values [L, 2, Hkv, n, D], which the runner hands to the forward as `meta.cross`
        (models/layers/cross_attention.py)."""
        ...

    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the layers (None: full attention)."""
        ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> token embeddings [T, H] (what media embeddings are spliced into)."""
        ...

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
        inputs_embeds: torch.Tensor | None = None,
        residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """-> final hidden states [T, H]; positions [T] or [rows, T]; `meta` the step's
        attention, state, cross-attention and LoRA batches; `residuals` (rows [R], values
        [K, R, H]) are added to those rows after each of the first K layers."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        ...

    def prepare_decode(self) -> bool:
        """Called on the CPU once the KV caches are bound and the linears planned: set up what
        the decode steps run through (models.layers.native_decode); whether they take one native
        call (at some row counts)."""
        ...

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Processed items -> embeddings [n_i, H] each ([1 + K, n_i, H] with K DeepStack
        layers; the cross-attention layers' keys and values [L, 2, Hkv, n_i, D] for a model
        with such layers), all in one batched forward per modality; text-only models raise."""
        ...

    @classmethod
    def modality_adapters(cls) -> tuple[tuple[str, str, str], ...]:
        """LoRA adapters the checkpoint ships for its modalities, in order of precedence:
        (adapter name, modality, folder inside the checkpoint); a request without an adapter
        of its own that has media of a listed modality uses the first such adapter (Phi-4-MM:
        images the vision adapter, audio the speech adapter). Empty for most families."""
        ...


@runtime_checkable
class CrossAttentionProbe(Protocol):
    """A language model whose cross-attention probabilities can be read (Whisper: its alignment
    heads, for word timestamps)."""

    def alignment_probabilities(self, input_ids: torch.Tensor, states: torch.Tensor,
                                heads: Sequence[tuple[int, int]]) -> torch.Tensor:
        """input_ids [T], one item's cross-attention keys and values -> the probabilities
        [len(heads), T, n] of each (decoder layer, head)."""
        ...


ProcessorFactory = Callable[[ProcessorContext], MultimodalProcessor]
