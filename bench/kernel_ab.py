"""A/B of our CPU kernels' sources: a git revision's build against the working tree's, side by
side in one process, on a model's linear shapes at chosen row counts.

    python -m bench.kernel_ab [--base HEAD] [--kernel gemm|gemm_int4|linear_rows|ggml|linear|
        linear_int8|linear_int4] [--rows 16,33,64,128,313,1024]
        [--shapes qwen2.5-vl-3b|qwen2.5-vl-3b-tower|qwen2.5-1.5b]
        [--rounds 9] [--threads 2] [--ggml-type Q4_K] [--digits 2] [--base-repacked]

The working tree's library is the one the engine loads (models.kernels.native.load); the other is
compiled from models/kernels/cpu as it is at `--base`, as the same variant with the same flags and
OpenMP runtime, and loaded beside it. Each round calls the kernel once on every shape of the
set (bfloat16 weights and x; int8 and int4 weights quantized at group 64, the engine's default;
`linear`, `linear_int8`, `linear_int4`: the decode matrix-vector kernels, at a decode's and a
verify's rows, e.g. `--rows 1,2,5,9 --shapes qwen2.5-1.5b`; `ggml`: the decode
matrix-vector kernel mm_ggml_linear on random blocks of `--ggml-type`, rows up to 16, the
working tree's in the layout it repacks the type to, if any; the base's as the file stores them,
or with `--base-repacked` repacked by the base's own code (its layout, of the same size), for a
change to the repacked kernels or their layout),
alternating between the two builds; per row count it prints each side's median GFLOP/s and
the median per-round ratio (> 1: the working tree is faster), and with a row count of 1 asked,
each side's time at every row count over its time at one row (a verify's cost). A build
compared with itself reads 0.97-1.06 on a shared 2-core machine: smaller differences are noise
there.
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
    "qwen2.5-1.5b": [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)],
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
        shown = subprocess.run(
            ["git", "show", f"{revision}:{source.relative_to(root).as_posix()}"], cwd=root,
            capture_output=True, text=True)
        # a source the revision did not have yet compiles to nothing
        (target / source.name).write_text(shown.stdout if shown.returncode == 0 else "")
    variant = next(v for v in cpu_variants.VARIANTS if v.name == loaded.variant)
    path, _ = native_build.build(variant, compiler, native_build.openmp_runtime(), target,
                                 source_dir=target)
    return native.NativeKernels(_Older(ctypes.CDLL(str(path))), revision)


class _Older:
    """A library built at an older revision: a function it does not have yet is bound as one
    that raises when called."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __getattr__(self, name: str):
        try:
            return getattr(self._lib, name)
        except AttributeError:
            def missing(*_args):
                raise RuntimeError(f"{name} is not in this revision's kernels")
            setattr(self, name, missing)
            return missing


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--kernel", default="gemm",
                        choices=("gemm", "gemm_int4", "linear_rows", "ggml", "linear",
                                 "linear_int8", "linear_int4"))
    parser.add_argument("--rows", default="16,33,64,128,313,1024")
    parser.add_argument("--shapes", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ggml-type", default="Q4_K", help="the block type of --kernel ggml")
    parser.add_argument("--digits", type=int, default=2, choices=(1, 2),
                        help="int8 digits per input of --kernel ggml's rows")
    parser.add_argument("--base-repacked", action="store_true",
                        help="--kernel ggml: the base runs its own repacked layout")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from models.kernels import native
    from models.kernels.int_formats import pack_int4, quantize_int4, quantize_int8

    with tempfile.TemporaryDirectory() as tmp:  # the loaded library stays mapped
        sides = {args.base: build_at(args.base, Path(tmp)),
                 "working tree": native.load()}  # built from the working tree's sources
    shapes = SHAPES[args.shapes]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(torch.bfloat16) for n, k in shapes]
    if args.kernel in ("gemm_int4", "linear_int4"):
        quantized = [quantize_int4(w.float(), GROUP) for w in weights]
        weights = [(pack_int4(q), sz) for q, sz in quantized]
    if args.kernel == "linear_int8":
        weights = [quantize_int8(w.float(), GROUP) for w in weights]
    if args.kernel == "ggml":
        from bench.ggml_kernels import random_blocks
        from models.kernels import ggml_blocks

        # the file's type for the base (or --base-repacked: its own layout); the working tree
        # runs it in our layout where it repacks the type (Q4_K: Q4_Kx8), else as stored
        stored = ggml_blocks.BLOCK_TYPES[args.ggml_type]
        weights = []
        for n, k in shapes:
            blocks = random_blocks(args.ggml_type, n, k)
            kind, held = ggml_blocks.repack(blocks, args.ggml_type, k)
            code = ggml_blocks.KERNEL_TYPES[kind].code
            base = (blocks, stored.code)
            if args.base_repacked and kind != args.ggml_type:
                # repacked by the base's own code: its layout, which a change may have moved
                base_held = torch.empty_like(held)
                status = sides[args.base].ggml_repack(blocks.data_ptr(), stored.code, n, k,
                                                      base_held.data_ptr(), 1)
                assert status == 0, f"the base's mm_ggml_repack refused {args.ggml_type}"
                base = (base_held, code)
            weights.append({args.base: base, "working tree": (held, code)})

    def call(kernels, x, w):
        if args.kernel == "gemm_int4":
            return kernels.gemm_int4(x, w[0], w[1], GROUP)
        if args.kernel == "linear_int4":
            return kernels.linear_int4(x, w[0], w[1], GROUP)
        if args.kernel == "linear_int8":
            return kernels.linear(x, w[0], w[1])
        if args.kernel == "ggml":
            blocks, code = w[args.base if kernels is sides[args.base] else "working tree"]
            m, k = x.shape
            y = torch.empty(m, blocks.shape[0], dtype=x.dtype)
            status = kernels.ggml_linear(
                x.data_ptr(), native.DTYPES[x.dtype], blocks.data_ptr(), code, y.data_ptr(),
                blocks.shape[0], m, blocks.shape[0], k, args.digits, 0, args.threads)
            assert status == 0, f"mm_ggml_linear: status {status}"
            return y
        return getattr(kernels, args.kernel)(x, w)

    table, one_row = [], {}
    rows_asked = [int(r) for r in args.rows.split(",")]
    if args.kernel == "ggml" and max(rows_asked) > 16:
        parser.error("--kernel ggml takes rows up to 16 (a decode step's or a verify's)")
    for rows in rows_asked:
        xs = [torch.randn(rows, k, generator=gen).to(torch.bfloat16) for _, k in shapes]
        base, new = sides.values()
        for x, w in zip(xs, weights, strict=True):  # the two builds compute the same products
            ref = call(base, x, w).float()
            torch.testing.assert_close(call(new, x, w).float(), ref, rtol=1e-2,
                                       atol=max(1e-1, 1e-2 * ref.abs().max().item()))
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
        if rows == 1:
            one_row = {name: median(s) for name, s in seconds.items()}
        over_one = [f"{median(s) / one_row[name]:.2f}x" if one_row else "-"
                    for name, s in seconds.items()]
        table.append((rows, *(f"{flops / median(s) / 1e9:.1f}" for s in seconds.values()),
                      f"{ratio:.3f}", *over_one))
    what = (f"ggml {args.ggml_type}, {args.digits} digits" if args.kernel == "ggml"
            else args.kernel)
    print(f"\nmachine: {machine()}; {what} on {args.shapes}'s linears, bfloat16 x, "
          f"{args.threads} threads, medians of {args.rounds} alternating rounds")
    print_table(table, ("rows", f"{args.base} GFLOP/s", "working tree GFLOP/s",
                        "working tree faster by", f"{args.base} x 1 row",
                        "working tree x 1 row"))


if __name__ == "__main__":
    main()
