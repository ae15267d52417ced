"""The formulations a CPU linear can run, and `Linear`, which runs the one planned for its
input's row count (models.kernel_plan decides by measurement; models.kernel_choice keeps the
bookkeeping).

Dense weights: F.linear; (W @ x^T)^T; torch.mv for one row; oneDNN with the weight prepacked
once (kept beside the dense weight, so choosing it costs that memory again); our own
matrix-vector kernel (models.native) for a few rows. Quantized weights (models.quantization):
PyTorch's int kernel, ours, or a dense GEMM on the weight dequantized per call (many rows are
compute-bound, where the int kernels are slower; our dequantizer where it builds), for a float32
model also in bfloat16.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models import native
from models.kernel_choice import BASELINE, bucket_index

Kernel = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _onednn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")


def _dequantized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    kernels = native.load()
    if kernels is None or x.dtype not in native.DTYPES:
        return F.linear(x, layer.dequantize(x.dtype))
    # Ours writes into one buffer reused by every layer (it stays in the last-level cache for
    # the GEMM that follows, and costs no fresh pages per call).
    n, k = layer.out_features, layer.in_features
    buffer = _scratch(n * k, x.dtype)
    if layer.mode == "int8":
        weight = kernels.dequantize_int8(layer.qweight, layer.scales, buffer.view(n, k))
        return F.linear(x, weight)
    weight_t = kernels.dequantize_int4_transposed(layer.qweight, layer.scales,
                                                  layer.group_size, buffer.view(k, n))
    return x @ weight_t


def _dequantized_bf16(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A float32 model's quantized linear as a bfloat16 GEMM (what the int kernels compute in
    anyway): faster where the CPU multiplies bfloat16 natively, slower where it does not."""
    return _dequantized(layer, x.to(torch.bfloat16)).to(x.dtype)


_SCRATCH = threading.local()
SCRATCH_BYTES = 64 << 20  # a larger weight (an LM head) is dequantized into a buffer of its own


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's dequantization buffer of `dtype`, at least `numel` long (grown, never
    shrunk, up to SCRATCH_BYTES: the decoder layers' largest weight); past that a fresh one,
    so that a huge head's dequantized copy is not kept for the life of the process."""
    if numel * dtype.itemsize > SCRATCH_BYTES:
        return torch.empty(numel, dtype=dtype)
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def _native(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return native.load().linear(x, layer.weight)


def _native_quantized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if layer.mode == "int8":
        return native.load().linear(x, layer.qweight, layer.scales)
    return native.load().linear_int4(x, layer.qweight, layer.scales, layer.group_size)


KERNELS: dict[str, Kernel] = {
    BASELINE: lambda layer, x: F.linear(x, layer.weight),
    "matmul_t": lambda layer, x: (layer.weight @ x.t()).t(),  # a view of [out, rows]
    "mv": lambda layer, x: torch.mv(layer.weight, x[0]).unsqueeze(0),
    "onednn": _onednn,
    "native": _native,
}
QUANTIZED_KERNELS: dict[str, Kernel] = {
    "int_kernel": lambda layer, x: layer.int_mm(x),  # the baseline of quantized layers
    "dequantized": _dequantized,
    "dequantized_bf16": _dequantized_bf16,
    "native": _native_quantized,
}


def run_kernel(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """y = x W^T + b through the layer's planned formulation for x's row count (a host-side
    shape: choosing costs no sync). Dense inputs other than 2-D CPU tensors use F.linear."""
    quantized = layer.is_quantized
    if x.dim() != 2:
        if quantized:
            lead = x.shape[:-1]
            return run_kernel(layer, x.reshape(-1, x.shape[-1])).reshape(*lead, -1)
        return F.linear(x, layer.weight, layer.bias)
    if x.device.type != "cpu" and not quantized:
        return F.linear(x, layer.weight, layer.bias)
    plan = layer.kernels
    if quantized:
        name = "int_kernel" if plan is None else plan[bucket_index(x.shape[0])]
        out = QUANTIZED_KERNELS[name](layer, x)
    else:
        name = BASELINE if plan is None else plan[bucket_index(x.shape[0])]
        out = KERNELS[name](layer, x)
    return out if layer.bias is None else out + layer.bias


class Linear(nn.Linear):
    """nn.Linear that runs, on the CPU, the formulation planned for its input's row-count
    bucket (`kernels`: one name of KERNELS per models.kernel_choice.BUCKETS; None: F.linear).
    A (W @ x^T)^T result is a transposed view, which the following ops accept."""

    is_quantized = False
    kernels: tuple[str, ...] | None = None
    packed: torch.Tensor | None = None  # the oneDNN-prepacked weight, when planned

    @property
    def format(self) -> str:
        return "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_kernel(self, x)
