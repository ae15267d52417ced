"""A/B of one engine feature on single-stream decode, side by side in one process.

    python -m bench.decode_ab --feature huge_pages|fused_ops|native_decode|native_experts|
        float32_logits
        [--model PATH] [--dtype bfloat16]
        [--quantization none|int8|int4] [--rounds 8] [--steps 16]

Without --model it uses bench.generate's checkpoint (Qwen2-0.5B shapes, random weights).
`huge_pages`: two engines, weights copied into transparent huge pages
(models.kernels.huge_pages) or left where they were loaded; `fused_ops`: one engine, the decode
step's norm / rotary / SiLU-and-multiply as our fused kernels
(models.kernels.native.for_small_ops) or as PyTorch's operators;
`native_decode`: one engine, its decode steps through the layers in one native call
(models.layers.native_decode) or module by module; `native_experts`: one engine of a
mixture-of-experts model, its routed experts at decode steps in one native call per block
(models.kernels.native_experts) or through the modules; `float32_logits`: one engine, its LM
head's float32 sums kept (models.kernels.linear.float32_logits) or its product in the model
dtype, widened.
Each engine decodes one request; rounds of `--steps` decode steps alternate between the two
sides, and the median milliseconds per step of each side and the median per-round ratio are
printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable

from bench.common import (
    add_decoding_arguments,
    decoding_checkpoint,
    decoding_engine,
    machine,
    median,
)


def one_engine(shared, setups: dict[str, Callable[[], None]]) -> dict[str, Callable[[], None]]:
    """Each side of a one-engine A/B: its setup (which switches the feature), then a step."""
    def side(setup: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            setup()
            shared.step()
        return run
    return {name: side(setup) for name, setup in setups.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feature", required=True,
                        choices=["huge_pages", "fused_ops", "native_decode", "native_experts",
                                 "float32_logits"])
    add_decoding_arguments(parser)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=16)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from models.kernels import huge_pages, native

    path, quantization = decoding_checkpoint(args)
    max_tokens = 16 + 2 * args.rounds * args.steps  # enough for both sides on one engine

    def engine():
        return decoding_engine(path, args.dtype, quantization, max_tokens, max_tokens + 256)

    sides: dict[str, Callable[[], None]] = {}
    if args.feature == "huge_pages":
        os.environ[huge_pages.DISABLE_ENV] = "0"
        plain = engine()
        os.environ[huge_pages.DISABLE_ENV] = "1"
        huge = engine()
        sides = {"huge pages": huge.step, "regular pages": plain.step}
    elif args.feature == "native_decode":
        shared = engine()
        model = shared.runner.model
        call = model.native_decode
        if call is None:
            raise SystemExit("this model's decode steps do not take the native call (see log)")

        def native_decode(value) -> Callable[[], None]:
            return lambda: setattr(model, "native_decode", value)

        sides = one_engine(shared, {"native call": native_decode(call),
                                    "modules": native_decode(None)})
    elif args.feature == "native_experts":
        from models.layers.moe import RoutedExperts

        shared = engine()
        blocks = [m for m in shared.runner.model.modules() if isinstance(m, RoutedExperts)]
        calls = [block.native for block in blocks]
        if not blocks or None in calls:
            raise SystemExit("this model has no sparse blocks whose experts take the native "
                             "call (see log)")

        def experts(on: bool) -> Callable[[], None]:
            def setup() -> None:
                for block, call in zip(blocks, calls, strict=True):
                    block.native = call if on else None
            return setup

        sides = one_engine(shared, {"native call": experts(True), "modules": experts(False)})
    elif args.feature == "float32_logits":
        import models.layers.decoder as decoder

        kept = decoder.float32_logits

        def head(logits: Callable) -> Callable[[], None]:
            return lambda: setattr(decoder, "float32_logits", logits)

        sides = one_engine(engine(), {
            "float32 logits": head(kept),
            "model-dtype logits": head(lambda layer, x: layer(x).float())})
    else:
        fused = native.for_small_ops

        def small_ops(use: Callable) -> Callable[[], None]:
            return lambda: setattr(native, "for_small_ops", use)

        sides = one_engine(engine(), {"fused ops": small_ops(fused),
                                      "PyTorch ops": small_ops(lambda x: None)})

    times: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, run in sides.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                run()
            times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    (a, ta), (b, tb) = times.items()
    ratio = median([y / x for x, y in zip(ta, tb, strict=True)])
    print(f"machine: {machine()}; {path.name}, {args.dtype}, quantization {args.quantization}; "
          f"{args.rounds} rounds of {args.steps} decode steps")
    print(f"{a}: {median(ta):.2f} ms/step; {b}: {median(tb):.2f} ms/step; "
          f"{a} is {ratio:.3f}x as fast (median of per-round ratios)")


if __name__ == "__main__":
    main()
