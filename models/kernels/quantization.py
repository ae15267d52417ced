"""Weight-only int8 / int4 quantization of the language model's linears, at load time: the
QuantizedLinear module and which linears become one (the formats themselves:
models/kernels/int_formats.py).

Only the decoder's linears and the LM head are quantized (a tied head gets a quantized copy; the
embedding table stays in the model dtype, as do norms, vision / audio towers and the linears
built `quantizable=False`, such as mixture-of-experts routers).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

import torch
from torch import nn

from models.kernels.int_formats import (
    INT4_BLOCK_N,
    dequantize_int4,
    dequantize_int8,
    int4_supported,
    int8_group,
    pack_int4,
    quantize_int4,
    quantize_int8,
    torch_int4_pack,
)
from models.kernels.linear import Linear, run_kernel
from models.mapped_files import let_go

log = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "int4")
GROUP_SIZES = (32, 64, 128)


QUANTIZE_BLOCK_BYTES = 64 << 20  # float32 bytes of a weight's output channels quantized at once


def _channel_blocks(n: int, k: int) -> list[tuple[int, int]]:
    """(first, last) output channels of each block a weight [n, k] is quantized in: whole
    blocks of the int4 pack's 64 channels, about QUANTIZE_BLOCK_BYTES of float32 each."""
    channels = max(INT4_BLOCK_N,
                   QUANTIZE_BLOCK_BYTES // (4 * k) // INT4_BLOCK_N * INT4_BLOCK_N)
    return [(first, min(n, first + channels)) for first in range(0, n, channels)]


class QuantizedLinear(nn.Module):
    """A Linear whose weight is int8 or int4, group-wise; bias in the model dtype.
    `group_size`: the inputs per scale (int8 per channel: all of them, `in_features`).

    PyTorch's int kernels take bfloat16 activations (a float32 input goes through a path tens
    of times slower), so for them the input is cast to bfloat16 and the output back to the
    input's dtype. Which formulation runs for a row-count bucket (PyTorch's int kernel, ours, a
    dequantized GEMM) is set by `models.kernels.linear_choice.choose_linear_kernels`; until
    then PyTorch's int kernel runs. `torch_packed` is PyTorch's int4 pack, made when its kernel
    first runs and dropped by the plan where that kernel is not chosen.
    """

    is_quantized = True
    pad_rows: int | None = None  # off the CPU: fewer rows run padded to this many

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, mode: str,
                 group_size: int = 128) -> None:
        super().__init__()
        if mode not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
        self.out_features, self.in_features = weight.shape
        n, k = weight.shape
        if mode == "int8":
            group_size = int8_group(k, group_size)
        self.mode, self.group_size = mode, group_size
        # Quantized a block of output channels at a time: the float32 temporaries of a whole LM
        # head would be several times its size.
        if mode == "int8":
            q = torch.empty(n, k, dtype=torch.int8)
            scales = torch.empty((n,) if group_size == k else (n, k // group_size),
                                 dtype=torch.bfloat16)
            for first, last in _channel_blocks(n, k):
                q[first:last], scales[first:last] = quantize_int8(weight[first:last],
                                                                  group_size)
                let_go(weight[first:last])  # a mapped weight's pages, read: not held
        else:
            q = torch.empty(n, k // 2, dtype=torch.uint8)
            scales = torch.empty(k // group_size, n, 2, dtype=torch.bfloat16)
            for first, last in _channel_blocks(n, k):  # the pack keeps 64-channel blocks apart
                values, scales[:, first:last] = quantize_int4(weight[first:last], group_size)
                q[first:last] = pack_int4(values)
                let_go(weight[first:last])
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(),
                                                           requires_grad=False)
        self.kernels: tuple[str, ...] | None = None
        self.torch_packed: torch.Tensor | None = None

    @classmethod
    def from_int4(cls, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                  bias: torch.Tensor | None, group_size: int) -> QuantizedLinear:
        """An int4 layer from values already quantized (a GGUF file's Q4_0 / Q4_1 blocks): our
        pack [N, K / 2] and bfloat16 scales and zeros [K / group_size, N, 2]."""
        return cls._from_values("int4", packed, packed.shape[1] * 2, scales_and_zeros, bias,
                                group_size)

    @classmethod
    def from_int8(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                  group_size: int) -> QuantizedLinear:
        """An int8 layer from values already quantized (a GGUF file's Q8_0 blocks): q [N, K]
        and bfloat16 scales [N, K / group_size]."""
        return cls._from_values("int8", q, q.shape[1], scales, bias, group_size)

    @classmethod
    def _from_values(cls, mode: str, q: torch.Tensor, in_features: int, scales: torch.Tensor,
                     bias: torch.Tensor | None, group_size: int) -> QuantizedLinear:
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = q.shape[0], in_features
        layer.mode, layer.group_size = mode, group_size
        layer.register_buffer("qweight", q.contiguous())
        layer.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        layer.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        layer.kernels, layer.torch_packed = None, None
        return layer

    @property
    def per_channel(self) -> bool:
        """int8 with one scale per output channel (the layout PyTorch's int8 kernel takes)."""
        return self.mode == "int8" and self.group_size == self.in_features

    @property
    def has_torch_kernel(self) -> bool:
        """Whether PyTorch has an int kernel for this layout: int4; int8 per channel over a
        multiple of 32 inputs (PyTorch 2.13's int8 kernel crashed the process on an AVX-512
        Xeon for 8, 24, 40 and 72 inputs at 4 rows; 16, 32, 48 and 64 ran)."""
        return self.mode == "int4" or (self.per_channel and self.in_features % 32 == 0)

    @property
    def format(self) -> str:
        if self.mode == "int8":
            return "int8" if self.per_channel else f"int8g{self.group_size}"
        return f"int4g{self.group_size}"

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight the kernels compute with, [N, K] in `dtype`."""
        if self.mode == "int8":
            return dequantize_int8(self.qweight, self.scales, dtype)
        return dequantize_int4(self.qweight, self.scales, dtype)

    def first_channels(self, n: int) -> QuantizedLinear:
        """A layer of the first n output channels (n a multiple of 64), sharing storage: the
        int4 pack keeps each block of 64 channels contiguous."""
        part = copy.copy(self)
        part._buffers = dict(self._buffers)
        part._parameters = dict(self._parameters)
        part.out_features = n
        part.torch_packed = None
        if self.mode == "int8":
            part.qweight, part.scales = self.qweight[:n], self.scales[:n]
        else:
            part.qweight = self.qweight.reshape(-1)[: n * self.in_features // 2].view(n, -1)
            part.scales = self.scales[:, :n].contiguous()
        if self.bias is not None:
            part.bias = nn.Parameter(self.bias[:n], requires_grad=False)
        return part

    def int_mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] -> [M, N] through PyTorch's int kernel, in x's dtype (x may be strided: the
        output of a (W x^T)^T formulation is a transposed view; the kernels take rows). Only
        where `has_torch_kernel`."""
        assert self.has_torch_kernel, f"PyTorch has no int kernel for {self.format}"
        xb = x.to(torch.bfloat16).contiguous()
        if self.mode == "int8":
            out = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scales)
        else:
            if self.torch_packed is None:
                self.torch_packed = torch_int4_pack(self.qweight)
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, self.torch_packed, self.group_size, self.scales)
        return out.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_kernel(self, x)


def quantized_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear to quantize: the decoder layers' and the LM head."""
    return _layer_linears(model) + [(model, "lm_head")]


def _layer_linears(model: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(parent, name) for layer in model.layers for parent in layer.modules()
            for name, child in parent.named_children()
            if isinstance(child, Linear) and child.quantizable]


def quantize_linear(linear: nn.Module, mode: str, group_size: int) -> QuantizedLinear:
    """`linear` as a QuantizedLinear; int8 where the int4 pack cannot take its shape (logged)."""
    layer_mode = mode
    if mode == "int4" and not int4_supported(*linear.weight.shape, group_size):
        log.info("int4 cannot pack %s (group %d): int8 instead", tuple(linear.weight.shape),
                 group_size)
        layer_mode = "int8"
    return QuantizedLinear(linear.weight, linear.bias, layer_mode, group_size)


# The LM head's format per quantization asked: its rounding reaches every logit directly, so
# with 4-bit linears it stays at 8 bits (as llama.cpp keeps its output tensor at 6 bits or more
# in its 4-bit types). bench.quality measures what each costs.
HEAD_MODE = {"int8": "int8", "int4": "int8"}


@torch.no_grad()
def quantize_language_model(model: nn.Module, mode: str, group_size: int = 128) -> int:
    """Replace the decoder's linears by QuantizedLinear in `mode` and the LM head in
    HEAD_MODE[mode] (those still dense: a model loaded through QuantizeOnLoad has only its head
    left); returns how many."""
    count = 0
    for parent, name in quantized_linears(model):
        linear = getattr(parent, name)
        if isinstance(linear, Linear):
            head = parent is model and name == "lm_head"
            setattr(parent, name,
                    quantize_linear(linear, HEAD_MODE[mode] if head else mode, group_size))
            count += 1
    return count


class QuantizeOnLoad:
    """Quantizes each decoder-layer linear as soon as the checkpoint loader has filled it
    (models.loader: `defer` to build, then the observer of load_weights), so that a model
    whose weights in its own dtype exceed memory loads: the linears wait on the meta device,
    and only those being filled are dense at any time. The LM head (which may share the
    embedding table) is quantized after loading, by quantize_language_model.

    `peak_dense_bytes`: the most bytes of dense linear weights resident at once while
    loading. `progress(done, total)`, if given, hears of each linear quantized."""

    def __init__(self, mode: str, group_size: int,
                 progress: Callable[[int, int], None] | None = None) -> None:
        if mode not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {mode!r}")
        self.mode, self.group_size = mode, group_size
        self._linears: dict[str, tuple[nn.Module, str]] = {}  # weight name -> parent, attr
        self._waiting: dict[str, set[str]] = {}  # weight name -> its parameters not yet full
        self._owner: dict[str, str] = {}  # parameter name -> its linear's weight name
        self._dense_bytes = 0
        self.peak_dense_bytes = 0
        self.count = 0
        self.progress = progress

    def defer(self, model: nn.Module) -> list[str]:
        """build_on_meta's `defer`: the decoder-layer linears' weights, to leave on the meta
        device (the module tree, built on it, is the one loaded afterwards)."""
        names = {id(m): n for n, m in model.named_modules()}
        for parent, attr in _layer_linears(model):
            prefix = f"{names[id(parent)]}.{attr}"
            weight = f"{prefix}.weight"
            self._linears[weight] = (parent, attr)
            self._waiting[weight] = {f"{prefix}.{p}" for p, _ in
                                     getattr(parent, attr).named_parameters()}
        self._owner = {p: w for w, params in self._waiting.items() for p in params}
        return list(self._linears)

    def allocated(self, name: str, nbytes: int) -> None:
        """A deferred weight was allocated: dense from now until quantized."""
        self._dense_bytes += nbytes
        self.peak_dense_bytes = max(self.peak_dense_bytes, self._dense_bytes)

    @torch.no_grad()
    def filled(self, name: str) -> list[str]:
        """Once all of a linear's parameters are filled, replace it by its quantized form and
        return the names of the parameters it dropped."""
        weight = self._owner.get(name)
        if weight is None:
            return []
        waiting = self._waiting[weight]
        parent, attr = self._linears[weight]
        waiting.discard(name)
        if waiting:
            return []
        linear = getattr(parent, attr)
        self._dense_bytes -= linear.weight.numel() * linear.weight.element_size()
        setattr(parent, attr, quantize_linear(linear, self.mode, self.group_size))
        self.count += 1
        if self.progress is not None:
            self.progress(self.count, len(self._linears))
        prefix = weight.removesuffix(".weight")
        return [f"{prefix}.{p}" for p, _ in linear.named_parameters()]
