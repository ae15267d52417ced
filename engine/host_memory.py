"""How much memory this process can take on the host (Linux; a fallback elsewhere).

The automatic KV budget on the CPU is sized from it. Free pages (`SC_AVPHYS_PAGES`) undercount on
any desktop that has been up a while: the page cache holding recently read files (model files
among them) is given back by the kernel on demand. The kernel's own estimate of what a new
allocation can get without swapping is /proc/meminfo's MemAvailable (free plus reclaimable page
cache and slab, less the reserves). Inside a container or a systemd slice a memory limit may be
lower still: cgroup v2's `memory.max` less `memory.current`, or v1's `memory.limit_in_bytes` less
`memory.usage_in_bytes`, of this process's cgroup; the smaller of the two is what is available.

`resident_bytes` says how much of a pool reserved with torch.empty has taken physical pages.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP = Path("/sys/fs/cgroup")
UNLIMITED = 1 << 60  # cgroup v1 reports "no limit" as a huge number (about 2**63 rounded down)


@dataclass(frozen=True)
class HostMemory:
    """Bytes available to a new allocation, and what set them (for the start-up line)."""

    available: int
    source: str


def host_memory(proc: Path = PROC, cgroup: Path = CGROUP) -> HostMemory:
    """The memory this process can still take: MemAvailable, lowered by a cgroup limit where
    one is set (`proc` and `cgroup`: where /proc and the cgroup file system are mounted)."""
    found = _meminfo_available(proc / "meminfo")
    if found is None:
        found = HostMemory(*_free_pages())
    limited = _cgroup_room(proc / "self" / "cgroup", cgroup)
    if limited is not None and limited.available < found.available:
        return limited
    return found


def _meminfo_available(file: Path) -> HostMemory | None:
    try:
        text = file.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key == "MemAvailable":
            value, *unit = rest.split()
            scale = 1024 if unit and unit[0].lower() == "kb" else 1
            return HostMemory(int(value) * scale, "MemAvailable in /proc/meminfo")
    return None


def _free_pages() -> tuple[int, str]:
    try:
        return (os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"),
                "free pages (no MemAvailable on this system)")
    except (ValueError, OSError, AttributeError):
        return 16 << 30, "unknown: assumed 16 GiB"


def _cgroup_room(membership: Path, root: Path) -> HostMemory | None:
    """The room under this process's cgroup memory limit (v2, else v1), or None if unlimited."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        lines = []
    v2, v1 = "/", "/"
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    candidates = [(root / v2.lstrip("/"), "memory.max", "memory.current", "cgroup v2"),
                  (root / "memory" / v1.lstrip("/"), "memory.limit_in_bytes",
                   "memory.usage_in_bytes", "cgroup v1")]
    for folder, limit_name, usage_name, kind in candidates:
        limit = _read_int(folder / limit_name)
        if limit is None or limit >= UNLIMITED:
            continue
        usage = _read_int(folder / usage_name) or 0
        return HostMemory(max(limit - usage, 0), f"{kind} memory limit {limit} less usage {usage}"
                          f" ({folder})")
    return None


def _read_int(file: Path) -> int | None:
    try:
        text = file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # v2's "max": no limit


def resident_bytes(tensors: list) -> int | None:
    """Bytes of the CPU tensors' memory that are resident (mincore(2): pages the process has
    touched, the rest being address space only), or None where that cannot be asked (off
    Linux, or a tensor not on the CPU)."""
    libc = _libc()
    if libc is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for t in tensors:
        if t.device.type != "cpu":
            return None
        nbytes = t.numel() * t.element_size()
        if not nbytes:
            continue
        start = t.data_ptr() // page * page
        length = t.data_ptr() + nbytes - start
        pages = -(-length // page)
        vec = (ctypes.c_ubyte * pages)()
        if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            return None
        total += (pages - bytes(vec).count(0)) * page  # the low bit: resident
    return total


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        return libc
    except (OSError, AttributeError):
        return None
