"""Time to ready and memory at start-up: mmserve (first start, with empty caches, and second
start, reading back the kernel plan and the quantized weights) against llama.cpp on the same
GGUF files and transformers on the same safetensors checkpoint, in one run.

    python -m bench.startup                 # every model found, every runtime installed
    python -m bench.startup --layers 8      # the safetensors checkpoint with 8 layers
    python -m bench.startup --smoke         # a tiny random checkpoint only (checks the script)
    python -m bench.startup --models 0.5B,1.5B   # only the models whose name holds one of these
    python -m bench.startup --rounds 5      # medians of 5 second starts, alternating runtimes

Models: the real GGUF files installed as data packages (testing/real_weights.py,
bench/speculative.py: SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M, Qwen2.5-Coder-0.5B and 1.5B
Q4_K_M), each skipped with the pip command when absent, and a bfloat16 safetensors checkpoint
at Qwen2.5-VL-3B's language-model widths (hidden 2048, MLP 11008, 16 heads, 2 KV heads, vocab
151936; random weights, built once, `--layers` of its 36 layers: the table says how many).

Each row runs in a process of its own, so that its peak resident set (VmHWM) is its own:
"ready" is the seconds from the process's launch (the interpreter's start and every import
counted: the row's process imports nothing before its runtime) to the constructor's return
plus one generated token (the model answers), "peak" the peak RSS, "resident" VmRSS after
that token (weights mapped from the file count as their touched pages), with the ratios peak /
resident (the goal: at most 1.15) and resident / file size. mmserve starts with its defaults
(no max_model_len: the context is fitted to the KV budget) and, on the safetensors checkpoint,
also in bfloat16 with int4 weights (what the weight cache keeps); the first start of each row
uses empty kernel-plan and weight caches, the second the caches the first left.
llama.cpp (llama-cpp-python) runs at n_ctx 4096, transformers at the checkpoint's dtype; a
runtime that is not installed is a row saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN25_VL_3B_TEXT = dict(hidden_size=2048, intermediate_size=11008, num_heads=16,
                         num_kv_heads=2, vocab_size=151936, max_position_embeddings=32768)
FULL_LAYERS = 36
PROMPT = "The capital of France is"


# ---- one row, in its own process ------------------------------------------------------------


def _status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS: resident now, VmHWM: its peak since exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _resident() -> int:
    return _status("VmRSS")


def _child(runtime: str, model: str, options: dict, launched: float) -> dict:
    if runtime == "mmserve":
        from engine import LLM, SamplingParams

        llm = LLM(model, device="cpu", **options)
        llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0))
        extra = {"context": llm.engine.max_model_len}
    elif runtime == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=model, n_ctx=4096, verbose=False)
        llm(PROMPT, max_tokens=1, temperature=0)
        extra = {"context": 4096}
    else:
        import torch
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(model)
        hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype="auto")
        with torch.no_grad():
            hf.generate(**tok(PROMPT, return_tensors="pt"), max_new_tokens=1, do_sample=False)
        extra = {"context": hf.config.max_position_embeddings}
    ready = time.time() - launched
    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across fork and exec, so a child of this
    # (large) process would report the parent's peak
    peak = _status("VmHWM")
    return {"ready_s": ready, "peak": peak, "resident": _resident(), **extra}


def _run_row(runtime: str, model: Path, options: dict, caches: Path) -> dict:
    env = dict(os.environ, MMSERVE_KERNEL_CACHE=str(caches),
               MMSERVE_WEIGHT_CACHE=str(caches / "weights"))
    command = [sys.executable, "-m", "bench.startup", "--child", runtime, str(model),
               json.dumps(options), repr(time.time())]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:100]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- models and rows ------------------------------------------------------------------------


def gguf_models() -> list[tuple[str, Path | None, str]]:
    """(name, file or None, why absent) of the real GGUF files."""
    from bench.speculative import DRAFT, PIP, TARGET, joined_gguf
    from testing.real_weights import PIP_HINT, gemma3_path, smollm2_path

    return [("SmolLM2-135M Q4_1", smollm2_path(), PIP_HINT),
            ("Gemma 3 270M Q4_K_M", gemma3_path(), PIP_HINT),
            ("Qwen2.5-Coder-0.5B Q4_K_M", joined_gguf(*DRAFT), PIP),
            ("Qwen2.5-Coder-1.5B Q4_K_M", joined_gguf(*TARGET), PIP)]


def safetensors_model(layers: int, smoke: bool) -> tuple[str, Path]:
    """The bfloat16 checkpoint at Qwen2.5-VL-3B's text widths (`layers` of 36), built once; or
    for `smoke` a tiny one."""
    if smoke:
        from testing.tiny import build_text_model

        path = Path(tempfile.mkdtemp()) / "tiny"
        return "tiny qwen2 (smoke)", build_text_model(path, "qwen2")
    from bench.common import cache_dir

    path = cache_dir(f"qwen2.5-vl-3b-text-{layers}-layers-bf16")
    if not (path / "config.json").exists():
        print(f"building a random bfloat16 checkpoint at Qwen2.5-VL-3B's text widths, {layers} "
              f"layers, in {path} (once)", flush=True)
        _build_bf16(path, layers)
    return f"Qwen2.5-VL-3B text widths, bf16, {layers} of {FULL_LAYERS} layers", path


def _build_bf16(path: Path, layers: int) -> None:
    import torch
    import transformers

    from testing.tiny import qwen_tokenizer, save_checkpoint

    shape = QWEN25_VL_3B_TEXT
    tok = qwen_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"], num_hidden_layers=layers,
        num_attention_heads=shape["num_heads"], num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=None, dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)
    save_checkpoint(model, tok, path, [tok.eos_token_id])


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def rows(args: argparse.Namespace) -> list[tuple]:
    table = []
    models: list[tuple[str, Path | None, str, list[tuple[str, str, dict]]]] = []
    if not args.smoke:
        for name, path, hint in gguf_models():
            models.append((name, path, hint, [("mmserve defaults", "mmserve", {}),
                                              ("llama.cpp n_ctx 4096", "llama.cpp", {})]))
    name, path = safetensors_model(args.layers, args.smoke)
    models.append((name, path, "", [
        ("mmserve defaults", "mmserve", {}),
        ("mmserve bf16 int4", "mmserve", {"dtype": "bfloat16", "quantization": "int4"}),
        ("transformers", "transformers", {})]))
    wanted = [w.strip().lower() for w in args.models.split(",") if w.strip()]
    for name, path, hint, runs in models:
        if wanted and not any(w in name.lower() for w in wanted):
            continue
        if path is None:
            table.append((name, "-", f"not installed: {hint}", "", "", "", "", "", ""))
            continue
        size = (path.stat().st_size if path.is_file()
                else sum(f.stat().st_size for f in path.glob("*.safetensors")))
        # each runtime's caches for the whole model: mmserve's first start fills them, its
        # second starts read them back, alternating with the others' starts, `rounds` times
        with tempfile.TemporaryDirectory() as root:
            results: dict[str, list[dict]] = {}
            order = []
            for label, runtime, options in runs:
                module = {"llama.cpp": "llama_cpp", "transformers": "transformers"}.get(runtime)
                if module and not _installed(module):
                    table.append((name, label, f"skipped: {module} is not installed", "", "",
                                  "", "", "", ""))
                    continue
                caches = Path(root) / str(len(order))
                if runtime == "mmserve":
                    results[f"{label} (first)"] = [_run_row(runtime, path, options, caches)]
                    order.append((f"{label} (second)", runtime, options, caches))
                else:
                    order.append((label, runtime, options, caches))
            for _ in range(args.rounds):
                for label, runtime, options, caches in order:
                    results.setdefault(label, []).append(
                        _run_row(runtime, path, options, caches))
        for label, starts in results.items():
            failed = next((r for r in starts if "error" in r), None)
            if failed is not None:
                table.append((name, label, f"failed: {failed['error']}", "", "", "", "", "", ""))
                continue
            r = {key: statistics.median(s[key] for s in starts)
                 for key in ("ready_s", "peak", "resident")} | {"context": starts[0]["context"]}
            table.append((name, label, round(r["ready_s"], 2), round(r["peak"] / 2**20),
                          round(r["resident"] / 2**20), round(size / 2**20),
                          round(r["peak"] / r["resident"], 2),
                          round(r["resident"] / size, 2), r["context"]))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4,
                        help=f"layers of the safetensors checkpoint (of {FULL_LAYERS})")
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint only")
    parser.add_argument("--models", default="",
                        help="only the models whose name holds one of these (comma-separated)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="second starts (and the other runtimes' starts), alternating; "
                             "the table holds their medians")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        runtime, model, options, launched = args.child
        print(json.dumps(_child(runtime, model, json.loads(options), float(launched))))
        return
    from bench.common import machine, print_table  # torch: not in a row's process before t0

    print(f"# start-up: {machine()}")
    print_table(rows(args), ("model", "runtime", "ready s", "peak MiB", "resident MiB",
                             "file MiB", "peak / resident", "resident / file", "context"))


if __name__ == "__main__":
    main()
