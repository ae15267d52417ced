"""Load a Hugging Face safetensors checkpoint (single file or sharded) into one of our modules.

The module is built on the meta device (no memory, no random init), materialised empty on the
target device, then every parameter is filled from the checkpoint through the model's explicit
name map. A parameter (or row range of a fused parameter) that nothing fills is an error, as is
a checkpoint tensor whose shape does not match. Tensors are read with plain reads, one at a time,
and memory freed along the way is handed back to the system, so loading holds little more than
the model. Tensors stored in the dtype the model runs in (`mapped_dtype`) are instead read-only
views of the file's mapping (models/mapped_files.py), and a whole parameter filled by one such
tensor views the file (no copy: the page cache's pages); a row range of a fused parameter (q, k
and v in our qkv_proj) and a converted dtype are copied as before.

Parameters the caller defers stay on the meta device until the checkpoint first writes them, and
an observer hears of each as it is complete (weights quantized while they stream in: only the
linears being filled are ever resident in the model dtype). `counted` reports how far a stream
of tensors is, for the start-up's progress line.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Collection, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from models.checkpoint import safetensors_header, weight_files
from models.kernels.huge_pages import return_freed_memory
from models.mapped_files import MappedFile, is_mapped, map_file


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a fused parameter (e.g. k_proj inside qkv_proj)."""

    start: int
    size: int


WeightMap = Callable[[str], "tuple[str, Shard | None] | None"]

StageProgress = Callable[[str, int, int], None]
"""Told how far a loading stage is: (what it does, steps done, steps in all), from 0 to all
(engine/load_progress.py shows it)."""

T = TypeVar("T")


class StageCounter:
    """Counts a stage's steps to a StageProgress (or to nothing): 0 when made, one more per
    `step()`, `total` at `finish()` however many were counted."""

    def __init__(self, stage: str, total: int, progress: StageProgress | None) -> None:
        self.stage, self.total, self.progress = stage, max(total, 1), progress
        self.done = 0
        if progress is not None:
            progress(stage, 0, self.total)

    def step(self) -> None:
        self.done = min(self.done + 1, self.total)
        if self.progress is not None:
            self.progress(self.stage, self.done, self.total)

    def finish(self) -> None:
        if self.done < self.total:
            self.done = self.total - 1
            self.step()


def counted(items: Iterable[T], stage: str, total: int,
            progress: StageProgress | None) -> Iterator[T]:
    """`items`, each counted to `progress` under `stage` once the consumer is done with it
    (0 before the first, `total` after the last)."""
    counter = StageCounter(stage, total, progress)
    for item in items:
        yield item
        counter.step()
    counter.finish()


class MissingWeights(ValueError):
    """Parameters the checkpoint does not fill (`missing`, our names)."""

    def __init__(self, missing: list[str]) -> None:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        super().__init__(f"checkpoint does not provide {len(missing)} parameter(s): {shown}")
        self.missing = missing


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sharded (with index) or single."""
    found = weight_files(path)
    if not found:
        raise FileNotFoundError(
            f"no safetensors weights in {path} (expected model.safetensors or "
            "model.safetensors.index.json; .bin checkpoints are not supported)"
        )
    return found


# safetensors' dtype names -> torch dtypes (what checkpoints hold).
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


def checkpoint_tensor_count(path: Path, prefix: str = "") -> int:
    """How many tensors `iter_checkpoint(path, prefix)` yields (read from the headers)."""
    return sum(sum(1 for k in safetensors_header(file) if k != "__metadata__"
                   and k.startswith(prefix)) for file in checkpoint_files(path))


# Read through a mapping, its pages leave the resident set this often, and memory freed since
# (dense weights quantized, tensors copied) goes back to the system: the peak of a load stays
# within about this much of what it keeps.
DROP_BYTES = 64 << 20


def iter_checkpoint(path: Path, prefix: str = "", mapped_dtype: torch.dtype | None = None,
                    mappings: list[MappedFile] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint's safetensors files (those whose names start with
    `prefix`: the others are not read) in file order: those of `mapped_dtype` as views of the
    file's read-only mapping (added to `mappings`, which the caller keeps as long as the model:
    models.mapped_files.keep), the others each read into memory of its own (plain reads: only
    the pages of tensors a model keeps are mapped). The pages read through a mapping (tensors
    copied or quantized from it) leave the resident set every DROP_BYTES; those of a view a
    model keeps come back from the page cache when it is next read."""
    read = 0
    mappings = mappings if mappings is not None else []
    for file in checkpoint_files(path):
        for name, tensor in read_safetensors(file, prefix, mapped_dtype, mappings):
            yield name, tensor
            read += tensor.numel() * tensor.element_size()
            if read >= DROP_BYTES:
                for mapping in mappings:
                    mapping.drop_pages(0, mapping.size)
                return_freed_memory()
                read = 0
    return_freed_memory()


def read_safetensors(file: Path, prefix: str = "", mapped_dtype: torch.dtype | None = None,
                     mappings: list[MappedFile] | None = None
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one safetensors file (little-endian, as the format is), in the order
    the data lies in the file; only names starting with `prefix`. Tensors of `mapped_dtype`
    (whose bytes start at a multiple of its size) are read-only views of the file's mapping,
    which is appended to `mappings`."""
    header = safetensors_header(file)
    entries = sorted(((k, v) for k, v in header.items()
                      if k != "__metadata__" and k.startswith(prefix)),
                     key=lambda item: item[1]["data_offsets"][0])
    mapping = None
    with open(file, "rb", buffering=0) as f:
        start = 8 + int.from_bytes(f.read(8), "little")  # the data follows the header
        for name, info in entries:
            dtype = SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{file.name}: tensor {name} has dtype {info['dtype']}, which "
                                 f"we do not read ({', '.join(SAFETENSORS_DTYPES)})")
            first, last = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if last - first != nbytes:
                raise ValueError(f"{file.name}: tensor {name} has {last - first} bytes for shape "
                                 f"{info['shape']} of {info['dtype']}")
            if nbytes and dtype == mapped_dtype and (start + first) % tensor.element_size() == 0:
                if mapping is None:
                    mapping = map_file(file)
                    if mappings is not None:
                        mappings.append(mapping)
                yield name, mapping.typed(start + first, dtype, tuple(info["shape"]))
                continue
            if nbytes:
                f.seek(start + first)
                view = memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr()))
                view = view.cast("B")
                got = 0
                while got < nbytes:
                    n = f.readinto(view[got:])
                    if not n:
                        raise ValueError(f"{file.name} ends inside tensor {name}")
                    got += n
            yield name, tensor


class LoadObserver(Protocol):
    """Told of deferred parameters as load_weights allocates them and of every parameter as it
    is complete (models.kernels.quantization.QuantizeOnLoad)."""

    def allocated(self, name: str, nbytes: int) -> None:
        """A deferred parameter was allocated on its first write."""
        ...

    def filled(self, name: str) -> Collection[str]:
        """`name` is complete; returns the parameters the observer took over (e.g. a linear it
        replaced by a quantized one), which load_weights then stops holding."""
        ...


@torch.no_grad()
def load_weights(
    module: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], mapping: WeightMap,
    observer: LoadObserver | None = None,
) -> None:
    """Copy checkpoint tensors into `module` (dtype converted); fail on gaps or mismatches.

    A parameter still on the meta device is allocated (empty, on the CPU) when first written;
    the parameters an `observer` takes over as they are complete are no longer held here, so
    their memory goes as soon as the module drops them."""
    params = dict(module.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    done: set[str] = set()
    for name, tensor in weights:
        target = mapping(name)
        if target is None:
            continue
        ours, shard = target
        param = params.get(ours)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} maps to unknown parameter {ours}"
                             + (" (filled and already taken over)" if ours in done else ""))
        if param.is_meta:
            param = params[ours] = _allocate(module, ours, param)
            if observer is not None:
                observer.allocated(ours, param.numel() * param.element_size())
        dest = param if shard is None else param.narrow(0, shard.start, shard.size)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} for {ours}"
            )
        if (shard is None and tensor.dtype == param.dtype and param.device.type == "cpu"
                and tensor.is_contiguous() and is_mapped(tensor)):
            param.data = tensor  # the file's bytes (ties survive: the same Parameter)
        else:
            dest.copy_(tensor)
        filled[ours] += dest.numel()
        if observer is not None and filled[ours] == param.numel():
            for taken in observer.filled(ours):
                del params[taken]
                done.add(taken)
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise MissingWeights(missing)


def _allocate(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
    """Replace a meta-device parameter by an empty CPU one on its owner; returns it."""
    owner_name, _, attr = name.rpartition(".")
    owner = module.get_submodule(owner_name)
    fresh = nn.Parameter(empty_off_meta(param, torch.device("cpu")),
                         requires_grad=param.requires_grad)
    owner._parameters[attr] = fresh
    return fresh


# nn.init's initializers, skipped while modules are built on the meta device (on_meta)
_INITIALIZERS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "constant_", "zeros_", "ones_",
                 "orthogonal_", "eye_", "dirac_", "sparse_")
_on_meta_lock = threading.Lock()


@contextmanager
def on_meta() -> Iterator[None]:
    """Modules built in this context are on the meta device and skip nn.init's initializers: a
    meta tensor holds no values to set, and torch runs a meta `normal_` through its reference
    implementations, whose first use imports torch._dynamo (seconds of a start-up). One build at
    a time: the initializers are torch's module functions."""
    with _on_meta_lock:
        saved = {name: getattr(nn.init, name) for name in _INITIALIZERS
                 if hasattr(nn.init, name)}

        def skip(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return tensor

        try:
            for name in saved:
                setattr(nn.init, name, skip)
            with torch.device("meta"):
                yield
        finally:
            for name, initializer in saved.items():
                setattr(nn.init, name, initializer)


def empty_off_meta(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor on `device` of a meta tensor's shape, strides and dtype. Not
    torch.empty_like: on a meta tensor that runs torch's Python reference implementation, whose
    first use imports torch.fx's symbolic shapes (about half a second of every start)."""
    return torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype,
                               device=device)


def build_on_meta(factory: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype,
                  defer: Callable[[nn.Module], Collection[str]] | None = None):
    """Construct with `factory` on the meta device, then allocate (uninitialised) on `device`.

    Buffers created with an explicit device inside the factory (rotary tables) stay as built.
    Moving off the meta device makes new Parameter objects, which unties shared weights, so the
    module's `tie_weights()` (if any) runs again afterwards. `defer(meta module)` names
    parameters to leave on the meta device (CPU only): load_weights allocates each when the
    checkpoint first writes it.
    """
    with on_meta():
        module = factory()
    module = module.to(dtype=dtype)
    if defer is not None and device.type != "cpu":
        raise ValueError(f"deferred parameters are allocated on the CPU, not {device}")
    deferred = set() if defer is None else set(defer(module))
    for owner_name, owner in module.named_modules():
        for attr, param in list(owner._parameters.items()):
            full = f"{owner_name}.{attr}" if owner_name else attr
            if param is not None and param.is_meta and full not in deferred:
                owner._parameters[attr] = nn.Parameter(empty_off_meta(param, device),
                                                       requires_grad=param.requires_grad)
        for attr, buffer in list(owner._buffers.items()):
            if buffer is not None and buffer.is_meta:
                owner._buffers[attr] = empty_off_meta(buffer, device)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module
