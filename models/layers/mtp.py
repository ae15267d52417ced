"""Multi-token prediction layers (Qwen3.5's and Qwen3-Next's `mtp.*` weights): a drafter that
predicts the token after next from the target's own final hidden state, as vLLM's
Qwen3_5MultiTokenPredictor defines it.

At position i, with h_i the target's final hidden state there (after its final norm) and
x_{i+1} the token that follows:

    e = fc(concat(pre_fc_norm_embedding(embed(x_{i+1})), pre_fc_norm_hidden(h_i)))
    h'_i = norm(layer(e, at position i))        (one full-attention decoder layer)
    logits = the target's LM head (h'_i)         (a guess at x_{i+2})

The embeddings and the LM head are the target's. The layer is the target's full-attention
layer shape (Qwen3.5: gated attention, q / k norms, partial rotary by the target's positions,
mRoPE included; a mixture of experts in MoE models) with keys and values of its own. Drafting
k tokens runs the layer once over the positions the target just computed, then k - 1 more
times on its own output: step j uses layer j mod `mtp_num_hidden_layers` (Qwen3.5 ships one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import torch
from torch import nn

from models.kernels.linear import Linear
from models.layers.attention import LayerAttention
from models.layers.attention_metadata import AttentionMetadata
from models.layers.decoder_config import DecoderConfig
from models.layers.decoder_layer import DecoderLayer
from models.layers.norm import RMSNorm

PREFIX = "mtp."


def mtp_layers(text_config) -> int:
    """How many MTP layers a text config declares (`mtp_num_hidden_layers`; 0: none)."""
    return int(getattr(text_config, "mtp_num_hidden_layers", 0) or 0)


def mtp_config(cfg: DecoderConfig, num_layers: int) -> DecoderConfig:
    """The target's DecoderConfig cut to `num_layers` full-attention layers (the MTP's): the
    target's full-attention layout and rope, its MLP (sparse where the target's are)."""
    full = next(i for i in range(cfg.num_layers) if cfg.mixer(i) == "attention")
    return replace(
        cfg, num_layers=num_layers, layer_rope=(cfg.layer_rope[full],) * num_layers,
        layer_attention=(LayerAttention(None, cfg.layer_attention[full].softcap),) * num_layers,
        layer_mixers=None, linear_attention=None, layer_shapes=(), layer_mlp_sizes=(),
        moe_layers=tuple(range(num_layers)) if cfg.moe_layers else ())


class MultiTokenPredictor(nn.Module):
    """The MTP layers of a target decoder (see the module docstring)."""

    def __init__(self, cfg: DecoderConfig, num_layers: int) -> None:
        super().__init__()
        self.cfg = mtp_config(cfg, num_layers)
        h, eps, unit = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, eps, unit, fused_decode=True)
        self.pre_fc_norm_hidden = RMSNorm(h, eps, unit, fused_decode=True)
        self.layers = nn.ModuleList(DecoderLayer(self.cfg, self.cfg.layer_attention[i], 0, i)
                                    for i in range(num_layers))
        self.norm = RMSNorm(h, eps, unit, fused_decode=True)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary: tuple,
                meta: AttentionMetadata, step: int = 0) -> torch.Tensor:
        """embeds [T, H] (the target's embeddings of the next tokens), hidden [T, H] (its
        final hidden states, or this layer's own output when chaining), rotary (cos, sin) of
        the positions -> [T, H], normed."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)],
                      dim=-1)
        layer = self.layers[step % len(self.layers)]
        return self.norm(layer(self.fc(x), [rotary], meta))

    def attention_layers(self) -> list:
        return [layer.self_attn for layer in self.layers]

    def state_layers(self) -> list:
        return []

    def checkpoint_map(self, decoder_map: Callable) -> Callable:
        """The checkpoint's `mtp.*` names to ours: `decoder_map` is the target decoder's
        weight_map method (models.layers.decoder.Decoder.weight_map), whose fusing of q / k / v
        and gate / up the layers share, called for this module's layers."""
        inner = decoder_map(self, prefix=PREFIX, lm_head="\0")

        def mapping(name: str):
            return inner(name) if name.startswith(PREFIX) else None

        return mapping

    def checkpoint_tensors(self, split: Callable,
                           tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator:
        """The checkpoint's tensors with fused experts split per expert (`split`: the target
        decoder's checkpoint_tensors method, called for this module)."""
        return split(self, tensors)
