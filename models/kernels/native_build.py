"""Building the native library (the C sources under models/kernels/cpu/) and caching it on disk.

The sources are compiled for one instruction-set level, a variant of models.kernels.cpu_variants,
with that variant's explicit target flags, and linked against the OpenMP runtime PyTorch itself
loaded, so that the kernels' parallel loops share PyTorch's thread pool.

The shared object is cached as native-<variant>-<digest>.so under $MMSERVE_KERNEL_CACHE, else
$MMSERVE_CACHE, else ~/.cache/mmserve, the digest covering the sources, the compiler, its flags
and the OpenMP runtime, so a change of any of them builds anew; a variant's build serves any
CPU that runs the variant. It is built in a temporary folder beside the cache and moved into
place in one rename, so that processes building at once never load a half-written file.

Loading it and binding its functions is models.kernels.native's job (load), with the signatures
of models.kernels.native_interface.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from models.kernels.choice import cache_path
from models.kernels.cpu_variants import Variant

HERE = Path(__file__).parent / "cpu"
# Compiled into one library; the header (shared helpers and declarations) is part of the digest.
SOURCES = tuple(HERE / name for name in (
    "small_ops.c", "linear_dense.c", "linear_int8.c", "linear_int4.c", "attention.c",
    "decode_layers.c", "gemm_quantized.c", "delta_rule.c", "moe_experts.c", "linear_rows.c",
    "gemm_dense.c", "fit_int4.c", "ggml_blocks.c", "ggml_x8.c", "linear_desc.c",
    "dot_bf16.c"))
HEADER = HERE / "kernels.h"
BUILD_TIMEOUT_S = 120
# + the variant's target. -fno-trapping-math: no kernel reads floating-point exception flags,
# and without it GCC keeps a branch around any operation one side of a condition computes (as in
# exp_nonpositive's clamp and silu's sign), which leaves that loop scalar. Values do not change.
FLAGS = ("-O3", "-fPIC", "-std=gnu11", "-Wno-unknown-pragmas", "-fno-trapping-math")


def find_compiler() -> str | None:
    """$CC, else cc, else gcc: the first that is on the PATH."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    return compiler if compiler and shutil.which(compiler) else None


def openmp_runtime() -> Path | None:
    """The libgomp this process loaded with PyTorch (from /proc/self/maps), if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if Path(path).name.startswith("libgomp") and ".so" in path:
            return Path(path)
    return None


def build(variant: Variant, compiler: str, openmp: Path | None = None,
          target_dir: Path | None = None, source_dir: Path = HERE) -> tuple[Path, float]:
    """Compile the sources as `variant` (unless cached) -> (path of the shared object, seconds
    spent building). `target_dir`: where to put it (default: beside the kernel choices);
    `source_dir`: a folder holding SOURCES and HEADER by name (default: ours; bench.kernel_ab
    builds another revision's)."""
    sources = tuple(source_dir / p.name for p in SOURCES)
    header = source_dir / HEADER.name
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    flags = [*FLAGS, *variant.flags, f'-DMM_VARIANT="{variant.name}"'] + (
        ["-fopenmp"] if openmp else [])
    digest = hashlib.sha256("\0".join(
        [*(p.read_text() for p in (*sources, header)), compiler, version, " ".join(flags),
         str(openmp)]
    ).encode()).hexdigest()[:16]
    target = (target_dir or cache_path().parent) / f"native-{variant.name}-{digest}.so"
    if target.exists():
        return target, 0.0
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{i}.o" for i in range(len(sources))]
        lib = Path(tmp) / "kernels.so"
        # Compiled with OpenMP, linked without the compiler's own runtime but against the one
        # PyTorch loaded: two OpenMP runtimes in a process would each keep a thread pool.
        for source, obj in zip(sources, objects, strict=True):
            _run([compiler, *flags, "-I", str(header.parent), "-c", str(source), "-o",
                  str(obj)])
        link = [compiler, "-shared", *map(str, objects), "-o", str(lib), "-lm"]
        _run(link + ([str(openmp)] if openmp else []))
        lib.replace(target)
    return target, time.perf_counter() - start


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        raise OSError(f"{' '.join(command[:2])}...: {done.stderr.strip()[-400:]}")
