"""A media turn (a picture sent, the time to its first word), this engine vs llama.cpp's
multimodal path, side by side in one process, alternating, on the same random weights.

    OMP_WAIT_POLICY=PASSIVE python -m bench.media_turn
        [--shape qwen2.5-vl-3b|qwen3-vl-2b|gemma3-4b] [--layers N] [--vision-layers N]
        [--sizes 448,896,1344] [--precisions bf16,int4] [--runs 3] [--new-tokens 16]
        [--threads 2] [--no-recompute]

OMP_WAIT_POLICY=PASSIVE: both libraries' OpenMP threads otherwise spin after their work, and in
one process with as many threads as cores each side then runs beside the other's spinning
threads (on 2 cores it changed this engine's time to first token by 1.5x).

The checkpoint has the named model's widths at full depth, or cut by --layers / --vision-layers
for quick runs (bench.vl_shapes, built once). llama.cpp runs GGUFs its own converter wrote from
the same checkpoint: the text model at bf16 or q4_0 (ours: bfloat16, or int4 weights at the
default group), the tower and projector (`mmproj`) at bf16 on both sides, as Ollama keeps
them; through llama-cpp-python's libmtmd bindings (bench.llama_mtmd). Both get the same
rendered chat prompt (the image where the template puts it); the table says how many prompt
and image tokens each made of it. Each run sends a new image (no cache serves it), then a
second turn about the same image: ours with its prefix cache; llama.cpp keeping its KV cache
(as llama-server does) and starting again from the rendered conversation (as
llama-cpp-python's chat handler does: the image encoded again).

Rulers printed with every table: the matrix-multiply peak of this machine per dtype (a large
GEMM through the fastest formulation the engine has for it) and the memory bandwidth, and each
compute stage's achieved FLOP/s against the peak (FLOPs counted from the shapes: bench.flops).
Medians of --runs; the machine line names the CPU and the variant of our kernels.
"""

from __future__ import annotations

import argparse
import gc
import io
import logging
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from bench import flops as count
from bench.common import machine, median, memory_bandwidth, print_table
from bench.gguf import ensure_gguf, ensure_mmproj
from bench.llama_mtmd import LlamaMtmd, LlamaTurn, build_features
from bench.vl_shapes import SHAPES, build

LLAMA_TYPES = {"bf16": "bf16", "int4": "q4_0"}
QUESTION = "Describe this image in detail."


@dataclass
class OurTurn:
    """Seconds per stage of one of our turns (from the request's own metrics)."""

    preprocess: float  # media decode, resize and normalize, hashing
    encode: float
    prefill: float
    ttft: float
    decode_rate: float
    prompt: list[int]  # the prompt's token ids, -1 at each image position
    image_tokens: int
    text: str


def photo(seed: int, size: int) -> bytes:
    """A PNG of `size` x `size` smooth random colour (a new image per seed)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((size, size), Image.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def messages(image: bytes, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image},
                                         {"type": "text", "text": question}]}]


def our_turn(llm, msgs: list[dict], new_tokens: int) -> OurTurn:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = llm.chat(msgs, params)[0]
    m = out.metrics
    prompt = list(out.prompt_token_ids)
    image_tokens = 0
    for span in out.multi_modal_placeholders:
        image_tokens += span.length
        prompt[span.offset:span.offset + span.length] = [-1] * span.length
    return OurTurn(
        preprocess=sum(m.stages.get(k, 0.0) for k in ("media_load", "preprocess", "hashing")),
        encode=m.encoder_time, prefill=m.prefill_time - m.encoder_time, ttft=m.ttft,
        decode_rate=(new_tokens - 1) / m.decode_time if m.decode_time else 0.0,
        prompt=prompt, image_tokens=image_tokens, text=out.outputs[0].text)


def rendered_prompt(llm, image_text: str, marker: str, msgs: list[dict]) -> str:
    """The chat prompt as our processor renders it, the image's text replaced by llama.cpp's
    marker (libmtmd writes the family's image delimiters itself)."""
    text = llm.engine.processor.render_chat(msgs).text
    if image_text not in text:
        raise RuntimeError(f"the rendered prompt has no {image_text!r}: {text!r}")
    return text.replace(image_text, marker)


def compare_prompts(ours: OurTurn, theirs: LlamaTurn) -> str:
    """Whether both sides saw the same prompt."""
    a = [t for t in ours.prompt if t != -1]
    b = [t for t in theirs.prompt if t != -1]
    same = ("same prompt" if ours.prompt == theirs.prompt else "same text tokens" if a == b
            else f"text tokens differ ({len(a)} vs {len(b)})")
    return (f"{same}; image tokens ours {ours.image_tokens}, llama.cpp {theirs.image_tokens}; "
            f"prompt ours {len(ours.prompt)}, llama.cpp {len(theirs.prompt)}")


def rulers(dtypes: tuple[torch.dtype, ...]) -> dict[str, float]:
    """The GEMM peak per dtype (FLOP/s) and the memory bandwidth (bytes/s)."""
    out = {f"gemm {str(d)[6:]}": count.gemm_peak(d) for d in dtypes}
    out["bandwidth"] = memory_bandwidth()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (full: none)")
    parser.add_argument("--vision-layers", type=int, default=None, help="tower blocks")
    parser.add_argument("--sizes", default="448,896,1344")
    parser.add_argument("--precisions", default="bf16,int4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--no-recompute", action="store_true",
                        help="skip llama.cpp's recomputed second turn (a whole first turn again)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    from engine import LLM

    shape = SHAPES[args.shape]
    path = build(args.shape, args.layers, args.vision_layers)
    sizes = [int(s) for s in args.sizes.split(",")]
    ruler = rulers((torch.float32, torch.bfloat16))
    print(f"machine: {machine()}; {args.shape} widths, {path.name}; rulers: "
          + ", ".join(f"{k} {v / 1e9:.0f} G{'B' if k == 'bandwidth' else 'FLOP'}/s"
                      for k, v in ruler.items()))
    if not args.no_llama_cpp:
        print(f"llama.cpp built for: {build_features()}")
    peak = ruler["gemm bfloat16"]
    table, summary = [], []
    for precision in args.precisions.split(","):
        quant = None if precision == "bf16" else precision
        # room for the largest image the checkpoint's preprocessor accepts (Qwen3-VL's: 16384
        # embeddings, each cached with its deepstack features)
        llm = LLM(path, device="cpu", dtype="bfloat16", quantization=quant, max_model_len=16384,
                  encoder_cache_size=32768)
        theirs = None
        if not args.no_llama_cpp:
            theirs = LlamaMtmd(ensure_gguf(path, LLAMA_TYPES[precision]),
                               ensure_mmproj(path, "bf16"), args.threads, 16384)
        model = llm.engine.runner.model
        for size in sizes:
            # Warm-ups: every graph, plan and buffer of this size made once on both sides; ours
            # counts the linears' FLOPs of its stages.
            warm = messages(photo(10_000 + size, size), QUESTION)
            with count.LinearFlops(model) as flops:
                warmed = our_turn(llm, warm, 1)
            flops.counts["decoder"] += count.causal_attention_flops(model.cfg,
                                                                    len(warmed.prompt))
            if theirs is not None:
                theirs.turn(photo(10_000 + size, size),
                            rendered_prompt(llm, shape.image_text, theirs.marker, warm), 2)
            runs = []
            for run in range(args.runs):
                image = photo(run * 7919 + size, size)
                first = messages(image, QUESTION)
                ours = our_turn(llm, first, args.new_tokens)
                history = first + [{"role": "assistant", "content": ours.text},
                                   {"role": "user", "content": "What colour dominates?"}]
                ours2 = our_turn(llm, history, args.new_tokens)
                row = {"ours": ours, "ours2": ours2}
                if theirs is not None:
                    text = rendered_prompt(llm, shape.image_text, theirs.marker, first)
                    row["llama"] = theirs.turn(image, text, args.new_tokens)
                    full = rendered_prompt(llm, shape.image_text, theirs.marker, history)
                    tail = full[len(text):]  # the new text after the first turn's prompt
                    row["llama2_keep"] = theirs.turn(b"", tail, args.new_tokens, keep=True)
                    if not args.no_recompute:
                        row["llama2_recompute"] = theirs.turn(image, full, args.new_tokens)
                runs.append(row)
                print(f"{precision} {size}px run {run + 1}: TTFT ours {ours.ttft:.2f} s"
                      + (f", llama.cpp {row['llama'].ttft:.2f} s" if theirs else ""))
            table += _rows(precision, size, runs, flops.counts, peak)
            if theirs is not None:
                print(f"  {size}px: {compare_prompts(runs[0]['ours'], runs[0]['llama'])}")
                summary.append((precision, size, median([r["llama"].ttft / r["ours"].ttft
                                                        for r in runs])))
        if theirs is not None:
            theirs.close()
        del llm, theirs
        gc.collect()
    print(f"\n{args.shape}, {path.name}: median of {args.runs} runs, {args.threads} threads, "
          f"text weights bf16 / int4 (llama.cpp q4_0), towers bf16 on both sides\n")
    print_table(table, ("precision", "image", "stage", "llama.cpp", "this engine",
                        "ours faster by", "ours: linears' FLOP/s of GEMM peak"))
    if summary:
        print("\nsummary: new image TTFT, llama.cpp / ours: "
              + "; ".join(f"{p} {s}px {r:.2f}x" for p, s, r in summary))


def _rows(precision: str, size: int, runs: list[dict], flops: dict[str, float],
          peak: float) -> list[tuple]:
    """Table rows for one precision and image size; `flops` of the tower and the decoder on
    this prompt (bench.flops)."""
    n_image = runs[0]["ours"].image_tokens
    n_prompt = len(runs[0]["ours"].prompt)
    have = "llama" in runs[0]

    def med(key: str, side: str = "ours") -> float:
        return median([getattr(r[side], key) for r in runs]) if side in runs[0] else float("nan")

    def row(stage: str, key: str, theirs: str, ours_side: str = "ours", flops: float = 0.0,
            rate: bool = False) -> tuple:
        o, t = med(key, ours_side), med(key, theirs) if have else float("nan")
        faster = (o / t if rate else t / o) if have and o and t else float("nan")
        achieved = f"{flops / o / peak:.0%}" if flops and o else ""
        return (precision, f"{size}px ({n_image} tok)", stage, t, o, faster, achieved)

    rows = [
        row("preprocess (s)", "preprocess", "llama"),
        row("vision encode (s)", "encode", "llama", flops=flops["tower"]),
        row(f"prefill, {n_prompt} tokens (s)", "prefill", "llama", flops=flops["decoder"]),
        row("time to first token (s)", "ttft", "llama"),
        row("decode (tok/s)", "decode_rate", "llama", rate=True),
        row("second turn, llama.cpp keeping its cache (s)", "ttft", "llama2_keep", "ours2"),
    ]
    if "llama2_recompute" in runs[0]:
        rows.append(row("second turn, llama.cpp recomputing (s)", "ttft", "llama2_recompute",
                        "ours2"))
    return rows


if __name__ == "__main__":
    main()
