"""Weights in transparent huge pages, on a Linux CPU.

A decode step streams every weight from memory once. In 4 KiB pages that is a TLB miss every
4 KiB (hundreds of megabytes per step, far past what the TLB covers), and the page walks cost a
measurable share of the bandwidth; 2 MiB pages remove almost all of them. PyTorch's CPU allocator
asks for huge pages only when THP_MEM_ALLOC_ENABLE is set before its first allocation, which an
engine imported into a running process (a notebook) cannot arrange; so after loading, the
model's large parameters and buffers are copied into one anonymous mapping advised with
MADV_HUGEPAGE, and each tensor's data is pointed there (`tensor.data = ...`, so ties between
parameters survive). The mapping lives as long as the tensors viewing it.

Weights that view a mapped file (models/mapped_files.py: GGUF blocks, safetensors tensors at
the model dtype) stay where they are: they are the page cache's pages, shared with other
processes and not this process's to copy (a copy would double them); they stay in the file's
regular pages. MMSERVE_MAP_WEIGHTS=0 copies a file's own tensors here instead; a GGUF's
repacked blocks come from the kept repack file (engine/weight_cache.py), mapped either way
unless MMSERVE_WEIGHT_CACHE=0 too (then repacked in memory and copied here).

Nothing changes where the kernel's THP setting is "never", off Linux, or with
MMSERVE_HUGE_PAGES=0. Memory freed as the weights move (and while they load:
`return_freed_memory`) is handed back to the system, so the model is not resident twice.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import mmap
import os
import weakref
from pathlib import Path

import torch
from torch import nn

from models.mapped_files import is_mapped

log = logging.getLogger(__name__)

DISABLE_ENV = "MMSERVE_HUGE_PAGES"  # "0" leaves the weights where they were loaded
MIN_BYTES = 64 << 10  # smaller tensors (norm weights, biases) are not worth the move
HUGE_PAGE = 2 << 20
ALIGN = 4096
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
TRIM_BYTES = 512 << 20  # while weights move, freed memory goes back every this many bytes
_PLACED: dict[int, int] = {}  # start -> end of each live mapping empty_in_huge_pages made


def available() -> tuple[bool, str]:
    """Whether weights can be placed in huge pages here, and why not."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return False, f"disabled by {DISABLE_ENV}=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False, "no MADV_HUGEPAGE on this platform"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False, f"no {THP_SETTING}"
    if "[never]" in setting:
        return False, "transparent huge pages are set to never"
    return True, setting.strip()


def place_weights(model: nn.Module) -> int:
    """Move the model's CPU parameters and buffers of MIN_BYTES or more (but those viewing a
    mapped file or already in huge pages: `empty_in_huge_pages`) into one huge-page mapping,
    in module order (a forward's order). Returns the bytes moved (0 if unavailable)."""
    ok, detail = available()
    if not ok:
        log.info("weights stay in regular pages: %s", detail)
        return 0
    tensors, seen = [], set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        if (id(tensor) in seen or tensor.device.type != "cpu" or not tensor.is_contiguous()
                or tensor.layout != torch.strided or tensor.nbytes < MIN_BYTES
                or is_mapped(tensor) or _in_huge_pages(tensor)):
            continue
        seen.add(id(tensor))
        tensors.append(tensor)
    total = sum(_aligned(t.nbytes) for t in tensors)
    if not total:
        return 0
    # A private anonymous mapping, one huge page longer so that its start can be aligned.
    area = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(area, dtype=torch.uint8)
    offset = -arena.data_ptr() % HUGE_PAGE
    moved = 0
    with torch.no_grad():
        for tensor in tensors:
            place = arena[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            place.copy_(tensor)
            tensor.data = place
            offset += _aligned(tensor.nbytes)
            moved += tensor.nbytes
            if moved >= TRIM_BYTES:  # so that the model is not resident twice
                return_freed_memory()
                moved = 0
    return_freed_memory()
    log.info("%d weight tensors (%.0f MB) placed in huge pages", len(tensors), total / 1e6)
    return total


def empty_in_huge_pages(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 tensor [nbytes] in an anonymous mapping of its own advised with
    MADV_HUGEPAGE (for a weight made at load, such as a repacked one: written once, its pages
    fault in 2 MiB at a time), which `place_weights` then leaves where it is. Regular memory
    where huge pages are unavailable or `nbytes` is under a huge page."""
    if nbytes < HUGE_PAGE or not available()[0]:
        return torch.empty(nbytes, dtype=torch.uint8)
    # One huge page longer, so that the tensor can start at a huge page's start (all of it but
    # its last partial 2 MiB in huge pages); that partial stretch and the slack after it are
    # advised back to small pages, so that touching the tensor's last bytes does not make the
    # whole 2 MiB resident.
    area = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    area.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(area, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = arena.data_ptr()
    _PLACED[start] = start + len(area)
    weakref.finalize(area, _PLACED.pop, start, None)
    offset = -start % HUGE_PAGE
    whole = offset + nbytes // HUGE_PAGE * HUGE_PAGE  # past the last whole huge page
    if hasattr(mmap, "MADV_NOHUGEPAGE") and whole < len(area):
        area.madvise(mmap.MADV_NOHUGEPAGE, whole, len(area) - whole)
    return arena[offset:offset + nbytes]


def _in_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether `tensor` lies in a mapping `empty_in_huge_pages` made"""
    at = tensor.data_ptr()
    return any(start <= at < end for start, end in _PLACED.items())


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def return_freed_memory() -> None:
    """Hand memory freed by this process back to the system where the C library keeps it
    (glibc's malloc_trim; elsewhere nothing): loading frees many weight-sized blocks (a dense
    weight once quantized, a tensor once copied into huge pages) that would otherwise stay
    resident."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
