"""The options a decoder is assembled from, named by feature and read once from a Hugging Face
text config: `DecoderConfig`, with per-layer shapes (`LayerShape`), windows and soft-caps
(`layer_attention_from_hf`) and rope settings (`layer_rope_from_hf`). The layers they build are
models/layers/decoder_layer.py and models/layers/decoder_attention.py.

Options: bias on q/k/v and on o, RMSNorm over each head's q and k (`qk_norm`), norms that scale
by (1 + w) (`norm_unit_offset`), norms after attention and MLP as well (`sandwich_norms`), the
attention scale, per-layer sliding windows and soft-caps, RoPE on the first `rotary_dim`
dimensions of each head only, an output gate (`attn_output_gate`: q_proj also emits a per-head
gate, and the attention output is multiplied by its sigmoid), hybrid stacks whose layers mix
tokens by Gated DeltaNet linear attention instead (`layer_mixers`), mixture-of-experts
feed-forward blocks in some or all layers (`moe`). Layers may differ in shape (`layer_shapes`:
KV heads and head size per layer, values that are the keys' projection, a layer that reads
another layer's keys and values instead of computing its own, and `layer_mlp_sizes`), normalize
their values (`v_norm`), scale their output by a learned scalar (`layer_scalar`) and take a
per-layer input (`per_layer_inputs`). Other options are said where they are declared below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.checkpoint import tie_word_embeddings
from models.layers.attention import LayerAttention
from models.layers.gated_deltanet import LinearAttentionShape
from models.layers.moe import MoEShape
from models.layers.per_layer_inputs import PerLayerInputShape


@dataclass(frozen=True)
class LayerShape:
    """One attention layer's shape where the layers of a decoder differ (`layer_shapes`).

    `values_are_keys`: the layer has no value projection, its values are the key projection
    (before the key norm); `kv_source`: the index of an earlier layer whose keys and values
    (its KV cache) this layer reads instead of computing and storing its own; `external_kv`:
    the layer reads keys and values another model stored (a drafter attending its target's
    cache, bound to it by the drafter) and computes none, its rows attending as decodes."""

    num_kv_heads: int
    head_dim: int
    values_are_keys: bool = False
    kv_source: int | None = None
    external_kv: bool = False


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's shape and features, converted once from a Hugging Face text config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    # One rope setting per layer (`rope_parameters` entries; identical dicts share a table).
    layer_rope: tuple[dict, ...] = ()
    # One entry per layer: its sliding window (None: full attention) and logit soft-cap.
    layer_attention: tuple[LayerAttention, ...] = ()
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_logit_softcap: float | None = None
    rotary_dim: int | None = None  # dimensions of each head RoPE rotates (None: all)
    attn_output_gate: bool = False
    # One entry per layer: "attention" or "linear_attention" (None: attention everywhere);
    # the linear layers' shape.
    layer_mixers: tuple[str, ...] | None = None
    linear_attention: LinearAttentionShape | None = None
    # Mixture-of-experts feed-forward blocks: their shape and the layers that have one (the
    # others have the dense MLP of `intermediate_size`).
    moe: MoEShape | None = None
    moe_layers: tuple[int, ...] = ()
    # Token embedding rows when ids past the LM head's vocabulary have embeddings (an image
    # token); None: vocab_size.
    embedding_rows: int | None = None
    # Per-layer shapes (empty: num_kv_heads x head_dim everywhere) and MLP sizes (empty:
    # intermediate_size everywhere).
    layer_shapes: tuple[LayerShape, ...] = ()
    layer_mlp_sizes: tuple[int, ...] = ()
    v_norm: bool = False  # values RMS-normed per head, without a learned scale
    norm_float32_scale: bool = False  # norms multiply their weight in float32, then round
    layer_scalar: bool = False  # each layer's output scaled by a learned scalar (a buffer)
    per_layer_inputs: PerLayerInputShape | None = None
    extra: dict = field(default_factory=dict, compare=False)  # family data, e.g. mrope_section

    def __post_init__(self) -> None:
        for name in ("layer_rope", "layer_attention"):
            n = len(getattr(self, name))
            if n != self.num_layers:
                raise ValueError(f"{name} has {n} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rotary_dim is not None and not (
                0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in "
                             f"(0, head_dim={self.head_dim}]")
        if self.layer_mixers is not None:
            if len(self.layer_mixers) != self.num_layers:
                raise ValueError(f"layer_mixers has {len(self.layer_mixers)} entries for "
                                 f"{self.num_layers} layers")
            unknown = set(self.layer_mixers) - set(MIXERS)
            if unknown:
                raise ValueError(f"unknown layer mixers {sorted(unknown)} (known: {MIXERS})")
            if "linear_attention" in self.layer_mixers and self.linear_attention is None:
                raise ValueError("linear_attention layers need the linear_attention shape")
        if self.moe_layers and self.moe is None:
            raise ValueError("moe_layers need the moe shape")
        if any(not 0 <= i < self.num_layers for i in self.moe_layers):
            raise ValueError(f"moe_layers {self.moe_layers} outside [0, {self.num_layers})")
        if len(self.moe_layers) < self.num_layers and self.intermediate_size <= 0:
            raise ValueError("layers with a dense MLP need intermediate_size > 0")
        if self.embedding_rows is not None and (
                self.embedding_rows < self.vocab_size or self.tie_word_embeddings
                and self.embedding_rows != self.vocab_size):
            raise ValueError(f"embedding_rows={self.embedding_rows} must be >= vocab_size="
                             f"{self.vocab_size}, and equal to it with a tied LM head")
        for name in ("layer_shapes", "layer_mlp_sizes"):
            n = len(getattr(self, name))
            if n not in (0, self.num_layers):
                raise ValueError(f"{name} has {n} entries for {self.num_layers} layers")
        for i in range(self.num_layers):
            self._check_shape(i)

    def _check_shape(self, i: int) -> None:
        shape = self.shape(i)
        if self.num_heads % shape.num_kv_heads:
            raise ValueError(f"layer {i}: num_heads={self.num_heads} is not a multiple of "
                             f"its {shape.num_kv_heads} KV heads")
        src = shape.kv_source
        if src is not None and shape.external_kv:
            raise ValueError(f"layer {i} reads the keys and values of layer {src} and of "
                             "another model (external_kv): one source at most")
        if src is None:
            return
        if not 0 <= src < i or self.shape(src).kv_source is not None:
            raise ValueError(f"layer {i} reads the keys and values of layer {src}, which is not "
                             "an earlier layer with keys and values of its own")
        source = self.shape(src)
        if (source.num_kv_heads, source.head_dim) != (shape.num_kv_heads, shape.head_dim) or (
                self.layer_attention[src] != self.layer_attention[i]):
            raise ValueError(f"layer {i} reads layer {src}'s keys and values but differs from "
                             "it in KV heads, head size or attention window")

    def shape(self, layer: int) -> LayerShape:
        """Layer `layer`'s attention shape."""
        if self.layer_shapes:
            return self.layer_shapes[layer]
        return LayerShape(self.num_kv_heads, self.head_dim)

    def is_kv_source(self, layer: int) -> bool:
        """Whether a later layer reads layer `layer`'s keys and values."""
        return any(s.kv_source == layer for s in self.layer_shapes)

    def mlp_size(self, layer: int) -> int:
        """Layer `layer`'s dense MLP intermediate size."""
        return self.layer_mlp_sizes[layer] if self.layer_mlp_sizes else self.intermediate_size

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward block is a mixture of experts."""
        return layer in self.moe_layers

    def mixer(self, layer: int) -> str:
        """How layer `layer` mixes tokens: one of MIXERS."""
        return "attention" if self.layer_mixers is None else self.layer_mixers[layer]

    @property
    def rope(self) -> dict:
        """The first layer's rope setting (models with one setting for every layer)."""
        return self.layer_rope[0]

    @classmethod
    def from_hf(cls, cfg, **features) -> DecoderConfig:
        """Read a transformers text config (LlamaConfig, Qwen2Config, a VLM's text_config).

        Fields every family names alike are read here (Llama's `attention_bias` puts a bias on
        q/k/v and o); `features` set the options a family's config does not spell out, e.g.
        Qwen2's `qkv_bias=True`. A text-only model's head is tied by `cfg`'s own flag; a
        composite model passes `tie_word_embeddings` as its reference class decides it
        (`Decoder.tied_head`).
        """
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kinds = _layer_kinds(cfg)
        hybrid = "linear_attention" in kinds
        options = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            # Absent where every layer is sparse (Qwen3.5-MoE).
            intermediate_size=getattr(cfg, "intermediate_size", None) or 0,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings(cfg)[0],
            hidden_act=getattr(cfg, "hidden_act", None) or cfg.hidden_activation,
            layer_rope=layer_rope_from_hf(cfg),
            layer_attention=layer_attention_from_hf(cfg),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
            rotary_dim=_rotary_dim(cfg, head_dim),
            layer_mixers=tuple("linear_attention" if k == "linear_attention" else "attention"
                               for k in kinds) if hybrid else None,
            linear_attention=LinearAttentionShape.from_hf(cfg) if hybrid else None,
        )
        options.update(features)
        return cls(**options)


# "cross_attention": the layer attends to media items' keys and values instead
# (models/layers/cross_attention.py).
MIXERS = ("attention", "linear_attention", "cross_attention")


def _rotary_dim(cfg, head_dim: int) -> int | None:
    """Dimensions RoPE rotates: head_dim x `partial_rotary_factor` (in `rope_parameters`, where
    transformers 5 keeps it, or on the config), None when it is the whole head."""
    rope = getattr(cfg, "rope_parameters", None) or {}
    factor = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    if factor is None or int(head_dim * factor) == head_dim:
        return None
    return int(head_dim * factor)


def _layer_kinds(cfg) -> list[str]:
    kinds = getattr(cfg, "layer_types", None)
    if kinds is None:
        window = getattr(cfg, "sliding_window", None)
        kinds = ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
    unknown = set(kinds) - {"sliding_attention", "full_attention", "linear_attention"}
    if unknown:
        raise NotImplementedError(f"layer types {sorted(unknown)} are not supported")
    return list(kinds)


def layer_attention_from_hf(cfg) -> tuple[LayerAttention, ...]:
    """Per-layer windows from `layer_types` ("sliding_attention" layers use `sliding_window`);
    without `layer_types`, a set `sliding_window` applies to every layer (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    return tuple(
        LayerAttention(window if kind == "sliding_attention" else None, softcap)
        for kind in _layer_kinds(cfg)
    )


def layer_rope_from_hf(cfg) -> tuple[dict, ...]:
    """Per-layer rope settings: `rope_parameters` itself, or its entry for the layer's type
    when it is keyed by layer type (Gemma 3: local and global bases)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default"})
    kinds = _layer_kinds(cfg)
    if set(rope) <= {"sliding_attention", "full_attention"}:
        return tuple(dict(rope[kind]) if kind in rope else {"rope_type": "default"}
                     for kind in kinds)
    return (rope,) * len(kinds)
