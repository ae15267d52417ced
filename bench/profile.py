"""Where a single-stream decode step's time goes: torch.profiler over the engine's own steps.

    python -m bench.profile [--model PATH] [--dtype bfloat16] [--quantization none|int8|int4]
        [--steps 32] [--top 15]

Without --model it uses bench.generate's checkpoint (Qwen2-0.5B shapes, random weights). One
request decodes alone; after a warm-up, `--steps` engine steps are profiled and the operators
with the most self CPU time are printed, with the share of the steps' wall time spent outside
any profiled operator (Python and bookkeeping, and our own kernels of models.kernels.native,
which are not PyTorch operators: `MMSERVE_NATIVE=0` profiles PyTorch's alone).
"""

from __future__ import annotations

import argparse
import logging
import time

from torch.profiler import ProfilerActivity, profile

from bench.common import add_decoding_arguments, decoding_checkpoint, decoding_engine, machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decoding_arguments(parser)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    path, quantization = decoding_checkpoint(args)
    engine = decoding_engine(path, args.dtype, quantization, args.steps + 16)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    ops = sum(e.self_cpu_time_total for e in events) / 1e6
    print(f"machine: {machine()}; {path.name}, {args.dtype}, quantization {args.quantization}; "
          f"{args.steps} decode steps, {wall / args.steps * 1e3:.1f} ms per step under the "
          f"profiler; operators {ops / wall:.0%} of the wall time\n")
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
