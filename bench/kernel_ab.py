"""A/B of our CPU kernels' sources: a git revision's build against the working tree's, side by
side in one process, on a model's linear shapes at chosen row counts.

    python -m bench.kernel_ab [--base HEAD] [--kernel gemm|gemm_int4|linear_rows]
        [--rows 16,33,64,128,313,1024] [--shapes qwen2.5-vl-3b|qwen2.5-vl-3b-tower]
        [--rounds 9] [--threads 2]

The working tree's library is the one the engine loads (models.kernels.native.load); the other is
compiled from models/kernels/cpu as it is at `--base`, as the same variant with the same flags and
OpenMP runtime, and loaded beside it. Each round calls the kernel once on every shape of the
set (bfloat16 weights and x; int4 weights quantized at group 64), alternating between the two
builds; per row count it prints each side's median GFLOP/s and the median per-round ratio (> 1:
the working tree is faster). A build compared with itself reads 0.97-1.06 on a shared 2-core
machine: smaller differences are noise there.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, median, print_table

SHAPES = {  # name: [(out_features, in_features)]
    "qwen2.5-vl-3b": [(2560, 2048), (2048, 2048), (22016, 2048), (2048, 11008)],
    "qwen2.5-vl-3b-tower": [(3840, 1280), (1280, 1280), (6840, 1280), (1280, 3420)],
}
GROUP = 64


def build_at(revision: str, target: Path):
    """Our kernel library compiled from its sources at a git revision, as the variant this
    process loaded (the same flags and OpenMP runtime) -> NativeKernels."""
    from models.kernels import cpu_variants, native, native_build

    loaded, compiler = native.load(), native_build.find_compiler()
    assert loaded is not None and compiler, "our kernels did not build here (see the log)"
    root = Path(__file__).resolve().parent.parent
    for source in (*native_build.SOURCES, native_build.HEADER):
        (target / source.name).write_text(subprocess.run(
            ["git", "show", f"{revision}:{source.relative_to(root).as_posix()}"], cwd=root,
            check=True, capture_output=True, text=True).stdout)
    variant = next(v for v in cpu_variants.VARIANTS if v.name == loaded.variant)
    path, _ = native_build.build(variant, compiler, native_build.openmp_runtime(), target,
                                 source_dir=target)
    return native.NativeKernels(ctypes.CDLL(str(path)), revision)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--kernel", default="gemm", choices=("gemm", "gemm_int4", "linear_rows"))
    parser.add_argument("--rows", default="16,33,64,128,313,1024")
    parser.add_argument("--shapes", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from models.kernels import native
    from models.kernels.quantization import pack_int4, quantize_int4

    with tempfile.TemporaryDirectory() as tmp:  # the loaded library stays mapped
        sides = {args.base: build_at(args.base, Path(tmp)),
                 "working tree": native.load()}  # built from the working tree's sources
    shapes = SHAPES[args.shapes]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n, k in shapes]
    if args.kernel == "gemm_int4":
        quantized = [quantize_int4(w.float(), GROUP) for w in weights]
        weights = [(pack_int4(q), sz) for q, sz in quantized]

    def call(kernels, x, w):
        if args.kernel == "gemm_int4":
            return kernels.gemm_int4(x, w[0], w[1], GROUP)
        return getattr(kernels, args.kernel)(x, w)

    table = []
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in shapes]
        base, new = sides.values()
        for x, w in zip(xs, weights, strict=True):  # the two builds compute the same products
            torch.testing.assert_close(call(new, x, w).float(), call(base, x, w).float(),
                                       rtol=1e-2, atol=1e-1)
        seconds: dict[str, list[float]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, kernels in sides.items():
                start = time.perf_counter()
                for x, w in zip(xs, weights, strict=True):
                    call(kernels, x, w)
                seconds[name].append(time.perf_counter() - start)
        flops = sum(2 * rows * n * k for n, k in shapes)
        ratio = median([b / a for b, a in zip(seconds[args.base], seconds["working tree"],
                                              strict=True)])
        table.append((rows, *(f"{flops / median(s) / 1e9:.1f}" for s in seconds.values()),
                      f"{ratio:.3f}"))
    print(f"\nmachine: {machine()}; {args.kernel} on {args.shapes}'s linears, bfloat16 x, "
          f"{args.threads} threads, medians of {args.rounds} alternating rounds")
    print_table(table, ("rows", f"{args.base} GFLOP/s", "working tree GFLOP/s",
                        "working tree faster by"))


if __name__ == "__main__":
    main()
