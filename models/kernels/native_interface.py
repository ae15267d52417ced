"""The C interface of the native library, in one place: every exported function's signature
(SIGNATURES), the structs its calls take, and the constants Python shares with the C sources.
Each mirrors a declaration of models/kernels/cpu/kernels.h, the header every source includes
(so the compiler holds each definition to its prototype there); tests/test_native_bindings.py
parses that header and fails where this module disagrees with it.

`bind` sets every function's argument and result types once, when models.kernels.native opens
the library: a call through ctypes without them passes each Python int as a C int and each float
as a double, which corrupts a 64-bit or float argument silently.

To add a kernel: declare it in kernels.h, add its line to SIGNATURES, and wrap it in
models.kernels.native.NativeKernels (or read it there as an attribute, as the whole-step calls
are read).
"""
from __future__ import annotations

import ctypes

# ---- constants (kernels.h's #defines of the same names) ----

DTYPE_F32, DTYPE_BF16, DTYPE_I8 = 0, 1, 2  # element types of x, y and weights
I4_BLOCK_N = 64  # our int4 pack interleaves output channels in blocks of this many
KV_SCALE_BYTES = 4  # an int8 KV row's float32 scale, after its values
FORMAT_DENSE, FORMAT_INT8, FORMAT_INT4, FORMAT_GGML = 0, 1, 2, 3  # mm_linear_desc.format
QUANT_INT8, QUANT_INT4 = 0, 1  # mm_gemm_quantized's w_format
NORM_FLOAT32, NORM_REDUCED, NORM_UNIT_OFFSET = 0, 1, 2  # mm_rms_norm's mode
# mm_activation's kind
ACT_SIGMOID, ACT_SILU, ACT_SOFTPLUS, ACT_EXP, ACT_TANH, ACT_GELU_TANH, ACT_GELU = range(7)
DELTA_MAX_DV = 1024  # mm_delta_rule_step's value heads, at most
FIT_ROUNDS = 3  # mm_fit_int4's rounds from each start
# ggml's type codes (enum ggml_type, as GGUF stores them) of the block types ggml_blocks.c runs
GGML_Q4_0, GGML_Q4_1, GGML_Q5_0, GGML_Q5_1, GGML_Q8_0 = 2, 3, 6, 7, 8
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
# ours, not ggml's: each of them in groups of 8 output channels (cpu/ggml_x8.c)
GGML_Q4_0_X8, GGML_Q4_1_X8, GGML_Q5_0_X8, GGML_Q5_1_X8 = 1002, 1003, 1006, 1007
GGML_Q8_0_X8, GGML_Q4_K_X8, GGML_Q5_K_X8, GGML_Q6_K_X8 = 1008, 1012, 1013, 1014

CONSTANTS: dict[str, int] = {
    name: value for name, value in globals().items()
    if name.isupper() and isinstance(value, int)}

# ---- structs ----

_ptr, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float
_int, _f64, _str = ctypes.c_int, ctypes.c_double, ctypes.c_char_p


class LinearDesc(ctypes.Structure):
    """mm_linear_desc: a linear layer as the calls that run several take it."""

    _fields_ = [("format", _i32), ("group", _i32), ("n", _i64), ("k", _i64),
                ("weight", _ptr), ("scales", _ptr), ("bias", _ptr), ("next", _ptr),
                ("digits", _i64)]


class LayerDesc(ctypes.Structure):
    """mm_layer_desc: one decoder layer's weights and KV cache (mm_decode_layers)."""

    _fields_ = [("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc),
                ("down", LinearDesc), ("input_norm", _ptr), ("post_norm", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("kv_cache", _ptr), ("rope", _i64),
                ("attn_out_norm", _ptr), ("mlp_out_norm", _ptr), ("window", _i64)]


class DecoderDesc(ctypes.Structure):
    """mm_decoder_desc: what a decoder's layers share (mm_decode_layers)."""

    _fields_ = [("dtype", _i32), ("norm_mode", _i32), ("threads", _i32), ("kv_int8", _i32),
                ("act", _i32), ("eps", _f32), ("scale", _f32), ("hidden", _i64), ("heads", _i64),
                ("kv_heads", _i64), ("head_dim", _i64), ("intermediate", _i64),
                ("num_blocks", _i64), ("block_size", _i64)]


STRUCTS: dict[str, type[ctypes.Structure]] = {
    "mm_linear_desc": LinearDesc, "mm_layer_desc": LayerDesc, "mm_decoder_desc": DecoderDesc}

# ---- functions: name -> (result type, argument types), in kernels.h's order ----

_linear_desc_p = ctypes.POINTER(LinearDesc)
# x, x dtype, weight, weight dtype, scales, group, y, m, n, k, threads
_TILED = [_ptr, _int, _ptr, _int, _ptr, _i64, _ptr, _i64, _i64, _i64, _int]
# q, cache, out, dtype, table, key0, context, batch, heads, kv heads, dim, width, blocks,
# block size, window, scale, softcap, threads
_ATTENTION = [_ptr, _ptr, _ptr, _int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64,
              _i64, _i64, _f32, _f32, _int]

SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "mm_variant": (_str, []),
    "mm_set_solo_bytes": (None, [_i64]),
    # small_ops.c
    "mm_argmax": (None, [_ptr, _i64, _i64, _ptr]),
    "mm_read_sum": (_f64, [_ptr, _i64, _int]),
    "mm_rms_norm": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _f32, _int]),
    "mm_rotary": (None, [_ptr, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64]),
    "mm_silu_mul": (None, [_ptr, _ptr, _int, _i64, _i64]),
    "mm_activation": (None, [_ptr, _ptr, _int, _i64, _int]),
    "mm_act_mul": (None, [_ptr, _ptr, _int, _i64, _i64, _int]),
    # linear_dense.c, linear_int8.c, linear_int4.c: the matrix-vector linears
    "mm_linear_f32": (_int, [_ptr, _int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "mm_linear_bf16": (_int, [_ptr, _int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int]),
    "mm_linear_i8": (_int, [_ptr, _int, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _int]),
    "mm_int8_group_ok": (_int, [_i64, _i64]),
    "mm_dequantize_i8": (None, [_ptr, _ptr, _i64, _ptr, _int, _i64, _i64, _int]),
    "mm_linear_i4": (_int, [_ptr, _int, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int, _int]),
    "mm_dequantize_i4": (None, [_ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _i64, _int]),
    "mm_dequantize_i4_block": (None, [_ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64, _i64,
                                      _i64, _i64]),
    # dot_bf16.c: the LM head of a bfloat16 x's few rows, float32 logits
    "mm_logits_bf16": (_int, [_ptr, _ptr, _int, _ptr, _i64, _ptr, _i64, _i64, _i64, _int]),
    # linear_rows.c, gemm_dense.c, gemm_quantized.c: the tiled products
    "mm_linear_rows": (_int, _TILED),
    "mm_gemm_dense": (_int, _TILED),
    "mm_gemm_int4": (_int, [_ptr, _int, _ptr, _ptr, _i64, _ptr, _i64, _i64, _i64, _int]),
    "mm_gemm_quantized_takes": (_int, [_i64, _i64, _int, _i64]),
    "mm_gemm_quantized": (_int, [_ptr, _int, _ptr, _int, _ptr, _i64, _ptr, _i64, _i64, _i64,
                                 _i64, _int]),
    # attention.c
    "mm_decode_attention": (_int, _ATTENTION),
    "mm_decode_attention_i8": (_int, _ATTENTION),
    "mm_quantize_kv_row": (None, [_ptr, _int, _i64, _i64, _ptr]),
    # delta_rule.c, fit_int4.c
    "mm_delta_rule_step": (_int, [_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                                  _i64, _i64, _int]),
    "mm_fit_int4": (None, [_ptr, _i64, _i64, _ptr, _ptr, _int]),
    # ggml_blocks.c
    "mm_ggml_takes": (_int, [_int, _i64]),
    "mm_ggml_dequantize": (_int, [_ptr, _int, _ptr, _i64, _i64, _i64, _ptr, _int]),
    "mm_ggml_linear_float": (_int, [_ptr, _int, _ptr, _int, _ptr, _i64, _i64, _i64, _int]),
    "mm_ggml_linear": (_int, [_ptr, _int, _ptr, _int, _ptr, _i64, _i64, _i64, _i64, _int,
                              _int, _int]),
    "mm_digits_row": (None, [_ptr, _i64, _int, _ptr, _ptr, _ptr]),
    # ggml_x8.c
    "mm_ggml_x8_stored": (_int, [_int]),
    "mm_ggml_repack_takes": (_int, [_int, _i64, _i64]),
    "mm_ggml_repack": (_int, [_ptr, _int, _i64, _i64, _ptr, _int]),
    "mm_ggml_x8_block": (None, [_ptr, _int, _i64, _i64, _i64, _ptr]),
    "mm_ggml_x8_rows": (None, [_int, _ptr, _i64, _ptr, _int, _ptr]),
    "mm_ggml_x8_pairs": (_int, [_int]),
    "mm_ggml_x8_rows_pair": (None, [_int, _ptr, _ptr, _i64, _ptr, _int, _ptr]),
    # decode_layers.c, moe_experts.c: the whole-step calls
    "mm_decode_layers": (_int, [ctypes.POINTER(DecoderDesc), ctypes.POINTER(LayerDesc), _i64,
                                _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr]),
    "mm_moe_experts": (_int, [_linear_desc_p, _linear_desc_p, _i64, _ptr, _int, _i64, _ptr,
                              _ptr, _i64, _ptr, _int]),
}


def bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets the result and argument types of every function of SIGNATURES on `lib` (an
    AttributeError names one it lacks) -> lib."""
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib
