"""Small building blocks shared by our decoders and encoders: RMSNorm, gated MLP, rotary tables,
and the one way host-built tensors reach the device. In decoders (`fused_decode`), at a decode
step's few rows on the CPU, the norm (with the residual add before it), SiLU-and-multiply and the
rotation run as one call each of our own kernels (models.kernels.native), rounding where the PyTorch
operators they replace round."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native
from models.kernels.linear import Linear


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a host tensor built this step: pinned + non_blocking on CUDA, as-is on the CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight, or by (1 + weight)
    with `unit_offset` (Gemma's checkpoints store the weight that way)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False,
                 fused_decode: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.fused_decode = fused_decode  # our kernel at a decode step's rows (decoders only)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self._fused(x)
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps, self.norm_mode(x.dtype))[1]
        if self.unit_offset:  # the reference scales in float32, then casts
            normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32:  # one fused kernel instead of six
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Reduced precision: normalize in float32, scale in the input dtype (the reference's
        # cast order, which decides the rounding).
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    def add_and_norm(self, h: torch.Tensor,
                     delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)): a residual add and the norm after it, in one call of
        our own kernel at a decode step's rows."""
        fused = self._fused(h)
        if fused is not None and delta.is_contiguous() and delta.dtype == h.dtype:
            return fused.rms_norm(h, self.weight, self.eps, self.norm_mode(h.dtype), delta)
        h = h + delta
        return h, self(h)

    def _fused(self, x: torch.Tensor) -> native.NativeKernels | None:
        if not self.fused_decode or not x.is_contiguous() or self.weight.dtype != x.dtype:
            return None
        return native.for_small_ops(x)

    def norm_mode(self, dtype: torch.dtype) -> str:
        """The convention of models.kernels.native.NORM_MODES this norm computes in `dtype`."""
        if self.unit_offset:
            return "unit_offset"
        return "float32" if dtype == torch.float32 else "reduced"


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False, act: str = "silu",
                 fused_decode: bool = False) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = ACTIVATIONS[act]
        self.fused_silu = fused_decode and act == "silu"  # our kernel at a decode's rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = native.for_small_ops(gate_up) if self.fused_silu and gate_up.dim() == 2 else None
        if fused is not None and gate_up.is_contiguous():
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(self.act(gate) * up)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def rope_inv_freq(head_dim: int, rope: dict) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] for the config's `rope_parameters` (float32, CPU).

    Supports rope_type default, linear (positions divided by `factor`, folded into the
    frequencies) and llama3 (long wavelengths slowed by `factor`, a smooth blend in between).
    """
    kind = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", 10000.0))
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv = 1.0 / base ** (steps / head_dim)
    if kind == "default" or kind == "mrope":
        return inv
    if kind == "linear":
        return inv / float(rope["factor"])
    if kind == "llama3":
        factor, lo, hi = float(rope["factor"]), rope["low_freq_factor"], rope["high_freq_factor"]
        old_len = rope["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        return torch.where(medium, blended, scaled)
    raise NotImplementedError(
        f"rope_type {kind!r} is not supported yet (supported: default, linear, llama3)"
    )


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
        self.cos = freqs.cos().to(device)
        self.sin = freqs.sin().to(device)

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
