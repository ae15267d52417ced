"""KV cache quantization on real weights: what an int8 cache (`kv_cache_dtype="int8"`) costs in
quality and gains in decode speed, against the unquantized cache, and llama.cpp's q8_0 cache
against its f16 one.

    python -m bench.kv_quant --model gemma3                 # or smollm2, or PATH.gguf
    python -m bench.kv_quant --model smollm2 --contexts 1024,8192
    python -m bench.kv_quant --smoke                        # a tiny random model, seconds
    python -m bench.kv_quant --model gemma3 --decode-only   # the decode rows alone

Quality: the teacher-forced next-token distribution over a long text every Debian machine ships
(the GPL, /usr/share/common-licenses/GPL-3, about 8 k tokens), cut into windows of `--window`
tokens, each run as a prefill in chunks of `--chunk` tokens through the paged cache, so that
every chunk after a window's first reads the keys and values before it from the cache (a chunk
starting a sequence attends its own, unrounded keys; so does llama.cpp's f16 cache, while its
q8_0 cache rounds those too). Reported: the mean and 99th percentile KL divergence of the int8
cache's distribution from the unquantized cache's (same weights, same dtype), top-1 agreement,
and both perplexities. llama.cpp reports its q8_0 KV cache at a KL divergence of about 1e-3.

Decode speed: one request at a context of each of `--contexts` tokens (the text repeated),
`--new-tokens` decoded greedily, decode tokens/s from the engine's metrics (the prompt's prefill
excluded), for the unquantized and the int8 cache, alternating, `--runs` times (median); with
llama-cpp-python installed (bench-only: `pip install llama-cpp-python`) also llama.cpp on the
same GGUF with its f16 and q8_0 caches (`type_k` / `type_v`, flash attention on, which a
quantized V cache needs); without it that column is skipped, saying so. Contexts past the
model's length are skipped. Run on a quiet machine: this is a timing benchmark.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import machine
from bench.quality import model_file

GPL = Path("/usr/share/common-licenses/GPL-3")
GGML_TYPE_F16, GGML_TYPE_Q8_0 = 1, 8  # ggml's type ids, llama-cpp-python's type_k / type_v


def smoke_model(folder: Path) -> Path:
    """A tiny random Llama-shaped checkpoint (head size 64, 2 KV heads) for a smoke run."""
    from testing.tiny import build_text_model

    return build_text_model(folder / "tiny", "llama", hidden_size=128, num_heads=2,
                            num_kv_heads=2, max_position_embeddings=1024)


def text_ids(path: Path, tokens: int, smoke: bool) -> tuple[list[int], int]:
    """The text's token ids (at most `tokens`) and the model's vocabulary size."""
    from engine.checkpoint_setup import CheckpointSetup

    setup = CheckpointSetup.load(path)
    vocab = setup.hf_config.get_text_config().vocab_size
    if smoke:
        gen = torch.Generator().manual_seed(0)
        return torch.randint(4, vocab, (tokens,), generator=gen).tolist(), vocab
    ids = setup.tokenizer(GPL.read_text(), add_special_tokens=False).input_ids[:tokens]
    return ids, vocab


def chunked_logits(llm, ids: list[int], chunk: int) -> torch.Tensor:
    """Teacher-forced logits [len, vocab] of `ids` as one sequence prefilled in chunks through
    the engine's paged cache (its blocks 0, 1, ...)."""
    from models.layers.attention_metadata import build_metadata

    runner = llm.engine.runner
    model, size = runner.model, runner.layout.block_size
    blocks = list(range(-(-len(ids) // size)))
    out = []
    with torch.inference_mode():
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            meta = build_metadata([start], [len(piece)], [blocks], size, torch.device("cpu"),
                                  runner.dtype, windows=model.attention_windows(),
                                  decode_kernel=runner.decode_kernel)
            positions = torch.arange(start, start + len(piece))
            out.append(model.compute_logits(model(torch.tensor(piece), positions, meta)).float())
    return torch.cat(out)


def compare(reference: Callable[[list[int]], torch.Tensor],
            other: Callable[[list[int]], torch.Tensor], windows: list[list[int]]) -> dict:
    """KL divergence of `other`'s next-token distributions from `reference`'s (mean, p99),
    top-1 agreement and both perplexities, over every window's scored positions."""
    klds, agree, nll_ref, nll_other, rows = [], 0, 0.0, 0.0, 0
    for ids in windows:
        lp = reference(ids)[:-1].log_softmax(-1)
        lq = other(ids)[:-1].log_softmax(-1)
        target = torch.tensor(ids[1:])[:, None]
        klds.append((lp.exp() * (lp - lq)).sum(-1))
        agree += (lp.argmax(-1) == lq.argmax(-1)).sum().item()
        nll_ref -= lp.gather(1, target).sum().item()
        nll_other -= lq.gather(1, target).sum().item()
        rows += lp.shape[0]
    kld = torch.cat(klds)
    return {"kld": kld.mean().item(), "kld_p99": kld.quantile(0.99).item(),
            "top1": agree / rows, "ppl_reference": float(torch.tensor(nll_ref / rows).exp()),
            "ppl": float(torch.tensor(nll_other / rows).exp()), "positions": rows}


def ours_quality(path: Path, windows: list[list[int]], window: int, chunk: int,
                 dtype: str) -> dict:
    from engine import LLM

    engines = {kv: LLM(path, dtype=dtype, max_model_len=window, max_num_seqs=1,
                       enable_prefix_caching=False, kv_cache_dtype=kv)
               for kv in ("auto", "int8")}
    return compare(lambda ids: chunked_logits(engines["auto"], ids, chunk),
                   lambda ids: chunked_logits(engines["int8"], ids, chunk), windows)


def llama_cpp_quality(path: Path, windows: list[list[int]], window: int, chunk: int,
                      threads: int) -> dict:
    """llama.cpp's q8_0 cache against its f16 cache, the same windows in the same chunks."""
    import numpy as np
    from llama_cpp import Llama

    def engine(kind: int) -> Callable[[list[int]], torch.Tensor]:
        llm = Llama(str(path), n_ctx=window, n_batch=chunk, n_ubatch=chunk, logits_all=True,
                    n_threads=threads, n_threads_batch=threads, flash_attn=True,
                    type_k=kind, type_v=kind, verbose=False)

        def run(ids: list[int]) -> torch.Tensor:
            llm.reset()
            llm.eval(ids)
            return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
        return run

    return compare(engine(GGML_TYPE_F16), engine(GGML_TYPE_Q8_0), windows)


def ours_decode(path: Path, dtype: str, kv: str, prompt: list[int], new_tokens: int) -> float:
    """Decode tokens/s of one request after a `len(prompt)`-token prompt."""
    from engine import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_model_len=len(prompt) + new_tokens, max_num_seqs=1,
              enable_prefix_caching=False, kv_cache_dtype=kv)
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    return (len(out.outputs[0].token_ids) - 1) / out.metrics.decode_time


def llama_cpp_decode(path: Path, kind: int, prompt: list[int], new_tokens: int,
                     threads: int) -> float:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=len(prompt) + new_tokens, n_batch=512, n_threads=threads,
                flash_attn=True, type_k=kind, type_v=kind, verbose=False)
    stream = llm.generate(prompt, temp=0.0, top_k=1, reset=True)
    next(stream)  # the prompt's prefill and the first token
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        next(stream)
    seconds = time.perf_counter() - t0
    llm.close()
    return (new_tokens - 1) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3", help="smollm2, gemma3 or a GGUF path")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (both caches)")
    parser.add_argument("--tokens", type=int, default=8192, help="of the GPL text, at most")
    parser.add_argument("--window", type=int, default=1024, help="tokens per window of the "
                        "quality rows (llama.cpp keeps every position's logits: a window x the "
                        "vocabulary in float32, twice)")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (llama.cpp's "
                        "ubatch) for the quality rows")
    parser.add_argument("--contexts", default="1024,8192,16384")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--decode-only", action="store_true", help="skip the quality rows")
    parser.add_argument("--smoke", action="store_true", help="a tiny random model, a few "
                        "hundred random tokens, short contexts, one run (checks the script)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.smoke:
            path = smoke_model(Path(tmp))
            args.tokens, args.window, args.chunk = 300, 128, 32
            args.contexts, args.new_tokens, args.runs = "64,256", 8, 1
        else:
            path = model_file(args.model)
        run(args, path)


def run(args: argparse.Namespace, path: Path) -> None:

    llama = None
    if not args.smoke and not args.no_llama_cpp:
        llama = (None if importlib.util.find_spec("llama_cpp") is None else "llama.cpp")
    reason = ("--smoke" if args.smoke else "--no-llama-cpp" if args.no_llama_cpp
              else "llama-cpp-python is not installed (pip install llama-cpp-python)")
    ids, _ = text_ids(path, args.tokens, args.smoke)
    windows = [ids[s:s + args.window] for s in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > args.chunk]
    print(f"{path.name}: {len(ids)} tokens in {len(windows)} windows of up to {args.window}, "
          f"chunks of {args.chunk}; {args.dtype}; {machine()}")

    if not args.decode_only:
        quality(args, path, windows, llama, reason)
    decode(args, path, ids, llama)


def quality(args: argparse.Namespace, path: Path, windows: list[list[int]], llama: str | None,
            reason: str) -> None:
    ours = ours_quality(path, windows, args.window, args.chunk, args.dtype)
    print(f"ours int8 cache vs ours {args.dtype} cache: KLD {ours['kld']:.3e} (p99 "
          f"{ours['kld_p99']:.3e}), top-1 {100 * ours['top1']:.2f}%, perplexity "
          f"{ours['ppl']:.3f} vs {ours['ppl_reference']:.3f} over {ours['positions']} positions")
    if llama is not None:
        theirs = llama_cpp_quality(path, windows, args.window, args.chunk, args.threads)
        print(f"llama.cpp q8_0 cache vs its f16 cache: KLD {theirs['kld']:.3e} (p99 "
              f"{theirs['kld_p99']:.3e}), top-1 {100 * theirs['top1']:.2f}%, perplexity "
              f"{theirs['ppl']:.3f} vs {theirs['ppl_reference']:.3f}")
    else:
        print(f"llama.cpp rows skipped: {reason}")


def decode(args: argparse.Namespace, path: Path, ids: list[int], llama: str | None) -> None:
    from engine.checkpoint_setup import CheckpointSetup
    from engine.memory_plan import context_length

    model_max = context_length(CheckpointSetup.load(path).hf_config)[0]
    print("\n| context | ours " + args.dtype + " cache tok/s | ours int8 cache tok/s | speed-up"
          + (" | llama.cpp f16 cache | llama.cpp q8_0 cache |" if llama else " |"))
    print("|---|---|---|---|" + ("---|---|" if llama else ""))
    for context in map(int, args.contexts.split(",")):
        if context + args.new_tokens > model_max:
            print(f"| {context} | skipped: past the model's {model_max} tokens |")
            continue
        prompt = (ids * (-(-context // len(ids))))[:context]
        rates: dict[str, list[float]] = {"auto": [], "int8": [], "f16": [], "q8_0": []}
        for _ in range(args.runs):  # alternating: a burst of load falls on both alike
            for kv in ("auto", "int8"):
                rates[kv].append(ours_decode(path, args.dtype, kv, prompt, args.new_tokens))
            if llama:
                for name, kind in (("f16", GGML_TYPE_F16), ("q8_0", GGML_TYPE_Q8_0)):
                    rates[name].append(llama_cpp_decode(path, kind, prompt, args.new_tokens,
                                                        args.threads))
        med = {k: statistics.median(v) for k, v in rates.items() if v}
        row = (f"| {context} | {med['auto']:.1f} | {med['int8']:.1f} | "
               f"{med['int8'] / med['auto']:.2f}x |")
        if llama:
            row += f" {med['f16']:.1f} | {med['q8_0']:.1f} |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
