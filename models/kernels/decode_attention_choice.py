"""Which decode attention kernel runs on this machine: each candidate of models.layers.attention's
KERNELS (ours where it builds) timed once per head shape and dtype, on decode steps run end to
end out of a paged cache."""

from __future__ import annotations

import logging
import time

import torch

from models.kernels import native
from models.layers import kv_quant
from models.layers.attention import (
    AttentionGroup,
    LayerAttention,
    _attend_group,
    _decode_view,
    _Shape,
)

log = logging.getLogger(__name__)

_CHOICES: dict[tuple, str] = {}


def choose_decode_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    block_size: int = 16, kv_cache_dtype: str = "auto",
) -> str:
    """The fastest decode kernel on this machine, by measurement (once per shape and dtype).

    Decode attention is a matrix-vector workload whose fastest formulation differs between CPUs
    and dtypes (SDPA's fused CPU kernel is tuned for long query blocks; oneDNN builds a kernel
    per shape, and a decode's context grows every step). Each candidate runs a step's decode
    attention end to end out of a paged cache, the PyTorch ones gathering the keys first: one
    sequence at ~256 keys and eight at ~1024, the context growing by one per call as it does
    in generation; the least total time wins. CUDA keeps SDPA. With `kv_cache_dtype` "int8"
    the cache timed is an int8 one (models/layers/kv_quant.py): the PyTorch candidates then
    dequantize the blocks they gather, ours reads the int8 rows in place.
    """
    if device.type != "cpu":
        return "sdpa"
    key = (num_heads, num_kv_heads, head_dim, dtype, block_size, kv_cache_dtype)
    if key not in _CHOICES:
        names = ["sdpa", "matmul"]
        if native.load() is not None and dtype in native.DTYPES:
            names.append("native")
        times = _time_decode_kernels(names, num_heads, num_kv_heads, head_dim, dtype,
                                     block_size, kv_cache_dtype == "int8")
        _CHOICES[key] = min(times, key=times.get)
        log.debug("decode attention kernel for %s heads %d/%d x %d: %s (%s)", dtype,
                  num_heads, num_kv_heads, head_dim, _CHOICES[key],
                  ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in times.items()))
    return _CHOICES[key]


def _time_decode_kernels(names: list[str], num_heads: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype, block_size: int,
                         int8: bool = False) -> dict[str, float]:
    """Median seconds of each kernel over the same decode steps (see choose_decode_attention)."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-1040 // block_size)
    num_blocks = 8 * blocks_per_seq
    kv_cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim,
                           generator=gen).to(dtype)
    if int8:
        kv_cache = kv_quant.quantize_rows(kv_cache)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(8)]
    shape = _Shape(block_size, torch.device("cpu"), dtype)
    steps = []
    for grow in range(4):
        for contexts in ([256 + grow], [1000 + grow + i for i in range(8)]):
            view = _decode_view(shape, contexts, tables[: len(contexts)], None)
            group = AttentionGroup(torch.arange(len(contexts)), len(contexts), 1, {None: view})
            q = torch.randn(len(contexts), num_heads, head_dim, generator=gen).to(dtype)
            steps.append((q, group))

    def run(kernel: str) -> None:
        for q, group in steps:
            for view in group.views.values():
                view.workspace = None  # a fresh gather per step, as in a real one
            _attend_group(q, q, q, kv_cache, group, 0.1, LayerAttention(), kernel)

    samples: dict[str, list[float]] = {name: [] for name in names}
    for name in names:
        run(name)  # warm-up
    for _ in range(3):
        for name in names:
            t0 = time.perf_counter()
            run(name)
            samples[name].append(time.perf_counter() - t0)
    return {name: sorted(t)[1] for name, t in samples.items()}
