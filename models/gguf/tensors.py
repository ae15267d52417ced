"""A GGUF file's tensors as a Hugging Face checkpoint's: their names, the rearrangements llama.cpp's
converter made that transformers undoes, dequantization, and Q4_0 / Q4_1 blocks as our int4.

Names: llama.cpp's (`blk.3.attn_q.weight`) to transformers' (`model.layers.3.self_attn.q_proj.
weight`), the table gguf-py's `TensorNameMap` holds for these families (tests/test_gguf_files.py
compares it with transformers' own map). Rearrangements, as transformers' GGUF loader undoes
them: a llama file's q and k rows are permuted for llama.cpp's rotary layout (reversed here, on
rows, so that blocks move whole); a Gemma file stores each norm as 1 + w (1 is subtracted, in
float32, as transformers does before any rounding).

Dequantization is gguf-py's (the function transformers' loader calls), a block of rows at a
time into the model dtype, so that no tensor is ever whole in float32.

Q4_0 (w = (q - 8) d) and Q4_1 (w = q d + m), 32 values per block with float16 d and m, are our
int4 at group 32, w = (q - 8) s + z, with s = d and z = m + 8 d. Our s and z are bfloat16: s is d
rounded (a relative change below 2^-8), and z the bfloat16 nearest to the group's least-squares
offset given that s (0 for a Q4_0 block whose d bfloat16 holds exactly). q is the file's.
"""

from __future__ import annotations

import functools
import re

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from models.gguf.reader import GGUFFile, TensorInfo

BLOCK = 32  # values per Q4_0 / Q4_1 / Q8_0 block: our group size for them
STORED_INT4 = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
DENSE_CHUNK_BYTES = 64 << 20  # float32 bytes of one tensor dequantized at once

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma's sandwich norms: its ffn_norm is the norm before the MLP.
_GEMMA_LAYER = _LAYER | {
    "ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(name: str, family: str) -> str | None:
    """The transformers checkpoint name of GGUF tensor `name` in a `family` model, or None
    when the family has no such tensor."""
    stem, dot, suffix = name.rpartition(".")
    if stem in _GLOBAL and dot:
        return f"{_GLOBAL[stem]}.{suffix}"
    match = _BLOCK.fullmatch(name)
    if match is None:
        return None
    layer, part, suffix = match.groups()
    table = _GEMMA_LAYER if family == "gemma3" else _LAYER
    if part not in table:
        return None
    return f"model.layers.{layer}.{table[part]}.{suffix}"


class Rearrange:
    """What transformers' loader does to a family's tensors after dequantizing them."""

    def __init__(self, family: str, num_heads: int, num_kv_heads: int) -> None:
        self.family = family
        # llama.cpp permutes a llama file's q / k rows; Mistral files are llama files.
        self.heads = {"attn_q": num_heads, "attn_k": num_kv_heads} if family in (
            "llama", "mistral") else {}

    def moves(self, name: str) -> bool:
        """Whether `rows` reorders tensor `name`'s rows (so its blocks cannot be the file's)."""
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        return part in self.heads

    def rows(self, name: str, rows: np.ndarray) -> np.ndarray:
        """A tensor's rows (values or blocks) in transformers' order."""
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        heads = self.heads.get(part)
        if heads is None:
            return rows
        dim = rows.shape[0] // heads // 2
        return rows.reshape(heads, dim, 2, -1).swapaxes(1, 2).reshape(rows.shape)

    def values(self, name: str, values: np.ndarray) -> np.ndarray:
        """Dequantized float32 values as transformers keeps them."""
        if self.family == "gemma3" and "norm.weight" in name:
            return values - np.float32(1)
        return values


def read_dense(file: GGUFFile, info: TensorInfo, rearrange: Rearrange,
               dtype: torch.dtype) -> torch.Tensor:
    """A tensor dequantized into `dtype`, a block of rows at a time (float32 in between)."""
    raw = rearrange.rows(info.name, file.read(info))  # [rows, bytes per row]
    rows, cols = raw.shape[0], info.shape[-1]
    out = torch.empty(rows, cols, dtype=dtype)
    step = max(1, DENSE_CHUNK_BYTES // (4 * cols))
    for first in range(0, rows, step):
        chunk = dequantize(raw[first:first + step], info.ggml_type).reshape(-1, cols)
        values = rearrange.values(info.name, np.ascontiguousarray(chunk, dtype=np.float32))
        out[first:first + step] = torch.from_numpy(values)
    return out.reshape(info.shape)


def read_int4(file: GGUFFile, info: TensorInfo, rearrange: Rearrange
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 tensor [N, K] as our int4 at group 32: (q uint8 [N, K] in [0, 15],
    scales and zeros bfloat16 [N, K / 32, 2])."""
    raw = rearrange.rows(info.name, file.read(info))
    n, k = info.shape
    blocks = raw.reshape(n * k // BLOCK, GGML_QUANT_SIZES[info.ggml_type][1])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    if info.ggml_type == GGMLQuantizationType.Q4_1:
        m, packed = blocks[:, 2:4].copy().view(np.float16).astype(np.float32), blocks[:, 4:]
    else:
        m, packed = -8 * d, blocks[:, 2:]
    q = np.concatenate([packed & 15, packed >> 4], axis=1)  # [B, 32]: low nibbles first
    centred = q.astype(np.float32) - 8
    w = centred * d + (m + 8 * d)  # the file's values: q d + m
    best_err, scale, zero = None, None, None
    for s in _bf16_neighbours(d):  # d rounded down and up to bfloat16
        # The least-squares z for these q and s (mean of w - (q - 8) s), rounded.
        z = _bf16((w - centred * s).mean(axis=1, keepdims=True))
        err = np.square(centred * s + z - w).sum(axis=1, keepdims=True)
        if best_err is None:
            best_err, scale, zero = err, s, z
        else:
            better = err < best_err
            best_err = np.where(better, err, best_err)
            scale, zero = np.where(better, s, scale), np.where(better, z, zero)
    sz = torch.from_numpy(np.concatenate([scale, zero], axis=1)).to(torch.bfloat16)
    sz = sz.reshape(n, k // BLOCK, 2)
    return torch.from_numpy(q.reshape(n, k)), sz


def read_int8(file: GGUFFile, info: TensorInfo, rearrange: Rearrange
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q8_0 tensor [N, K] as our int8 at group 32: (q int8 [N, K] as stored, scales bfloat16
    [N, K / 32]: each block's float16 d rounded to the nearest bfloat16, which for these q is
    also the scale of least squared error)."""
    raw = rearrange.rows(info.name, file.read(info))
    n, k = info.shape
    blocks = raw.reshape(n * k // BLOCK, GGML_QUANT_SIZES[info.ggml_type][1])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    q = torch.from_numpy(blocks[:, 2:].copy().view(np.int8).reshape(n, k))
    return q, torch.from_numpy(d.reshape(n, k // BLOCK)).to(torch.bfloat16)


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (nearest, ties to even), as float32."""
    return torch.from_numpy(np.ascontiguousarray(x, np.float32)).to(torch.bfloat16).float().numpy()


def _bf16_neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values at or below and at or above each (positive) float32 value."""
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    down = (bits & np.uint32(0xFFFF0000)).view(np.float32)
    up = ((bits + np.uint32(0xFFFF)) & np.uint32(0xFFFF0000)).view(np.float32)
    return down, up


@functools.cache
def readable(ggml_type: GGMLQuantizationType) -> bool:
    """Whether gguf-py dequantizes `ggml_type` (floats and block types; not the integer types
    or blocks it has no dequantizer for)."""
    if ggml_type.name.startswith("I") and ggml_type.name[1:].isdigit():
        return False  # I8 ... I64: integers, not weights
    block, nbytes = GGML_QUANT_SIZES[ggml_type]
    try:
        dequantize(np.zeros((1, nbytes), dtype=np.uint8), ggml_type)
    except NotImplementedError:
        return False
    return True


def bytes_per_weight(ggml_type: GGMLQuantizationType) -> float:
    block, nbytes = GGML_QUANT_SIZES[ggml_type]
    return nbytes / block
