"""Prefix caching on a hybrid model (Qwen3.5: Gated DeltaNet + attention), side by side in one run.

    python -m bench.hybrid_prefix [--model PATH] [--dtype bfloat16] [--requests 8]

Without --model it builds (once, cached) a random-weight checkpoint with Qwen3.5-0.8B's shapes
(24 layers, 18 of them Gated DeltaNet; a 12-block vision tower). Two scenarios, each a run of
requests that share a prefix and differ after it:
- a ~100-token system prompt, then a different question each time;
- the same image, then a different question each time.
Every request runs on an engine with prefix caching (its linear layers' state restored from a
snapshot together with the KV blocks) and, alternately, on one without (cold; the encoder cache
stays on in both, so the image's encoder runs once either way). Reported: the tokens each warm
request skipped, its TTFT against cold (median of per-request ratios), and the tokens vLLM's
hybrid prefix cache would skip on the same prompts, which hits only on prefixes aligned to its
hybrid block size (528 tokens for Qwen3.5; vllm#40696).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from bench.common import QWEN3_5_08B, cached_checkpoint, machine, median, print_table

VLLM_HYBRID_ALIGNMENT = 528  # tokens: vLLM's prefix-cache unit for Qwen3.5 (vllm#40696)

QWEN3_5_08B_VISION = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12,
                          out_hidden_size=1024, patch_size=16, spatial_merge_size=2,
                          temporal_patch_size=2, num_position_embeddings=2304)


def build_checkpoint() -> Path:
    """Qwen3.5-0.8B shapes with its vision tower, random weights (transformers' initialisation),
    saved in bfloat16: its own cache folder, apart from bench.common's text-only Qwen3.5."""
    return cached_checkpoint("qwen3.5-0.8b-vl-shapes", "Qwen3.5-0.8B-shaped (with vision)",
                             _build)


def _build(path: Path) -> None:
    import transformers

    from testing.layouts import save_processor
    from testing.tiny import QWEN_SPECIAL, qwen_tokenizer, save_checkpoint

    tok = qwen_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    config = transformers.Qwen3_5Config(
        text_config=dict(**QWEN3_5_08B, eos_token_id=tok.eos_token_id, bos_token_id=None),
        vision_config=QWEN3_5_08B_VISION, image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    save_checkpoint(model, tok, path, [tok.eos_token_id])
    image = transformers.Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2,
        size={"shortest_edge": 64 * 1024, "longest_edge": 1024 * 1024},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    save_processor(path, "Qwen3VLProcessor", tok, image_processor=image, video_settings={
        "video_processor_type": "Qwen3VLVideoProcessor", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5]})
    (path / "bench.json").write_text(json.dumps({"shapes": "Qwen3.5-0.8B"}))


SYSTEM = ("You are the assistant of a small bakery. Answer in one or two short sentences, "
          "name prices in euros and never promise a delivery time.")  # ~100 tokens rendered
QUESTIONS = ["What is the special today?", "Do you sell rye bread?", "How much is a croissant?",
             "Are you open on Sunday?", "Can I order a cake for Friday?", "What is gluten?",
             "Which bread keeps longest?", "Do you have vegan pastries?", "Where are you?",
             "Who bakes the bread?", "Is the coffee fair trade?", "What is a kouign-amann?"]


def conversations(kind: str, n: int) -> list[list[dict]]:
    if kind == "system prompt":
        return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}]
                for q in QUESTIONS[:n]]
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8))
    return [[{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": q}]}] for q in QUESTIONS[:n]]


def ttft(llm, messages) -> tuple[float, int, list[int]]:
    from engine import SamplingParams

    t0 = time.perf_counter()
    out = llm.chat(messages, SamplingParams(max_tokens=1, temperature=0))[0]
    return time.perf_counter() - t0, out.num_cached_tokens, out.prompt_token_ids


def shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    from engine import LLM

    path = args.model or build_checkpoint()
    options = dict(device="cpu", dtype=args.dtype, max_model_len=4096, max_num_seqs=4)
    warm = LLM(path, **options)
    cold = LLM(path, enable_prefix_caching=False, **options)
    stats = warm.stats()
    rows = []
    for kind in ("system prompt", "image"):
        chats = conversations(kind, args.requests)
        ttft(cold, chats[0])  # warm-up (the image's encoder output is cached in both)
        ttft(warm, chats[0])
        ratios, hits, lengths, vllm_hits, seen = [], [], [], [], []
        for messages in chats[1:]:
            cold_s, _, ids = ttft(cold, messages)
            warm_s, hit, _ = ttft(warm, messages)
            shared = max((shared_prefix(ids, s) for s in seen), default=0)
            seen.append(ids)
            ratios.append(cold_s / warm_s)
            hits.append(hit)
            lengths.append(len(ids))
            vllm_hits.append(min(shared, len(ids) - 1) // VLLM_HYBRID_ALIGNMENT
                             * VLLM_HYBRID_ALIGNMENT)
        rows.append((kind, median(lengths), median(hits),
                     f"{sum(hits) / sum(lengths):.0%}", median(vllm_hits),
                     f"{sum(vllm_hits) / sum(lengths):.0%}", median(ratios)))
    end = warm.stats()
    tok = warm.engine.tokenizer
    system = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}],
                                                    tokenize=False), add_special_tokens=False))
    print(f"\nmachine: {machine()}; checkpoint {path.name}, {args.dtype}; system prompt "
          f"{system} tokens as rendered; "
          f"{args.requests - 1} requests after the first per scenario; state "
          f"{stats['state_bytes_per_request'] / 2**20:.1f} MiB per request, "
          f"{stats['state_snapshots_total']} snapshots "
          f"({stats['state_snapshot_bytes'] / 2**20:.0f} MiB); snapshots saved "
          f"{end['state_snapshots_saved']}, restored {end['state_snapshot_hits']}\n")
    print_table(rows, ("shared prefix", "prompt tokens", "tokens skipped", "hit rate",
                       f"vLLM ({VLLM_HYBRID_ALIGNMENT}-aligned) skipped", "vLLM hit rate",
                       "TTFT speed-up vs cold"))


if __name__ == "__main__":
    main()
