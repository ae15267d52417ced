"""How fast the CPU's matrix-vector kernels stream weights from memory, per dtype.

Decode reads every weight once per token, so its ceiling is the rate at which a matrix-vector
product streams weights that are not in cache. This runs one decode step's worth of products
(Qwen2-0.5B's 24 layers of qkv, o, gate_up and down: 0.7 GB in float32, more than any L3) with
a single-row input and reports the bytes streamed per second against plain memory bandwidth
(a float32 sum), for each kernel the engine could use.

    python -m bench.gemv [--runs 7]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import machine, median, memory_bandwidth, print_table, timeit

LAYERS = 24
SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down


def kernels(dtype: torch.dtype) -> dict:
    def padded(x, w):  # one row padded to two, so that the AMX kernels engage
        return (w @ torch.cat((x, x)).t()).t()[:1]

    out = {"F.linear": lambda x, w: F.linear(x, w), "torch.mv": lambda x, w: torch.mv(w, x[0])}
    if dtype == torch.bfloat16:
        out["two-row padded"] = padded
    return out


def streamed(dtype: torch.dtype, runs: int) -> dict[str, float]:
    """Median bytes/s of each kernel over one pass through all layers' weights."""
    torch.manual_seed(0)
    weights = [[torch.randn(o, i, dtype=dtype) for o, i in SHAPES] for _ in range(LAYERS)]
    inputs = {i: torch.randn(1, i, dtype=dtype) for _, i in SHAPES}
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    found = kernels(dtype)
    times: dict[str, list[float]] = {name: [] for name in found}
    for run in range(runs + 1):
        for name, fn in found.items():  # interleaved, so drift hits every kernel alike
            t = timeit(lambda fn=fn: [fn(inputs[w.shape[1]], w) for layer in weights
                                      for w in layer])
            if run:  # the first pass warms up
                times[name].append(t)
    return {name: nbytes / median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    bandwidth = memory_bandwidth()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, rate in streamed(dtype, args.runs).items():
            rows.append((f"{str(dtype)[6:]} {name}", rate / 1e9, bandwidth / 1e9,
                         rate / bandwidth))
    print(f"machine: {machine()}; {LAYERS} layers of {SHAPES}, one input row; "
          f"median of {args.runs} runs\n")
    print_table(rows, ("kernel", "weights streamed (GB/s)", "memory bandwidth (GB/s)",
                       "fraction"))
    best = {d: max(r[3] for r in rows if r[0].startswith(d)) for d in ("float32", "bfloat16")}
    print(f"\nsummary: the best matrix-vector kernel streams {best['float32']:.0%} of memory "
          f"bandwidth in float32 and {best['bfloat16']:.0%} in bfloat16")


if __name__ == "__main__":
    main()
