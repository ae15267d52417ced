"""Which formulation steps the gated delta rule's recurrence at decode on this machine: PyTorch's
ops (gather the states, update, scatter back) or our kernel (updates them in place), each timed
once per head shape on decode steps of one and of eight sequences out of a state pool."""

from __future__ import annotations

import logging
import time

import torch

from models.kernels import native
from models.layers.delta_rule import recurrent_step

log = logging.getLogger(__name__)

_CHOICES: dict[tuple, str] = {}


def choose_delta_rule(heads: int, dk: int, dv: int, device: torch.device) -> str:
    """The faster recurrence kernel for states [heads, dk, dv], by measurement (once per shape);
    PyTorch's where ours is not built or off the CPU."""
    if device.type != "cpu" or native.load() is None:
        return "torch"
    key = (heads, dk, dv)
    if key not in _CHOICES:
        times = _time(heads, dk, dv)
        _CHOICES[key] = min(times, key=times.get)
        log.info("delta rule recurrence for %d heads x %d x %d: %s (%s)", heads, dk, dv,
                 _CHOICES[key], ", ".join(f"{k} {t * 1e3:.2f} ms" for k, t in times.items()))
    return _CHOICES[key]


def _time(heads: int, dk: int, dv: int) -> dict[str, float]:
    """Median seconds of each kernel over the same steps (one and eight sequences)."""
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(16, heads, dk, dv, generator=gen) * 0.01
    steps = []
    for batch in (1, 8):
        q, k = (torch.nn.functional.normalize(torch.randn(batch, heads, dk, generator=gen), dim=-1)
                for _ in range(2))
        steps.append((q, k, torch.randn(batch, heads, dv, generator=gen),
                      -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads,
                                                                          generator=gen),
                      torch.arange(batch) * 2))
    samples: dict[str, list[float]] = {"torch": [], "native": []}
    for _ in range(4):  # the first round warms up
        for name in samples:
            t0 = time.perf_counter()
            for q, k, v, g, beta, slots in steps:
                recurrent_step(q, k, v, g, beta, pool, slots, name)
            samples[name].append(time.perf_counter() - t0)
    return {name: sorted(t[1:])[1] for name, t in samples.items()}
