"""Which decode attention kernel runs on this machine: each candidate of models.layers.attention's
KERNELS (ours where it builds) timed once per head shape and dtype, on decode steps run end to
end out of a paged cache; the choice is kept in the kernel plan's cache file beside the linear
kernels' (models/kernels/choice.py), so a second start does not time it again."""

from __future__ import annotations

import logging
import time

import torch

from models.kernels import native
from models.kernels.choice import KernelCache, cache_path
from models.kernels.linear_policy import PLAN_RULES
from models.layers import kv_quant
from models.layers.attention import LayerAttention, _attend_group
from models.layers.attention_metadata import AttentionGroup, _decode_view, _Shape

log = logging.getLogger(__name__)

_CHOICES: dict[tuple, str] = {}


def choose_decode_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
    block_size: int = 16, kv_cache_dtype: str = "auto", cache: KernelCache | None = None,
) -> str:
    """The fastest decode kernel on this machine, by measurement (once per shape and dtype).

    Decode attention is a matrix-vector workload whose fastest formulation differs between CPUs
    and dtypes (SDPA's fused CPU kernel is tuned for long query blocks; oneDNN builds a kernel
    per shape, and a decode's context grows every step). Each candidate runs a step's decode
    attention end to end out of a paged cache, the PyTorch ones gathering the keys first: one
    sequence at ~256 keys and eight at ~1024, the context growing by one per call as it does
    in generation; the least total time wins. CUDA keeps SDPA. With `kv_cache_dtype` "int8"
    the cache timed is an int8 one (models/layers/kv_quant.py): the PyTorch candidates then
    dequantize the blocks they gather, ours reads the int8 rows in place. `cache`: where the
    choice is kept (by default the kernel plan's cache of this CPU and build).
    """
    if device.type != "cpu":
        return "sdpa"
    key = (num_heads, num_kv_heads, head_dim, dtype, block_size, kv_cache_dtype)
    if key not in _CHOICES:
        built = native.load()
        names = ["sdpa", "matmul"]
        if built is not None and dtype in native.DTYPES:
            names.append("native")
        if cache is None:
            cache = KernelCache(cache_path(native_build=built.build_id if built else None,
                                           rules=PLAN_RULES))
        saved_key = (f"decode_attention/{str(dtype).removeprefix('torch.')}/{num_heads}x"
                     f"{num_kv_heads}x{head_dim}/block{block_size}/{kv_cache_dtype}")
        saved = cache.get(saved_key, set(names))
        if saved is None:
            times = _time_decode_kernels(names, num_heads, num_kv_heads, head_dim, dtype,
                                         block_size, kv_cache_dtype == "int8")
            saved = min(times, key=times.get)
            cache.put(saved_key, saved, times)
            cache.save()
            log.debug("decode attention kernel for %s heads %d/%d x %d: %s (%s)", dtype,
                      num_heads, num_kv_heads, head_dim, saved,
                      ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in times.items()))
        _CHOICES[key] = saved
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
