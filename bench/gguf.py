"""Bench-only: GGUF copies of a checkpoint at llama.cpp's precisions, for bench.generate's
llama.cpp column.

    python -m bench.gguf [--model PATH] [--types f32,bf16,q8_0,q4_0]

Needs `llama-cpp-python` (built from source by pip; never a runtime dependency) for q4_0.
The converter is not part of llama-cpp-python's wheel: testing/llama_convert.py fetches its
source distribution (which vendors llama.cpp's `convert_hf_to_gguf.py`) once from the package
index into the cache and runs the converter there (with the shims it lists for test
checkpoints: their locally trained tokenizers and transformers 5's names). f32 / bf16 / q8_0
are written by the converter, q4_0 by llama.cpp's own quantizer from the f32 file (bf16 for a
bfloat16 checkpoint, which it holds exactly).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import build_checkpoint, cache_dir
from testing.llama_convert import convert

CONVERTED = ("f32", "bf16", "q8_0")
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
# llama.cpp's quantizer's target types, for a GGUF made from another GGUF (requantize).
FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
          "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def _lossless(model: Path) -> str:
    """The converted type that holds the checkpoint's weights exactly (q4_0's source): bf16
    for a bfloat16 checkpoint (half the bytes of f32), else f32."""
    import json

    config = json.loads((model / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype")
    return "bf16" if dtype == "bfloat16" else "f32"


def ensure_gguf(model: Path, kind: str) -> Path:
    """The GGUF of `model` at `kind` (f32, bf16, q8_0 or q4_0), converted once and cached."""
    folder = cache_dir("gguf")
    folder.mkdir(exist_ok=True)
    out = folder / f"{model.name}-{kind}.gguf"
    if out.exists():
        return out
    if kind in CONVERTED:
        print(f"converting {model.name} to {kind} GGUF (once)")
        convert(model, out, kind)
    elif kind in QUANTIZED:
        import llama_cpp

        source = ensure_gguf(model, _lossless(model))
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = getattr(llama_cpp, QUANTIZED[kind])
        print(f"quantizing {source.name} to {kind} (once)")
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
        if failed:
            out.unlink(missing_ok=True)
            raise RuntimeError(f"llama.cpp could not quantize {source} to {kind}")
    else:
        raise ValueError(f"unknown GGUF type {kind!r}: {', '.join([*CONVERTED, *QUANTIZED])}")
    return out


def requantize(source: Path, kind: str) -> Path:
    """`source` (a GGUF) at `kind` (FTYPES), written once by llama.cpp's own quantizer into the
    cache: blocks of the source are dequantized first (its requantize option), so an f32 file
    holds exactly the values the source's blocks stand for. llama.cpp's default rules apply
    (a q4 file's embeddings and head may get a wider type, as its users get them)."""
    import llama_cpp

    if kind not in FTYPES:
        raise ValueError(f"unknown GGUF type {kind!r}: {', '.join(FTYPES)}")
    folder = cache_dir("gguf")
    folder.mkdir(exist_ok=True)
    out = folder / f"{source.stem}-{kind}.gguf"
    if out.exists():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.allow_requantize = True
    print(f"llama.cpp: {source.name} -> {kind} (once)")
    failed = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    if failed:
        out.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not write {source} as {kind}")
    return out


def ensure_mmproj(model: Path, kind: str = "bf16") -> Path:
    """The vision (or audio) projector of a multimodal `model` as llama.cpp's converter writes it
    (`--mmproj`: the tower and its projector, for libmtmd) at `kind`, converted once and
    cached."""
    folder = cache_dir("gguf")
    folder.mkdir(exist_ok=True)
    out = folder / f"{model.name}-mmproj-{kind}.gguf"
    if out.exists():
        return out
    print(f"converting {model.name}'s projector to {kind} GGUF (once)")
    return convert(model, out, kind, mmproj=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--types", default="f32,bf16,q8_0,q4_0")
    args = parser.parse_args()
    model = args.model or build_checkpoint()
    for kind in args.types.split(","):
        print(ensure_gguf(model, kind))


if __name__ == "__main__":
    main()
