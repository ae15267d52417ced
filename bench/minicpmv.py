"""MiniCPM-V 4.6, this engine vs transformers: TTFT of a new sliced image, and of a new question
about an image seen before (new text before it: the prefix cache cannot serve its span, the
encoder cache can), run by bench.multimodal (`--minicpmv-model` for a real checkpoint).

Without a checkpoint it builds (once, cached) random weights with MiniCPM-V 4.6's published
shape, fewer layers: a SigLIP2-400M-wide tower (1152 wide, 16 heads, 4304 MLP, 14-px patches, a
70 x 70 position table) of 4 blocks with the window merger after the second, Qwen3.5-0.8B's
widths (1024 wide, 8 heads of 256, 2 KV heads, 3584 MLP, Gated DeltaNet of 16 heads of 128,
vocabulary 248320, the head tied) over 4 layers, and the processor's defaults (448-px slices,
up to 9).
Both sides start from a PIL image: ours through chat() (preprocessing, tower, prefill, one
token); transformers' through its own processor (MiniCPMV4_6ImageProcessorPil) and generate().
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.common import cached_checkpoint, median

WIDTHS = {
    "hidden_size": 1024, "vision_width": 1152, "vision_depth": 4,
    "layer_types": ("linear_attention", "linear_attention", "linear_attention",
                    "full_attention"),
    "text_overrides": {"intermediate_size": 3584, "num_attention_heads": 8,
                       "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
                       "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                       "linear_value_head_dim": 128, "vocab_size": 248320},
    "vision_overrides": {"intermediate_size": 4304, "num_attention_heads": 16,
                         "image_size": 980},
}


def build_checkpoint() -> Path:
    from testing.minicpmv import build_minicpmv_model

    return cached_checkpoint(
        "minicpm-v-4.6-widths", "MiniCPM-V 4.6 with its widths",
        lambda path: build_minicpmv_model(path, scale=448, patch=14, max_slice_nums=9, std=0.02,
                                          tie_word_embeddings=True, **WIDTHS))


def photo(seed: int) -> Image.Image:
    """A 1000 x 700 picture of noise (a 2 x 2 grid of slices), different for every seed."""
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (700, 1000, 3), dtype=np.uint8))


def chat(text_before: str, image: Image.Image, text_after: str) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": text_before}, {"type": "image", "image": image},
        {"type": "text", "text": text_after}]}]


def minicpmv_rows(args) -> list[tuple]:
    """TTFT cold and with an encoder-cache hit, ours vs transformers', alternating, a new image
    every run (the first run warms both up)."""
    from transformers import AutoModelForImageTextToText

    from engine import LLM, SamplingParams
    from testing.minicpmv import load_hf_processor

    path = args.minicpmv_model or build_checkpoint()
    llm = LLM(path, device="cpu", dtype=args.dtype, max_model_len=4096)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=getattr(torch, args.dtype))
    hf = hf.eval()
    hf_processor = load_hf_processor(path)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    never = hf.config.get_text_config().vocab_size

    def transformers_ttft(messages) -> tuple[float, int]:
        parsed = llm.engine.processor.render_chat(messages)
        images = [p["image"] for m in messages for p in m["content"] if p["type"] == "image"]
        t0 = time.perf_counter()
        inputs = hf_processor(text=[parsed.text], images=images, return_tensors="pt")
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False, eos_token_id=never,
                        pad_token_id=never)
        return time.perf_counter() - t0, inputs["input_ids"].shape[1]

    cold, hit, ref_cold, ref_hit, tokens = [], [], [], [], 0
    for run in range(args.runs + 1):
        image = photo(run)
        first = chat("Look:", image, "Describe the image in detail.")
        second = chat(f"Question {run}: in one word,", image, "what colour dominates?")
        out = llm.chat(first, one)[0]
        again = llm.chat(second, one)[0]
        assert again.multi_modal_placeholders[0].cache_hit
        t_cold, tokens = transformers_ttft(first)
        t_hit, _ = transformers_ttft(second)
        if run:
            cold.append(out.metrics.ttft)
            hit.append(again.metrics.ttft)
            ref_cold.append(t_cold)
            ref_hit.append(t_hit)
    o, t, oh, th = median(cold), median(ref_cold), median(hit), median(ref_hit)
    print(f"MiniCPM-V 4.6 ({tokens} prompt tokens): TTFT cold ours {o:.3f} s, transformers "
          f"{t:.3f} s; a new question about the image: ours {oh:.3f} s (encoder-cache hit), "
          f"transformers {th:.3f} s")
    return [("TTFT, MiniCPM-V sliced image, ours / transformers (s)", o, t, o / t, "<= 1"),
            ("TTFT, new question on a MiniCPM-V image, ours / transformers (s)", oh, th,
             oh / th, "<= 0.5")]
