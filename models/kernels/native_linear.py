"""A linear layer as our C calls that run several take it (`mm_linear_desc` of
models/kernels/cpu/kernels.h, models.kernels.native_interface.LinearDesc): its weight format,
shape and pointers to its weight, scales and bias, read once when a call is set up
(models.layers.native_decode, native_experts). A weight held in a GGUF file's blocks of
several types (a fused q / k / v whose tensors differ) is a chain: one descriptor per part,
each pointing at the next."""

from __future__ import annotations

import ctypes

from models.kernels.ggml_blocks import KERNEL_TYPES, BlockLinear
from models.kernels.linear import Linear
from models.kernels.native_interface import (
    FORMAT_DENSE,
    FORMAT_GGML,
    FORMAT_INT4,
    FORMAT_INT8,
    LinearDesc,
)
from models.kernels.quantization import QuantizedLinear

FORMATS = {"dense": FORMAT_DENSE, "int8": FORMAT_INT8, "int4": FORMAT_INT4}


def linear_desc(linear: Linear | QuantizedLinear | BlockLinear,
                keep: list[LinearDesc] | None = None) -> LinearDesc:
    """The descriptor of `linear`'s weights as they are now (a weight moved later, e.g. into
    huge pages, needs a new one). A block linear's parts after the first are appended to
    `keep`, which the caller holds while the C side may read them (required for those)."""
    bias = None if linear.bias is None else linear.bias.data_ptr()
    if isinstance(linear, BlockLinear):
        if len(linear.parts) > 1 and keep is None:
            raise ValueError("a block linear in parts needs `keep` for its later parts")
        following = None
        for part in reversed(linear.parts[1:]):
            desc = LinearDesc(FORMAT_GGML, KERNEL_TYPES[part.kernel_type].code,
                              part.out_features, part.in_features, part.blocks.data_ptr(),
                              None, None, following, part.digits)
            keep.append(desc)
            following = ctypes.addressof(desc)
        first = linear.parts[0]
        return LinearDesc(FORMAT_GGML, KERNEL_TYPES[first.kernel_type].code,
                          first.out_features, first.in_features, first.blocks.data_ptr(),
                          None, bias, following, first.digits)
    if linear.is_quantized:
        return LinearDesc(FORMATS[linear.mode], linear.group_size, linear.out_features,
                          linear.in_features, linear.qweight.data_ptr(),
                          linear.scales.data_ptr(), bias)
    return LinearDesc(FORMATS["dense"], 0, linear.out_features, linear.in_features,
                      linear.weight.data_ptr(), None, bias)
