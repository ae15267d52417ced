"""Rotary position embeddings: inverse frequencies per rope type, the precomputed cos / sin table
a forward gathers rows of, and the rotation (one call of our own kernel at a decode step's rows on
the CPU), and under mRoPE which position row drives each frequency (`mrope_bands`,
`mrope_cos_sin`). Multimodal position ids themselves are models/layers/mrope.py."""

from __future__ import annotations

import math

import torch

from models.kernels import native


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for the config's `rope_parameters` (float32, CPU).

    Supports rope_type default, linear (positions divided by `factor`, folded into the
    frequencies), llama3 (long wavelengths slowed by `factor`, a smooth blend in between) and
    longrope with its `short_factor` per frequency (the frequencies transformers uses while a
    sequence is within `original_max_position_embeddings`; the runner serves no longer ones),
    proportional (the first `partial_rotary_factor` of the pairs rotate at the frequencies of
    the whole head size, the rest not at all: zero frequency).
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", 10000.0))
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / base ** (steps / head_dim)
    if kind == "default" or kind == "mrope":
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "proportional":
        angles = int(float(rope.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        inv = torch.cat([inv[:angles], torch.zeros(head_dim // 2 - angles, device="cpu")])
        return inv / float(rope.get("factor", 1.0))
    if kind == "llama3":
        factor, lo, hi = float(rope["factor"]), rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, blended, scaled)
    if kind == "longrope":
        factors = torch.tensor(rope["short_factor"], dtype=torch.float32, device="cpu")
        if factors.shape != inv.shape:
            raise ValueError(f"longrope short_factor has {len(factors)} entries for "
                             f"{len(inv)} rotary frequencies")
        return 1.0 / (factors * base ** (steps / head_dim))
    raise NotImplementedError(
        f"rope_type {kind!r} is not supported yet (supported: default, linear, llama3, "
        "longrope, proportional)"
    )


def longrope_attention_factor(cfg, rope: dict) -> float:
    """longrope's scale of cos and sin: `attention_factor`, else sqrt(1 + ln(factor) /
    ln(original_max_position_embeddings)) with `factor` (default: the config's
    max_position_embeddings over the original), 1 for a factor of at most 1 (transformers'
    rule)."""
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or cfg.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryTable:
    """Precomputed cos/sin [max_positions, head_dim / 2] (float32), indexed by position ids.

    Built once at start-up on the target device (explicitly on the CPU first, so that building
    a model on the meta device leaves these real); a forward gathers rows, nothing is
    recomputed per layer.
    """

    def __init__(
        self, head_dim: int, max_positions: int, rope: dict, device: torch.device
    ) -> None:
        inv = rope_inv_freq(head_dim, rope)
        t = torch.arange(max_positions, dtype=torch.int64, device="cpu").float()
        freqs = torch.outer(t, inv)  # [P, D/2]
        scale = rope.get("attention_factor", 1.0) if rope.get("rope_type") == "longrope" else 1.0
        cos, sin = freqs.cos(), freqs.sin()
        if scale != 1.0:  # longrope scales both, in float32, before any rounding
            cos, sin = cos * scale, sin * scale
        self.cos = cos.to(device)
        self.sin = sin.to(device)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions [T] -> (cos, sin) [T, 1, D/2] in `dtype`, broadcastable over heads."""
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]); x [T, H, D], cos/sin [T, 1, D/2]."""
    fused = native.for_small_ops(x)
    if (fused is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.dtype == x.dtype and cos.is_contiguous() and sin.is_contiguous()
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2] // 2)):
        return fused.rotary(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def mrope_bands(section: list[int], half: int, interleaved: bool) -> torch.Tensor:
    """For each of the head's `half` frequencies, the position row (0 t, 1 h, 2 w) that drives
    it: contiguous bands of `section` sizes, or interleaved t, h, w (Qwen3-VL). int64 [half]."""
    if sum(section) != half:
        raise ValueError(f"mrope_section {section} must sum to head_dim / 2 = {half}")
    if not interleaved:
        return torch.cat([torch.full((n,), i % 3, device="cpu") for i, n in enumerate(section)])
    band = torch.zeros(half, dtype=torch.int64, device="cpu")  # explicit: built under meta
    for row in (1, 2):
        band[row : 3 * section[row] : 3] = row
    return band


def mrope_cos_sin(rotary: RotaryTable, positions: torch.Tensor, band: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [3, T] -> cos, sin [T, 1, D/2]: frequency i takes its angle from position row
    band[i] (`mrope_bands`)."""
    cos, sin = rotary.cos[positions], rotary.sin[positions]  # [3, T, D/2]
    rows = band[None, :].expand(positions.shape[1], -1)[None]  # [1, T, D/2]
    cos = cos.gather(0, rows).squeeze(0)
    sin = sin.gather(0, rows).squeeze(0)
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]
