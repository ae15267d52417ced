"""Text generation, this engine vs transformers generate(), side by side in one run.

    python -m bench.generate [--model PATH] [--dtype float32] [--runs 3]

Without --model it builds (once, cached) a checkpoint with Qwen2-0.5B's shapes and random
weights. Measures single-stream TTFT and decode tokens/s, and total output tokens/s for 8
concurrent requests (transformers runs them one after another, as a local app would), then the
decode rate as a fraction of the memory-bandwidth roofline (weight bytes read per token).
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

from bench.common import cache_dir, machine, median, memory_bandwidth, print_table, timeit

QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
    vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, std=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


def build_checkpoint() -> Path:
    from testing.tiny import build_text_model

    path = cache_dir("qwen2-0.5b-shapes")
    if not (path / "config.json").exists():
        print(f"building a random checkpoint with Qwen2-0.5B shapes in {path} (once)")
        build_text_model(path, "qwen2", **QWEN2_05B)
    return path


def decode_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every parameter, except that of the embedding
    table only one row is gathered, while the LM head (even when tied to it) is read whole."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # shared counted once
    table = model.embed_tokens.weight
    head = model.lm_head.weight
    return total - table.numel() * table.element_size() + head.numel() * head.element_size()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=8)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    from engine import LLM, SamplingParams

    path = args.model or build_checkpoint()
    llm = LLM(path, device="cpu", dtype=args.dtype, max_model_len=1024,
              enable_prefix_caching=False)
    dtype = llm.engine.dtype
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    vocab = hf.config.vocab_size
    prompts = [torch.randint(0, min(vocab, 100_000), (args.prompt_len,)).tolist()
               for _ in range(args.concurrent)]
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    never = vocab  # an EOS id no argmax produces: HF generates exactly n tokens

    def hf_generate(prompt, tokens):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                        min_new_tokens=tokens, do_sample=False, eos_token_id=never,
                        pad_token_id=never)

    results: dict[str, list[float]] = {k: [] for k in (
        "ours_ttft", "hf_ttft", "ours_decode", "hf_decode", "ours_conc", "hf_conc")}
    llm.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    hf_generate(prompts[0], 4)
    for run in range(args.runs):
        # Single stream (alternating engines).
        out = llm.generate([prompts[0]], params)[0]
        results["ours_ttft"].append(out.metrics.ttft)
        results["ours_decode"].append((n - 1) / out.metrics.decode_time)
        hf_ttft = timeit(lambda: hf_generate(prompts[0], 1))
        hf_total = timeit(lambda: hf_generate(prompts[0], n))
        results["hf_ttft"].append(hf_ttft)
        results["hf_decode"].append((n - 1) / (hf_total - hf_ttft))
        # Concurrent requests: one batch for us, one after another for transformers.
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        ours = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
        results["ours_conc"].append(ours)
        hf_seconds = timeit(lambda: [hf_generate(p, n) for p in prompts])
        results["hf_conc"].append(len(prompts) * n / hf_seconds)
        print(f"run {run + 1}/{args.runs}: " + ", ".join(
            f"{k}={v[-1]:.3g}" for k, v in results.items()))

    m = {k: median(v) for k, v in results.items()}
    # Each run measures both engines back to back, so per-run ratios cancel this machine's
    # drift between runs; the claim is their median.
    ratio = {
        name: median([o / h for o, h in zip(results[ours], results[hf], strict=True)])
        for name, ours, hf in (("ttft", "hf_ttft", "ours_ttft"),
                               ("decode", "ours_decode", "hf_decode"),
                               ("conc", "ours_conc", "hf_conc"))
    }
    bandwidth = memory_bandwidth()
    weight_bytes = decode_bytes_per_token(llm.engine.runner.model)
    roofline = bandwidth / weight_bytes
    print(f"\nmachine: {machine()}; checkpoint {path.name}, {str(dtype)[6:]}; "
          f"prompt {args.prompt_len} tokens, {n} new tokens; median of {args.runs} runs")
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s; {weight_bytes / 1e9:.2f} GB of weights "
          f"per decode step; roofline {roofline:.1f} tokens/s\n")
    print_table(
        [
            ("TTFT (s)", m["ours_ttft"], m["hf_ttft"], ratio["ttft"]),
            ("decode, 1 stream (tok/s)", m["ours_decode"], m["hf_decode"], ratio["decode"]),
            (f"{args.concurrent} concurrent (output tok/s)", m["ours_conc"], m["hf_conc"],
             ratio["conc"]),
        ],
        ("metric", "this engine", "transformers", "speed-up (median of per-run ratios)"),
    )
    print(f"\nsummary: single-stream decode {ratio['decode']:.2f}x transformers, "
          f"{m['ours_decode'] / roofline:.0%} of roofline; "
          f"{args.concurrent} concurrent {ratio['conc']:.2f}x transformers")


if __name__ == "__main__":
    main()
