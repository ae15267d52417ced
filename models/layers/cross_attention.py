"""Decoder layers that attend to media instead of to the sequence (Llama 3.2 Vision's
cross-attention layers), placed among the self-attention layers (`DecoderConfig.layer_mixers`
"cross_attention").

A layer's keys and values come from an item's encoder output, once per item
(`CrossAttention.key_values`, called by the model's `encode`): RMS-normed keys (`k_norm`),
plain values, no positions. The engine caches them by the item's content hash and hands each
step's rows their items' keys and values (models/layers/cross_metadata.py). Queries are
RMS-normed per head (`q_norm`). The layer is pre-norm with tanh-gated residuals:
    h = h + tanh(attn_gate) * o_proj(attention(norm(h)))
    h = h + tanh(mlp_gate) * mlp(post_norm(h))
applied to the rows that attend to some item; the others pass unchanged (their attention and
MLP outputs are zero in Meta's model), and a step without such rows skips the layer.
"""

from __future__ import annotations

import torch
from torch import nn

from models.kernels import native
from models.kernels.linear import Linear
from models.layers.attention import attend
from models.layers.attention_metadata import AttentionMetadata
from models.layers.cross_metadata import CrossSegment
from models.layers.decoder_config import DecoderConfig
from models.layers.mlp import GatedMLP
from models.layers.norm import RMSNorm


class CrossAttention(nn.Module):
    """GQA attention of a chunk's rows over the keys and values of the items they see."""

    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.index = index  # which of the model's cross-attention layers: [L] of the states
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.scale = cfg.attn_scale or cfg.head_dim**-0.5
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q, bias=False)
        self.k_proj = Linear(cfg.hidden_size, kv, bias=False)
        self.v_proj = Linear(cfg.hidden_size, kv, bias=False)
        self.o_proj = Linear(q, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, fused_decode=True)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def key_values(self, states: torch.Tensor) -> torch.Tensor:
        """An item's encoder output [n, H] -> this layer's keys and values [2, Hkv, n, D]."""
        n = states.shape[0]
        k = self.k_norm(self.k_proj(states).view(n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(states).view(n, self.num_kv_heads, self.head_dim)
        return torch.stack([k, v]).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, segments: list[CrossSegment]) -> torch.Tensor:
        """x [R, H] (the attending rows) -> [R, H]."""
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(n, self.num_heads, self.head_dim))
        out = attend_segments(q, segments, self.index, self.num_kv_heads, self.scale)
        return self.o_proj(out.view(n, -1))


def attend_segments(q: torch.Tensor, segments: list[CrossSegment], index: int,
                    num_kv_heads: int, scale: float) -> torch.Tensor:
    """The attending rows' queries q [R, Hq, D] over their segments' keys and values (layer
    `index` of each item's [L, 2, Hkv, n, D]) -> [R, Hq, D]."""
    n, num_heads, head_dim = q.shape
    out = q.new_empty(n, num_heads, head_dim)
    # At a decode step's rows, our paged decode kernel: each row attends by itself, so a
    # row's result does not depend on how many rows share the step (a verification's
    # rows equal decodes of their tokens); the item's keys are one block of the "cache".
    ours = native.for_small_ops(q)
    for seg in segments:
        if len(seg.states) == 1:  # the item's own tensor: no copy
            kv = seg.states[0][index]  # [2, Hkv, n_keys, D]
        else:  # images that follow each other are attended together
            kv = torch.cat([s[index] for s in seg.states], dim=2)
        if ours is not None and kv.dtype == q.dtype and kv.is_contiguous():
            rows, keys = seg.hi - seg.lo, kv.shape[2]
            first = torch.zeros(rows, 1, dtype=torch.int64)
            out[seg.lo : seg.hi] = ours.decode_attention(
                q[seg.lo : seg.hi], kv.view(2, num_kv_heads, 1, keys, head_dim),
                first, first[:, 0], torch.full((rows,), keys), scale, None, None)
            continue
        queries = q[seg.lo : seg.hi].transpose(0, 1)[None]  # [1, Hq, rows, D]
        result = attend(queries, kv[0][None], kv[1][None], None, False, scale)
        out[seg.lo : seg.hi] = result[0].transpose(0, 1)
    return out


class CrossAttentionLayer(nn.Module):
    """A tanh-gated cross-attention layer and its MLP (see the module docstring)."""

    mixer = "cross_attention"
    is_linear = False

    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, fused_decode=True)
        self.cross_attn = CrossAttention(cfg, index)
        self.cross_attn_attn_gate = nn.Parameter(torch.zeros(1))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps,
                                                fused_decode=True)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, cfg.hidden_act,
                            fused_decode=True)
        self.cross_attn_mlp_gate = nn.Parameter(torch.zeros(1))

    def forward(self, h: torch.Tensor, rotary: list, meta: AttentionMetadata,
                per_layer: torch.Tensor | None = None) -> torch.Tensor:
        plan = meta.cross
        if plan is None:  # no row of the step attends to an item
            return h
        x = h if plan.rows is None else h.index_select(0, plan.rows)
        attn = self.cross_attn(self.input_layernorm(x), plan.segments)
        x = x + self.cross_attn_attn_gate.tanh() * attn
        x = x + self.cross_attn_mlp_gate.tanh() * self.mlp(self.post_attention_layernorm(x))
        return x if plan.rows is None else h.index_copy(0, plan.rows, x)
