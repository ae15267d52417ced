"""Per-layer inputs (`per_layer_inputs`, Gemma 4's per-layer embeddings): besides the token
embeddings, every token gets a small input for each decoder layer, the sum of a row of a second
embedding table (token identity, [vocab, layers x P]) and a projection of the token's embedding
(context), which each layer adds through a gate after its MLP.

The table is the largest tensor of such models (262144 x 42 x 256 on Gemma 4 E4B); a step reads
only its tokens' rows (an embedding lookup), and it is not a linear: it is never quantized or
planned, and the engine counts its bytes apart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from models.kernels.linear import Linear
from models.layers.activations import DECODER_ACTIVATIONS
from models.layers.norm import RMSNorm


@dataclass(frozen=True)
class PerLayerInputShape:
    """`vocab_size` rows of `dim` values per layer (`vocab_size_per_layer_input`,
    `hidden_size_per_layer_input`)."""

    vocab_size: int
    dim: int

    def __post_init__(self) -> None:
        if self.vocab_size <= 0 or self.dim <= 0:
            raise ValueError(f"per-layer inputs need a positive vocabulary and size, got "
                             f"{self.vocab_size} x {self.dim}")


class PerLayerInputs(nn.Module):
    """The step's per-layer inputs: token ids [T] and their embeddings [T, H] -> [T, L, P].

    token part: table[id] * sqrt(P); context part: RMSNorm(projection(embeds) / sqrt(H)) per
    layer; the input is their sum / sqrt(2) (the reference's roundings: scales applied in the
    model dtype)."""

    def __init__(self, hidden: int, num_layers: int, shape: PerLayerInputShape, eps: float,
                 float32_scale: bool) -> None:
        super().__init__()
        self.num_layers, self.dim, self.hidden = num_layers, shape.dim, hidden
        self.embed_tokens_per_layer = nn.Embedding(shape.vocab_size, num_layers * shape.dim)
        self.per_layer_model_projection = Linear(hidden, num_layers * shape.dim, bias=False)
        self.per_layer_projection_norm = RMSNorm(shape.dim, eps, float32_scale=float32_scale)

    def table_bytes(self) -> int:
        """Bytes of the embedding table (read a few rows per step, never streamed whole)."""
        weight = self.embed_tokens_per_layer.weight
        return weight.numel() * weight.element_size()

    def forward(self, token_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        t = token_ids.shape[0]
        rows = self.embed_tokens_per_layer(token_ids)  # only the step's tokens' rows
        tokens = rows * torch.tensor(math.sqrt(self.dim), dtype=rows.dtype)
        context = self.per_layer_model_projection(embeds) * self.hidden**-0.5
        context = self.per_layer_projection_norm(context.view(t, self.num_layers, self.dim))
        return (context + tokens.view(t, self.num_layers, self.dim)) * 2**-0.5


class PerLayerInputGate(nn.Module):
    """One layer's use of its input: h [T, H], x [T, P] -> norm(up(act(gate(h)) * x)) [T, H],
    added to the residual stream by the layer."""

    def __init__(self, hidden: int, shape: PerLayerInputShape, act: str, norm: RMSNorm) -> None:
        super().__init__()
        self.per_layer_input_gate = Linear(hidden, shape.dim, bias=False)
        self.per_layer_projection = Linear(shape.dim, hidden, bias=False)
        self.post_per_layer_input_norm = norm
        self.act = DECODER_ACTIVATIONS[act]

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gated = self.act(self.per_layer_input_gate(h)) * x
        return self.post_per_layer_input_norm(self.per_layer_projection(gated))
