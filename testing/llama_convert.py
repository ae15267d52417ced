"""llama.cpp's own converter (`convert_hf_to_gguf.py`, with `--mmproj` for a multimodal model's
tower and projector) run on a local checkpoint, for tests and benches: GGUF files as Ollama and
LM Studio users get them, written by the real converter rather than by a writer of ours.

The converter is not part of llama-cpp-python's wheel, so its source distribution (which vendors
llama.cpp's `convert_hf_to_gguf.py`, `conversion/` and `gguf-py/`) is fetched once with pip from
the package index into the cache (`pip download --no-binary :all: --no-deps`) and those files
extracted; no llama.cpp build is needed. The version is the installed llama-cpp-python's, else
PINNED (the one the benches' llama.cpp runs).

The converter runs in a child process with a few shims for test checkpoints, none of which
changes a tensor's values: their locally trained tokenizers' pre-tokenizer (which the converter
recognises by a hash of known ones) is declared Qwen2's; without `sentencepiece` installed a
checkpoint with no `tokenizer.model` takes the converter's byte-level BPE path as it would with
it; Gemma 4's converter, which reads a SentencePiece-style vocabulary, is given the byte-level
BPE path; transformers 5 saves Gemma 3's SigLIP tower as `vision_tower.*` where the converter
reads the Hub's `vision_tower.vision_model.*`; and Gemma 3's embedding keeps every row of the
model (the converter cuts it to the tokenizer's length, where our tokenizers are the smaller).
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PINNED = "0.3.36"
_MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")

# argv: the converter's source folder, then a JSON list of the converter's argument lists (one
# conversion each, in one process: the converter's imports are most of a small conversion's time).
_SHIMS = """
import sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
_sentencepiece = base.TextModel._create_vocab_sentencepiece
def _sentencepiece_or_missing(self):
    if not (self.dir_model / "tokenizer.model").is_file():
        raise FileNotFoundError(self.dir_model / "tokenizer.model")
    return _sentencepiece(self)
base.TextModel._create_vocab_sentencepiece = _sentencepiece_or_missing
import conversion.gemma as gemma
gemma.Gemma4Model.set_vocab = base.TextModel._set_vocab_gpt2
_gemma3_tensors = gemma.Gemma3VisionModel.modify_tensors
def _gemma3_tower_names(self, data, name, bid):
    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
        name = "vision_tower.vision_model." + name[len("vision_tower."):]
    return _gemma3_tensors(self, data, name, bid)
gemma.Gemma3VisionModel.modify_tensors = _gemma3_tower_names
_gemma3_text = gemma.Gemma3Model.modify_tensors
def _gemma3_all_rows(self, data, name, bid):
    if "embed_tokens.weight" in name:
        return super(gemma.Gemma3Model, self).modify_tensors(data, name, bid)
    return _gemma3_text(self, data, name, bid)
gemma.Gemma3Model.modify_tensors = _gemma3_all_rows
import json
import convert_hf_to_gguf as convert
for args in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", *args]
    convert.main()
"""


def cache_root() -> Path:
    """Where fetched and converted files are kept (`$MMSERVE_CACHE`, else ~/.cache/mmserve)."""
    return Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve"))


def converter_version() -> str:
    """The installed llama-cpp-python's version, else PINNED."""
    try:
        return importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        return PINNED


def converter_source(version: str | None = None) -> Path:
    """llama.cpp's converter files from llama-cpp-python's source distribution at `version`
    (converter_version() by default), fetched once into the cache. Raises
    subprocess.CalledProcessError when pip cannot download it."""
    version = version or converter_version()
    root = cache_root() / "bench" / f"llama.cpp-{version}-convert"
    if (root / "convert_hf_to_gguf.py").exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary",
             ":all:", f"llama-cpp-python=={version}", "--dest", tmp],
            check=True,
        )
        (archive,) = Path(tmp).glob("*.tar.gz")
        staging = Path(tmp) / "convert"
        with tarfile.open(archive) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            for member in tar.getmembers():
                rel = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and rel.startswith(_MEMBERS) and member.isfile():
                    member.name = rel
                    tar.extract(member, staging, filter="data")
        staging.rename(root)  # whole or not at all
    return root


def convert(checkpoint: Path, out: Path, outtype: str = "f32", mmproj: bool = False,
            source: Path | None = None) -> Path:
    """`checkpoint` written by llama.cpp's converter as a GGUF at `out` (`outtype`: f32, f16,
    bf16, q8_0); `mmproj`: its tower and projector instead of its text model. Raises
    RuntimeError with the converter's last lines when it fails."""
    convert_many([(checkpoint, out, outtype, mmproj)], source)
    return out


def convert_many(jobs: list[tuple[Path, Path, str, bool]], source: Path | None = None) -> None:
    """Several conversions (checkpoint, out, outtype, mmproj) in one converter process."""
    import json

    source = source or converter_source()
    argv = [[str(checkpoint), "--outtype", outtype, "--outfile", str(out)]
            + (["--mmproj"] if mmproj else []) for checkpoint, out, outtype, mmproj in jobs]
    done = subprocess.run([sys.executable, "-c", _SHIMS, str(source), json.dumps(argv)],
                          capture_output=True, text=True)
    for checkpoint, out, _, mmproj in jobs:
        prefixed = out.with_name("mmproj-" + out.name)  # where some converter versions write it
        if mmproj and not out.exists() and prefixed.exists():
            prefixed.rename(out)
        if done.returncode or not out.exists():
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-8:])
            raise RuntimeError(f"llama.cpp's converter failed on {checkpoint}:\n{tail}")


def round_to_half(checkpoint: Path) -> Path:
    """The checkpoint's floating-point weights rounded to float16's grid, in place (kept in
    their own dtype): the tensors the converter writes as F16 whatever `--outtype` asks (a
    Whisper tower's convolutions, Gemma 3's projection) then hold the checkpoint's values, so
    that a GGUF and its checkpoint compute alike in float32."""
    import torch
    from safetensors.torch import load_file, save_file

    for file in sorted(checkpoint.glob("*.safetensors")):
        state = load_file(str(file))
        rounded = {name: t.to(torch.float16).to(t.dtype) if t.is_floating_point() else t
                   for name, t in state.items()}
        save_file(rounded, str(file), metadata={"format": "pt"})
    return checkpoint
