"""CPU time of one decode row through a linear held in GGUF's ggml blocks, per block type and
path, against our int4 kernel and a float32 F.linear on the same shape.

Single-threaded CPU time per call (time.thread_time around many calls, one thread), so that a
busy machine's other work does not count; paths (models.kernels.ggml_blocks.block_linear):
"float" (each block dequantized and multiplied in float32, the earlier kernel), "vector" with
one int8 digit per input (llama.cpp's activations) and with two (the default).

    python -m bench.ggml_kernels [--n 8960 --k 1536 --calls 200]
    python -m bench.ggml_kernels --smoke
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F

from models.kernels import ggml_blocks, native
from models.kernels.ggml_blocks import BLOCK_TYPES
from models.kernels.quantization import QuantizedLinear

ORDER = ("Q4_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q5_1", "Q5_K")


def random_blocks(type_name: str, n: int, k: int) -> torch.Tensor:
    """Random bytes as blocks [n, row bytes], every float16 scale set to 0.01 (speed does not
    depend on the values)."""
    block = BLOCK_TYPES[type_name]
    raw = np.random.default_rng(0).integers(0, 256, (n, k // block.values, block.nbytes),
                                            dtype=np.uint8)
    scale = np.full(raw.shape[:2], 0.01, dtype=np.float16).view(np.uint8).reshape(
        *raw.shape[:2], 2)
    for at in ((208,) if type_name == "Q6_K" else (0, 2)):
        raw[:, :, at:at + 2] = scale
    return torch.from_numpy(raw.reshape(n, -1))


def cpu_us(fn, calls: int) -> float:
    """Microseconds of this thread's CPU time per call (after two warm-up calls)."""
    fn(), fn()
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=8960)
    parser.add_argument("--k", type=int, default=1536)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape, few calls")
    args = parser.parse_args()
    n, k, calls = (256, 512, 3) if args.smoke else (args.n, args.k, args.calls)
    torch.set_num_threads(1)
    kernels = native.load()
    assert kernels is not None, native.status().detail
    x = torch.randn(1, k)
    print(f"{kernels.variant} variant, weight [{n}, {k}], 1 row, 1 thread, CPU us per call")
    weight = torch.randn(n, k) * 0.02
    int4 = QuantizedLinear(weight, None, "int4", group_size=32)
    rows = [("float32 F.linear", cpu_us(lambda: F.linear(x, weight), calls)),
            ("int4 g32 (ours)", cpu_us(lambda: kernels.linear_int4(
                x, int4.qweight, int4.scales, 32), calls))]
    for name in ORDER:
        blocks = random_blocks(name, n, k)
        for label, path, digits in (("float", "float", 2), ("1 digit", "vector", 1),
                                    ("2 digits", "vector", 2)):
            def call(blocks=blocks, name=name, path=path, digits=digits):
                return ggml_blocks.block_linear(x, blocks, name, k, path, digits)

            rows.append((f"{name} {label}", cpu_us(call, calls)))
    for label, us in rows:
        print(f"{label:20s} {us:10.1f}")


if __name__ == "__main__":
    main()
