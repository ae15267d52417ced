"""Which build of our C kernels this CPU runs.

The C sources under models/kernels/cpu/ are compiled once per instruction-set level (a
*variant*), each with explicit target flags, never `-march=native`: what one machine builds and
tests is what another of the same level runs. At start-up the CPU's features, as the operating
system reports them, decide the best variant it can run; `MMSERVE_CPU_ISA=<name>` forces a
lower one (for tests and A/B runs) and refuses one this CPU cannot run. Plain Python: the
choice is testable on any machine.
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

FORCE_ENV = "MMSERVE_CPU_ISA"

_V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: its name, the CPU architecture, the compiler's target flags and
    the CPU features (as /proc/cpuinfo names them) a machine needs to run it."""

    name: str
    arch: str  # "x86_64" or "aarch64"
    flags: tuple[str, ...]
    needs: frozenset[str]

    def runs_on(self, arch: str, features: frozenset[str]) -> bool:
        return self.arch == arch and self.needs <= features


# Lowest first within an architecture; a CPU runs the last one it can.
VARIANTS: tuple[Variant, ...] = (
    # Portable C (SSE2, the x86-64 baseline): every kernel's plain path, the reference the others
    # are tested against.
    Variant("x86-64", "x86_64", ("-march=x86-64", "-mtune=generic"), frozenset()),
    # AVX2 + FMA (Haswell and later, AMD Zen 1-3): the plain paths vectorized 8 floats wide.
    Variant("x86-64-v3", "x86_64", ("-march=x86-64-v3",), _V3),
    # AVX-512 F/BW/CD/DQ/VL (Skylake-X).
    Variant("avx512", "x86_64", ("-march=x86-64-v4",), _V4),
    # + VNNI (Cascade Lake, Ice Lake, Sapphire Rapids with BF16 hidden by its hypervisor): the
    # integer matrix-vector products through VPDPBUSD; bfloat16 still widened to float32.
    Variant("avx512-vnni", "x86_64", ("-march=x86-64-v4", "-mavx512vnni"),
            _V4 | {"avx512_vnni"}),
    # + BF16, VNNI, VBMI (Cooper Lake, Sapphire Rapids, Zen 4 / 5): VDPBF16PS and VPDPBUSD paths.
    Variant("avx512-bf16", "x86_64",
            ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"),
            _V4 | {"avx512_bf16", "avx512_vnni", "avx512vbmi"}),
    # Armv8.0 NEON (Cortex-A53/A72, Raspberry Pi 4, Graviton 1).
    Variant("armv8-a", "aarch64", ("-march=armv8-a",), frozenset({"asimd"})),
    # + dot products (Armv8.2: Graviton 2, Apple M1, Cortex-A76, Raspberry Pi 5).
    Variant("armv8.2-a+dotprod", "aarch64", ("-march=armv8.2-a+dotprod",),
            frozenset({"asimd", "asimddp"})),
    # + int8 matrix multiply and bfloat16 (Armv8.6: Graviton 3 / 4, Apple M2 and later).
    Variant("armv8.6-a+i8mm+bf16", "aarch64", ("-march=armv8.6-a+dotprod+i8mm+bf16",),
            frozenset({"asimd", "asimddp", "i8mm", "bf16"})),
)
BY_NAME = {v.name: v for v in VARIANTS}


def machine_arch() -> str:
    """"x86_64", "aarch64", or the machine's own name for anything else."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x86_64": "x86_64", "arm64": "aarch64",
            "aarch64": "aarch64"}.get(machine, machine)


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's features, named as Linux's /proc/cpuinfo names them (its "flags" on x86, its
    "Features" on Arm); on macOS from sysctl. Read once per process."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    if platform.system() == "Darwin" and machine_arch() == "aarch64":
        return _darwin_arm_features()
    return frozenset()


def _darwin_arm_features() -> frozenset[str]:
    names = {"FEAT_DotProd": "asimddp", "FEAT_I8MM": "i8mm", "FEAT_BF16": "bf16"}
    found = {"asimd"}  # every Apple Silicon CPU
    for key, name in names.items():
        try:
            out = subprocess.run(["sysctl", "-n", f"hw.optional.arm.{key}"], capture_output=True,
                                 text=True, timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out == "1":
            found.add(name)
    return frozenset(found)


def runnable(arch: str, features: frozenset[str]) -> list[Variant]:
    """The variants this CPU can run, lowest first."""
    return [v for v in VARIANTS if v.runs_on(arch, features)]


def choose(arch: str, features: frozenset[str], forced: str | None = None) -> Variant | None:
    """The best variant this CPU runs, or `forced` (a name of VARIANTS): a ValueError names
    what a forced variant needs that this CPU lacks, or the names it knows. None: no variant
    for this architecture (PyTorch's kernels only)."""
    can = runnable(arch, features)
    if forced:
        variant = BY_NAME.get(forced)
        if variant is None:
            raise ValueError(f"{FORCE_ENV}={forced!r} is not a kernel variant "
                             f"({', '.join(BY_NAME)})")
        if not variant.runs_on(arch, features):
            lacking = (f"an {variant.arch} CPU" if variant.arch != arch else
                       ", ".join(sorted(variant.needs - features)))
            raise ValueError(
                f"{FORCE_ENV}={forced!r} needs {lacking}, which this CPU does not have; it runs "
                f"{', '.join(v.name for v in can) or 'none of them'}")
        return variant
    return can[-1] if can else None


def chosen() -> Variant | None:
    """The variant for this machine and $MMSERVE_CPU_ISA (asked before every call of our
    kernels: the CPU's features are read once, the choice cached per forced value)."""
    return _chosen(os.environ.get(FORCE_ENV) or None)


@functools.cache
def _chosen(forced: str | None) -> Variant | None:
    return choose(machine_arch(), cpu_features(), forced)
