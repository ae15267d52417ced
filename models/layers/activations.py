"""Activations at a decode step's rows computed value by value, so that a row's result does not
depend on the rows beside it.

PyTorch computes an elementwise exp, sigmoid, tanh or GELU with vector code for most values of a
buffer and scalar code for the rest (a vector loop's tail, the end of a thread's share), and the
two round differently in the last bits; which values fall where moves with the step's row
count. At up to FUSED_ROWS rows on the CPU `rowwise` runs our kernel instead
(models/kernels/cpu/small_ops.c, mm_activation), whose every value is computed from its own
input alone: a verification's rows (speculative decoding) then equal decodes of their tokens to
the bit. Elsewhere (prefill chunks, accelerators) PyTorch's operators run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels import native

TORCH = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "exp": torch.exp,
    "tanh": torch.tanh,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


def rowwise(kind: str, x: torch.Tensor) -> torch.Tensor:
    """`kind` (one of TORCH) of x [T, ...]: our kernel at a decode step's rows, else PyTorch's."""
    kernels = native.for_small_ops(x) if x.dim() > 0 else None
    if kernels is None:
        return TORCH[kind](x)
    return kernels.activation(x.contiguous(), kind)


# The decoders' MLP activations (transformers' names) through `rowwise`.
DECODER_ACTIVATIONS = {
    "silu": lambda x: rowwise("silu", x),
    "gelu": lambda x: rowwise("gelu", x),
    "gelu_pytorch_tanh": lambda x: rowwise("gelu_tanh", x),
    "quick_gelu": lambda x: x * rowwise("sigmoid", 1.702 * x),
}
