"""Weights quantized at load (`quantization`: int8 / int4 from the checkpoint's floats, the int4
grid fitted per group, a GGUF file's blocks repacked) kept on disk, so that the second start of
the same model reads them back instead of quantizing again.

A GGUF file run as stored keeps only the blocks repacked for our kernels (`KeptRepacks`, the
store models/gguf/repacks.py reads and fills): one entry per file (named by the file's identity
and the layouts' version, whatever the model's settings), holding each repacked weight under
the names of the file's tensors it was made of.

An entry holds the whole model's state after quantization (the quantized linears' packs and
scales, every other tensor at the model dtype) and which modules are quantized, in one file under
`weights/` beside the kernel plan's cache (models.kernels.choice.cache_path; $MMSERVE_WEIGHT_CACHE
overrides the folder, "0" turns the cache off and "1" keeps it on in its default folder). Its
name is a hash of what decides the result: each weights file's path, size and modification
time (and the projector's), the model class, the dtype, the context the model is built for, the
quantization settings, the torch version and this format's version; so a changed file or
setting misses and is quantized anew, and a stale entry is never read. An entry that cannot be
read back (truncated, corrupt, from another layout) is logged, removed and rebuilt. Models with
LoRA adapters are not cached.

An entry is a safetensors file (what it is for in its metadata), read back mapped: its tensors
are views of the file's read-only mapping (models/mapped_files.py), so a second start copies
nothing, its pages are the page cache's (shared, given back under pressure), and the resident
set holds the quantized weights once, not a copy beside the pages read.
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
from models import mapped_files
from models.checkpoint import safetensors_header, weight_files
from models.gguf.reader import is_gguf
from models.kernels.choice import cache_path
from models.kernels.ggml_blocks import REPACK_FORMAT
from models.kernels.quantization import QuantizedLinear
from models.loader import SAFETENSORS_DTYPES, empty_off_meta, on_meta

log = logging.getLogger(__name__)

CACHE_ENV = "MMSERVE_WEIGHT_CACHE"
FORMAT = 3  # bump when an entry's layout or what quantization computes changes


def cache_dir() -> Path | None:
    """The folder of entries: $MMSERVE_WEIGHT_CACHE's, else the default one (also for "1",
    "on", "true": on, not a folder named so); None where it says "0", "off" or "false"."""
    root = (os.environ.get(CACHE_ENV) or "").strip()
    if root.lower() in ("0", "off", "false"):
        return None
    if not root or root.lower() in ("1", "on", "true"):
        return cache_path().parent / "weights"
    return Path(root)


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
    return folder / f"{Path(path).name[:48]}-{digest}.safetensors"


def repacks_path(path: Path) -> Path | None:
    """Where the repacked blocks of the GGUF file at `path` are kept (None: not cached)."""
    folder = cache_dir()
    if folder is None:
        return None
    identity = {"format": FORMAT, "repack": REPACK_FORMAT, "file": _identity(path)}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{Path(path).name[:48]}-{digest}.repacked.safetensors"


class KeptRepacks:
    """A GGUF file's repacked blocks kept in an entry (models.gguf.repacks.RepackStore): what
    the entry holds is read back as views of its mapping; what is put is written, with it, by
    `save` (a new entry replacing the old one, and removing the entries kept for an earlier
    state of the same file: another size or modification time, an older layout). An entry
    that cannot be read is logged and removed (its blocks are repacked anew)."""

    def __init__(self, entry: Path, source: Path) -> None:
        """`entry`: where (repacks_path); `source`: the GGUF file the blocks come from."""
        self.entry, self.source = entry, str(Path(source).resolve())
        self._blocks: dict[str, tuple[str, torch.Tensor]] = {}
        self._new: set[str] = set()
        self._mapping: mapped_files.MappedFile | None = None
        if entry.exists():
            try:
                self._read()
            except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
                log.warning("the kept repacked blocks %s cannot be read back (%s: %s); "
                            "removed, repacking anew", entry, type(e).__name__, e)
                self._blocks.clear()
                self._mapping = None
                entry.unlink(missing_ok=True)

    def _read(self) -> None:
        metadata, state, self._mapping = _read(self.entry)
        layouts = json.loads(metadata["layouts"])
        self._blocks = {key: (layouts[key], blocks) for key, blocks in state.items()}

    def get(self, key: str) -> tuple[str, torch.Tensor] | None:
        return self._blocks.get(key)

    def put(self, key: str, kernel_type: str, blocks: torch.Tensor) -> None:
        self._blocks[key] = (kernel_type, blocks)
        self._new.add(key)

    def save(self) -> bool:
        if not self._new:
            return True
        tensors = {key: blocks for key, (_, blocks) in self._blocks.items()}
        metadata = {"format": str(FORMAT), "aliases": "{}", "source": self.source,
                    "layouts": json.dumps(
                        {key: layout for key, (layout, _) in self._blocks.items()})}
        tmp = self.entry.with_suffix(f".tmp{os.getpid()}")
        try:
            self.entry.parent.mkdir(parents=True, exist_ok=True)
            _write(tmp, tensors, metadata)
            os.replace(tmp, self.entry)
            self._read()
        except (OSError, ValueError) as e:
            log.warning("could not keep the repacked blocks in %s: %s", self.entry, e)
            tmp.unlink(missing_ok=True)
            return False
        self._new.clear()
        log.info("repacked blocks kept in %s (%.0f MiB): the next start reads them back",
                 self.entry, self.entry.stat().st_size / 2**20)
        self._remove_stale()
        return True

    def _remove_stale(self) -> None:
        """Remove the other entries kept for this file (its earlier states: they would never
        be read again, and each is as large as the file's repacked blocks)."""
        for other in self.entry.parent.glob("*.repacked.safetensors"):
            try:
                source = (safetensors_header(other).get("__metadata__") or {}).get("source")
            except Exception:  # noqa: BLE001 - not an entry we can read: not ours to remove
                continue
            if other != self.entry and source == self.source:
                other.unlink(missing_ok=True)
                log.info("removed %s, kept for an earlier state of %s", other, self.source)

    def mappings(self) -> list[mapped_files.MappedFile]:
        return [self._mapping] if self._mapping is not None else []


def _identity(file: Path) -> list:
    stat = Path(file).stat()
    return [str(Path(file).resolve()), stat.st_size, stat.st_mtime_ns]


def save(entry: Path, model: nn.Module, summary: str) -> None:
    """Keep `model`'s quantized state in `entry` (written to a temporary name, then moved: a
    reader never sees half an entry). A failure to write is logged, not raised."""
    quantized = {name: [m.mode, m.in_features, m.group_size]
                 for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    tensors, aliases, seen = {}, {}, {}
    for name, tensor in model.state_dict().items():
        key = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride())
        if key in seen:  # a tied weight: kept once, the other name points at it
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = tensor.detach().contiguous()
    metadata = {"format": str(FORMAT), "summary": summary, "quantized": json.dumps(quantized),
                "aliases": json.dumps(aliases)}
    tmp = entry.with_suffix(f".tmp{os.getpid()}")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        _write(tmp, tensors, metadata)
        os.replace(tmp, entry)
    except OSError as e:
        log.warning("could not keep the quantized weights in %s: %s", entry, e)
        tmp.unlink(missing_ok=True)
        return
    log.info("quantized weights kept in %s (%.0f MiB): the next start reads them back", entry,
             entry.stat().st_size / 2**20)


_WRITE_BYTES = 64 << 20  # written a piece at a time, so a mapped weight is not read whole
_ALIGN = 64  # every tensor of an entry starts at a multiple of this many bytes
_PAD = "__pad"  # the bytes between two tensors, named as a tensor (safetensors has no gaps)
_SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def _write(file: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """`tensors` as a safetensors file, streamed (no copy of the model in memory): after a
    header padded to a multiple of 64 bytes, each tensor at a multiple of 64 bytes (the bytes
    between are a `_PAD` tensor each), so that every tensor maps as a view as aligned as
    memory of the process's own (PyTorch's int8 kernel faults on a weight 8 bytes off)."""
    names = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict[str, dict] = {"__metadata__": metadata}
    offset, order = 0, []
    for name in names:
        if offset % _ALIGN:
            pad = torch.zeros(-offset % _ALIGN, dtype=torch.uint8)
            order.append((f"{_PAD}{len(order)}", pad))
            header[order[-1][0]] = {"dtype": "U8", "shape": [pad.numel()],
                                    "data_offsets": [offset, offset + pad.numel()]}
            offset += pad.numel()
        t = tensors[name]
        order.append((name, t))
        header[name] = {"dtype": _SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 64)
    with open(file, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for _, tensor in order:
            data = tensor.reshape(-1).view(torch.uint8)
            for first in range(0, data.numel(), _WRITE_BYTES):
                piece = data[first:first + _WRITE_BYTES]
                f.write(piece.numpy().data)
                mapped_files.let_go(piece)  # a mapped weight's pages, read to be written


def load(entry: Path, factory: Callable[[], nn.Module], device: torch.device,
         dtype: torch.dtype) -> tuple[nn.Module, str] | None:
    """The model built by `factory` with its state read from `entry` (views of the file's
    mapping, which the model keeps), and the load summary saved with it; None when there is
    no entry or it cannot be read back (then it is removed, and the caller quantizes anew)."""
    if not entry.exists():
        return None
    try:
        metadata, state, mapping = _read(entry)
        model = _restore(state, json.loads(metadata["quantized"]), factory, device, dtype)
        mapped_files.keep(model, [mapping])
    except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
        log.warning("the cached quantized weights %s cannot be read back (%s: %s); removed, "
                    "quantizing anew", entry, type(e).__name__, e)
        entry.unlink(missing_ok=True)
        return None
    log.info("quantized weights read back from %s", entry)
    return model, metadata["summary"]


def _read(entry: Path) -> tuple[dict[str, str], dict[str, torch.Tensor],
                                mapped_files.MappedFile]:
    """An entry's metadata and its tensors, each a view of the file's mapping."""
    header = safetensors_header(entry)
    metadata = header.pop("__metadata__", None) or {}
    if metadata.get("format") != str(FORMAT):
        raise ValueError(f"format {metadata.get('format')!r}, expected {FORMAT}")
    with open(entry, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")  # the data follows the header
    mapping = mapped_files.map_file(entry)
    state = {}
    for name, info in header.items():
        if name.startswith(_PAD):
            continue
        first, last = info["data_offsets"]
        dtype, shape = SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"])
        data = mapping.view(start + first, last - first)
        if (start + first) % dtype.itemsize:  # not where a view of dtype can start: a copy
            data = data.clone()
        state[name] = data.view(dtype).view(shape)  # a wrong byte count fails here
    for name, target in json.loads(metadata["aliases"]).items():
        state[name] = state[target]
    return metadata, state, mapping


def _restore(state: dict[str, torch.Tensor], quantized: dict[str, list],
             factory: Callable[[], nn.Module], device: torch.device,
             dtype: torch.dtype) -> nn.Module:
    with on_meta():
        model = factory()
    model = model.to(dtype=dtype)
    for name, (mode, in_features, group_size) in quantized.items():
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
                owner._buffers[attr] = empty_off_meta(buffer, device)
    return model
