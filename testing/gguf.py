"""GGUF files of tiny checkpoints, written as llama.cpp's converter writes them, for tests.

`write_gguf(checkpoint, out, types)` turns a tiny Hugging Face checkpoint (testing/tiny.py) into
a GGUF file with gguf-py's writer: llama.cpp's metadata keys for the family, the byte-level BPE
vocabulary with its merges, token types, special ids and chat template, the tensors under
gguf-py's own names for the family (`TensorNameMap`: not our table), a llama model's q / k rows
permuted as the converter permutes them, a Gemma model's norms stored as 1 + w, and each tensor
quantized by gguf-py to the type `types` gives it (F32 where it gives none; Q4_K, Q5_K and
Q6_K, which gguf-py does not quantize, by `quantize_k`). The real files the
packages ship (SmolLM2 Q4_1, Gemma 3 270M Q4_K_M) are what the real converter wrote; these test
what those do not hold (Qwen2's biases, Qwen3, llama's permutation with grouped heads, Q4_0).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, get_tensor_name_map
from gguf.quants import quantize
from safetensors.torch import load_file

_ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3,
          "gemma3_text": MODEL_ARCH.GEMMA3}
_ARCH_NAMES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}

Q4_0, Q4_1, Q8_0 = GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
F16, F32 = GGMLQuantizationType.F16, GGMLQuantizationType.F32
# A mix like a real quantized file's: the linears in 4 bits, v and the embeddings in 8.
MIXED = {r"attn_[qko]|ffn_(gate|up)": Q4_1, r"ffn_down": Q4_0, r"attn_v|token_embd": Q8_0,
         r"^output$": F16}


def write_gguf(checkpoint: Path, out: Path, types: Mapping[str, GGMLQuantizationType] = MIXED,
               name: str = "tiny", config_edits: Mapping | None = None,
               extra: Mapping[str, object] | None = None) -> Path:
    """`checkpoint` as a GGUF file at `out`; `types` maps a regular expression on GGUF tensor
    names (searched) to the type of the tensors it matches (first match; 1-D tensors stay F32;
    I8 writes the values as integers). For tests of broken files: `config_edits` change the
    config the metadata is written from (not the tensors), `extra` adds metadata keys
    (strings, floats or ints)."""
    config = json.loads((checkpoint / "config.json").read_text()) | dict(config_edits or {})
    model_type = config["model_type"]
    arch = _ARCH_NAMES[model_type]
    tokenizer = json.loads((checkpoint / "tokenizer.json").read_text())
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    template = tokenizer_config.get("chat_template")
    if template is None and (checkpoint / "chat_template.jinja").exists():
        template = (checkpoint / "chat_template.jinja").read_text()
    writer = GGUFWriter(str(out), arch)
    writer.add_name(name)
    _write_config(writer, arch, config)
    _write_tokenizer(writer, tokenizer, tokenizer_config, template, config)
    for key, value in (extra or {}).items():
        add = (writer.add_string if isinstance(value, str) else writer.add_float32
               if isinstance(value, float) else writer.add_uint32)
        add(key, value)
    names = get_tensor_name_map(_ARCHS[model_type], config["num_hidden_layers"])
    state = load_file(str(checkpoint / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for hf_name, tensor in state.items():
        stem, suffix = hf_name.rsplit(".", 1)
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            raise ValueError(f"gguf-py names no tensor for {hf_name}")
        data = tensor.float().numpy()
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):
            data = _permute(data, heads, heads if stem.endswith("q_proj") else kv_heads)
        if arch == "gemma3" and stem.endswith("norm"):
            data = data + 1
        kind = F32 if data.ndim == 1 else next(
            (t for pattern, t in types.items() if re.search(pattern, gguf_name)), F32)
        if kind == F32:
            writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float32))
        elif kind == GGMLQuantizationType.I8:
            writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.int8))
        elif kind == F16:
            writer.add_tensor(f"{gguf_name}.{suffix}", data.astype(np.float16))
        else:
            blocks = quantize_k(data, kind) if kind in K_QUANTS else quantize(data, kind)
            writer.add_tensor(f"{gguf_name}.{suffix}", blocks, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _permute(w: np.ndarray, heads: int, kv_heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k row order (rotary halves interleaved per head)."""
    n = kv_heads if kv_heads != heads else heads
    return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_config(writer: GGUFWriter, arch: str, config: dict) -> None:
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    theta = rope.get("rope_theta") or rope.get("full_attention", {}).get("rope_theta")
    writer.add_rope_freq_base(theta)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config["vocab_size"])
    else:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])


def _write_tokenizer(writer: GGUFWriter, tokenizer: dict, tokenizer_config: dict,
                     template: str | None, config: dict) -> None:
    model = tokenizer["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    special = {t["id"]: t["content"] for t in tokenizer.get("added_tokens", [])}
    tokens = [token for token, _ in vocab]
    for index, content in special.items():
        if index >= len(tokens):
            tokens += [f"[PAD{i}]" for i in range(len(tokens), index)] + [content]
        else:
            tokens[index] = content
    tokens += [f"[PAD{i}]" for i in range(len(tokens), config["vocab_size"])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_token_merges(merges)
    ids = {t: i for i, t in enumerate(tokens)}
    writer.add_eos_token_id(ids[tokenizer_config["eos_token"]])
    if tokenizer_config.get("pad_token") in ids:
        writer.add_pad_token_id(ids[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    if template:
        writer.add_chat_template(template)


def dequantized(path: Path, name: str) -> torch.Tensor:
    """One tensor of a GGUF file dequantized by gguf-py, in float32 (as stored: not permuted)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    for tensor in GGUFReader(str(path)).tensors:
        if tensor.name == name:
            return torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).copy())
    raise KeyError(name)


@contextmanager
def one_parse_per_file() -> Iterator[None]:
    """transformers' GGUF loader parses a file's header twice (config, then tensors) with
    gguf-py's reader, half a minute each for a 262,144-token vocabulary: within this context
    each file is parsed once (the reader is read-only; nothing else changes)."""
    import gguf

    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def rewrite_gguf(source: Path, out: Path, *, drop_tensors: tuple[str, ...] = (),
                 rename_tensors: Mapping[str, str] | None = None,
                 set_keys: Mapping[str, object] | None = None,
                 drop_keys: tuple[str, ...] = ()) -> Path:
    """A copy of the GGUF `source` (F32 / F16 tensors) at `out` with tensors or metadata keys
    removed, tensors renamed, or keys set (strings, bools, ints as u32, floats as f32, lists):
    a broken or edited file for tests, everything else as the source has it."""
    from models.gguf.reader import GGUFFile

    file = GGUFFile(source)
    writer = GGUFWriter(str(out), file.architecture)
    for key, value in {**file.metadata, **dict(set_keys or {})}.items():
        if key in drop_keys or key == "general.architecture":
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, list(value.tolist() if isinstance(value, np.ndarray) else value))
    for info in file.tensors:
        if info.name in drop_tensors:
            continue
        kind = {F32: np.float32, F16: np.float16}[info.ggml_type]
        writer.add_tensor((rename_tensors or {}).get(info.name, info.name),
                          file.read(info).view(kind).reshape(info.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)


def quantize_k(data: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """`data` [..., K] (K a multiple of 256) as Q4_K, Q5_K or Q6_K blocks, uint8 [..., K / 256
    * block bytes], which gguf-py only dequantizes: a plain min-max fit per sub-block (not
    llama.cpp's search), packed bit for bit as ggml lays the blocks out."""
    rows = data.reshape(-1, 256).astype(np.float32)  # [B, 256]
    if kind == GGMLQuantizationType.Q6_K:
        packed = _q6_k(rows)
    else:
        packed = _q45_k(rows, 15 if kind == GGMLQuantizationType.Q4_K else 31)
    return packed.reshape(*data.shape[:-1], -1)


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x as float16 (its bytes [..., 2]) and the float32 of that float16."""
    half = x.astype(np.float16)
    return half.view(np.uint8).reshape(*x.shape, 2), half.astype(np.float32)


def _q45_k(w: np.ndarray, top: int) -> np.ndarray:
    blocks = w.shape[0]
    sub = w.reshape(blocks, 8, 32)
    low = np.minimum(sub.min(-1), 0)
    step, offset = (sub.max(-1) - low) / top, -low  # [B, 8]
    d_bytes, d = _f16(step.max(-1) / 63)
    m_bytes, dmin = _f16(offset.max(-1) / 63)
    sc = np.clip(np.rint(step / np.where(d > 0, d, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(offset / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    scale = d[:, None] * sc
    q = np.rint((sub + (dmin[:, None] * mn)[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8).reshape(blocks, 4, 2, 32)  # [B, chunk, half, l]
    scales = np.zeros((blocks, 12), np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)
    qs = ((q[:, :, 0] & 0xF) | ((q[:, :, 1] & 0xF) << 4)).reshape(blocks, 128)
    parts = [d_bytes, m_bytes, scales]
    if top == 31:  # Q5_K: bit 2c of qh[l] is the fifth bit of chunk c's first half, 2c+1 second
        high = (q >> 4).astype(np.uint8)  # [B, 4, 2, 32]
        qh = np.zeros((blocks, 32), np.uint8)
        for c in range(4):
            qh |= (high[:, c, 0] << (2 * c)) | (high[:, c, 1] << (2 * c + 1))
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    blocks = w.shape[0]
    sub = w.reshape(blocks, 16, 16)
    step = np.abs(sub).max(-1) / 31  # [B, 16]
    d_bytes, d = _f16(step.max(-1) / 127)
    sc = np.clip(np.rint(step / np.where(d > 0, d, 1)[:, None]), -128, 127).astype(np.int8)
    scale = d[:, None] * sc
    q = np.clip(np.rint(sub / np.where(scale != 0, scale, 1)[..., None]), -32, 31)
    u = (q + 32).astype(np.uint8).reshape(blocks, 2, 4, 32)  # [B, half, group, l]
    ql = np.concatenate([(u[:, :, 0] & 0xF) | ((u[:, :, 2] & 0xF) << 4),
                         (u[:, :, 1] & 0xF) | ((u[:, :, 3] & 0xF) << 4)], axis=2)  # [B, 2, 64]
    qh = ((u[:, :, 0] >> 4) | ((u[:, :, 1] >> 4) << 2) | ((u[:, :, 2] >> 4) << 4)
          | ((u[:, :, 3] >> 4) << 6))  # [B, 2, 32]
    return np.concatenate([ql.reshape(blocks, 128), qh.reshape(blocks, 64),
                           sc.view(np.uint8), d_bytes], axis=1)
