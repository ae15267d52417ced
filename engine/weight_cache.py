"""Weights quantized at load (`quantization`: int8 / int4 from the checkpoint's floats, the int4
grid fitted per group, a GGUF file's blocks repacked) kept on disk, so that the second start of
the same model reads them back instead of quantizing again.

An entry holds the whole model's state after quantization (the quantized linears' packs and
scales, every other tensor at the model dtype) and which modules are quantized, in one file under
`weights/` beside the kernel plan's cache (models.kernels.choice.cache_path; $MMSERVE_WEIGHT_CACHE
overrides the folder, and "0" turns the cache off). Its name is a hash of what decides the
result: each weights file's path, size and modification time (and the projector's), the model
class, the dtype, the context the model is built for, the quantization settings, the torch
version and this format's version; so a changed file or setting misses and is quantized anew,
and a stale entry is never read. An entry that cannot be read back (truncated, corrupt, from
another layout) is logged, removed and rebuilt. Models with LoRA adapters are not cached.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from models.checkpoint import weight_files
from models.gguf.reader import is_gguf
from models.kernels.choice import cache_path
from models.kernels.quantization import QuantizedLinear
from models.loader import on_meta

log = logging.getLogger(__name__)

CACHE_ENV = "MMSERVE_WEIGHT_CACHE"
FORMAT = 1  # bump when an entry's layout or what quantization computes changes


def cache_dir() -> Path | None:
    """The folder of entries (None: turned off by $MMSERVE_WEIGHT_CACHE=0)."""
    root = os.environ.get(CACHE_ENV)
    if root == "0":
        return None
    return Path(root) if root else cache_path().parent / "weights"


def entry_path(path: Path, mmproj: Path | None, model_cls: type, config: EngineConfig,
               dtype: torch.dtype, max_len: int) -> Path | None:
    """Where the quantized weights of this model and these settings are kept (None: not
    cached)."""
    folder = cache_dir()
    if folder is None:
        return None
    files = [path] if is_gguf(path) else weight_files(path)
    files += [mmproj] if mmproj is not None else []
    identity = {
        "format": FORMAT, "torch": torch.__version__,
        "files": [_identity(f) for f in files],
        "model": f"{model_cls.__module__}.{model_cls.__qualname__}",
        "dtype": str(dtype), "max_len": max_len,
        "quantization": config.quantization, "group_size": config.quantization_group_size,
        "dequantize_gguf": config.dequantize_gguf,
    }
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{Path(path).name[:48]}-{digest}.pt"


def _identity(file: Path) -> list:
    stat = Path(file).stat()
    return [str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns]


def save(entry: Path, model: nn.Module, summary: str) -> None:
    """Keep `model`'s quantized state in `entry` (written to a temporary name, then moved: a
    reader never sees half an entry). A failure to write is logged, not raised."""
    quantized = {name: [m.mode, m.in_features, m.group_size]
                 for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    state = {"format": FORMAT, "summary": summary, "quantized": quantized,
             "state": model.state_dict()}
    tmp = entry.with_suffix(f".tmp{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, tmp)
        os.replace(tmp, entry)
    except OSError as e:
        log.warning("could not keep the quantized weights in %s: %s", entry, e)
        tmp.unlink(missing_ok=True)
        return
    log.info("quantized weights kept in %s (%.0f MiB): the next start reads them back", entry,
             entry.stat().st_size / 2**20)


def load(entry: Path, factory: Callable[[], nn.Module], device: torch.device,
         dtype: torch.dtype) -> tuple[nn.Module, str] | None:
    """The model built by `factory` with its state read from `entry` (mapped from the file),
    and the load summary saved with it; None when there is no entry or it cannot be read back
    (then it is removed, and the caller quantizes anew)."""
    if not entry.exists():
        return None
    try:
        saved = torch.load(entry, map_location="cpu", mmap=True, weights_only=True)
        if saved.get("format") != FORMAT:
            raise ValueError(f"format {saved.get('format')!r}, expected {FORMAT}")
        model = _restore(saved, factory, device, dtype)
    except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
        log.warning("the cached quantized weights %s cannot be read back (%s: %s); removed, "
                    "quantizing anew", entry, type(e).__name__, e)
        entry.unlink(missing_ok=True)
        return None
    log.info("quantized weights read back from %s", entry)
    return model, saved["summary"]


def _restore(saved: dict, factory: Callable[[], nn.Module], device: torch.device,
             dtype: torch.dtype) -> nn.Module:
    state = saved["state"]
    with on_meta():
        model = factory()
    model = model.to(dtype=dtype)
    for name, (mode, in_features, group_size) in saved["quantized"].items():
        owner, _, attr = name.rpartition(".")
        layer = QuantizedLinear._from_values(
            mode, state[f"{name}.qweight"], in_features, state[f"{name}.scales"],
            state.get(f"{name}.bias"), group_size)
        setattr(model.get_submodule(owner) if owner else model, attr, layer)
    model.load_state_dict(state, strict=True, assign=True)
    for owner_name, owner in model.named_modules():
        for attr, param in owner._parameters.items():
            if param is not None and param.is_meta:
                raise ValueError(f"the entry has no {owner_name}.{attr}")
        for attr, buffer in list(owner._buffers.items()):  # not saved: as build_on_meta
            if buffer is not None and buffer.is_meta:
                owner._buffers[attr] = torch.empty_like(buffer, device=device)
    return model
