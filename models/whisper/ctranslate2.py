"""CTranslate2 Whisper folders as faster-whisper keeps them (`model.bin`, `config.json`,
`tokenizer.json` or only `vocabulary.txt` / `vocabulary.json`), read by our own parser of
CTranslate2's binary format.

`model.bin` (binary versions 4 to 6, the ones CTranslate2 4.x writes): a little-endian header
(version, the spec's name `WhisperSpec` and revision), then each variable: its name, rank,
dimensions, type id (float32, int8, int16, int32, float16, bfloat16), byte count and data; then
aliases (`decoder/projection/weight` -> the token embeddings: a tied head). Strings are a uint16
length (the terminating NUL counted) and the bytes. The model's shape is the tensors' shapes and
the `num_heads` scalars; `config.json` holds the suppressed tokens (`suppress_ids`,
`suppress_ids_begin`) and the language ids, the tokenizer the special tokens' ids.

The tensors map onto transformers' names (CTranslate2's converter fuses q, k and v of the
self-attention and k and v of the cross-attention, and stores the key projection's missing bias
as zeros; it names LayerNorm scales gamma and beta). float16 and float32 weights are read as
they are. int8 weights (per output channel, `weight_scale` = 127 / max |w| of the row) run as our
int8 linears, one scale per channel, the file's values unchanged (scales rounded to bfloat16);
the convolutions and embeddings of an int8 file are dequantized into the model dtype.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from models.checkpoint import CheckpointError

MODEL_FILE = "model.bin"
SPEC = "WhisperSpec"
VERSIONS = (4, 5, 6)
# CTranslate2's DataType enum.
DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16,
          5: torch.bfloat16}
NUMPY = {torch.float32: np.float32, torch.int8: np.int8, torch.int16: np.int16,
         torch.int32: np.int32, torch.float16: np.float16, torch.bfloat16: np.uint16}


@dataclass(frozen=True)
class Variable:
    """One tensor of the file: where its data lies."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class CT2File:
    """A CTranslate2 model.bin's header: its spec, variables and aliases (no data read)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:

            def take(fmt: str) -> tuple:
                size = struct.calcsize("<" + fmt)
                raw = f.read(size)
                if len(raw) != size:
                    raise CheckpointError(f"{self.path}: truncated CTranslate2 header")
                return struct.unpack("<" + fmt, raw)

            def string() -> str:
                (n,) = take("H")
                return take(f"{n}s")[0].rstrip(b"\0").decode()

            (self.version,) = take("I")
            if self.version not in VERSIONS:
                raise CheckpointError(f"{self.path}: CTranslate2 binary version {self.version} "
                                      f"is not read (versions {VERSIONS})")
            self.spec = string()
            (self.revision,) = take("I")
            (count,) = take("I")
            self.variables: dict[str, Variable] = {}
            for _ in range(count):
                name = string()
                (rank,) = take("B")
                shape = take(f"{rank}I") if rank else ()
                type_id, nbytes = take("BI")
                if type_id not in DTYPES:
                    raise CheckpointError(f"{self.path}: {name} has unknown type id {type_id}")
                self.variables[name] = Variable(name, DTYPES[type_id], tuple(shape), f.tell(),
                                                nbytes)
                f.seek(nbytes, 1)  # the data: read when asked for
            (aliases,) = take("I")
            self.aliases: dict[str, str] = {}
            for _ in range(aliases):
                alias = string()
                self.aliases[alias] = string()

    def read(self, name: str) -> torch.Tensor:
        """One variable's tensor (aliases resolved)."""
        var = self.variables[self.aliases.get(name, name)]
        count = var.nbytes // torch.empty(0, dtype=var.dtype).element_size()
        array = np.fromfile(self.path, dtype=NUMPY[var.dtype], count=count, offset=var.offset)
        tensor = torch.from_numpy(array.copy())
        if var.dtype == torch.bfloat16:
            tensor = tensor.view(torch.bfloat16)
        return tensor.reshape(var.shape)

    def scalar(self, name: str) -> int:
        return int(self.read(name).item())

    def has(self, name: str) -> bool:
        return name in self.variables or name in self.aliases


def is_ctranslate2(path: Path) -> bool:
    """A folder holding a CTranslate2 model.bin."""
    file = Path(path) / MODEL_FILE
    if not file.is_file():
        return False
    with open(file, "rb") as f:
        head = f.read(6)
    return len(head) == 6 and struct.unpack_from("<I", head)[0] in range(1, 16)


def _layers(file: CT2File, side: str) -> int:
    n = 0
    while file.has(f"{side}/layer_{n}/self_attention/linear_0/weight"):
        n += 1
    return n


def _ct2_config(folder: Path) -> dict:
    data = json.loads((folder / "config.json").read_text())
    if not isinstance(data, dict):
        raise CheckpointError(f"{folder / 'config.json'} is not a JSON object")
    return data


def load_tokenizer(folder: Path):
    """The folder's tokenizer.json as a transformers tokenizer; without one, its
    vocabulary.txt (or vocabulary.json) as a tokenizer that decodes but refuses to encode
    (models/whisper/vocabulary.py)."""
    from transformers import PreTrainedTokenizerFast

    from models.whisper.vocabulary import VOCABULARY_FILES, vocabulary_tokenizer

    folder = Path(folder)
    file = folder / "tokenizer.json"
    if file.is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(file))
    else:
        found = [folder / name for name in VOCABULARY_FILES if (folder / name).is_file()]
        if not found:
            raise CheckpointError(f"{folder}: a CTranslate2 Whisper folder needs tokenizer.json "
                                  f"or {' or '.join(VOCABULARY_FILES)}; it has none")
        tok = vocabulary_tokenizer(found[0])
    end = "<|endoftext|>"
    tok.add_special_tokens({"eos_token": end, "bos_token": end, "pad_token": end,
                            "unk_token": end})
    return tok


def whisper_settings(folder: Path, tokenizer) -> tuple[Any, dict, dict[str, str]]:
    """(a transformers WhisperConfig, generation_config.json's fields as the Hub's checkpoints
    have them, the source of each derived setting) from the folder's tensors, config.json and
    tokenizer."""
    from transformers import WhisperConfig

    folder = Path(folder)
    file = CT2File(folder / MODEL_FILE)
    if file.spec != SPEC:
        raise CheckpointError(f"{folder / MODEL_FILE}: a CTranslate2 {file.spec or '(unnamed)'} "
                              f"model; only {SPEC} (Whisper) folders are read")
    for flag, wanted in (("decoder/scale_embeddings", 0), ("decoder/pre_norm", 1),
                         ("decoder/alibi", 0)):
        if file.has(flag) and file.scalar(flag) != wanted:
            raise CheckpointError(f"{folder / MODEL_FILE}: {flag}={file.scalar(flag)} is not "
                                  "Whisper's (not built)")
    ct2 = _ct2_config(folder)
    embed = file.variables["decoder/embeddings/weight"].shape
    ffn = file.variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    ids = tokenizer.convert_tokens_to_ids

    def token(name: str) -> int:
        found = ids(name)
        if found is None or found == tokenizer.unk_token_id and name != "<|endoftext|>":
            raise CheckpointError(f"{folder}: the tokenizer has no {name} token")
        return found

    end, start = token("<|endoftext|>"), token("<|startoftranscript|>")
    suppress = [int(i) for i in ct2.get("suppress_ids", [])]
    begin = [int(i) for i in ct2.get("suppress_ids_begin", [])]
    config = WhisperConfig(
        vocab_size=embed[0], num_mel_bins=file.variables["encoder/conv1/weight"].shape[1],
        d_model=embed[1], encoder_layers=_layers(file, "encoder"),
        decoder_layers=_layers(file, "decoder"),
        encoder_attention_heads=file.scalar("encoder/num_heads"),
        decoder_attention_heads=file.scalar("decoder/num_heads"),
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=file.variables["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=file.variables["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=file.variables["decoder/position_encodings/encodings"].shape[0],
        decoder_start_token_id=start, eos_token_id=end, pad_token_id=end, bos_token_id=end,
        suppress_tokens=suppress, begin_suppress_tokens=begin,
        tie_word_embeddings=file.aliases.get("decoder/projection/weight")
        == "decoder/embeddings/weight",
        architectures=["WhisperForConditionalGeneration"],
    )
    # CTranslate2 and openai-whisper: a multilingual vocabulary has 51865 entries or more.
    multilingual = embed[0] >= 51865
    languages = {tokenizer.convert_ids_to_tokens(int(i)): int(i) for i in ct2.get("lang_ids", [])}
    generation = {
        "decoder_start_token_id": start, "eos_token_id": end, "pad_token_id": end,
        "bos_token_id": end, "no_timestamps_token_id": token("<|notimestamps|>"),
        "prev_sot_token_id": token("<|startofprev|>"), "is_multilingual": multilingual,
        "suppress_tokens": suppress, "begin_suppress_tokens": begin,
        # faster-whisper's default max_initial_timestamp (1.0 s; the folder does not say)
        "max_initial_timestamp_index": 50, "max_length": config.max_target_positions,
    }
    if ct2.get("alignment_heads"):
        generation["alignment_heads"] = [[int(a), int(b)] for a, b in ct2["alignment_heads"]]
    if multilingual:
        generation["lang_to_id"] = languages
        generation["task_to_id"] = {t: token(f"<|{t}|>") for t in ("transcribe", "translate")}
    dtypes = {str(v.dtype).removeprefix("torch.") for v in file.variables.values()
              if v.name.endswith("/weight")}
    sources = {"config": f"{MODEL_FILE} (tensor shapes, num_heads) + config.json",
               "generation": "config.json (suppress_ids, lang_ids, alignment_heads) + "
                             + getattr(tokenizer, "source", "tokenizer.json"),
               "weights": f"CTranslate2 {SPEC} rev {file.revision}, binary v{file.version}, "
                          f"{'/'.join(sorted(dtypes))} weights"}
    return config, generation, sources


# ---- tensors -----------------------------------------------------------------------------------

_NORMS = {"gamma": "weight", "beta": "bias"}


def _layer_tensors(file: CT2File, side: str, i: int) -> Iterator[tuple[str, str, Any]]:
    """(CTranslate2 module, transformers module, row split) of one layer's linears and norms;
    a split is [(name, rows)] of a fused linear."""
    ours = f"model.{side}.layers.{i}"
    src = f"{side}/layer_{i}"
    d = file.variables[f"{src}/self_attention/linear_1/weight"].shape[0]
    yield f"{src}/self_attention/linear_0", ours + ".self_attn", [("q_proj", d), ("k_proj", d),
                                                                   ("v_proj", d)]
    yield f"{src}/self_attention/linear_1", ours + ".self_attn.out_proj", None
    yield f"{src}/self_attention/layer_norm", ours + ".self_attn_layer_norm", None
    if side == "decoder":
        yield f"{src}/attention/linear_0", ours + ".encoder_attn.q_proj", None
        yield f"{src}/attention/linear_1", ours + ".encoder_attn", [("k_proj", d), ("v_proj", d)]
        yield f"{src}/attention/linear_2", ours + ".encoder_attn.out_proj", None
        yield f"{src}/attention/layer_norm", ours + ".encoder_attn_layer_norm", None
    yield f"{src}/ffn/linear_0", ours + ".fc1", None
    yield f"{src}/ffn/linear_1", ours + ".fc2", None
    yield f"{src}/ffn/layer_norm", ours + ".final_layer_norm", None


def _modules(file: CT2File) -> Iterator[tuple[str, str, Any]]:
    yield "encoder/conv1", "model.encoder.conv1", None
    yield "encoder/conv2", "model.encoder.conv2", None
    for i in range(_layers(file, "encoder")):
        yield from _layer_tensors(file, "encoder", i)
    yield "encoder/layer_norm", "model.encoder.layer_norm", None
    for i in range(_layers(file, "decoder")):
        yield from _layer_tensors(file, "decoder", i)
    yield "decoder/layer_norm", "model.decoder.layer_norm", None


@dataclass
class Int8Weight:
    """A linear stored as int8: values [N, K] and scales (w = q / scale) [N]."""

    q: torch.Tensor
    scale: torch.Tensor


def ct2_tensors(file: CT2File, dtype: torch.dtype
                ) -> Iterator[tuple[str, torch.Tensor | Int8Weight]]:
    """(transformers name, tensor) of every weight; int8 linear weights as Int8Weight, the
    other int8 tensors (convolutions, embeddings) dequantized."""

    def weight(src: str, linear: bool) -> torch.Tensor | Int8Weight:
        w = file.read(f"{src}/weight")
        if w.dtype != torch.int8:
            return w
        scale = file.read(f"{src}/weight_scale").float()  # [N]
        if linear:
            return Int8Weight(w, scale)
        return (w.float() / scale.view(-1, *[1] * (w.dim() - 1))).to(dtype)

    for src, ours, split in _modules(file):
        is_norm = src.endswith("layer_norm")
        if is_norm:
            for theirs, name in _NORMS.items():
                yield f"{ours}.{name}", file.read(f"{src}/{theirs}")
            continue
        w = weight(src, linear="conv" not in src)
        bias = file.read(f"{src}/bias") if file.has(f"{src}/bias") else None
        if split is None:
            yield f"{ours}.weight", w
            if bias is not None:
                yield f"{ours}.bias", bias
            continue
        start = 0
        for part, rows in split:
            if isinstance(w, Int8Weight):
                piece = Int8Weight(w.q[start : start + rows], w.scale[start : start + rows])
            else:
                piece = w[start : start + rows]
            yield f"{ours}.{part}.weight", piece
            if bias is not None and part != "k_proj":  # Whisper's key projections: no bias
                yield f"{ours}.{part}.bias", bias[start : start + rows]
            start += rows
    yield "model.encoder.embed_positions.weight", file.read(
        "encoder/position_encodings/encodings")
    yield "model.decoder.embed_positions.weight", file.read(
        "decoder/position_encodings/encodings")
    yield "model.decoder.embed_tokens.weight", weight("decoder/embeddings", linear=False)
    if file.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight":
        yield "proj_out.weight", weight("decoder/projection", linear=False)


def held_bytes(folder: Path, dtype_bytes: int) -> int:
    """The folder's weights as the engine holds them: int8 linears a byte per weight and a
    bfloat16 scale per row, every other tensor at `dtype_bytes` per value (scalars, aliases and
    the converter's zero key biases left out)."""
    file = CT2File(Path(folder) / MODEL_FILE)
    total = 0
    for name, var in file.variables.items():
        if not var.shape or name.endswith("weight_scale"):
            continue
        numel = 1
        for d in var.shape:
            numel *= d
        linear = var.dtype == torch.int8 and "linear_" in name
        if name.endswith(("self_attention/linear_0/bias", "/attention/linear_1/bias")):
            numel -= numel // (3 if "self_attention" in name else 2)  # the keys' zero bias
        total += numel + 2 * var.shape[0] if linear else numel * dtype_bytes
    return total


def load_ctranslate2(path: Path, factory: Callable[[], nn.Module], device: torch.device,
                     dtype: torch.dtype, quantizer: Any = None) -> nn.Module:
    """The model built by `factory`, filled from the folder's model.bin: int8 linears placed
    as our int8 (per channel), every other tensor through models.loader."""
    from models.kernels.quantization import QuantizedLinear
    from models.loader import build_on_meta, load_weights

    file = CT2File(Path(path) / MODEL_FILE)
    model = build_on_meta(factory, device, dtype)
    mapping = model.checkpoint_map()
    int8: dict[str, Int8Weight] = {}

    def dense() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in ct2_tensors(file, dtype):
            if isinstance(tensor, Int8Weight):
                int8[name] = tensor
                target = mapping(name)
                if target is not None:  # load_weights checks the rest: give it a stand-in
                    yield name, (tensor.q.float() / tensor.scale[:, None]).to(dtype)
                continue
            yield name, tensor

    load_weights(model, dense(), mapping, quantizer)
    for name, stored in int8.items():
        target = mapping(name)
        if target is None:
            continue
        owner_name, _, attr = target[0].removesuffix(".weight").rpartition(".")
        owner = model.get_submodule(owner_name)
        linear = getattr(owner, attr)
        if isinstance(linear, QuantizedLinear):
            continue  # quantized on load already (the user asked for it)
        bias = None if linear.bias is None else linear.bias.detach()
        setattr(owner, attr, QuantizedLinear.from_int8(
            stored.q.to(device), (1.0 / stored.scale).to(device), bias,
            group_size=stored.q.shape[1]))
    model.tie_weights()
    return model
