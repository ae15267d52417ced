"""The pre-norm decoder shared by every family, assembled from options named by feature.

GQA attention over the paged cache (models.layers.attention) with q/k/v fused into one matmul, RoPE
from precomputed tables (one per distinct rope setting: Gemma 3's local and global layers use
different bases), RMSNorm, a gated MLP with gate/up fused. Options: bias on q/k/v and on o,
RMSNorm over each head's q and k (`qk_norm`), norms that scale by (1 + w) (`norm_unit_offset`),
norms after attention and MLP as well (`sandwich_norms`), scaled token embeddings
(`embed_scale`), the attention scale, per-layer sliding windows and soft-caps, a final logit
soft-cap, tied or untied LM head. `weight_map` says which checkpoint tensor fills which rows.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from models.interfaces import EncoderItem
from models.kernels.linear import Linear
from models.layers.attention import AttentionMetadata, LayerAttention, paged_attention
from models.layers.basic import GatedMLP, RMSNorm, RotaryTable, apply_rotary
from models.loader import Shard

if TYPE_CHECKING:
    from models.kernels.native_decode import NativeDecode


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

    @property
    def rope(self) -> dict:
        """The first layer's rope setting (models with one setting for every layer)."""
        return self.layer_rope[0]

    @classmethod
    def from_hf(cls, cfg, **features) -> DecoderConfig:
        """Read a transformers text config (LlamaConfig, Qwen2Config, a VLM's text_config).

        Fields every family names alike are read here (Llama's `attention_bias` puts a bias on
        q/k/v and o); `features` set the options a family's config does not spell out, e.g.
        Qwen2's `qkv_bias=True`.
        """
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        heads = cfg.num_attention_heads
        options = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            hidden_act=getattr(cfg, "hidden_act", None) or cfg.hidden_activation,
            layer_rope=layer_rope_from_hf(cfg),
            layer_attention=layer_attention_from_hf(cfg),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            final_logit_softcap=getattr(cfg, "final_logit_softcapping", None),
        )
        options.update(features)
        return cls(**options)


def _layer_kinds(cfg) -> list[str]:
    kinds = getattr(cfg, "layer_types", None)
    if kinds is None:
        window = getattr(cfg, "sliding_window", None)
        kinds = ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
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
        return tuple(dict(rope[kind]) for kind in kinds)
    return (rope,) * len(kinds)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: LayerAttention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        self.layout = layout
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            head_norm = functools.partial(RMSNorm, cfg.head_dim, cfg.rms_norm_eps,
                                          cfg.norm_unit_offset, fused_decode=True)
            self.q_norm, self.k_norm = head_norm(), head_norm()
        self.qk_norm = cfg.qk_norm
        self.kv_cache = torch.empty(0)  # bound by the model runner

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k are adjacent in the fused projection: rotate both heads at once.
        qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(
            paged_attention(q, k, v, self.kv_cache, meta, self.scale, self.layout)
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: LayerAttention, rope_index: int) -> None:
        super().__init__()
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps,
                                 cfg.norm_unit_offset, fused_decode=True)
        self.rope_index = rope_index
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layout)
        # Without sandwich norms this is the norm before the MLP (the checkpoints' naming).
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act,
                            fused_decode=True)

    def forward(self, h, rotary: list, meta: AttentionMetadata) -> torch.Tensor:
        cos, sin = rotary[self.rope_index]
        attn = self.self_attn(self.input_layernorm(h), cos, sin, meta)
        if not self.sandwich:
            h, normed = self.post_attention_layernorm.add_and_norm(h, attn)
            return h + self.mlp(normed)
        h = h + self.post_attention_layernorm(attn)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Decoder(nn.Module):
    """Embeddings, layers, final norm and LM head. Positions are [T] (or [3, T] for mRoPE).

    A `models.interfaces.LanguageModel`; families with encoders subclass it and add `encode`.
    """

    position_rows = 1
    deepstack_layers = 0  # per-layer media residuals each encoder item carries (DeepStack)
    native_decode: NativeDecode | None = None  # set by prepare_decode

    def __init__(self, cfg: DecoderConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        ropes = list({repr(sorted(r.items())): r for r in cfg.layer_rope}.values())
        index = [ropes.index(r) for r in cfg.layer_rope]
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, layout, i)
            for layout, i in zip(cfg.layer_attention, index, strict=True)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset,
                            fused_decode=True)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotaries = [self.make_rotary(max_positions, rope, device) for rope in ropes]

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, max_positions: int, rope: dict, device: torch.device) -> RotaryTable:
        return RotaryTable(self.cfg.head_dim, max_positions, rope, device)

    def rotary_cos_sin(self, rotary: RotaryTable, positions: torch.Tensor, dtype: torch.dtype):
        return rotary.lookup(positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids [T] (or inputs_embeds [T, H]) -> final hidden states [T, H].

        `residuals` (rows [R] int64, values [K, R, H]): added to the rows' hidden states after
        each of the first K layers (DeepStack's per-layer media features)."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rotary = [self.rotary_cos_sin(r, positions, h.dtype) for r in self.rotaries]
        layers_out = None
        if self.native_decode is not None and residuals is None:
            layers_out = self.native_decode.run(h, rotary, meta)  # None: not a step it takes
        if layers_out is not None:
            return self.norm(layers_out)
        for i, layer in enumerate(self.layers):
            h = layer(h, rotary, meta)
            if residuals is not None and i < residuals[1].shape[0]:
                h = h.index_add(0, residuals[0], residuals[1][i].to(h.dtype))
        return self.norm(h)

    def prepare_decode(self) -> bool:
        """Once the KV caches are bound and the linears planned, on the CPU: run the decode
        steps it can take through one native call (models.kernels.native_decode). Whether any
        will."""
        from models.kernels.native_decode import NativeDecode  # it builds on this module's classes

        self.native_decode = NativeDecode.build(self)
        return self.native_decode is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:
            # The reference rounds the scale to the weights' dtype first.
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        return h

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} takes no media")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        logits = self.lm_head(hidden).float()
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn for layer in self.layers]

    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the layers (None: full attention)."""
        return tuple(dict.fromkeys(a.layout.sliding_window for a in self.attention_layers()))

    def weight_map(self, prefix: str = "model.", lm_head: str = "lm_head.") -> Callable:
        """Maps a checkpoint tensor name to (our parameter name, row shard) or None (skip)."""
        q, kv = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size
        inter = self.cfg.intermediate_size
        fused = {
            "q_proj": ("qkv_proj", Shard(0, q)),
            "k_proj": ("qkv_proj", Shard(q, kv)),
            "v_proj": ("qkv_proj", Shard(q + kv, kv)),
            "gate_proj": ("gate_up_proj", Shard(0, inter)),
            "up_proj": ("gate_up_proj", Shard(inter, inter)),
        }
        tied = self.cfg.tie_word_embeddings

        def mapping(name: str) -> tuple[str, Shard | None] | None:
            if name.startswith(lm_head):
                return None if tied else ("lm_head." + name[len(lm_head):], None)
            if not name.startswith(prefix) or name.endswith("rotary_emb.inv_freq"):
                return None
            ours = name[len(prefix):]
            parts = ours.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, shard = fused[parts[-2]]
                return ".".join(parts[:-2] + [target, parts[-1]]), shard
            return ours, None

        return mapping


class CausalLM(Decoder):
    """A text-only causal LM of any family in TEXT_FEATURES (Llama, Mistral, Qwen2/3, Gemma 3)."""

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device) -> CausalLM:
        return cls(DecoderConfig.from_hf(hf_config, **text_features(hf_config)), max_positions,
                   device)

    def checkpoint_map(self) -> Callable:
        return self.weight_map()


QWEN2_FEATURES = {"qkv_bias": True, "o_bias": False}  # bias on q/k/v, none on o


def gemma_features(cfg) -> dict:
    """Gemma 2/3 decoders: (1 + w) norms before and after attention and MLP, qk-norm,
    embeddings scaled by sqrt(hidden), attention scaled by `query_pre_attn_scalar`."""
    return {
        "qk_norm": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": math.sqrt(cfg.hidden_size),
        "attn_scale": cfg.query_pre_attn_scalar**-0.5,
    }


# Options each family's text config does not spell out, by `model_type`; the rest is read from
# the config (DecoderConfig.from_hf). Llama and Mistral need none.
TEXT_FEATURES: dict[str, Callable[[object], dict]] = {
    "llama": lambda cfg: {},
    "mistral": lambda cfg: {},
    "qwen2": lambda cfg: QWEN2_FEATURES,
    "qwen2_vl_text": lambda cfg: QWEN2_FEATURES,
    "qwen2_5_vl_text": lambda cfg: QWEN2_FEATURES,
    "qwen3": lambda cfg: {"qk_norm": True},
    "qwen3_vl_text": lambda cfg: {"qk_norm": True},
    "gemma3_text": gemma_features,
}


def text_features(cfg) -> dict:
    """The feature options of a text config's family (a clear error for unknown families)."""
    if cfg.model_type not in TEXT_FEATURES:
        raise NotImplementedError(
            f"text model type {cfg.model_type!r} is not supported "
            f"({', '.join(sorted(TEXT_FEATURES))})"
        )
    return TEXT_FEATURES[cfg.model_type](cfg)
