"""One layer of the pre-norm decoder every family shares, and the options it is assembled from
(`DecoderConfig`, named by feature and read once from a Hugging Face text config).

GQA attention over the paged cache (models.layers.attention) with q/k/v fused into one matmul, RoPE
from the tables the decoder precomputes, RMSNorm, a gated MLP with gate/up fused. Options: bias on
q/k/v and on o, RMSNorm over each head's q and k (`qk_norm`), norms that scale by (1 + w)
(`norm_unit_offset`), norms after attention and MLP as well (`sandwich_norms`), the attention
scale, per-layer sliding windows and soft-caps. The stack of layers is models/layers/decoder.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from models.checkpoint import tie_word_embeddings
from models.kernels.linear import Linear
from models.layers.attention import AttentionMetadata, LayerAttention, paged_attention
from models.layers.mlp import GatedMLP
from models.layers.norm import RMSNorm
from models.layers.rotary import apply_rotary


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
        Qwen2's `qkv_bias=True`. A text-only model's head is tied by `cfg`'s own flag; a
        composite model passes `tie_word_embeddings` as its reference class decides it
        (`Decoder.tied_head`).
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
            tie_word_embeddings=tie_word_embeddings(cfg)[0],
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
