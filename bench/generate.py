"""Text generation, this engine (per dtype x weight quantization) vs transformers generate(),
side by side in one run, with an optional llama.cpp column.

    python -m bench.generate [--model PATH | --shapes qwen2-0.5b|qwen3.5-0.8b|gemma4-e4b]
        [--dtype float32,bfloat16] [--quantization none,int8,int4] [--group-size 64]
        [--runs 3] [--no-llama-cpp] [--no-transformers] [--device cuda]

Without --model it builds (once, cached) a checkpoint with random weights and Qwen2-0.5B's
shapes, or with `--shapes qwen3.5-0.8b` Qwen3.5-0.8B's language model (hybrid: Gated DeltaNet
and attention; its rows also give the recurrent state's bytes per request, which each decode
step reads and writes, counted in its roofline), or with `--shapes gemma4-e4b` Gemma 4 E4B's
language model at 12 of its 42 layers (bench.common.GEMMA4_E4B: per-layer embeddings, KV shared
by its last 6 layers, global layers with their own head size; in bfloat16 it and transformers'
copy take about 5 GB each: pass `--dtype bfloat16` on a machine that cannot hold both in
float32). For each dtype it measures, run after run
alternating with transformers: single-stream TTFT and decode tokens/s, and total output
tokens/s for 8 concurrent requests (transformers runs them one after another, as a local app
would), then the decode rate as a fraction of the memory-bandwidth roofline on the bytes one
decode step actually reads (int8 / int4 weights and their scales), against the bandwidth read
right after that row's single-stream decode (on a shared VM it moves with the neighbours'
load, within a run too). transformers has no counterpart of the quantized rows: their ratios
are against its unquantized model in the same dtype. With llama-cpp-python installed
(bench-only, never a runtime dependency: `pip install llama-cpp-python sentencepiece` builds
it), each row is also run alternately against llama.cpp on a GGUF of the same weights at the
matching precision (f32, bf16, q8_0 for int8, q4_0 for int4; bench.gguf converts them once);
otherwise that column is skipped. The machine line names the CPU and the variant of our
kernels that ran. A mixture-of-experts model's roofline counts the routed experts only (top k
per sparse layer, bench.moe_checkpoint writes one with Qwen3-30B-A3B's shapes);
`--no-transformers` skips the reference where it cannot hold the model in memory. `--device
cuda` runs both on the GPU (no llama.cpp column; the roofline against the GPU's memory
bandwidth, read the same way).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import logging
import time
from pathlib import Path

import torch

from bench.common import (
    SHAPES,
    build_checkpoint,
    machine,
    median,
    memory_bandwidth,
    print_table,
    timeit,
)
from engine.config import EngineConfig


def decode_bytes_per_token(model, state_bytes: int = 0) -> int:
    """Bytes one decode step of one request reads: every parameter and buffer (quantized
    weights and their scales; a oneDNN-prepacked copy replaces the weight it packs), except
    that of the embedding tables (the token embeddings, a per-layer table) only one row is
    gathered, while the LM head is read whole even when it shares the table; of a
    mixture-of-experts block only the routed experts (top k of them; the router and any shared
    expert whole); and a hybrid model's recurrent state (`state_bytes` per request), read and
    written back."""
    from models.layers.moe import RoutedExperts

    table = model.embed_tokens.weight
    seen, total = {table.data_ptr()}, 2 * state_bytes
    per_layer = getattr(model, "per_layer_inputs", None)
    if per_layer is not None:  # one row of the per-layer table
        rows = per_layer.embed_tokens_per_layer.weight
        seen.add(rows.data_ptr())
        total += rows[0].numel() * rows.element_size()
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    for block in experts:  # all experts of a block have one size: k of them are read
        sizes = [_nbytes(e, seen) for e in block.experts]
        total += sizes[0] * block.shape.top_k
    total += _nbytes(model, seen)
    head = getattr(model.lm_head, "weight", None)
    if head is not None and head.data_ptr() == table.data_ptr():
        total += head.numel() * head.element_size()
    return total


def _nbytes(module, seen: set[int]) -> int:
    """Bytes of `module`'s parameters and buffers not in `seen` (which it extends)."""
    total = 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


class Transformers:
    """transformers' generate() on the same checkpoint and prompts."""

    def __init__(self, path: Path, dtype: torch.dtype, device: str = "cpu") -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
        self.never = self.model.config.vocab_size  # an EOS id no argmax produces

    def generate(self, prompt: list[int], tokens: int) -> None:
        ids = torch.tensor([prompt], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                      max_new_tokens=tokens, min_new_tokens=tokens,
                                      do_sample=False, eos_token_id=self.never,
                                      pad_token_id=self.never)
        out.tolist()  # on a GPU: wait for the last token, as the engine's caller does

    def measure(self, prompts: list[list[int]], n: int) -> dict[str, float]:
        ttft = timeit(lambda: self.generate(prompts[0], 1))
        total = timeit(lambda: self.generate(prompts[0], n))
        conc = timeit(lambda: [self.generate(p, n) for p in prompts])
        return {"ttft": ttft, "decode": (n - 1) / (total - ttft),
                "conc": len(prompts) * n / conc}


def measure_engine(llm, prompts: list[list[int]], n: int,
                   device: str = "cpu") -> dict[str, float]:
    """TTFT and decode of one request, the memory bandwidth right after it (the VM's moves with
    its neighbours' load; read before, it would disturb the TTFT), then the concurrent rate."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = llm.generate([prompts[0]], params)[0]
    bandwidth = memory_bandwidth(device=device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    conc = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    return {"ttft": out.metrics.ttft, "decode": (n - 1) / out.metrics.decode_time, "conc": conc,
            "bandwidth": bandwidth}


# The llama.cpp GGUF type each of our rows is compared with: by quantization, else by dtype.
LLAMA_QUANTIZED = {"int8": "q8_0", "int4": "q4_0"}
LLAMA_DENSE = {"float32": "f32", "bfloat16": "bf16"}


class LlamaCpp:
    """llama.cpp (through llama-cpp-python) on a GGUF of the same weights: single-stream TTFT
    and decode tokens/s for the same prompt (it has no batched counterpart here)."""

    def __init__(self, gguf: Path, context: int) -> None:
        from llama_cpp import Llama

        self.name = gguf.name
        self.llm = Llama(str(gguf), n_ctx=context, n_threads=torch.get_num_threads(),
                         n_batch=512, verbose=False)

    def measure(self, prompts: list[list[int]], n: int) -> dict[str, float]:
        # Forget the previous run's tokens: generate() would otherwise reuse the KV of the
        # longest common prefix and skip most of the prompt.
        self.llm.reset()
        t0 = time.perf_counter()
        stream = self.llm.generate(prompts[0], temp=0.0, top_k=1, reset=True)
        next(stream)
        ttft = time.perf_counter() - t0
        for _ in range(n - 1):
            next(stream)
        return {"ttft": ttft, "decode": (n - 1) / (time.perf_counter() - t0 - ttft)}


def llama_cpp_engines(path: Path, dtype_name: str, modes: list[str | None],
                      context: int) -> dict:
    """{quantization mode: LlamaCpp} for this dtype's rows, or {} without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return {}
    from bench.gguf import ensure_gguf

    kinds = {q: LLAMA_QUANTIZED[q] if q else LLAMA_DENSE.get(dtype_name) for q in modes}
    try:
        return {q: LlamaCpp(ensure_gguf(path, kind), context)
                for q, kind in kinds.items() if kind}
    except Exception as e:  # noqa: BLE001 - a converter or llama.cpp without this architecture
        print(f"llama.cpp column skipped for {path.name}: {type(e).__name__}: {e}")
        return {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--shapes", default=SHAPES[0], choices=SHAPES,
                        help="the checkpoint built when --model is not given")
    parser.add_argument("--dtype", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--quantization", default="none,int8,int4", help="comma-separated")
    parser.add_argument("--group-size", type=int,
                        default=EngineConfig.quantization_group_size)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="skip the llama.cpp column even when llama-cpp-python is installed")
    parser.add_argument("--no-transformers", action="store_true",
                        help="skip transformers (a checkpoint it cannot hold in memory); the "
                             "speed-up columns are then empty")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (then no llama.cpp)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    from engine import LLM, SamplingParams

    path = args.model or build_checkpoint(args.shapes)
    modes = [None if q == "none" else q for q in args.quantization.split(",")]
    n = args.new_tokens
    context = max(1024, args.prompt_len + n)
    bandwidths = []  # read within each row's run: on a shared VM it moves with the neighbours
    rows, summary, llama_rows = [], [], []
    if args.device != "cpu":
        args.no_llama_cpp = True
    if args.no_llama_cpp or importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp column skipped: llama-cpp-python is not installed (or --no-llama-cpp)")
    for dtype_name in args.dtype.split(","):
        engines = {q: LLM(path, device=args.device, dtype=dtype_name, max_model_len=context,
                          max_num_seqs=args.concurrent, enable_prefix_caching=False,
                          quantization=q, quantization_group_size=args.group_size)
                   for q in modes}
        dtype = next(iter(engines.values())).engine.dtype
        hf = None if args.no_transformers else Transformers(path, dtype, args.device)
        llama = {} if args.no_llama_cpp else llama_cpp_engines(path, dtype_name, modes, context)
        vocab = next(iter(engines.values())).engine.runner.vocab_size
        prompts = [torch.randint(0, min(vocab, 100_000), (args.prompt_len,)).tolist()
                   for _ in range(args.concurrent)]
        for llm in engines.values():  # warm-up
            llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))
        if hf is not None:
            hf.generate(prompts[0], 4)
        for other in llama.values():
            other.measure(prompts, 4)
        ours = {q: [] for q in modes}
        theirs = []
        cpp = {q: [] for q in llama}
        for run in range(args.runs):  # alternating: drift hits every row alike
            if hf is not None:
                theirs.append(hf.measure(prompts, n))
            for q, llm in engines.items():
                ours[q].append(measure_engine(llm, prompts, n, args.device))
                bandwidths.append(ours[q][-1]["bandwidth"])
                if q in llama:
                    cpp[q].append(llama[q].measure(prompts, n))
            print(f"{dtype_name} run {run + 1}/{args.runs}: transformers "
                  + (", ".join(f"{k}={v:.3g}" for k, v in theirs[-1].items()) if theirs
                     else "-") + "; "
                  + "; ".join(f"{q or 'none'} " + ", ".join(
                      f"{k}={v:.3g}" for k, v in ours[q][-1].items()) for q in modes))
        for q, llm in engines.items():
            state = llm.engine.stats().get("state_bytes_per_request", 0)
            weight_bytes = decode_bytes_per_token(llm.engine.runner.model, state)
            of_roofline = median([r["decode"] * weight_bytes / r["bandwidth"] for r in ours[q]])

            def med(key: str, runs=ours[q]) -> float:
                return median([r[key] for r in runs])

            def ratio(key: str, runs=ours[q], base=theirs, invert: bool = False):
                if not base:
                    return "-"
                pairs = zip(runs, base, strict=True)
                return median([h[key] / o[key] if invert else o[key] / h[key] for o, h in pairs])

            label = f"{str(dtype)[6:]} {q or 'dense'}"
            versus = "-"
            if cpp.get(q):
                versus = (f"{llama[q].name.rsplit('-', 1)[-1][:-5]}: "
                          f"{ratio('decode', base=cpp[q]):.2f}x decode, "
                          f"{ratio('ttft', base=cpp[q], invert=True):.2f}x TTFT")
            rows.append((label, med("ttft"), ratio("ttft", invert=True), med("decode"),
                         ratio("decode"), of_roofline, weight_bytes / 1e9,
                         f"{state / 2**20:.1f}" if state else "-",
                         med("conc"), ratio("conc"), versus))
            if cpp.get(q):
                llama_rows.append((f"{str(dtype)[6:]} {q or 'dense'}", llama[q].name,
                                   median([r["ttft"] for r in cpp[q]]),
                                   median([r["decode"] for r in cpp[q]])))
        if theirs:
            summary.append((str(dtype)[6:], median([t["ttft"] for t in theirs]),
                            median([t["decode"] for t in theirs]),
                            median([t["conc"] for t in theirs])))
        del engines, hf, llama
        gc.collect()

    print(f"\nmachine: {machine(args.device)}; checkpoint {path.name}; "
          f"prompt {args.prompt_len} tokens, {n} new tokens; median of {args.runs} runs; "
          f"memory bandwidth "
          f"{median(bandwidths) / 1e9:.1f} GB/s (median of the readings in each row's run, "
          f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f}); "
          f"int4 group {args.group_size}\n")
    print_table(rows, ("this engine", "TTFT (s)", "TTFT speed-up", "decode tok/s",
                       "decode speed-up", "of roofline", "GB read / token",
                       "state MiB / request",
                       f"{args.concurrent} concurrent tok/s", "concurrent speed-up",
                       "vs llama.cpp"))
    print("\nspeed-ups: median of per-run ratios against transformers, unquantized, same dtype")
    print_table(summary, ("transformers", "TTFT (s)", "decode tok/s",
                          f"{args.concurrent} sequential tok/s"))
    if llama_rows:
        print("\nvs llama.cpp: median of per-run ratios, ours / llama.cpp's (speed)")
        print_table(llama_rows, ("llama.cpp beside", "GGUF", "TTFT (s)", "decode tok/s"))

if __name__ == "__main__":
    main()
