"""What a LoRA adapter costs a step, side by side in one engine.

    python -m bench.lora [--model PATH] [--dtype bfloat16] [--quantization none|int8|int4]
        [--rank 16] [--batch 1] [--prompt 512] [--rounds 8] [--steps 16]

Without --model it uses bench.generate's checkpoint (Qwen2-0.5B shapes, random weights), with
two random adapters of `--rank` on every attention and MLP linear (written once beside it).
`--batch` requests decode together; the sides alternate round by round on the same requests:

- base: no request uses an adapter (the one-call native decode taken where it would be);
- base, modules: the same without the native call (what a step carrying an adapter runs);
- one adapter: every request uses adapter a;
- two adapters: half the requests use a, half b (two groups per linear).

Then a `--prompt`-token prefill, alone, with and without an adapter. Medians of milliseconds
per step and the median per-round ratio to "base" are printed.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

from bench.common import add_decoding_arguments, decoding_checkpoint, machine, median


def _adapters(path, rank: int) -> dict[str, str]:
    """Two random adapters on every attention and MLP linear of `path`, written once."""
    import json

    from testing.lora import write_lora_folder

    config = json.loads((path / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head = hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    shapes = {}
    for i in range(config["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        shapes |= {f"{layer}.self_attn.q_proj": (hidden, hidden),
                   f"{layer}.self_attn.k_proj": (hidden, kv),
                   f"{layer}.self_attn.v_proj": (hidden, kv),
                   f"{layer}.self_attn.o_proj": (hidden, hidden),
                   f"{layer}.mlp.gate_proj": (hidden, inter),
                   f"{layer}.mlp.up_proj": (hidden, inter),
                   f"{layer}.mlp.down_proj": (inter, hidden)}
    folders = {}
    for seed, name in enumerate(("a", "b")):
        folder = path.parent / f"{path.name}-lora-r{rank}-{name}"
        if not (folder / "adapter_config.json").exists():
            write_lora_folder(folder, shapes, ["q_proj", "k_proj", "v_proj", "o_proj",
                                               "gate_proj", "up_proj", "down_proj"],
                              r=rank, lora_alpha=2 * rank, seed=seed, std=0.02)
        folders[name] = str(folder)
    return folders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decoding_arguments(parser)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from engine import LLM, SamplingParams

    path, quantization = decoding_checkpoint(args)
    decoding = 8 + 4 * args.rounds * args.steps
    llm = LLM(path, device="cpu", dtype=args.dtype,
              max_model_len=max(args.prompt, 128 + args.batch) + decoding + 8,
              quantization=quantization, enable_prefix_caching=False,
              lora_adapters=_adapters(path, args.rank))
    engine = llm.engine
    model = engine.runner.model
    processor = engine.processor
    reqs = []
    for i in range(args.batch):
        parsed = processor.parse(list(range(100 + i, 228 + i)))
        processed = processor.process(parsed, processor.load_media_sync(parsed))
        req = engine.make_request(processed, SamplingParams(max_tokens=decoding, temperature=0,
                                                            ignore_eos=True))
        engine.add_request(req)
        reqs.append(req)
    for _ in range(8):  # the prefills and a few decodes
        engine.step()
    call = model.native_decode

    def decode(adapters: list[str | None], native: bool) -> Callable[[], None]:
        def run() -> None:
            model.native_decode = call if native else None
            for req, name in zip(reqs, adapters, strict=True):
                req.adapter = name
            engine.step()
        return run

    half = args.batch // 2
    sides = {
        "base": decode([None] * args.batch, True),
        "base, modules": decode([None] * args.batch, False),
        "one adapter": decode(["a"] * args.batch, True),
        "two adapters": decode(["a"] * (args.batch - half) + ["b"] * half, True),
    }
    times = _rounds(sides, args.rounds, args.steps)
    for req in reqs:
        engine.abort_request(req.request_id)

    def prefill(adapter: str | None) -> Callable[[], None]:
        def run() -> None:
            parsed = processor.parse(list(range(50, 50 + args.prompt)))
            processed = processor.process(parsed, processor.load_media_sync(parsed))
            req = engine.make_request(processed, SamplingParams(max_tokens=1, lora=adapter))
            engine.add_request(req)
            while engine.has_unfinished():
                engine.step()
        return run

    prefills = _rounds({"prefill": prefill(None), "prefill, adapter": prefill("a")},
                       args.rounds, 1)
    print(f"machine: {machine()}; {path.name}, {args.dtype}, quantization {args.quantization}; "
          f"rank {args.rank}; {args.batch} requests decoding; native call: "
          f"{'yes' if call is not None else 'no'}")
    for group in (times, prefills):
        (first, base), *rest = group.items()
        print(f"{first}: {median(base):.2f} ms/step")
        for name, values in rest:
            ratio = median([y / x for x, y in zip(base, values, strict=True)])
            print(f"{name}: {median(values):.2f} ms/step, {ratio:.3f}x the time of {first}")


def _rounds(sides: dict[str, Callable[[], None]], rounds: int, steps: int) -> dict[str, list]:
    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(rounds):
        for name, run in sides.items():
            start = time.perf_counter()
            for _ in range(steps):
                run()
            times[name].append((time.perf_counter() - start) / steps * 1e3)
    return times


if __name__ == "__main__":
    main()
