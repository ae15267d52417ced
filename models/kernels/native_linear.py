"""A linear layer as our C calls that run several take it (`mm_linear_desc` of
models/kernels/cpu/kernels.h): its weight format, shape and pointers to its weight, scales and
bias, read once when a call is set up (models.kernels.native_decode, native_experts)."""

from __future__ import annotations

import ctypes

from models.kernels.linear import Linear
from models.kernels.quantization import QuantizedLinear

FORMATS = {"dense": 0, "int8": 1, "int4": 2}  # cpu/kernels.h's FORMAT_*

_ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64


class LinearDesc(ctypes.Structure):
    _fields_ = [("format", _i32), ("group", _i32), ("n", _i64), ("k", _i64),
                ("weight", _ptr), ("scales", _ptr), ("bias", _ptr)]


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
