"""Reads a GGUF file's header: its metadata keys and its tensor table (names, shapes, block
types, where the bytes lie), checked against the file before any tensor is read.

The layout (GGUF v2 / v3, little-endian): "GGUF", the version (u32), the tensor count and the
metadata count (u64 each), the metadata as (key, type, value), then per tensor its name, its
dimensions (innermost first), its ggml type and the offset of its data from the start of the data
section, which begins at the next multiple of `general.alignment` (32 when absent). Every
problem is a GGUFError naming the file and the key or tensor, and the value.

String arrays (a vocabulary of 262,144 tokens) are read in one pass over the bytes; numeric
arrays as numpy arrays. The header is parsed through a read-only mapping closed afterwards.
Tensors dequantized at load are read with plain reads (no page of the file stays mapped for
them); tensors run as stored are `view`s of the file's one long-lived read-only mapping
(models/mapped_files.py: no copy, the page cache's pages).
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from models.checkpoint import CheckpointError

if TYPE_CHECKING:  # the header is read without torch (the app's model picker)
    import torch

    from models.mapped_files import MappedFile

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_COUNT = 1 << 24  # tensors or metadata keys: any count above is a corrupt header
LAZY_STRINGS = 4096  # string arrays longer than this are split into strings when first read

# Metadata value types: fixed-size scalars (struct format), string (8) and array (9).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")


class GGUFError(CheckpointError):
    """A GGUF file that cannot be read as one: the message names the file, the key or tensor,
    and the value."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the table: `shape` in PyTorch's order (outermost first), `offset` from the
    start of the file, `nbytes` of its blocks."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int
    nbytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# The last header parsed, by the file's identity: a start-up reads one file's header from a few
# places (config, tokenizer, weights), and a vocabulary's strings take a while to parse.
_last_parse: tuple[tuple, tuple] | None = None


class GGUFFile:
    """A GGUF file's metadata and tensor table (`metadata`: key -> value; strings as str,
    numeric arrays as numpy arrays, string arrays as lists). Read-only: a file parsed just before
    (same path, size and modification time) shares the earlier parse."""

    def __init__(self, path: Path) -> None:
        global _last_parse
        self.path = Path(path)
        try:
            f = open(self.path, "rb")  # noqa: SIM115 - closed below, after the mapping
        except OSError as e:
            raise GGUFError(f"{self.path.name}: cannot read the file ({e.strerror})") from e
        with f:
            stat = os.fstat(f.fileno())
            identity = (str(self.path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
            if f.seek(0, 2) < 4:
                raise GGUFError(f"{self.path.name}: not a GGUF file ({f.tell()} bytes)")
            self.file_size = stat.st_size
            if _last_parse is not None and _last_parse[0] == identity:
                parsed = _last_parse[1]
            else:
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                    parsed = _Parser(data, self.path.name).parse()
                _last_parse = (identity, parsed)
        self.version, self.metadata, self.tensors, self.data_start = parsed
        self._mapping: MappedFile | None = None

    @cached_property
    def tensor_by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    @property
    def architecture(self) -> str:
        return self.metadata["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def type_counts(self) -> dict[str, int]:
        """Tensors per ggml type, most common first."""
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))

    def read(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes as stored, uint8 [rows, bytes per row] (plain reads)."""
        out = np.empty(info.nbytes, dtype=np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(info.offset)
            view = memoryview(out)
            got = 0
            while got < info.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise GGUFError(f"{self.path.name} ends inside tensor {info.name}")
                got += n
        rows = info.numel // info.shape[-1] if info.shape else 1
        return out.reshape(rows, -1)

    def mapping(self) -> MappedFile:
        """The file's read-only mapping (one per file, shared: models.mapped_files), held by
        this object from its first use (views do not hold the MappedFile, only its bytes)."""
        from models.mapped_files import map_file

        if self._mapping is None:
            self._mapping = map_file(self.path)
        return self._mapping

    def view(self, info: TensorInfo) -> torch.Tensor:
        """A tensor's bytes as stored, uint8 [rows, bytes per row], a read-only view of the
        file's mapping (no copy; writing into it faults)."""
        rows = info.numel // info.shape[-1] if info.shape else 1
        return self.mapping().view(info.offset, info.nbytes).view(rows, -1)


def is_gguf(path: Path) -> bool:
    """Whether `path` is a file that starts with GGUF's magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == MAGIC
    except OSError:
        return False


class StringArray(Sequence[str]):
    """A metadata array of n strings (a vocabulary, its merges), kept as the file's bytes and
    split into strings when first read: a start whose tokenizer is cached never decodes them.
    A string that is not UTF-8 is a GGUFError then."""

    def __init__(self, raw: bytes, n: int, where: str, file_name: str) -> None:
        self._raw, self._n, self._where, self._file_name = raw, n, where, file_name
        self._items: list[str] | None = None

    def _list(self) -> list[str]:
        if self._items is None:
            raw, pos, items, length = self._raw, 0, [], _U64.unpack_from
            try:
                for _ in range(self._n):
                    (size,) = length(raw, pos)
                    items.append(raw[pos + 8:pos + 8 + size].decode("utf-8"))
                    pos += 8 + size
            except UnicodeDecodeError as e:
                raise GGUFError(f"{self._file_name}: {self._where} holds a string that is not "
                                f"UTF-8 ({e})") from e
            self._items, self._raw = items, b""
        return self._items

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):  # int -> str, slice -> list[str]
        return self._list()[index]

    def __iter__(self) -> Iterator[str]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"StringArray({self._n} strings)"


class _Parser:
    """One pass over the header's bytes."""

    def __init__(self, data: mmap.mmap, name: str) -> None:
        self.data, self.name, self.pos = data, name, 0
        self.where = "the header"

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.name}: {what}")

    def take(self, n: int) -> int:
        start = self.pos
        if n < 0 or start + n > len(self.data):
            raise self.fail(f"the file ends inside {self.where} (at byte {start}, needs {n} "
                            f"more of {len(self.data)}): truncated or not a GGUF file")
        self.pos += n
        return start

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.data, self.take(size))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        try:
            return self.data[start:start + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"{self.where} holds a string that is not UTF-8 ({e})") from e

    def strings(self, n: int) -> list[str] | StringArray:
        """n strings in a row; past LAZY_STRINGS of them (a vocabulary's hundreds of
        thousands) their bytes, split into strings when first read (`StringArray`)."""
        data, end, length = self.data, len(self.data), _U64.unpack_from
        first = pos = self.pos
        count = 0
        while count < n:  # one tight loop: only the lengths
            size = length(data, pos)[0] if pos + 8 <= end else end
            if pos + 8 + size > end:
                self.pos = pos
                self.take(8 + size if pos + 8 <= end else 8)  # names the truncation
            pos += 8 + size
            count += 1
        self.pos = pos
        array = StringArray(bytes(data[first:pos]), n, self.where, self.name)
        return array if n > LAZY_STRINGS else list(array)

    def parse(self):
        if self.data[:4] != MAGIC:
            raise self.fail(f"not a GGUF file (starts with {bytes(self.data[:4])!r}, not "
                            f"{MAGIC!r})")
        self.take(4)
        version = self.scalar("<I")
        if version not in VERSIONS:
            raise self.fail(f"GGUF version {version} is not read (versions "
                            f"{', '.join(map(str, VERSIONS))})")
        n_tensors, n_keys = self.scalar("<Q"), self.scalar("<Q")
        for what, n in (("tensor count", n_tensors), ("metadata count", n_keys)):
            if n > MAX_COUNT:
                raise self.fail(f"{what} {n} is not plausible (corrupt header)")
        metadata: dict[str, Any] = {}
        for i in range(n_keys):
            self.where = f"metadata key #{i}"
            key = self.string()
            self.where = f"metadata key {key}"
            if key in metadata:
                raise self.fail(f"metadata key {key} appears twice")
            metadata[key] = self.value(self.scalar("<I"), key)
        if not isinstance(metadata.get("general.architecture"), str):
            raise self.fail("metadata has no general.architecture string")
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise self.fail(f"general.alignment={alignment!r} is not a positive multiple of 8")
        entries = []
        for i in range(n_tensors):
            self.where = f"tensor #{i} of the table"
            name = self.string()
            self.where = f"the table entry of tensor {name}"
            dims = self.scalar("<I")
            if not 1 <= dims <= 4:
                raise self.fail(f"tensor {name} has {dims} dimensions (1 to 4)")
            shape = tuple(self.scalar("<Q") for _ in range(dims))[::-1]
            entries.append((name, shape, self.scalar("<I"), self.scalar("<Q")))
        data_start = -(-self.pos // alignment) * alignment
        tensors, names = [], set()
        for name, shape, kind, offset in entries:
            if name in names:
                raise self.fail(f"tensor {name} appears twice in the table")
            names.add(name)
            tensors.append(self.tensor(name, shape, kind, offset, data_start, alignment))
        return version, metadata, tensors, data_start

    def value(self, kind: int, key: str) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise self.fail(f"metadata key {key} has value type {kind}, which GGUF does not "
                            "define")
        item, n = self.scalar("<I"), self.scalar("<Q")
        if n > len(self.data):
            raise self.fail(f"metadata key {key} claims {n} items (corrupt header)")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            start = self.take(n * dtype.itemsize)
            return np.frombuffer(self.data, dtype, n, start).copy()
        if item == _STRING:
            return self.strings(n)
        raise self.fail(f"metadata key {key} is an array of type {item}, which is not read")

    def tensor(self, name: str, shape: tuple[int, ...], kind: int, offset: int,
               data_start: int, alignment: int) -> TensorInfo:
        try:
            ggml_type = GGMLQuantizationType(kind)
        except ValueError:
            raise self.fail(f"tensor {name} has ggml type {kind}, which is not known") from None
        if any(d <= 0 for d in shape):
            raise self.fail(f"tensor {name} has shape {list(shape)}")
        block, block_bytes = GGML_QUANT_SIZES[ggml_type]
        if shape[-1] % block:
            raise self.fail(f"tensor {name} of type {ggml_type.name} has rows of {shape[-1]} "
                            f"values, not a multiple of its blocks of {block}")
        if offset % alignment:
            raise self.fail(f"tensor {name} starts at offset {offset}, not a multiple of the "
                            f"alignment {alignment}")
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel // block * block_bytes
        start = data_start + offset
        if start + nbytes > len(self.data):
            raise self.fail(f"tensor {name} ({ggml_type.name} {list(shape)}) needs bytes "
                            f"{start} to {start + nbytes}, past the end of the file "
                            f"({len(self.data)} bytes): truncated")
        return TensorInfo(name, shape, ggml_type, start, nbytes)
