"""Quantized prefill against dense, and the quantized linears' prefill formulations against each
other: TTFT side by side in one process.

    python -m bench.prefill_ab [--quantization int8|int4] [--dtype bfloat16] [--rounds 12]
        [--prompt-len 128] [--variants planned,dequantized_t,panel_gemm]

Without --model it uses bench.generate's checkpoint (Qwen2-0.5B shapes, random weights). Two
engines, the model dense and quantized; each round times one 128-token prefill (TTFT) of the
dense engine and then of the quantized one under each variant, in alternating order (a
`--prompt-len` token prompt, 128 by default). A variant
is "planned" (the kernel plan's choice for the prefill's row count) or a formulation of
models.kernels.linear.QUANTIZED_KERNELS forced on every quantized linear at that row count;
":whole" dequantizes each weight whole instead of in tiles of output channels. Prints each
side's median TTFT and its median per-round ratio to the dense engine's.
"""

from __future__ import annotations

import argparse
import logging

from bench.common import add_decoding_arguments, decoding_checkpoint, machine, median


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_decoding_arguments(parser)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--variants", default="planned,dequantized_t,panel_gemm")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.set_defaults(quantization="int8")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from engine import LLM, SamplingParams
    from models.kernels import linear as linear_kernels
    from models.kernels.choice import bucket_index
    from models.kernels.quantization import QuantizedLinear

    prompt = list(range(100, 100 + args.prompt_len))
    path, quantization = decoding_checkpoint(args)
    if quantization is None:
        raise SystemExit("--quantization int8 or int4: the A/B is of quantized prefill")

    def engine(mode: str | None) -> LLM:
        return LLM(path, device="cpu", dtype=args.dtype,
                   max_model_len=max(1024, 2 * args.prompt_len),
                   quantization=mode, enable_prefix_caching=False)

    dense, quantized = engine(None), engine(quantization)
    layers = [m for m in quantized.engine.runner.model.modules()
              if isinstance(m, QuantizedLinear)]
    planned = {id(layer): layer.kernels for layer in layers}
    bucket, tile_bytes = bucket_index(len(prompt)), linear_kernels.TILE_BYTES

    def use(variant: str) -> None:
        name, _, option = variant.partition(":")
        linear_kernels.TILE_BYTES = 1 << 62 if option == "whole" else tile_bytes
        for layer in layers:
            kernels = list(planned[id(layer)])
            if name != "planned":
                kernels[bucket] = name
            layer.kernels = tuple(kernels)

    def ttft(llm: LLM) -> float:
        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        return llm.generate([prompt], params)[0].metrics.ttft

    variants = args.variants.split(",")
    for variant in variants:  # warm-up, and an unknown formulation fails here
        name = variant.partition(":")[0]
        if name != "planned" and name not in linear_kernels.QUANTIZED_KERNELS:
            raise SystemExit(f"unknown formulation {name!r}: one of "
                             f"{sorted(linear_kernels.QUANTIZED_KERNELS)}")
        use(variant)
        ttft(quantized)
    ttft(dense)
    times: dict[str, list[float]] = {"dense": [], **{v: [] for v in variants}}
    for round_ in range(args.rounds):
        times["dense"].append(ttft(dense))
        for variant in variants if round_ % 2 else variants[::-1]:
            use(variant)
            times[variant].append(ttft(quantized))
    use("planned")
    print(f"machine: {machine()}; {path.name}, {args.dtype}, {quantization}; "
          f"{args.rounds} rounds of one {len(prompt)}-token prefill per side")
    for name, values in times.items():
        ratio = median([t / d for t, d in zip(values, times["dense"], strict=True)])
        print(f"{name}: TTFT {median(values) * 1e3:.1f} ms, {ratio:.3f}x the dense engine's "
              "(median of per-round ratios)")


if __name__ == "__main__":
    main()
