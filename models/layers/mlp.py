"""The gated MLP and the activations our blocks name. In decoders, at a decode step's few rows on
the CPU, SiLU-and-multiply runs as one call of our own kernel (models.kernels.native)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native
from models.kernels.linear import Linear
from models.layers.activations import DECODER_ACTIVATIONS


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu",
                 fused_decode: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        # A decoder's activation at a decode's rows: value by value (models/layers/activations.py)
        self.act = (DECODER_ACTIVATIONS if fused_decode else ACTIVATIONS)[act]
        self.activation = act  # its name (transformers')
        self.fused_decode = fused_decode
        self.fused_silu = fused_decode and act == "silu"  # our kernel at a decode's rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = native.for_small_ops(gate_up) if self.fused_silu and gate_up.dim() == 2 else None
        if fused is not None and gate_up.is_contiguous():
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
