"""bench.multimodal's InternVL rows: TTFT of a new image (cold) and of a new question about an
image seen before (new text before it: the prefix cache cannot serve its tiles, the encoder
cache can), this engine against transformers, alternating, a new image every run.

The checkpoint has InternVL3-1B's widths (InternViT-300M on 448-pixel tiles, a Qwen2.5-0.5B
decoder) with 4 layers each, random weights (`--internvl-model` for another). The image is
672 x 448: a 3 x 2 grid and its thumbnail, 7 tiles of 256 tokens. Both sides start from the
decoded PIL image: ours runs tiling, preprocessing, the tower per tile and the prefill;
transformers' InternVLProcessor (assembled over its PIL image processor: its video processor
needs torchvision) and generate() for one token.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.common import cached_checkpoint, median

INTERNVL3_1B_WIDTHS = dict(
    hidden_size=896, num_layers=4, heads=14, kv_heads=2, intermediate_size=4864,
    vocab_size=151674, vision_width=1024, vision_depth=4, vision_heads=16,
    vision_intermediate=4096, tile=448, patch=14, max_patches=12)


def build_internvl_checkpoint() -> Path:
    from testing.internvl import build_internvl_model

    return cached_checkpoint("internvl3-1b-widths", "InternVL with InternVL3-1B widths",
                             lambda path: build_internvl_model(path, std=0.02,
                                                               **INTERNVL3_1B_WIDTHS))


def _picture(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (448, 672, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def internvl_rows(args, make_llm) -> list[tuple]:
    """(metric, ours, transformers, ratio, target) rows; `make_llm(path, args, **options)`
    builds our engine as the other rows do."""
    from transformers import InternVLForConditionalGeneration

    from engine import SamplingParams
    from testing.internvl import reference_processor

    path = getattr(args, "internvl_model", None) or build_internvl_checkpoint()
    dtype = getattr(torch, args.dtype)
    llm = make_llm(path, args)
    hf = InternVLForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    proc = reference_processor(path)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    never = hf.config.get_text_config().vocab_size

    def transformers_ttft(messages, image) -> float:
        text = llm.engine.processor.render_chat(messages).text
        t0 = time.perf_counter()
        inputs = proc(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            hf.generate(**inputs, max_new_tokens=1, do_sample=False, eos_token_id=never,
                        pad_token_id=never)
        return time.perf_counter() - t0

    cold, again, ref_cold, ref_again, tiles = [], [], [], [], 0
    for run in range(args.runs + 1):  # the first run warms both up
        image = _picture(run)
        first = [{"role": "user", "content": [
            {"type": "image", "image": image}, {"type": "text", "text": "Describe the image."}]}]
        second = [{"role": "user", "content": [
            {"type": "text", "text": f"Question {run} about this picture:"},
            {"type": "image", "image": image}, {"type": "text", "text": "is it bright?"}]}]
        out = llm.chat(first, one)[0]
        hit = llm.chat(second, one)[0]
        assert all(p.cache_hit for p in hit.multi_modal_placeholders)
        tiles = len(out.multi_modal_placeholders)
        t_cold, t_again = transformers_ttft(first, image), transformers_ttft(second, image)
        if run:
            cold.append(out.metrics.ttft)
            again.append(hit.metrics.ttft)
            ref_cold.append(t_cold)
            ref_again.append(t_again)
    o, t, oa, ta = median(cold), median(ref_cold), median(again), median(ref_again)
    print(f"InternVL image ({tiles} tiles): TTFT cold ours {o:.3f} s, transformers {t:.3f} s; "
          f"a new question about it: ours {oa:.3f} s (encoder-cache hit), transformers "
          f"{ta:.3f} s")
    return [("TTFT, InternVL image, ours / transformers (s)", o, t, o / t, "<= 1"),
            ("TTFT, new question on an InternVL image, ours / transformers (s)", oa, ta,
             oa / ta, "<= 0.5")]
