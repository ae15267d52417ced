"""Images and videos, this engine vs transformers, side by side in one run.

    python -m bench.multimodal [--model PATH] [--dtype float32] [--runs 3]

Without --model it builds (once, cached) a random-weight checkpoint with Qwen2-VL-2B's widths
(vision 1280, decoder 1536) and 8 vision + 8 decoder layers. Measures:
- TTFT for a new image (cold), for a seen image behind new text (encoder-cache hit: the KV of
  the image cannot be reused, its embeddings can), and for a repeated request (prefix-cache hit);
- the vision tower on 8 images from 8 requests: one batched forward vs one forward per image,
  and the batched forward's FLOP rate against the measured matmul throughput;
- total output tokens/s of 8 concurrent image requests vs transformers one after another;
- inter-token latency of 4 running streams while a long video prompt is admitted, with chunked
  prefill (small step budget) and without (the whole prompt in one step);
- TTFT of a video heard with its sound (Qwen2.5-Omni's thinker, frames and sound interleaved)
  against transformers' thinker, on a checkpoint with Qwen2.5-Omni-3B's widths and 4 layers per
  tower and decoder (`--omni-model` for another). Ours starts from the mp4's bytes (decoding,
  preprocessing, both encoders, prefill, one token); transformers' from our decoded frames,
  sound and pixel values (its video processor needs torchvision), with its own feature
  extractor and generate(): its time leaves out decoding and pixel preprocessing;
- TTFT of a new InternVL image (7 tiles) and of a new question about it (encoder-cache hit)
  against transformers (bench/internvl.py; `--internvl-model` for another checkpoint).
- TTFT of a new sliced image and of a new question about it (encoder-cache hit) for MiniCPM-V
  4.6 against transformers (bench/minicpmv.py; `--minicpmv-model` for another checkpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.common import (
    cache_dir,
    cached_checkpoint,
    machine,
    matmul_flops,
    median,
    print_table,
    timeit,
)
from bench.internvl import internvl_rows
from bench.minicpmv import minicpmv_rows

QWEN2_VL_2B_WIDTHS = dict(vision_width=1280, vision_depth=8, vision_heads=16, hidden=1536,
                          intermediate=8960, layers=8, heads=12, kv_heads=2, vocab=151936)


def build_checkpoint() -> Path:
    """Qwen2-VL-2B widths, fewer layers, random weights (std 0.02), default image budgets."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from testing.tiny import CLIP_MEAN, CLIP_STD, qwen_tokenizer, save_checkpoint

    path = cache_dir("qwen2-vl-2b-widths")
    if (path / "config.json").exists():
        return path
    print(f"building a random checkpoint with Qwen2-VL-2B widths in {path} (once)")
    w = QWEN2_VL_2B_WIDTHS
    tok = qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in
           ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")}
    config = Qwen2VLConfig(
        text_config=dict(
            hidden_size=w["hidden"], intermediate_size=w["intermediate"],
            num_hidden_layers=w["layers"], num_attention_heads=w["heads"],
            num_key_value_heads=w["kv_heads"], vocab_size=w["vocab"],
            max_position_embeddings=8192, eos_token_id=tok.eos_token_id, bos_token_id=None,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                             "rope_theta": 1e6},
        ),
        vision_config=dict(depth=w["vision_depth"], embed_dim=w["vision_width"],
                           hidden_size=w["hidden"], num_heads=w["vision_heads"], mlp_ratio=4),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2VLForConditionalGeneration(config)
    save_checkpoint(model, tok, path, [tok.eos_token_id])
    pre = {"patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
           "min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280,
           "image_mean": CLIP_MEAN, "image_std": CLIP_STD}
    (path / "preprocessor_config.json").write_text(json.dumps(pre))
    return path


def picture(seed: int, size: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def chat(text_before: str, image: Image.Image, text_after: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": text_before}, {"type": "image", "image": image},
        {"type": "text", "text": text_after}]}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--image-size", type=int, default=336)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--video-frames", type=int, default=32)
    parser.add_argument("--omni-model", type=Path, default=None)
    parser.add_argument("--heard-seconds", type=int, default=8)
    parser.add_argument("--internvl-model", type=Path, default=None)
    parser.add_argument("--minicpmv-model", type=Path, default=None)
    args = parser.parse_args()
    path = args.model or build_checkpoint()
    print(f"machine: {machine()}; checkpoint {path.name}; dtype {args.dtype}")
    rows = []
    rows += ttft_rows(path, args)
    rows += encoder_rows(path, args)
    rows += concurrency_rows(path, args)
    rows += itl_rows(path, args)
    rows += heard_video_rows(args)
    rows += internvl_rows(args, _llm)
    rows += minicpmv_rows(args)
    print()
    print_table([r[:4] for r in rows], ("metric", "value", "reference", "ratio"))
    print("\nsummary: " + "; ".join(f"{r[0]}: {r[3]:.2f} (target {r[4]})" for r in rows
                                   if r[4]))


def _llm(path, args, **options):
    from engine import LLM

    return LLM(path, device="cpu", dtype=args.dtype, **{"max_model_len": 4096, **options})


def ttft_rows(path: Path, args) -> list[tuple]:
    from engine import SamplingParams

    llm = _llm(path, args)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    llm.chat(chat("warm up", picture(999, args.image_size), "go"), one)
    cold, hit, prefix = [], [], []
    for run in range(args.runs):
        img = picture(run, args.image_size)
        first = chat("Look:", img, "Describe the image in detail.")
        cold.append(llm.chat(first, one)[0].metrics.ttft)
        # New text before the image: its KV blocks cannot be reused, its embeddings can.
        second = chat(f"Question {run}: in one word,", img, "what colour dominates?")
        out = llm.chat(second, one)[0]
        assert out.multi_modal_placeholders[0].cache_hit
        hit.append(out.metrics.ttft)
        prefix.append(llm.chat(first, one)[0].metrics.ttft)
    c, h, p = median(cold), median(hit), median(prefix)
    print(f"TTFT cold {c:.3f} s, encoder-cache hit {h:.3f} s, prefix-cache hit {p:.3f} s")
    return [
        ("TTFT, encoder-cache hit / cold (s)", h, c, h / c, "<= 0.5"),
        ("TTFT, prefix-cache hit / cold (s)", p, c, p / c, "<= 0.15"),
    ]


def encoder_rows(path: Path, args) -> list[tuple]:
    llm = _llm(path, args)
    proc = llm.engine.processor
    items = []
    for i in range(8):
        parsed = proc.parse({"prompt": "<|vision_start|><|image_pad|><|vision_end|>",
                             "multi_modal_data": {"image": picture(100 + i, args.image_size)}})
        feature = proc.process(parsed, proc.load_media_sync(parsed)).mm_features[0]
        items.append((feature.modality, feature.data))
    model = llm.engine.runner.model
    with torch.inference_mode():
        model.encode(items[:1])
        batched, loop = [], []
        for _ in range(args.runs):
            batched.append(timeit(lambda: model.encode(items)))
            loop.append(timeit(lambda: [model.encode([it]) for it in items]))
    b, lp = median(batched), median(loop)
    flops = vision_flops(model.visual.cfg, [tuple(data["grid_thw"]) for _, data in items])
    peak = matmul_flops(getattr(torch, args.dtype))
    print(f"vision tower, 8 images: batched {b:.3f} s, one by one {lp:.3f} s; "
          f"{flops / 1e9:.0f} GFLOP = {flops / b / 1e9:.0f} GFLOP/s batched; {args.dtype} "
          f"matmul roofline {peak / 1e9:.0f} GFLOP/s ({flops / b / peak:.0%})")
    return [("encoder, 8 images batched / loop (s)", b, lp, b / lp, "<= 0.8")]


def vision_flops(cfg, grids: list[tuple[int, int, int]]) -> float:
    """FLOPs of the vision tower on these items: patch embedding, blocks (each frame attends
    within itself) and the 2x2 merger."""
    w, m2 = cfg.width, cfg.merge_size**2
    patch = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    total = 0.0
    for t, h, wd in grids:
        n, frame = t * h * wd, h * wd
        block = 2 * n * (4 * w * w + 2 * w * cfg.mlp_hidden) + 4 * t * frame * frame * w
        merger = 2 * (n // m2) * (m2 * w * m2 * w + m2 * w * cfg.out_dim)
        total += 2 * n * patch * w + cfg.depth * block + merger
    return total


def concurrency_rows(path: Path, args) -> list[tuple]:
    from transformers import AutoModelForImageTextToText

    from engine import SamplingParams

    llm = _llm(path, args)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=llm.engine.dtype).eval()
    n = args.new_tokens
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    never = hf.config.text_config.vocab_size
    ours_tps, hf_tps = [], []
    for run in range(args.runs):
        msgs = [chat(f"Request {i}.", picture(1000 * run + i, args.image_size), "Describe it.")
                for i in range(8)]
        t0 = time.perf_counter()
        outs = llm.chat(msgs, params)
        ours_tps.append(sum(len(o.outputs[0].token_ids) for o in outs)
                        / (time.perf_counter() - t0))
        proc = llm.engine.processor
        inputs = []
        for m in msgs:
            parsed = proc.render_chat(m)
            p = proc.process(parsed, proc.load_media_sync(parsed))
            ids = torch.tensor([p.token_ids])
            d = p.mm_features[0].data
            inputs.append(dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                               pixel_values=d["pixel_values"],
                               image_grid_thw=torch.tensor([d["grid_thw"]]),
                               mm_token_type_ids=(ids == hf.config.image_token_id).int()))
        t0 = time.perf_counter()
        with torch.inference_mode():
            for kw in inputs:
                hf.generate(**kw, max_new_tokens=n, do_sample=False, eos_token_id=never,
                            pad_token_id=never)
        hf_tps.append(8 * n / (time.perf_counter() - t0))
        print(f"run {run + 1}: 8 concurrent {ours_tps[-1]:.2f} tok/s, "
              f"transformers sequential {hf_tps[-1]:.2f} tok/s")
    o, h = median(ours_tps), median(hf_tps)
    return [("8 concurrent image requests (output tok/s)", o, h, o / h, ">= 4")]


def itl_rows(path: Path, args) -> list[tuple]:
    results = {}
    for label, budget in (("on", 128), ("off", 16384)):
        results[label] = asyncio.run(_itl(path, args, budget))
        steady, p50, p99, count = results[label]
        print(f"chunked prefill {label} (step budget {budget} tokens): ITL before the video "
              f"p50 {steady * 1000:.0f} ms; during its prefill p50 {p50 * 1000:.0f} ms, "
              f"p99 {p99 * 1000:.0f} ms, {count} tokens per stream")
    on, off = results["on"], results["off"]
    return [
        ("ITL p99 / p50 during a long video prefill, chunking on", on[2], on[1],
         on[2] / on[1], "<= 3"),
        ("ITL p99 during a long video prefill, chunking on / off (s)", on[2], off[2],
         on[2] / off[2], ""),
    ]


async def _itl(path: Path, args, budget: int) -> tuple[float, float, float, int]:
    """Gaps between tokens of 4 text streams: the median before a long video prompt arrives,
    and the median, p99 and tokens per stream while it is prefilled."""
    from engine import AsyncLLM, SamplingParams

    llm = AsyncLLM(path, device="cpu", dtype=args.dtype, max_model_len=8192,
                   max_num_batched_tokens=budget)
    stamps: list[list[float]] = [[] for _ in range(4)]
    video_window: list[float] = []

    async def stream(i: int) -> None:
        params = SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True)
        async for _ in llm.generate(f"stream {i}: tell me a long story", params):
            stamps[i].append(time.perf_counter())
            if video_window and len(video_window) == 2:
                return

    async def video() -> None:
        while min(len(s) for s in stamps) < 6:
            await asyncio.sleep(0.01)
        frames = np.random.default_rng(7).integers(
            0, 256, (args.video_frames, 224, 224, 3), dtype=np.uint8)
        msgs = [{"role": "user", "content": [{"type": "video", "video": frames},
                                             {"type": "text", "text": "What happens?"}]}]
        video_window.append(time.perf_counter())
        async for _ in llm.chat(msgs, SamplingParams(max_tokens=1, ignore_eos=True)):
            pass
        video_window.append(time.perf_counter())

    try:
        await asyncio.gather(video(), *(stream(i) for i in range(4)))
    finally:
        llm.shutdown()
    start, end = video_window
    pairs = [(a, b) for s in stamps for a, b in zip(s, s[1:], strict=False)]
    steady = sorted(b - a for a, b in pairs if b < start)
    during = sorted(b - a for a, b in pairs if start <= b <= end)
    count = len(during) // 4
    return (steady[len(steady) // 2], during[len(during) // 2],
            during[min(len(during) - 1, int(0.99 * len(during)))], count)


# Qwen2.5-Omni-3B's widths (decoder 2048, vision 1280, audio 1280), 4 layers each.
OMNI_3B_WIDTHS = dict(hidden_size=2048, num_layers=4, heads=16, kv_heads=2,
                      intermediate_size=11008, vision_width=1280, vision_depth=3,
                      vision_heads=16, vision_intermediate=3420, vision_window=112,
                      audio_width=1280, audio_layers=4, audio_heads=20, audio_ffn=5120)


def build_omni_checkpoint() -> Path:
    from testing.qwen_omni import build_qwen_omni_model

    return cached_checkpoint("qwen2.5-omni-3b-widths", "Qwen2.5-Omni with 3B widths",
                             lambda path: build_qwen_omni_model(path, std=0.02, **OMNI_3B_WIDTHS))


def heard_movie(seconds: int, seed: int) -> bytes:
    """An mp4 (H.264 320x240 at 8 fps, AAC at 16 kHz) of moving noise and a chirp, different
    for every seed."""
    import io

    import av

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        video = container.add_stream("libx264", rate=8)
        video.width, video.height, video.pix_fmt = 320, 240, "yuv420p"
        audio = container.add_stream("aac", rate=16000, layout="mono")
        for _ in range(seconds * 8):
            pixels = rng.integers(0, 256, (240, 320, 3), dtype=np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        t = np.arange(seconds * 16000) / 16000
        wave = (0.3 * np.sin(2 * np.pi * (300 + 40 * seed + 50 * t) * t)).astype(np.float32)
        for start in range(0, len(wave), 1024):
            frame = av.AudioFrame.from_ndarray(wave[None, start:start + 1024], format="flt",
                                               layout="mono")
            frame.sample_rate = 16000
            container.mux(audio.encode(frame))
        container.mux(audio.encode())
    return buffer.getvalue()


def heard_video_rows(args) -> list[tuple]:
    """TTFT of a new video heard with its sound, then of a new question about the same video
    (new text before it: the prefix cache cannot serve its span, the encoder cache can): ours
    vs transformers', alternating, a new video every run (no cache serves a later run)."""
    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    from engine import SamplingParams
    from testing.qwen_omni import reference_inputs

    path = args.omni_model or build_omni_checkpoint()
    dtype = getattr(torch, args.dtype)
    llm = _llm(path, args, max_model_len=8192)
    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    never = hf.config.get_text_config().vocab_size
    p = llm.engine.processor

    def transformers_ttft(messages) -> tuple[float, int]:
        parsed = p.render_chat(messages)  # not timed: our decoded media and pixel values
        media = p.load_media_sync(parsed)
        proc = p.process(parsed, media)
        t0 = time.perf_counter()
        inputs = reference_inputs(proc, media)  # its feature extractor runs here
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False, eos_token_id=never,
                        pad_token_id=never)
        return time.perf_counter() - t0, len(proc.token_ids)

    cold, again, ref_cold, ref_again, tokens = [], [], [], [], 0
    for run in range(args.runs + 1):  # the first run warms both up
        movie = heard_movie(args.heard_seconds, seed=run)
        first = [{"role": "user", "content": [
            {"type": "video", "video": movie},
            {"type": "text", "text": "What happens, and what do you hear?"}]}]
        second = [{"role": "user", "content": [
            {"type": "text", "text": f"Question {run} about this clip:"},
            {"type": "video", "video": movie}, {"type": "text", "text": "is it loud?"}]}]
        out = llm.chat(first, one)[0]
        assert {p.modality for p in out.multi_modal_placeholders} == {"video", "audio"}
        hit = llm.chat(second, one)[0]
        assert all(p.cache_hit for p in hit.multi_modal_placeholders)
        t_cold, tokens = transformers_ttft(first)
        t_again, _ = transformers_ttft(second)
        if run:
            cold.append(out.metrics.ttft)
            again.append(hit.metrics.ttft)
            ref_cold.append(t_cold)
            ref_again.append(t_again)
    o, t, oa, ta = median(cold), median(ref_cold), median(again), median(ref_again)
    print(f"heard video ({args.heard_seconds} s, {tokens} prompt tokens): TTFT cold ours {o:.3f} "
          f"s, transformers {t:.3f} s; a new question about it: ours {oa:.3f} s (encoder-cache "
          f"hit), transformers {ta:.3f} s")
    return [("TTFT, video heard with its sound, ours / transformers (s)", o, t, o / t, "<= 1"),
            ("TTFT, new question on a heard video, ours / transformers (s)", oa, ta, oa / ta,
             "<= 0.5")]


if __name__ == "__main__":
    main()
