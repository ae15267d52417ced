"""Weight files mapped into memory read-only, whose tensors are views of the mapping: weights
stored in the form they run in (a GGUF file's ggml blocks, a safetensors tensor at the model
dtype) are used where they lie in the file, not copied.

The pages are the kernel's page cache: shared with every other process that maps or reads the
file, read in as a forward first touches them, and given back under memory pressure (they are
clean: the file holds them). One mapping per file (`map_file` hands out the live one again:
two models or a draft of the same file share it). A mapping lives as long as any tensor
viewing it (each view holds the buffer, so the mapping cannot be closed under a tensor), and a
model keeps the `MappedFile`s its weights view (`keep`), so that it is closed with the model.
A view does not hold its `MappedFile` (only the bytes): whoever hands out views holds the
`MappedFile` until a model keeps it, or `is_mapped` stops knowing the views (and the next
`map_file` maps the file again).

The mapping is PROT_READ: a write into a mapped weight faults (the process stops with SIGSEGV)
instead of reaching the file or silently copying the page. Nothing of ours writes into a
weight after loading (tests/test_mapped_weights.py checks a whole load and a forward leave the
bytes as the file holds them). MMSERVE_MAP_WEIGHTS=0 reads the weights into process memory
instead (as before mapping; then they are placed in huge pages: models/kernels/huge_pages.py).
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
import weakref
from pathlib import Path

import torch
from torch import nn

DISABLE_ENV = "MMSERVE_MAP_WEIGHTS"  # "0": weights read into process memory, not mapped

_LIVE: weakref.WeakValueDictionary[tuple, MappedFile] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def enabled() -> bool:
    """Whether weights stored as they run are mapped from their files (MMSERVE_MAP_WEIGHTS)."""
    return os.environ.get(DISABLE_ENV, "1") != "0"


class MappedFile:
    """One file mapped read-only: `view` hands out tensors of its bytes (no copy)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # "not writable": read-only is the point
            warnings.simplefilter("ignore", UserWarning)
            self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.start = self._bytes.data_ptr()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes [offset, offset + nbytes) of the file, uint8 [nbytes], a view of the map."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ValueError(f"{self.path.name}: bytes {offset} to {offset + nbytes} are past "
                             f"the end of the file ({self.size} bytes)")
        return self._bytes[offset:offset + nbytes]

    def typed(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of `dtype` and `shape` whose bytes start at `offset`, a view of the map
        (the offset must be a multiple of the dtype's size)."""
        numel = 1
        for d in shape:
            numel *= d
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError(f"{self.path.name}: offset {offset} is not aligned to {dtype}")
        return self.view(offset, numel * itemsize).view(dtype).view(shape)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s bytes lie in this mapping."""
        if tensor.device.type != "cpu":
            return False
        pointer = tensor.untyped_storage().data_ptr()
        return self.start <= pointer < self.start + max(self.size, 1)

    def drop_pages_except(self, tensors: list[torch.Tensor]) -> int:
        """Hand back this process's hold on the pages of bytes none of `tensors` views (the
        tensors read through the mapping and copied at load): they stay in the page cache but
        leave the resident set. -> bytes dropped."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        ranges = sorted((t.data_ptr() - self.start, t.data_ptr() - self.start + t.nbytes)
                        for t in tensors if self.holds(t))
        dropped, at = 0, 0
        for first, last in [*ranges, (self.size, self.size)]:
            dropped += self.drop_pages(at, first)  # the bytes between viewed tensors
            at = max(at, last)
        return dropped

    def drop_pages(self, first: int, last: int) -> int:
        """Hand back this process's hold on the whole pages within bytes [first, last) of the
        file (they stay in the page cache; a later read faults them back). -> bytes dropped."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return 0
        page = mmap.PAGESIZE
        start, end = -(-first // page) * page, last // page * page
        if end <= start:
            return 0
        self._map.madvise(mmap.MADV_DONTNEED, start, end - start)
        return end - start

    def __repr__(self) -> str:
        return f"MappedFile({self.path}, {self.size} bytes)"


def map_file(path: Path) -> MappedFile:
    """The live read-only mapping of the file at `path`, made if there is none (a file
    replaced since, with another size or modification time, is mapped anew)."""
    stat = Path(path).stat()
    key = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
    with _LOCK:
        found = _LIVE.get(key)
        if found is None:
            found = _LIVE[key] = MappedFile(path)
        return found


def is_mapped(tensor: torch.Tensor) -> bool:
    """Whether `tensor` views a live mapped file (so it is read-only, and not to be copied
    into memory of the process's own)."""
    return any(m.holds(tensor) for m in list(_LIVE.values()))


def let_go(tensor: torch.Tensor) -> None:
    """Drop from the resident set the whole pages of `tensor`'s bytes if it views a live
    mapping (read through once, say quantized from: the page cache keeps them, and a later
    read faults them back); otherwise nothing."""
    if not tensor.is_contiguous():
        return
    for mapping in list(_LIVE.values()):
        if mapping.holds(tensor):
            first = tensor.data_ptr() - mapping.start
            mapping.drop_pages(first, first + tensor.nbytes)
            return


def keep(model: nn.Module, files: list[MappedFile]) -> None:
    """Let `model` hold those of `files` its parameters or buffers view (closed when the model
    goes; a mapping no weight views is left to go now), and drop from the resident set the
    pages of the bytes no weight views (read through the mapping and copied)."""
    held = list(getattr(model, "mapped_files", ()))
    tensors = [*model.parameters(), *model.buffers()]
    for file in files:
        if all(file is not other for other in held) and any(file.holds(t) for t in tensors):
            held.append(file)
    for file in held:
        file.drop_pages_except(tensors)
    model.mapped_files = tuple(held)


def mapped_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s parameters and buffers that view mapped files."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen and is_mapped(tensor):
            seen.add(tensor.data_ptr())
            total += tensor.nbytes
    return total
