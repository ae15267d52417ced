"""How a step's attention scales: batched decode, a long chunk beside decodes, metadata memory.

    python -m bench.scaling [--dtype float32] [--runs 5] [--contexts 128,512,2048,8192]

Builds (once, cached) a 4-layer checkpoint of Qwen2-0.5B's width and drives the model directly
over the paged cache (no scheduler, so each step is exactly the shape being measured):
1. decode steps for batch 1/8/32 at each context: step time against the bytes the step must
   read (weights once, plus every request's keys and values), at the measured bandwidth;
2. one 2048-token prefill chunk with 0/16/32 decodes beside it, against the chunk alone plus
   the decodes alone (the target is a mixed step within 1.2x of its parts);
3. the bytes of the step's attention metadata (masks and index tensors), beside what a dense
   [batch, longest chunk, context] mask would take;
4. the share of a batch-8 decode step spent gathering keys and values out of the paged cache
   (PyTorch has no paged attention kernel on the CPU), at 4k and 16k contexts.
Medians of --runs; one process, so every ratio compares runs of the same machine state.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import torch

from bench.common import (
    QWEN2_05B,
    cache_dir,
    machine,
    median,
    memory_bandwidth,
    print_table,
    timeit,
)
from bench.generate import decode_bytes_per_token

LAYERS = 4


def build_checkpoint() -> Path:
    from testing.tiny import build_text_model

    path = cache_dir("qwen2-0.5b-width-4-layers")
    if not (path / "config.json").exists():
        print(f"building a random 4-layer checkpoint of Qwen2-0.5B width in {path} (once)")
        shapes = dict(QWEN2_05B, num_layers=LAYERS, max_position_embeddings=32768)
        build_text_model(path, "qwen2", **shapes)
    return path


class Stepper:
    """Runs one forward (+ logits of the sampled rows) for a list of (start, q_len) requests,
    each with its own random blocks of the runner's cache."""

    def __init__(self, llm) -> None:
        self.runner = llm.engine.runner
        self.model = self.runner.model
        self.block_size = self.runner.layout.block_size
        self.num_blocks = self.runner.layout.num_blocks
        self.rng = random.Random(0)

    def metadata(self, shape: list[tuple[int, int]]):
        from models.layers.attention_metadata import build_metadata

        need = [-(-(s + n) // self.block_size) for s, n in shape]
        pool = self.rng.sample(range(self.num_blocks), sum(need))
        tables, used = [], 0
        for k in need:
            tables.append(pool[used : used + k])
            used += k
        return build_metadata([s for s, _ in shape], [n for _, n in shape], tables,
                              self.block_size, self.runner.device, self.runner.dtype,
                              windows=self.model.attention_windows(),
                              decode_kernel=self.runner.decode_kernel)

    def step(self, shape: list[tuple[int, int]]) -> float:
        meta = self.metadata(shape)
        total = sum(n for _, n in shape)
        ids = torch.randint(0, 1000, (total,))
        pos = torch.cat([torch.arange(s, s + n) for s, n in shape])
        rows, offset = [], 0
        for _, n in shape:
            offset += n
            rows.append(offset - 1)
        rows_t = torch.tensor(rows)

        def run():
            with torch.inference_mode():
                self.model.compute_logits(self.model(ids, pos, meta)[rows_t])

        run()  # warm-up (first touch of the blocks)
        return timeit(run)


def kv_bytes_per_token(model, dtype: torch.dtype) -> int:
    """Over the layers that hold keys and values (a layer reading another's holds none)."""
    own = [a for a in model.attention_layers() if a.kv_source is None]
    return sum(2 * a.num_kv_heads * a.head_dim for a in own) * torch.finfo(dtype).bits // 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--contexts", default="128,512,2048,8192")
    parser.add_argument("--batches", default="1,8,32")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from engine import LLM
    from models.layers.attention import gather_blocks

    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    path = build_checkpoint()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    per_token = 2 * LAYERS * 2 * 64 * torch.finfo(dtype).bits // 8
    tokens = max(max(batches) * (max(contexts) + 1), 8 * 16384 + 2048, 2048 + 32 * 513)
    llm = LLM(path, device="cpu", dtype=args.dtype, max_model_len=16384 + 64,
              max_num_seqs=max(batches) + 1, kv_cache_bytes=int(tokens * per_token * 1.1),
              enable_prefix_caching=False)
    stepper = Stepper(llm)
    model = stepper.model
    kv_token = kv_bytes_per_token(model, llm.engine.dtype)
    weights = decode_bytes_per_token(model)
    bandwidth = memory_bandwidth()
    med = lambda fn: median([fn() for _ in range(args.runs)])  # noqa: E731

    print(f"machine: {machine()}; {path.name}, {args.dtype}; medians of {args.runs} runs; "
          f"decode kernel {stepper.runner.decode_kernel}")
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; weights read per step "
          f"{weights / 1e6:.0f} MB; KV {kv_token} bytes per token\n")

    # 1. Decode steps against their bytes roofline.
    # The attention's own share: the step's growth over the shortest context, against the
    # KV bytes added (the weights and the linears cost the same at every context).
    rows = []
    for b in batches:
        base = None
        for c in contexts:
            seconds = med(lambda b=b, c=c: stepper.step([(c, 1)] * b))
            read = weights + b * (c + 1) * kv_token
            kv_x = "-"
            if base is None:
                base = (seconds, c)
            elif c > base[1]:
                kv_x = (seconds - base[0]) / (b * (c - base[1]) * kv_token / bandwidth)
            rows.append((b, c, seconds * 1e3, read / 1e6, seconds / (read / bandwidth), kv_x))
    print_table(rows, ("batch", "context", "step (ms)", "bytes read (MB)", "x roofline",
                       "added time / added KV bytes' roofline"))
    at_4k = [r for r in rows if r[0] == 8 and r[1] >= 4096]

    # 2. A long chunk beside decodes, against its parts.
    print()
    mixed_rows = []
    chunk = [(0, 2048)]
    for d in (0, 16, 32):
        decodes = [(512, 1)] * d
        ratios, parts_t, mixed_t = [], [], []
        for _ in range(args.runs):
            alone = stepper.step(chunk) + (stepper.step(decodes) if d else 0.0)
            together = stepper.step(chunk + decodes)
            ratios.append(together / alone)
            parts_t.append(alone)
            mixed_t.append(together)
        mixed_rows.append((d, median(mixed_t) * 1e3, median(parts_t) * 1e3, median(ratios)))
    print_table(mixed_rows, ("decodes beside a 2048-token chunk", "mixed step (ms)",
                             "parts alone (ms)", "mixed / parts (median of per-run ratios)"))

    # 3. Metadata memory.
    print()
    meta_rows = []
    elem = torch.finfo(llm.engine.dtype).bits // 8
    for d, c in ((16, 512), (32, 512), (32, 8192)):
        shape = [(0, 2048)] + [(c, 1)] * d
        meta = stepper.metadata(shape)
        dense = (d + 1) * 2048 * (max(c + 1, 2048)) * elem
        meta_rows.append((f"2048-chunk + {d} decodes at {c}", meta.nbytes() / 1e6, dense / 1e6))
    print_table(meta_rows, ("step", "metadata (MB)", "one dense padded mask would be (MB)"))

    # 4. The share of a decode step spent gathering from the paged cache.
    print()
    gather_rows = []
    cache = model.attention_layers()[0].kv_cache
    for c in (4096, 16384):
        meta = stepper.metadata([(c, 1)] * 8)
        view = meta.groups[0].views[None]
        gather = med(lambda v=view: timeit(lambda: gather_blocks(cache, v, 8))) * LAYERS
        step = med(lambda c=c: stepper.step([(c, 1)] * 8))
        gather_rows.append((8, c, gather * 1e3, step * 1e3, gather / step))
    print_table(gather_rows, ("batch", "context", "K+V gathers, all layers (ms)", "step (ms)",
                              "share"))

    worst_mixed = max(r[3] for r in mixed_rows)
    roof = ", ".join(f"{r[4]:.2f}x at {r[1]}" for r in at_4k) or "n/a"
    print(f"\nsummary: mixed step {worst_mixed:.2f}x its parts (worst of 0/16/32 decodes); "
          f"batch-8 decode {roof} of its bytes roofline; largest metadata "
          f"{max(r[1] for r in meta_rows):.1f} MB")


if __name__ == "__main__":
    main()
