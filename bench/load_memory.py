"""Peak memory of loading a checkpoint quantized, against the bytes of the quantized model:
weights are quantized as they stream in (models.kernels.quantization.QuantizeOnLoad), so a
checkpoint larger than memory in its own dtype loads.

    python -m bench.load_memory --model PATH [--quantization int4] [--layers-of N]
    python -m bench.load_memory --model FILE.gguf --quantization none [--dtype float32]

Run it in a fresh process (it is its own): the peak resident set (`ru_maxrss`) covers
everything this process ever held. Reports the checkpoint's bytes on disk, the loaded model's
(parameters and buffers: quantized weights, their scales, the embedding table), the peak RSS
and its excess over the model, the load time, and a short greedy decode to show the model
runs. `--layers-of N`: for a checkpoint holding some of a model's N layers, also the model's
bytes extrapolated to all N (the non-layer tensors once, the layers' bytes scaled).
"""

from __future__ import annotations

import argparse
import logging
import resource
import time
from pathlib import Path

from bench.common import machine


def _model_bytes(module) -> int:
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--quantization", default="int4", choices=("int8", "int4", "none"),
                        help="none: a GGUF at its own precision (its Q4_0 / Q4_1 as stored)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--layers-of", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    from engine import LLM, SamplingParams

    disk = (args.model.stat().st_size if args.model.is_file() else
            sum(f.stat().st_size for f in args.model.glob("*.safetensors")))
    quantization = None if args.quantization == "none" else args.quantization
    t0 = time.perf_counter()
    llm = LLM(args.model, device="cpu", dtype=args.dtype, max_model_len=512, max_num_seqs=1,
              quantization=quantization, quantization_group_size=args.group_size,
              enable_prefix_caching=False)
    load_s = time.perf_counter() - t0
    model = llm.engine.runner.model
    loaded = _model_bytes(model)
    layers = sum(_model_bytes(layer) for layer in model.layers)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out = llm.generate([{"prompt_token_ids": list(range(100, 228))}],
                       SamplingParams(max_tokens=args.new_tokens, temperature=0,
                                      ignore_eos=True))[0]
    decode = (args.new_tokens - 1) / out.metrics.decode_time
    gib = 2**30
    print(f"\nmachine: {machine()}; checkpoint {args.model.name}, {len(model.layers)} layers, "
          f"{disk / gib:.2f} GiB on disk; {args.dtype}, {args.quantization}, group "
          f"{args.group_size}; {llm.engine.weights_description()}")
    print(f"loaded in {load_s:.0f} s; model {loaded / gib:.2f} GiB (layers {layers / gib:.2f}); "
          f"peak RSS while loading {peak / gib:.2f} GiB = model + {(peak - loaded) / gib:.2f} "
          f"GiB; decode {decode:.1f} tok/s over {args.new_tokens} tokens")
    if args.layers_of:
        full = loaded - layers + layers * args.layers_of / len(model.layers)
        print(f"all {args.layers_of} layers: model {full / gib:.2f} GiB, peak RSS about "
              f"{(full + peak - loaded) / gib:.2f} GiB at the same excess")


if __name__ == "__main__":
    main()
