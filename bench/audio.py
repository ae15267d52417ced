"""Audio on Qwen2-Audio, this engine vs transformers, side by side in one run.

    python -m bench.audio [--model PATH] [--dtype float32] [--runs 3]

Without --model it builds (once, cached) a checkpoint with a Whisper-small-wide audio encoder
(768 wide, 4 layers, 128 mels) and a Qwen2-1.5B-wide decoder cut to 4 layers, random weights.
Measures, alternating engines in every run, on fresh clips (so no cache serves a later run):
- encoder time for 8 clips of 4-11 s (voice messages) and of 1-2 s (voice commands): our one
  batched forward vs our forward per clip, and transformers' tower per clip (it always pads to
  the 30 s window), with the batched forward's FLOP rate against the measured matmul
  throughput;
- TTFT of a request whose clip is new (cold) vs one whose clip is in the encoder cache (the
  text before the clip differs, so the prefix cache cannot serve its span) vs one that only
  changes the question after the clip (the prefix cache serves the span), and transformers'
  TTFT (its processor + one generated token);
- output tokens/s for 8 concurrent audio requests vs transformers' processor + generate() run
  one request after another, as a local app would.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import cached_checkpoint, machine, matmul_flops, median, print_table, timeit

RATE = 16000
SHAPES = dict(
    hidden_size=1536, num_layers=4, num_heads=12, num_kv_heads=2, intermediate_size=8960,
    audio_width=768, audio_layers=4, audio_heads=12, audio_ffn=3072, n_mels=128, std=0.02,
)


def build_checkpoint() -> Path:
    from testing.tiny import build_qwen2_audio_model

    return cached_checkpoint("qwen2-audio-small-shapes", "Qwen2-Audio with small shapes",
                             lambda path: build_qwen2_audio_model(path, **SHAPES))


def clip(seconds: float, seed: int) -> np.ndarray:
    """A chirp under noise: float32 mono at 16 kHz, different for every seed."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * RATE)) / RATE
    wave = 0.3 * np.sin(2 * np.pi * (200 + 37 * (seed % 10) + 100 * t) * t)
    return (wave + 0.05 * rng.standard_normal(len(t))).astype(np.float32)


def conversation(wave: np.ndarray, before: str, after: str = "Transcribe the audio clip."):
    return [{"role": "user", "content": [{"type": "text", "text": before},
                                         {"type": "audio", "audio": (wave, RATE)},
                                         {"type": "text", "text": after}]}]


def encoder_flops(cfg, frames: list[int]) -> float:
    """FLOPs of one batched forward: each clip's convolutions over its own receptive frames,
    and the layers over its own positions (nothing is padded)."""
    from models.encoders.whisper import encoder_lengths, receptive_frames

    w = cfg.width
    lengths = [encoder_lengths(f)[0] for f in frames]
    convs = sum(2 * 3 * (cfg.num_mel_bins * w * receptive_frames(f, 3000) + w * w * t)
                for f, t in zip(frames, lengths, strict=True))
    layers = sum(2 * t * (4 * w * w + 2 * w * cfg.ffn_dim) + 4 * t * t * w for t in lengths)
    return convs + cfg.num_layers * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from transformers import (
        AutoTokenizer,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    from engine import LLM, SamplingParams

    path = args.model or build_checkpoint()
    llm = LLM(path, device="cpu", dtype=args.dtype, max_model_len=2048)
    dtype = llm.engine.dtype
    model = llm.engine.runner.model
    hf = Qwen2AudioForConditionalGeneration.from_pretrained(path, dtype=dtype).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    hf_processor = Qwen2AudioProcessor(WhisperFeatureExtractor.from_pretrained(path), tokenizer,
                                       chat_template=tokenizer.chat_template)
    processor = llm.engine.processor
    n, k = args.new_tokens, args.concurrent
    never = hf.config.text_config.vocab_size  # an EOS id no argmax produces

    def items(waves):
        """Our processed encoder inputs for clips (what the runner hands the encoder)."""
        out = []
        for wave in waves:
            parsed = processor.parse({"prompt": "<|audio_bos|><|AUDIO|><|audio_eos|>",
                                      "multi_modal_data": {"audio": [(wave, RATE)]}})
            features = processor.process(parsed, processor.load_media_sync(parsed)).mm_features
            out += [(f.modality, f.data) for f in features]
        return out

    def hf_inputs(wave, before):
        text = tokenizer.apply_chat_template(conversation(wave, before), tokenize=False,
                                             add_generation_prompt=True)
        return hf_processor(text=text, audio=[wave], sampling_rate=RATE, return_tensors="pt")

    def hf_generate(wave, before, tokens):
        inputs = hf_inputs(wave, before)
        hf.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                    eos_token_id=never, pad_token_id=never)

    def hf_tower(inputs):
        """transformers' encoder work for one clip (its mask changes no FLOP: left out)."""
        states = hf.model.audio_tower(inputs["input_features"]).last_hidden_state
        hf.model.multi_modal_projector(states)

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    seconds = [4 + i for i in range(k)]  # 4 to 11 s voice messages
    short = [1 + i / k for i in range(k)]  # 1 to 2 s voice commands
    results: dict[str, list[float]] = {key: [] for key in (
        "enc_batched", "enc_loop", "hf_enc_loop", "enc_short_batched", "enc_short_loop",
        "ttft_cold", "ttft_encoder_hit",
        "ttft_prefix_hit", "hf_ttft", "ours_conc", "hf_conc")}
    with torch.inference_mode():
        llm.chat(conversation(clip(3, 999), "Warm up."), first)
        hf_generate(clip(3, 999), "Warm up.", 2)
        for run in range(args.runs):
            # Encoder: 8 clips in one forward vs one forward each; transformers one each.
            waves = [clip(s, 100 * run + 10 + i) for i, s in enumerate(seconds)]
            batch = items(waves)
            results["enc_batched"].append(timeit(lambda b=batch: model.encode(b)))
            results["enc_loop"].append(timeit(lambda b=batch: [model.encode([i]) for i in b]))
            hf_mels = [hf_inputs(w, "Listen.") for w in waves]
            results["hf_enc_loop"].append(timeit(lambda m=hf_mels: [hf_tower(i) for i in m]))
            few = items([clip(s, 100 * run + 30 + i) for i, s in enumerate(short)])
            results["enc_short_batched"].append(timeit(lambda b=few: model.encode(b)))
            results["enc_short_loop"].append(timeit(lambda b=few: [model.encode([i]) for i in b]))
            # TTFT: a new clip; the same clip after other text (encoder-cache hit); the same
            # prefix with another question after the clip (prefix-cache hit).
            wave = clip(20, 100 * run + 50)
            cold = llm.chat(conversation(wave, "Listen."), first)[0]
            hit = llm.chat(conversation(wave, "Here is a recording."), first)[0]
            prefix = llm.chat(conversation(wave, "Listen.", "Which language is it?"), first)[0]
            assert hit.metrics.encoder_cache_hits == 1 and hit.metrics.encoder_calls == 0
            results["ttft_cold"].append(cold.metrics.ttft)
            results["ttft_encoder_hit"].append(hit.metrics.ttft)
            results["ttft_prefix_hit"].append(prefix.metrics.ttft)
            results["hf_ttft"].append(timeit(lambda w=wave: hf_generate(w, "Listen.", 1)))
            # Concurrent requests: one batch for us, one after another for transformers.
            waves = [clip(s, 100 * run + 20 + i) for i, s in enumerate(seconds)]
            t0 = time.perf_counter()
            outs = llm.chat([conversation(w, "Listen.") for w in waves], params)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            results["ours_conc"].append(tokens / (time.perf_counter() - t0))
            hf_seconds = timeit(lambda ws=waves: [hf_generate(w, "Listen.", n) for w in ws])
            results["hf_conc"].append(k * n / hf_seconds)
            print(f"run {run + 1}/{args.runs}: " + ", ".join(
                f"{key}={v[-1]:.3g}" for key, v in results.items()))

    m = {key: median(v) for key, v in results.items()}
    flops = encoder_flops(model.audio_tower.cfg, [d["num_frames"] for _, d in batch])
    peak = matmul_flops(dtype)
    print(f"\nmachine: {machine()}; checkpoint {path.name}, {str(dtype)[6:]}; clips "
          f"{seconds[0]}-{seconds[-1]} s; {n} new tokens; median of {args.runs} runs")
    print(f"batched encoder: {flops / 1e9:.0f} GFLOP in {m['enc_batched']:.3g} s = "
          f"{flops / m['enc_batched'] / 1e9:.0f} GFLOP/s; {str(dtype)[6:]} matmul roofline "
          f"{peak / 1e9:.0f} GFLOP/s ({flops / m['enc_batched'] / peak:.0%})\n")
    rows = [
        (f"encoder, {k} clips of 4-11 s (s): batched / per clip", "enc_batched", "enc_loop"),
        (f"encoder, {k} clips of 1-2 s (s): batched / per clip", "enc_short_batched",
         "enc_short_loop"),
        (f"encoder, {k} clips of 4-11 s (s): batched / transformers per clip", "enc_batched",
         "hf_enc_loop"),
        ("TTFT, 20 s clip (s): encoder-cache hit / cold", "ttft_encoder_hit", "ttft_cold"),
        ("TTFT, 20 s clip (s): prefix-cache hit / cold", "ttft_prefix_hit", "ttft_cold"),
        ("TTFT, 20 s clip (s): cold / transformers", "ttft_cold", "hf_ttft"),
        (f"{k} concurrent (output tok/s): ours / transformers one by one", "ours_conc",
         "hf_conc"),
    ]
    print_table([(name, m[a], m[b], m[a] / m[b]) for name, a, b in rows],
                ("metric: this / reference", "this", "reference", "ratio"))
    print(f"\nsummary: batched encoder {m['enc_batched'] / m['enc_loop']:.2f}x the per-clip "
          f"loop on 4-11 s clips, {m['enc_short_batched'] / m['enc_short_loop']:.2f}x on 1-2 s "
          f"clips ({m['hf_enc_loop'] / m['enc_batched']:.1f}x faster than transformers); "
          f"TTFT on an encoder-cache hit {m['ttft_encoder_hit'] / m['ttft_cold']:.2f}x cold "
          f"({m['ttft_prefix_hit'] / m['ttft_cold']:.2f}x with the prefix cache); {k} concurrent "
          f"{m['ours_conc'] / m['hf_conc']:.2f}x transformers")


if __name__ == "__main__":
    main()
