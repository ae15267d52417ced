"""Bench-only: GGUF copies of a checkpoint at llama.cpp's precisions, for bench.generate's
llama.cpp column.

    python -m bench.gguf [--model PATH] [--types f32,bf16,q8_0,q4_0]

Needs `llama-cpp-python` (built from source by pip; never a runtime dependency) and
`sentencepiece`. The converter is not part of llama-cpp-python's wheel, so its source
distribution (which vendors llama.cpp's `convert_hf_to_gguf.py`) is fetched once from the
package index into the cache and the converter's files extracted. f32 / bf16 / q8_0 are written
by the converter, q4_0 by llama.cpp's own quantizer from the f32 file (bf16 for a bfloat16
checkpoint, which it holds exactly).

Test checkpoints carry locally trained tokenizers, whose pre-tokenizer the converter does not
recognise by hash; the speed measured does not depend on it (prompts are token ids), so the
conversion declares Qwen2's. For the same reason Gemma 4's converter, which reads a
SentencePiece-style vocabulary (the Hub's tokenizer), is given the byte-level BPE path instead.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from bench.common import build_checkpoint, cache_dir

CONVERTED = ("f32", "bf16", "q8_0")
QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}
# llama.cpp's quantizer's target types, for a GGUF made from another GGUF (requantize).
FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "bf16": "LLAMA_FTYPE_MOSTLY_BF16",
          "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# Runs the vendored converter with a declared pre-tokenizer (argv: source dir, then the
# converter's own arguments).
_CONVERT = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import conversion.gemma as gemma
gemma.Gemma4Model.set_vocab = base.TextModel._set_vocab_gpt2
# transformers 5 saves Gemma 3's SigLIP tower as vision_tower.*; the converter's names are the
# Hub's (transformers 4) vision_tower.vision_model.*
_gemma3_tensors = gemma.Gemma3VisionModel.modify_tensors
def _gemma3_tower_names(self, data, name, bid):
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    return _gemma3_tensors(self, data, name, bid)
gemma.Gemma3VisionModel.modify_tensors = _gemma3_tower_names
# the converter cuts Gemma 3's embedding to the tokenizer's size; the vocabulary it writes is
# padded to the model's (our tokenizers are small), so every row is kept, as the model has them
_gemma3_text = gemma.Gemma3Model.modify_tensors
def _gemma3_all_rows(self, data, name, bid):
    if "embed_tokens.weight" in name:
        return super(gemma.Gemma3Model, self).modify_tensors(data, name, bid)
    return _gemma3_text(self, data, name, bid)
gemma.Gemma3Model.modify_tensors = _gemma3_all_rows
import convert_hf_to_gguf as convert
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
convert.main()
"""


def converter_source() -> Path:
    """llama.cpp's converter files, from the installed llama-cpp-python's source distribution."""
    version = importlib.metadata.version("llama-cpp-python")
    root = cache_dir(f"llama.cpp-{version}-convert")
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", f"llama-cpp-python=={version}", "--dest", tmp],
            check=True,
        )
        (archive,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(archive) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            for member in tar.getmembers():
                rel = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and rel.startswith(_MEMBERS) and member.isfile():
                    member.name = rel
                    tar.extract(member, root, filter="data")
    return root


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
        subprocess.run(
            [sys.executable, "-c", _CONVERT, str(converter_source()), str(model),
             "--outtype", kind, "--outfile", str(out)],
            check=True, stdout=subprocess.DEVNULL,
        )
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
    subprocess.run(
        [sys.executable, "-c", _CONVERT, str(converter_source()), str(model), "--mmproj",
         "--outtype", kind, "--outfile", str(out)],
        check=True, stdout=subprocess.DEVNULL,
    )
    prefixed = out.with_name("mmproj-" + out.name)  # where some converter versions write it
    if not out.exists() and prefixed.exists():
        prefixed.rename(out)
    return out


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
