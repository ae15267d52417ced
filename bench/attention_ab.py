"""A/B of our paged decode attention kernel: a git revision's build against the working tree's,
side by side in one process, one request decoding at long contexts.

    python -m bench.attention_ab [--base HEAD] [--heads 4] [--kv-heads 1] [--head-dim 256]
        [--contexts 1024,4096,16384] [--cache bfloat16,int8] [--rounds 30] [--threads 2]

Defaults: Gemma 3 270M's attention (4 query heads on 1 KV head of 256), the shape where one
request gives a team of threads a single (sequence, KV head) pair to share. Each round calls
both builds once on the same query and paged cache (blocks of 16, in order), alternating; per
context and cache it prints each side's median milliseconds and the median per-round ratio
(> 1: the working tree is faster). The two builds come from bench.kernel_ab's `build_at`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import machine, median, print_table
from bench.kernel_ab import build_at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--head-dim", type=int, default=256)
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--cache", default="bfloat16,int8")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from models.kernels import native
    from models.layers import kv_quant

    with tempfile.TemporaryDirectory() as tmp:  # the loaded library stays mapped
        sides = {args.base: build_at(args.base, Path(tmp)), "working tree": native.load()}
    gen = torch.Generator().manual_seed(0)
    rows = []
    for kind in args.cache.split(","):
        for context in map(int, args.contexts.split(",")):
            block = 16
            blocks = -(-context // block)
            raw = torch.randn(2, args.kv_heads, blocks, block, args.head_dim, generator=gen)
            cache = kv_quant.quantize_rows(raw) if kind == "int8" else raw.to(torch.bfloat16)
            q = torch.randn(1, args.heads, args.head_dim, generator=gen).to(torch.bfloat16)
            table, key0 = torch.arange(blocks)[None], torch.zeros(1, dtype=torch.int64)
            lengths = torch.tensor([context])
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, kernels in sides.items():
                    t0 = time.perf_counter()
                    kernels.decode_attention(q, cache, table, key0, lengths, 0.0625, None, None)
                    times[name].append(time.perf_counter() - t0)
            base, ours = times[args.base][1:], times["working tree"][1:]
            rows.append((kind, context, f"{median(base) * 1e3:.3f}", f"{median(ours) * 1e3:.3f}",
                         f"{median([b / o for b, o in zip(base, ours, strict=True)]):.2f}x"))
    print(f"# decode attention, {args.heads} query heads on {args.kv_heads} KV heads of "
          f"{args.head_dim}, one request; {machine()}")
    print_table(rows, ("cache", "context", f"{args.base} ms", "working tree ms", "ratio"))


if __name__ == "__main__":
    main()
