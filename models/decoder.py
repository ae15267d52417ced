"""The Llama-architecture decoder shared by Llama, Mistral and Qwen2 (and the Qwen VL/Audio LMs).

GQA attention over the paged cache (models.attention), RoPE from precomputed tables, RMSNorm,
SwiGLU, optional qkv bias (Qwen2), tied or untied embeddings, per-layer sliding windows and
attention-logit soft-capping. q/k/v and gate/up are fused into
one matmul each; `weight_map` says which checkpoint tensor fills which rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.attention import AttentionMetadata, LayerAttention, paged_attention
from models.interfaces import EncoderItem
from models.layers import GatedMLP, Linear, RMSNorm, RotaryTable, apply_rotary
from models.loader import Shard


@dataclass(frozen=True)
class DecoderConfig:
    """The decoder's shape, converted once from a Hugging Face text config."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: dict
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    # One entry per layer: its sliding window (None: full attention) and logit soft-cap.
    layer_attention: tuple[LayerAttention, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_attention and len(self.layer_attention) != self.num_layers:
            raise ValueError(
                f"layer_attention has {len(self.layer_attention)} entries for "
                f"{self.num_layers} layers"
            )

    @classmethod
    def from_hf(cls, cfg, *, qwen2_bias: bool = False, tie: bool | None = None):
        """Read a transformers text config (LlamaConfig, Qwen2Config, a VLM's text_config).

        `qwen2_bias`: the Qwen2 layout (bias on q/k/v, none on o); otherwise Llama's
        `attention_bias` (on q/k/v and o).
        """
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        heads = cfg.num_attention_heads
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope=dict(getattr(cfg, "rope_parameters", None) or {"rope_type": "default"}),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(cfg.tie_word_embeddings if tie is None else tie),
            qkv_bias=qwen2_bias or attention_bias,
            o_bias=attention_bias and not qwen2_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            hidden_act=cfg.hidden_act,
            layer_attention=layer_attention_from_hf(cfg),
        )


def layer_attention_from_hf(cfg) -> tuple[LayerAttention, ...]:
    """Per-layer windows from `layer_types` ("sliding_attention" layers use `sliding_window`);
    without `layer_types`, a set `sliding_window` applies to every layer (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    softcap = getattr(cfg, "attn_logit_softcapping", None)
    kinds = getattr(cfg, "layer_types", None)
    if kinds is None:
        kinds = ["sliding_attention" if window else "full_attention"] * cfg.num_hidden_layers
    unknown = set(kinds) - {"sliding_attention", "full_attention"}
    if unknown:
        raise NotImplementedError(f"layer types {sorted(unknown)} are not supported")
    return tuple(
        LayerAttention(window if kind == "sliding_attention" else None, softcap)
        for kind in kinds
    )


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: LayerAttention) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.layout = layout
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.kv_cache = torch.empty(0)  # bound by the model runner

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k are adjacent in the fused projection: rotate both heads at once.
        qk = apply_rotary(qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(
            paged_attention(q, k, v, self.kv_cache, meta, self.scale, self.layout)
        )


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layout: LayerAttention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layout)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act)

    def forward(self, h, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Decoder(nn.Module):
    """Embeddings, layers, final norm and LM head. Positions are [T] (or [3, T] for mRoPE).

    A `models.interfaces.LanguageModel`; families with encoders subclass it and add `encode`.
    """

    position_rows = 1

    def __init__(self, cfg: DecoderConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layouts = cfg.layer_attention or (LayerAttention(),) * cfg.num_layers
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout) for layout in layouts)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary = self.make_rotary(max_positions, device)

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, max_positions: int, device: torch.device) -> RotaryTable:
        return RotaryTable(self.cfg.head_dim, max_positions, self.cfg.rope, device)

    def rotary_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        return self.rotary.lookup(positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids [T] (or inputs_embeds [T, H]) -> final hidden states [T, H]."""
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.rotary_cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, meta)
        return self.norm(h)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} takes no media")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        return self.lm_head(hidden).float()

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
    """A text-only causal LM (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)."""

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device) -> CausalLM:
        qwen2 = hf_config.model_type == "qwen2"
        return cls(DecoderConfig.from_hf(hf_config, qwen2_bias=qwen2), max_positions, device)

    def checkpoint_map(self) -> Callable:
        return self.weight_map()
