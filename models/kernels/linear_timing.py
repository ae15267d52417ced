"""What the linear plan measures, and how much of it: the calls timed for a group's candidates
(on as many of its layers as a byte and a FLOP budget allow, or on a lone huge matrix's first
output channels), a layer's weight bytes, and the read ruler that a decode-row timing's
bandwidth is checked against (models.kernels.linear_policy decides from these)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch
from torch import nn

from models.kernels import native
from models.kernels.int_formats import INT4_BLOCK_N
from models.kernels.linear import KERNELS, QUANTIZED_KERNELS, Linear, prepack_onednn

TIMED_BYTES = 32 << 20  # weight bytes one timed call streams through, at most (more than L2)
TIMED_FLOPS = 1e9  # and FLOPs
# A group of one matrix with more output channels than this (the LM head) is timed on its first
# channels: every candidate's cost grows with the channels alike, so a slice ranks them as the
# whole does.
LONE_MATRIX_SLICE_CHANNELS = 16384
READ_RULER_BYTES = 64 << 20  # twice TIMED_BYTES: read from memory, not from a cache


def weight_bytes(layer: nn.Module) -> int:
    """The bytes of a layer's weight (a quantized one's codes and scales)."""
    weights = [layer.qweight, layer.scales] if layer.is_quantized else [layer.weight]
    return sum(w.numel() * w.element_size() for w in weights)


def int4_pack_bytes(layers: list[nn.Module]) -> int:
    """The bytes PyTorch's int4 packs of these layers would add (0 for other formats)."""
    return sum(layer.qweight.nbytes for layer in layers
               if layer.is_quantized and layer.mode == "int4")


def timing_layers(group: list[nn.Module], tokens: int, dtype: torch.dtype) -> list[nn.Module]:
    """The layers one timed call runs through: as many of the group as the budgets allow, or
    the first output channels of one layer when a lone matrix is huge or one layer alone
    exceeds the FLOP budget at this token count."""
    first = group[0]
    flops_per_channel = 2.0 * tokens * first.in_features
    fit = int(TIMED_FLOPS // flops_per_channel) // INT4_BLOCK_N * INT4_BLOCK_N
    cap = LONE_MATRIX_SLICE_CHANNELS if len(group) == 1 else first.out_features
    channels = min(first.out_features, cap, max(INT4_BLOCK_N, fit))
    if channels < first.out_features:
        return [first_channels(first, channels)]
    n = min(len(group), int(TIMED_BYTES // max(weight_bytes(first), 1)),
            int(TIMED_FLOPS // (flops_per_channel * first.out_features)))
    return group[:max(1, n)]


def first_channels(layer: nn.Module, n: int) -> nn.Module:
    """A layer of the first `n` output channels of `layer`, sharing its weight."""
    if layer.is_quantized:
        return layer.first_channels(n)
    sliced = Linear(layer.in_features, n, bias=False, device="meta")
    sliced.weight = nn.Parameter(layer.weight.detach()[:n], requires_grad=False)
    return sliced


def timed_calls(names: list[str], group: list[nn.Module], tokens: int,
                dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """The call timed for each candidate of this group at `tokens` tokens: the same input
    through the same layers (oneDNN left out where it cannot prepack them)."""
    layers = timing_layers(group, tokens, dtype)
    x = torch.randn(tokens, group[0].in_features, dtype=dtype)
    if "onednn" in names:
        try:
            for layer in layers:
                prepack_onednn(layer)
        except RuntimeError:
            names = [n for n in names if n != "onednn"]
    table = QUANTIZED_KERNELS if group[0].is_quantized else KERNELS

    def run(name: str) -> Callable[[], object]:
        kernel = table[name]
        return lambda: [kernel(layer, x) for layer in layers]

    return {n: run(n) for n in names}


def untimed_calls(names: list[str]) -> dict[str, Callable[[], object]]:
    """Calls that do nothing, for candidates whose choice is read from the cache."""
    return {n: _noop for n in names}


def _noop() -> None:
    return None


@functools.cache
def read_bandwidth() -> float:
    """Bytes/s a plain read of a buffer larger than the caches streams (the best of a few
    reads), with our read loop where it builds, else torch's sum; measured once per process."""
    x = torch.ones(READ_RULER_BYTES // 4)
    kernels = native.load()
    read = (lambda: kernels.read_sum(x)) if kernels is not None else x.sum
    read()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t0)
    return READ_RULER_BYTES / best
