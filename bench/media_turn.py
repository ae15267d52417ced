"""A media turn (a picture or a sound sent, the time to its first word), this engine vs
llama.cpp's multimodal path, side by side in one process, alternating, on the same random
weights; and a video turn against transformers (llama.cpp's libmtmd takes no video).

    OMP_WAIT_POLICY=PASSIVE python -m bench.media_turn
        [--shape qwen2.5-vl-3b|qwen3-vl-2b|gemma3-4b|qwen2-audio-7b] [--layers N]
        [--vision-layers N] [--sizes 448,896,1344] [--seconds 30] [--video SECONDS]
        [--precisions bf16,int4] [--runs 3] [--new-tokens 16] [--threads 2] [--no-recompute]
        [--from-gguf [--check-tokens]] [--pair TEXT.gguf MMPROJ.gguf]

--from-gguf: this engine loads the very GGUF files llama.cpp runs (the text model at bf16 or
q4_0, which runs as stored: int4 at group 32; the projector at bf16), not the checkpoint;
--check-tokens first says whether the same checkpoint converted at f32 (text and projector)
gives the greedy tokens of the checkpoint loaded from safetensors at float32, on the first
media item. --pair TEXT MMPROJ: a multimodal GGUF pair of one's own (Qwen2.5-VL, Qwen3-VL, Gemma
3 or Qwen2-Audio, as LM Studio or llama.cpp keep them), both sides on those two files at their
stored precision (the shape's media and context are the family's; --shape and --precisions do
not apply).

OMP_WAIT_POLICY=PASSIVE: both libraries' OpenMP threads otherwise spin after their work, and in
one process with as many threads as cores each side then runs beside the other's spinning
threads (on 2 cores it changed this engine's time to first token by 1.5x).

The checkpoint has the named model's widths at full depth, or cut by --layers / --vision-layers
(tower or audio encoder blocks) for quick runs (bench.vl_shapes, built once). llama.cpp runs
GGUFs its own converter wrote from the same checkpoint: the text model at bf16 or q4_0 (ours:
bfloat16, or int4 weights at the default group), the tower and projector (`mmproj`) at bf16 on
both sides, as Ollama keeps them; through llama-cpp-python's libmtmd bindings
(bench.llama_mtmd). Both get the same rendered chat prompt (the media where the template puts
it); the table says how many prompt and media tokens each made of it. Images are PNGs of
--sizes pixels square, sounds WAVs (16 kHz mono) of --seconds. Each run sends a new image or
sound (no cache serves it), then a second turn about the same one: ours with its prefix cache;
llama.cpp keeping its KV cache (as llama-server does) and starting again from the rendered
conversation (as llama-cpp-python's chat handler does: the media encoded again).

--video SECONDS (Qwen2.5-VL): a new mp4 of that length (448 x 448, H.264 at 8 fps, sampled at
the processor's 2 fps) sent with a question, at bf16, against transformers' generate() of one
token on the same checkpoint in bfloat16. Ours starts from the mp4's bytes (decoding,
sampling, preprocessing, tower, prefill); transformers from our preprocessed pixel values (its
video processor needs torchvision), so its time leaves decoding and preprocessing out.

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
import time
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench import flops as count
from bench.audio import RATE, clip
from bench.common import machine, median, memory_bandwidth, print_table
from bench.gguf import ensure_gguf, ensure_mmproj
from bench.llama_mtmd import LlamaMtmd, LlamaTurn, build_features
from bench.vl_shapes import SHAPES, build

LLAMA_TYPES = {"bf16": "bf16", "int4": "q4_0"}
# (the first turn's question, the second turn's) per media kind
QUESTIONS = {"image": ("Describe this image in detail.", "What colour dominates?"),
             "audio": ("What do you hear in this clip?", "Is the pitch rising?")}
VIDEO_QUESTION = "Describe what happens in this video."


@dataclass
class OurTurn:
    """Seconds per stage of one of our turns (from the request's own metrics)."""

    preprocess: float  # media decode, resize and normalize, hashing
    encode: float
    prefill: float
    ttft: float
    decode_rate: float
    prompt: list[int]  # the prompt's token ids, -1 at each media position
    media_tokens: int
    text: str


def photo(seed: int, size: int) -> bytes:
    """A PNG of `size` x `size` smooth random colour (a new image per seed)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((size, size), Image.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def sound(seed: int, seconds: int) -> bytes:
    """A WAV (16 kHz mono, 16-bit) of a chirp under noise (a new sound per seed)."""
    samples = np.clip(clip(seconds, seed) * 32767, -32768, 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(RATE)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def movie(seed: int, seconds: int, size: int = 448, fps: int = 8) -> bytes:
    """An mp4 (H.264, `size` x `size` at `fps`) of smooth random colour drifting frame by
    frame (a new video per seed)."""
    import av

    rng = np.random.default_rng(seed)
    start, step = rng.uniform(0, 255, (8, 8, 3)), rng.uniform(-4, 4, (8, 8, 3))
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = size, size, "yuv420p"
        for i in range(seconds * fps):
            small = np.clip(start + i * step, 0, 255).astype(np.uint8)
            frame = np.asarray(Image.fromarray(small).resize((size, size), Image.BICUBIC))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def messages(kind: str, media: bytes, question: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": kind, kind: media},
                                         {"type": "text", "text": question}]}]


def our_turn(llm, msgs: list[dict], new_tokens: int) -> OurTurn:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = llm.chat(msgs, params)[0]
    m = out.metrics
    prompt = list(out.prompt_token_ids)
    media_tokens = 0
    for span in out.multi_modal_placeholders:
        media_tokens += span.length
        prompt[span.offset:span.offset + span.length] = [-1] * span.length
    return OurTurn(
        preprocess=sum(m.stages.get(k, 0.0) for k in ("media_load", "preprocess", "hashing")),
        encode=m.encoder_time, prefill=m.prefill_time - m.encoder_time, ttft=m.ttft,
        decode_rate=(new_tokens - 1) / m.decode_time if m.decode_time else 0.0,
        prompt=prompt, media_tokens=media_tokens, text=out.outputs[0].text)


def rendered_prompt(llm, media_text: str, marker: str, msgs: list[dict]) -> str:
    """The chat prompt as our processor renders it, the media's text replaced by llama.cpp's
    marker (libmtmd writes the family's media delimiters itself)."""
    text = llm.engine.processor.render_chat(msgs).text
    if media_text not in text:
        raise RuntimeError(f"the rendered prompt has no {media_text!r}: {text!r}")
    return text.replace(media_text, marker)


def compare_prompts(ours: OurTurn, theirs: LlamaTurn) -> str:
    """Whether both sides saw the same prompt."""
    a = [t for t in ours.prompt if t != -1]
    b = [t for t in theirs.prompt if t != -1]
    same = ("same prompt" if ours.prompt == theirs.prompt else "same text tokens" if a == b
            else f"text tokens differ ({len(a)} vs {len(b)})")
    return (f"{same}; media tokens ours {ours.media_tokens}, llama.cpp {theirs.media_tokens}; "
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
    parser.add_argument("--vision-layers", type=int, default=None,
                        help="tower (or audio encoder) blocks (full: none)")
    parser.add_argument("--sizes", default="448,896,1344", help="image sides in pixels")
    parser.add_argument("--seconds", default="30", help="sound lengths (audio shapes)")
    parser.add_argument("--video", type=int, default=0,
                        help="seconds of a video turn against transformers (0: none)")
    parser.add_argument("--precisions", default="bf16,int4")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument("--no-recompute", action="store_true",
                        help="skip llama.cpp's recomputed second turn (a whole first turn again)")
    parser.add_argument("--from-gguf", action="store_true",
                        help="this engine loads the GGUF pair llama.cpp runs, not the checkpoint")
    parser.add_argument("--check-tokens", action="store_true",
                        help="with --from-gguf: the f32 GGUF pair's greedy tokens against the "
                        "checkpoint's at float32 first")
    parser.add_argument("--pair", nargs=2, type=Path, metavar=("TEXT", "MMPROJ"),
                        help="a GGUF model and its projector file: both sides run these")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    if args.pair:
        args.shape, args.precisions = pair_shape(*args.pair), "file"
    shape = SHAPES[args.shape]
    if args.video and (args.shape != "qwen2.5-vl-3b" or args.pair or args.from_gguf):
        parser.error("--video runs Qwen2.5-VL from its checkpoint (--shape qwen2.5-vl-3b, "
                     "without --pair or --from-gguf)")
    if args.check_tokens and not args.from_gguf:
        parser.error("--check-tokens goes with --from-gguf")
    path = args.pair[0] if args.pair else build(args.shape, args.layers, args.vision_layers)
    items = media_items(shape.media, args.sizes, args.seconds)
    if args.check_tokens:
        print(check_tokens(path, items[0][1](20_000), shape, QUESTIONS[shape.media][0],
                           args.new_tokens))
    ruler = rulers((torch.float32, torch.bfloat16))
    print(f"machine: {machine()}; {args.shape} widths, {path.name}; rulers: "
          + ", ".join(f"{k} {v / 1e9:.0f} G{'B' if k == 'bandwidth' else 'FLOP'}/s"
                      for k, v in ruler.items()))
    if not args.no_llama_cpp:
        print(f"llama.cpp built for: {build_features()}")
    peak = ruler["gemm bfloat16"]
    first_q, second_q = QUESTIONS[shape.media]
    table, summary, video = [], [], []
    for precision in args.precisions.split(","):
        if args.pair:
            files = tuple(args.pair)
        elif args.from_gguf or not args.no_llama_cpp:
            files = (ensure_gguf(path, LLAMA_TYPES[precision]), ensure_mmproj(path, "bf16"))
        else:
            files = None
        llm = our_engine(path, precision, shape, files if args.pair or args.from_gguf else None)
        theirs = None
        if not args.no_llama_cpp:
            theirs = LlamaMtmd(*files, args.threads, shape.context)
        for label, make in items:
            # Warm-ups: every graph, plan and buffer of this size made once on both sides; ours
            # counts the FLOPs of its stages.
            warm = messages(shape.media, make(10_000), first_q)
            work = counted_turn(llm, warm)
            if theirs is not None:
                theirs.turn(make(10_000),
                            rendered_prompt(llm, shape.media_text, theirs.marker, warm), 2)
            runs = []
            for run in range(args.runs):
                media = make(run * 7919 + 1)
                first = messages(shape.media, media, first_q)
                ours = our_turn(llm, first, args.new_tokens)
                history = first + [{"role": "assistant", "content": ours.text},
                                   {"role": "user", "content": second_q}]
                ours2 = our_turn(llm, history, args.new_tokens)
                row = {"ours": ours, "ours2": ours2}
                if theirs is not None:
                    text = rendered_prompt(llm, shape.media_text, theirs.marker, first)
                    row["llama"] = theirs.turn(media, text, args.new_tokens)
                    full = rendered_prompt(llm, shape.media_text, theirs.marker, history)
                    tail = full[len(text):]  # the new text after the first turn's prompt
                    row["llama2_keep"] = theirs.turn(b"", tail, args.new_tokens, keep=True)
                    if not args.no_recompute:
                        row["llama2_recompute"] = theirs.turn(media, full, args.new_tokens)
                runs.append(row)
                print(f"{precision} {label} run {run + 1}: TTFT ours {ours.ttft:.2f} s"
                      + (f", llama.cpp {row['llama'].ttft:.2f} s" if theirs else ""))
            table += _rows(precision, label, runs, work, peak)
            if theirs is not None:
                print(f"  {label}: {compare_prompts(runs[0]['ours'], runs[0]['llama'])}")
                summary.append((precision, label, median([r["llama"].ttft / r["ours"].ttft
                                                          for r in runs])))
        if theirs is not None:
            theirs.close()
        if args.video and precision == "bf16":
            video = video_rows(llm, path, args.video, args.runs, peak)
        del llm, theirs
        gc.collect()
    print(f"\n{args.shape}, {path.name}: median of {args.runs} runs, {args.threads} threads, "
          + ("both on the pair's two files at their own precision\n" if args.pair else
             "both on the same GGUF files (text bf16 / q4_0, towers bf16)\n" if args.from_gguf
             else "text weights bf16 / int4 (llama.cpp q4_0), towers bf16 on both sides\n"))
    print_table(table, ("precision", "media", "stage", "llama.cpp", "this engine",
                        "ours faster by", "ours: FLOP/s of GEMM peak"))
    if summary:
        print("\nsummary: new media TTFT, llama.cpp / ours: "
              + "; ".join(f"{p} {s} {r:.2f}x" for p, s, r in summary))
    if video:
        print(f"\nvideo turn ({args.video} s), bf16, against transformers (not llama.cpp):\n")
        print_table(video, ("stage", "transformers", "this engine", "ours faster by",
                            "ours: FLOP/s of GEMM peak"))


def our_engine(path, precision: str, shape, files: tuple | None):
    """This engine on the checkpoint at `precision` (bfloat16, or int4 weights at the default
    group), or on the GGUF pair `files` at the files' own precision (a q4_0 text model runs
    as stored)."""
    from engine import LLM

    # an encoder cache with room for the largest image (Qwen3-VL's 16384 embeddings, each
    # cached with its deepstack features)
    common = dict(device="cpu", dtype="bfloat16", max_model_len=shape.context,
                  encoder_cache_size=32768)
    if files is not None:
        text, mmproj = files
        return LLM(text, mmproj=mmproj, kv_cache_bytes=kv_bytes(text, shape.context, mmproj),
                   **common)
    quant = None if precision == "bf16" else precision
    return LLM(path, quantization=quant, kv_cache_bytes=kv_bytes(path, shape.context), **common)


# The shape whose media and context a GGUF pair of each family is run with.
PAIR_SHAPES = {"Qwen2_5_VLForConditionalGeneration": "qwen2.5-vl-3b",
               "Qwen3VLForConditionalGeneration": "qwen3-vl-2b",
               "Gemma3ForConditionalGeneration": "gemma3-4b",
               "Qwen2AudioForConditionalGeneration": "qwen2-audio-7b"}


def pair_shape(text, mmproj) -> str:
    """The shape name of a GGUF pair's family (PAIR_SHAPES), read from the files' metadata."""
    from engine.checkpoint_setup import CheckpointSetup

    architecture = CheckpointSetup.load(text, mmproj).architecture
    if architecture not in PAIR_SHAPES:
        raise SystemExit(f"--pair: {architecture} has no media turn here "
                         f"({', '.join(PAIR_SHAPES)})")
    return PAIR_SHAPES[architecture]


def check_tokens(path, media: bytes, shape, question: str, new_tokens: int) -> str:
    """Whether the checkpoint converted at f32 by llama.cpp's converter (text and projector)
    gives the greedy tokens of the checkpoint loaded from safetensors, both at float32."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    msgs = messages(shape.media, media, question)
    common = dict(device="cpu", dtype="float32", max_model_len=shape.context,
                  encoder_cache_size=32768)
    tokens = []
    for source, extra in ((path, {}), (ensure_gguf(path, "f32"),
                                       {"mmproj": ensure_mmproj(path, "f32")})):
        llm = LLM(source, kv_cache_bytes=2 * kv_bytes(path, shape.context), **common, **extra)
        tokens.append(list(llm.chat(msgs, params)[0].outputs[0].token_ids))
        del llm
        gc.collect()
    same = sum(a == b for a, b in zip(*tokens, strict=True))
    return (f"tokens of the f32 GGUF pair against the checkpoint at float32: {same} of "
            f"{len(tokens[0])} equal ({'identical' if tokens[0] == tokens[1] else 'differ'})")


def counted_turn(llm, msgs: list[dict]) -> dict[str, float]:
    """One turn of one token (a warm-up) -> the FLOPs of its tower and of its decoder
    (bench.flops: linears and the towers' attention, with the decoder's causal attention)."""
    model = llm.engine.runner.model
    with count.LinearFlops(model) as flops:
        turn = our_turn(llm, msgs, 1)
    flops.counts["decoder"] += count.causal_attention_flops(model.cfg, len(turn.prompt))
    return flops.counts


def kv_bytes(path, tokens: int, mmproj=None) -> int:
    """Bytes of a bfloat16 KV cache holding `tokens` positions in every layer of the checkpoint's
    (or GGUF pair's) decoder (at full depth the engine's default budget holds fewer than the
    bench's context)."""
    from engine.checkpoint_setup import CheckpointSetup

    cfg = CheckpointSetup.load(path, mmproj).hf_config.get_text_config()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * 2 * tokens * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim


def media_items(kind: str, sizes: str, seconds: str) -> list[tuple[str, Callable[[int], bytes]]]:
    """(label, seed -> a new media file) per image side or sound length."""
    if kind == "audio":
        return [(f"{int(s)} s", lambda seed, s=int(s): sound(seed, s)) for s in seconds.split(",")]
    return [(f"{int(s)}px", lambda seed, s=int(s): photo(seed, s)) for s in sizes.split(",")]


def video_rows(llm, path, seconds: int, runs: int, peak: float) -> list[tuple]:
    """A new video's stages, ours, and its time to first token against transformers' (from our
    pixel values, bfloat16), alternating, a new video per run after a warm-up of each."""
    import transformers

    from testing.qwen_vl import qwen_vl_hf_inputs

    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.bfloat16).eval()
    never = hf.config.get_text_config().vocab_size  # an EOS id no argmax produces
    processor = llm.engine.processor

    def reference(msgs: list[dict]) -> float:
        parsed = processor.render_chat(msgs)  # not timed: our decoded frames and pixel values
        inputs = qwen_vl_hf_inputs(hf, processor.process(parsed,
                                                         processor.load_media_sync(parsed)))
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False, eos_token_id=never,
                        pad_token_id=never)
        return time.perf_counter() - t0

    warm = messages("video", movie(10_000, seconds), VIDEO_QUESTION)
    work = counted_turn(llm, warm)
    reference(warm)
    ours, theirs = [], []
    for run in range(runs):
        msgs = messages("video", movie(run * 7919 + 1, seconds), VIDEO_QUESTION)
        ours.append(our_turn(llm, msgs, 1))
        theirs.append(reference(msgs))
        print(f"video {seconds} s run {run + 1}: TTFT ours {ours[-1].ttft:.2f} s, "
              f"transformers {theirs[-1]:.2f} s")
    label = f"{seconds} s, {ours[0].media_tokens} video tokens, {len(ours[0].prompt)} in all"

    def stage(name: str, key: str, work: float = 0.0) -> tuple:  # ours alone
        value = median([getattr(o, key) for o in ours])
        return (name, float("nan"), value, float("nan"),
                f"{work / value / peak:.0%}" if work else "")

    ttft = median([o.ttft for o in ours])
    ref = median(theirs)
    return [stage("decode, sample, preprocess (s)", "preprocess"),
            stage("vision encode (s)", "encode", work["tower"]),
            stage("prefill (s)", "prefill", work["decoder"]),
            (f"time to first token ({label}) (s)", ref, ttft, ref / ttft, "")]


def _rows(precision: str, label: str, runs: list[dict], flops: dict[str, float],
          peak: float) -> list[tuple]:
    """Table rows for one precision and media item; `flops` of the tower and the decoder on
    this prompt (bench.flops)."""
    n_media = runs[0]["ours"].media_tokens
    n_prompt = len(runs[0]["ours"].prompt)
    have = "llama" in runs[0]

    def med(key: str, side: str = "ours") -> float:
        return median([getattr(r[side], key) for r in runs]) if side in runs[0] else float("nan")

    def row(stage: str, key: str, theirs: str, ours_side: str = "ours", flops: float = 0.0,
            rate: bool = False) -> tuple:
        o, t = med(key, ours_side), med(key, theirs) if have else float("nan")
        faster = (o / t if rate else t / o) if have and o and t else float("nan")
        achieved = f"{flops / o / peak:.0%}" if flops and o else ""
        return (precision, f"{label} ({n_media} tok)", stage, t, o, faster, achieved)

    rows = [
        row("preprocess (s)", "preprocess", "llama"),
        row("tower encode (s)", "encode", "llama", flops=flops["tower"]),
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
