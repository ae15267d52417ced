"""The formulations a CPU linear can run, and `Linear`, which runs the one planned for its
input's row count (models.kernels.linear_choice decides by measurement; models.kernels.choice
keeps the bookkeeping).

Dense weights: F.linear; (W @ x^T)^T; torch.mv for one row; oneDNN with the weight prepacked
once (kept beside the dense weight, so choosing it costs that memory again); our own
matrix-vector kernel (models.kernels.native) for a few rows, our register-tiled one for
tens to hundreds (also for int8 weights) and our packed-panel GEMM for more (also for int8 and
int4 weights, dequantized panel by panel); for bfloat16 weights, a float32
GEMM on tiles of the weight widened in cache (CPUs without bfloat16 arithmetic). Quantized weights
(models.kernels.quantization): PyTorch's int kernel, ours, a dense GEMM on the weight dequantized
per call (many rows are compute-bound, where the int kernels are slower; our dequantizer where it
builds), also in the other of float32 and bfloat16, or our GEMM that dequantizes a panel at a
time in cache (no dequantized copy written out and read back)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native
from models.kernels.choice import BASELINE, bucket_index
from models.kernels.ggml_blocks import BlockLinear

Kernel = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def _onednn(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [], "")


def prepack_onednn(layer: nn.Module) -> None:
    """Keep oneDNN's prepacked copy of a dense layer's weight in `packed` (once), which the
    "onednn" formulation reads."""
    if layer.packed is None:
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)


def _dequantized(layer: nn.Module, x: torch.Tensor, weight_first: bool) -> torch.Tensor:
    """A dense GEMM on the weight dequantized per call: x W^T (`weight_first` False) or
    (W x^T)^T, a transposed view (as "matmul_t": some GEMMs take a plain left operand without
    repacking it). Ours dequantizes a tile of output channels at a time into a reused buffer,
    which stays in the last-level cache for the GEMM that reads it."""
    kernels = native.load()
    if kernels is None or x.dtype not in native.DTYPES:
        weight = layer.dequantize(x.dtype)
        return (weight @ x.t()).t() if weight_first else F.linear(x, weight)
    n, k = layer.out_features, layer.in_features
    tiles = dequantization_tiles(n, k, x.dtype)
    buffer = _scratch((tiles[0][1] - tiles[0][0]) * k, x.dtype)

    def weight(first: int, last: int) -> torch.Tensor:
        out = buffer[: (last - first) * k].view(last - first, k)
        if layer.mode == "int8":
            return kernels.dequantize_int8(layer.qweight[first:last], layer.scales[first:last],
                                           out)
        return kernels.dequantize_int4(layer.qweight, layer.scales, layer.group_size, out,
                                       first)

    if len(tiles) == 1:
        w = weight(0, n)
        return (w @ x.t()).t() if weight_first else F.linear(x, w)
    if weight_first:
        out = torch.empty(n, x.shape[0], dtype=x.dtype)
        for first, last in tiles:
            torch.mm(weight(first, last), x.t(), out=out[first:last])
        return out.t()
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for first, last in tiles:
        out[:, first:last] = F.linear(x, weight(first, last))
    return out


# A weight dequantized per call is dequantized in tiles of output channels:
TILE_BYTES = 4 << 20  # bytes of a dequantized tile: well inside a last-level cache
# tiles start on a block of the int4 pack (models.kernels.int_formats.INT4_BLOCK_N channels)
TILE_CHANNEL_BLOCK = 64
MIN_TILE_CHANNELS = 1024  # thinner tiles make thin GEMMs (a long-k weight is dequantized whole)


def dequantization_tiles(n: int, k: int, dtype: torch.dtype) -> list[tuple[int, int]]:
    """(first, last) output channels of each tile a weight [n, k] is dequantized in: equal
    tiles of about TILE_BYTES, no thinner than MIN_TILE_CHANNELS, in whole blocks of
    TILE_CHANNEL_BLOCK."""
    count = max(1, min(n * k * dtype.itemsize // TILE_BYTES, n // MIN_TILE_CHANNELS))
    channels = -(-n // count)  # ceil(n / count), rounded up to whole blocks
    channels = -(-channels // TILE_CHANNEL_BLOCK) * TILE_CHANNEL_BLOCK
    return [(first, min(n, first + channels)) for first in range(0, n, channels)]


def _in_dtype(kernel: Kernel, dtype: torch.dtype) -> Kernel:
    """A quantized linear's GEMM computed in `dtype` whatever the model's: a float32 model's in
    bfloat16 (what the int kernels compute in anyway: faster where the CPU multiplies bfloat16
    natively), a bfloat16 model's in float32 (faster where it does not: PyTorch's bfloat16 GEMM
    widens as it goes, far below the float32 one)."""
    return lambda layer, x: kernel(layer, x.to(dtype)).to(x.dtype)


_SCRATCH = threading.local()


def _scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's dequantization buffer of `dtype`, at least `numel` long (grown, never
    shrunk: one tile, at most about TILE_BYTES)."""
    buffers = _SCRATCH.__dict__.setdefault("buffers", {})
    buffer = buffers.get(dtype)
    if buffer is None or buffer.numel() < numel:
        # A plain tensor even when first made under inference_mode (the engine's), so that a
        # later call outside it may still write into it.
        with torch.inference_mode(False):
            buffer = buffers[dtype] = torch.empty(numel, dtype=dtype)
    return buffer[:numel]


def _native(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return native.load().linear(x, layer.weight)


def _native_rows(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if layer.is_quantized:
        assert layer.mode == "int8", "the tiled kernel takes int8, not our int4 pack"
        return native.load().linear_rows(x, layer.qweight, layer.scales)
    return native.load().linear_rows(x, layer.weight)


def _native_gemm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if not layer.is_quantized:
        return native.load().gemm(x, layer.weight)
    if layer.mode == "int8":
        return native.load().gemm(x, layer.qweight, layer.scales)
    return native.load().gemm_int4(x, layer.qweight, layer.scales, layer.group_size)


def _widened(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """bfloat16 weights through a float32 GEMM: each tile of output channels widened into a
    reused float32 buffer (a shift per element, in cache), x widened once, the result rounded
    back. Where the CPU has no bfloat16 arithmetic (AVX2), PyTorch's bfloat16 GEMM converts far
    more slowly, and this keeps the weights bfloat16 in memory at float32's speed."""
    n, k = layer.out_features, layer.in_features
    xf = x.float()
    tiles = dequantization_tiles(n, k, torch.float32)
    buffer = _scratch((tiles[0][1] - tiles[0][0]) * k, torch.float32)

    def weight(first: int, last: int) -> torch.Tensor:
        return buffer[: (last - first) * k].view(last - first, k).copy_(
            layer.weight.detach()[first:last])

    if len(tiles) == 1:
        return F.linear(xf, weight(0, n)).to(x.dtype)
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    for first, last in tiles:
        out[:, first:last] = F.linear(xf, weight(first, last))
    return out.to(x.dtype)


def _panel_gemm(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return native.load().gemm_quantized(x, layer.qweight, layer.scales, layer.group_size)


def _native_quantized(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if layer.mode == "int8":
        return native.load().linear(x, layer.qweight, layer.scales)
    return native.load().linear_int4(x, layer.qweight, layer.scales, layer.group_size)


def _matmul_t(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(W @ x^T)^T, a view of [out, rows]; the bias goes into the GEMM (a broadcast column),
    since adding it to the transposed view afterwards is a strided pass over the output."""
    if layer.bias is None:
        return (layer.weight @ x.t()).t()
    return torch.addmm(layer.bias.unsqueeze(1), layer.weight, x.t()).t()


def _with_bias(kernel: Kernel) -> Kernel:
    """A kernel that computes x W^T, followed by the bias."""
    def run(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = kernel(layer, x)
        return out if layer.bias is None else out + layer.bias
    return run


# Dense formulations: each computes x W^T + b, the bias fused where the formulation allows
# (the plan times them so, bias included).
KERNELS: dict[str, Kernel] = {
    BASELINE: lambda layer, x: F.linear(x, layer.weight, layer.bias),
    "matmul_t": _matmul_t,
    "mv": lambda layer, x: (torch.mv(layer.weight, x[0]) if layer.bias is None else
                            torch.addmv(layer.bias, layer.weight, x[0])).unsqueeze(0),
    "onednn": _with_bias(_onednn),
    "native": _with_bias(_native),
    "native_rows": _with_bias(_native_rows),
    "native_gemm": _with_bias(_native_gemm),
    "widened": _with_bias(_widened),
}
QUANTIZED_KERNELS: dict[str, Kernel] = {
    "int_kernel": lambda layer, x: layer.int_mm(x),  # the baseline of quantized layers
    "dequantized": lambda layer, x: _dequantized(layer, x, weight_first=False),
    "dequantized_t": lambda layer, x: _dequantized(layer, x, weight_first=True),
}
QUANTIZED_KERNELS |= {  # the same GEMMs in the other dtype (see _in_dtype)
    "dequantized_bf16": _in_dtype(QUANTIZED_KERNELS["dequantized"], torch.bfloat16),
    "dequantized_t_bf16": _in_dtype(QUANTIZED_KERNELS["dequantized_t"], torch.bfloat16),
    "dequantized_f32": _in_dtype(QUANTIZED_KERNELS["dequantized"], torch.float32),
    "dequantized_t_f32": _in_dtype(QUANTIZED_KERNELS["dequantized_t"], torch.float32),
    "native": _native_quantized,
    "native_rows": _native_rows,  # int8 only
    "native_gemm": _native_gemm,
    "panel_gemm": _panel_gemm,
}


def run_kernel(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """y = x W^T + b through the layer's planned formulation for x's row count (a host-side
    shape: choosing costs no sync), an input of other than 2 dimensions (an encoder's batch
    [B, T, W]) as its rows. Dense inputs off the CPU or of an unplanned layer use F.linear."""
    quantized = layer.is_quantized
    if x.dim() != 2:
        if quantized or (x.device.type == "cpu" and layer.kernels is not None):
            lead = x.shape[:-1]
            return run_kernel(layer, x.reshape(-1, x.shape[-1])).reshape(*lead, -1)
        return F.linear(x, layer.weight, layer.bias)
    if x.device.type != "cpu":
        rows = layer.pad_rows
        if rows is not None and x.shape[0] < rows:
            # one shape, so one library kernel, for every row count up to `rows`: a row's
            # result then does not depend on how many rows share its step
            n = x.shape[0]
            return run_kernel(layer, F.pad(x, (0, 0, 0, rows - n)))[:n]
        if not quantized:
            return F.linear(x, layer.weight, layer.bias)
    plan = layer.kernels
    if plan is not None:
        name = plan[bucket_index(x.shape[0])]
    elif not quantized:
        name = BASELINE
    else:  # unplanned: PyTorch's int kernel where it has one
        name = "int_kernel" if layer.has_torch_kernel else "dequantized_t"
    return _formulation(layer, name, x)


def _formulation(layer: nn.Module, name: str, x: torch.Tensor) -> torch.Tensor:
    """x W^T + b through the layer's formulation `name` (a dense one adds the bias itself)."""
    if not layer.is_quantized:
        return KERNELS[name](layer, x)
    out = QUANTIZED_KERNELS[name](layer, x)
    return out if layer.bias is None else out + layer.bias


class Linear(nn.Linear):
    """nn.Linear that runs, on the CPU, the formulation planned for its input's row-count
    bucket (`kernels`: one name of KERNELS per models.kernels.choice.BUCKETS; None: F.linear).
    A (W @ x^T)^T result is a transposed view, which the following ops accept.
    `quantizable=False` keeps the weight in the model dtype when the model is quantized (a
    mixture-of-experts router: rounding it would change which experts a token reaches).
    `contiguous_output=True` (the encoders' linears, whose callers view their output) leaves
    out the formulations that return a transposed view; such layers are planned as a group of
    their own ("dense-rows")."""

    is_quantized = False
    kernels: tuple[str, ...] | None = None
    pad_rows: int | None = None  # off the CPU: fewer rows run padded to this many
    packed: torch.Tensor | None = None  # the oneDNN-prepacked weight, when planned

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 quantizable: bool = True, contiguous_output: bool = False, **factory) -> None:
        super().__init__(in_features, out_features, bias, **factory)
        self.quantizable = quantizable
        self.contiguous_output = contiguous_output

    @property
    def format(self) -> str:
        return "dense-rows" if self.contiguous_output else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_kernel(self, x)


class EncoderLinear(Linear):
    """A media encoder's (tower, projector) linear: planned like the decoder's, so that a
    bfloat16 tower on a CPU without bfloat16 arithmetic runs the widened GEMM instead of
    PyTorch's far slower bfloat16 one; never quantized; its output has contiguous rows."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 **factory) -> None:
        super().__init__(in_features, out_features, bias, quantizable=False,
                         contiguous_output=True, **factory)


# Our formulations, which take a float32 x whatever the weight's dtype and sum in float32.
TAKE_FLOAT32_X = ("native", "native_rows", "native_gemm", "panel_gemm")
FEW_ROWS = 16  # up to this many rows of x, our matrix-vector loop; past it our GEMM


def _few_logits(layer: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """native.logits for a bfloat16 or int8 head (bias added in float32), else None."""
    if layer.is_quantized and layer.mode != "int8":
        return None
    weight, scales = (layer.qweight, layer.scales) if layer.is_quantized else (layer.weight, None)
    logits = native.load().logits(x, weight, scales)
    if logits is not None and layer.bias is not None:
        logits += layer.bias.float()
    return logits


def float32_logits(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The LM head's x W^T (+ b) as float32, summed in float32 and not rounded to bfloat16
    where our kernels run it (a bfloat16 x on the CPU with the library loaded): rounding a
    logit to bfloat16 (up to 2^-9 of its size) made about a third of a bfloat16 model's KL
    divergence from float32 (docs/performance.md). The planned formulation where it is one of
    ours, else ours for that many rows (the int4 pack has no tiled one); elsewhere layer(x)
    widened. A decode's or a verify's few rows against a bfloat16 or int8 head take x as it
    is (bfloat16) through VDPBF16PS where the build has it (`native.logits`), whatever the
    plan: every row count up to FEW_ROWS then sums a row alike."""
    if isinstance(layer, BlockLinear):  # a GGUF head in its blocks: float32 sums already
        return layer(x.float())
    ours = x.dtype == torch.bfloat16 and x.dim() == 2 and x.device.type == "cpu"
    if not ours or native.load() is None:
        return layer(x).float()
    if x.shape[0] <= FEW_ROWS and (logits := _few_logits(layer, x)) is not None:
        return logits
    plan = layer.kernels
    name = None if plan is None else plan[bucket_index(x.shape[0])]
    int4 = layer.is_quantized and layer.mode == "int4"
    if name not in TAKE_FLOAT32_X or (name == "native_rows" and int4):
        name = "native" if x.shape[0] <= FEW_ROWS else "native_gemm"
    return _formulation(layer, name, x.float())
