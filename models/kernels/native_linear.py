"""A linear layer as our C calls that run several take it (`mm_linear_desc` of
models/kernels/cpu/kernels.h, models.kernels.native_interface.LinearDesc): its weight format,
shape and pointers to its weight, scales and bias, read once when a call is set up
(models.kernels.native_decode, native_experts)."""

from __future__ import annotations

from models.kernels.linear import Linear
from models.kernels.native_interface import FORMAT_DENSE, FORMAT_INT4, FORMAT_INT8, LinearDesc
from models.kernels.quantization import QuantizedLinear

FORMATS = {"dense": FORMAT_DENSE, "int8": FORMAT_INT8, "int4": FORMAT_INT4}


def linear_desc(linear: Linear | QuantizedLinear) -> LinearDesc:
    """The descriptor of `linear`'s weights as they are now (a weight moved later, e.g. into
    huge pages, needs a new one)."""
    bias = None if linear.bias is None else linear.bias.data_ptr()
    if linear.is_quantized:
        return LinearDesc(FORMATS[linear.mode], linear.group_size, linear.out_features,
                          linear.in_features, linear.qweight.data_ptr(),
                          linear.scales.data_ptr(), bias)
    return LinearDesc(FORMATS["dense"], 0, linear.out_features, linear.in_features,
                      linear.weight.data_ptr(), None, bias)
