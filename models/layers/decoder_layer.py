"""One layer of the pre-norm decoder every family shares, assembled from the options of
`DecoderConfig` (models/layers/decoder_config.py, named by feature and read once from a Hugging
Face text config): a token mixer (GQA attention over the paged cache, models/layers/
decoder_attention.py; Gated DeltaNet linear attention in hybrid stacks, `layer_mixers`,
models/layers/gated_deltanet.py; cross-attention to media, models/layers/cross_attention.py),
then a gated MLP with gate/up fused or a mixture-of-experts block (`moe`, models/layers/moe.py),
with RMSNorm before each (scaling by 1 + w with `norm_unit_offset`), and after each as well with
`sandwich_norms`. A layer may scale its output by a learned scalar (`layer_scalar`) and take a
per-layer input (`per_layer_inputs`, models/layers/per_layer_inputs.py). The stack of layers is
models/layers/decoder.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from models.layers.attention import LayerAttention
from models.layers.attention_metadata import AttentionMetadata
from models.layers.decoder_attention import Attention
from models.layers.decoder_config import DecoderConfig
from models.layers.gated_deltanet import GatedDeltaNet
from models.layers.mlp import GatedMLP
from models.layers.moe import SparseMoE
from models.layers.norm import RMSNorm
from models.layers.per_layer_inputs import PerLayerInputGate


class DecoderLayer(nn.Module):
    """Pre-norm token mixer (attention, or linear attention in hybrid stacks) and MLP; with
    `per_layer_inputs`, a gated per-layer input added after them; with `layer_scalar`, the
    output scaled by the layer's learned scalar."""

    def __init__(self, cfg: DecoderConfig, layout: LayerAttention, rope_index: int,
                 index: int = 0) -> None:
        super().__init__()
        norm = functools.partial(RMSNorm, cfg.hidden_size, cfg.rms_norm_eps,
                                 cfg.norm_unit_offset, fused_decode=True,
                                 float32_scale=cfg.norm_float32_scale)
        self.rope_index = rope_index
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = norm()
        self.mixer = cfg.mixer(index)
        self.is_linear = self.mixer == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear_attention,
                                             cfg.rms_norm_eps)
        else:
            self.self_attn = Attention(cfg, layout, index)
        # Without sandwich norms this is the norm before the MLP (the checkpoints' naming).
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp: GatedMLP | SparseMoE
        if cfg.is_sparse(index):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe, cfg.hidden_act)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.mlp_size(index), cfg.mlp_bias,
                                cfg.hidden_act, fused_decode=True)
        self.per_layer_input: PerLayerInputGate | None = None
        if cfg.per_layer_inputs is not None:
            self.per_layer_input = PerLayerInputGate(cfg.hidden_size, cfg.per_layer_inputs,
                                                     cfg.hidden_act, norm())
        if cfg.layer_scalar:
            self.layer_scalar = nn.Parameter(torch.ones(1))
        self.scaled = cfg.layer_scalar

    def forward(self, h, rotary: list, meta: AttentionMetadata,
                per_layer_input: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, H] -> [T, H]; `per_layer_input` [T, P] with `per_layer_inputs`."""
        if self.is_linear:
            attn = self.linear_attn(self.input_layernorm(h), meta.states)
        else:
            cos, sin = rotary[self.rope_index]
            attn = self.self_attn(self.input_layernorm(h), cos, sin, meta)
        if not self.sandwich:
            h, normed = self.post_attention_layernorm.add_and_norm(h, attn)
            h = h + self.mlp(normed)
        else:
            h = h + self.post_attention_layernorm(attn)
            h = h + self.post_feedforward_layernorm(self.feed_forward(h))
        if self.per_layer_input is not None:
            h = h + self.per_layer_input(h, per_layer_input)
        return h * self.layer_scalar if self.scaled else h

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        """The sandwiched feed-forward block before its post-norm (families with a block of
        another shape override this)."""
        return self.mlp(self.pre_feedforward_layernorm(h))
