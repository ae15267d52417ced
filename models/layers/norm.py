"""RMSNorm, shared by our decoders and encoders. In decoders (`fused_decode`), at a decode step's
few rows on the CPU, the norm (with the residual add before it) runs as one call of our own kernel
(models.kernels.native), rounding where the PyTorch operators it replaces round. A norm without a
learned scale is `rms_norm_unscaled`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.kernels import native


def rms_norm_unscaled(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, computed in float32, rounded to x's dtype."""
    return F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, scaled by a learned weight, or by (1 + weight)
    with `unit_offset` (Gemma 2/3's checkpoints store the weight that way). In reduced precision
    the weight multiplies the normed value rounded to the dtype, or, with `float32_scale`
    (Gemma 4), the float32 one before rounding."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False,
                 fused_decode: bool = False, float32_scale: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_scale = float32_scale
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
        if self.float32_scale:
            return F.rms_norm(x.float(), self.weight.shape, self.weight.float(),
                              self.eps).to(x.dtype)
        # Reduced precision: normalize in float32, scale in the input dtype (the reference's
        # cast order, which decides the rounding). The fused normalization sums a row alike
        # at any row count; pow and mean as separate ops did not on CUDA (a verified row then
        # differed from the decode row of its token).
        normed = F.rms_norm(x.float(), self.weight.shape, None, self.eps)
        return self.weight * normed.to(x.dtype)

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
        return "float32" if dtype == torch.float32 or self.float32_scale else "reduced"
