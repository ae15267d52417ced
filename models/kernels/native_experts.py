"""A mixture-of-experts block's routed experts at a decode's rows in one native call
(`mm_moe_experts` of models/kernels/cpu/moe_experts.c), on the CPU.

Through the modules, each routed expert costs a handful of calls from Python per step and layer
(its two linears, the activation, the scaling, the sum), about as long as the expert's weights
take to stream in. The call runs the same kernels over the same rows, expert by expert, with the
same roundings, so its result is the modules' to the bit; it only replaces the calls. It takes a
step only where the modules would run exactly those kernels: every expert's linears planned to
ours ("native") at the step's row count, the SiLU of the fused decode op, float32 or bfloat16
on the CPU, at most models.kernels.native.FUSED_ROWS tokens. `MMSERVE_NATIVE_DECODE=0` keeps
the modules.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from models.kernels import native
from models.kernels.choice import BUCKETS, bucket_index
from models.kernels.linear import Linear
from models.kernels.native_interface import LinearDesc
from models.kernels.native_linear import linear_desc
from models.kernels.quantization import QuantizedLinear

log = logging.getLogger(__name__)

DISABLE_ENV = "MMSERVE_NATIVE_DECODE"  # "0": the modules run every step (as native_decode)

Pair = tuple[Linear | QuantizedLinear, Linear | QuantizedLinear]  # an expert's gate_up, down


class NativeExperts:
    """The call for one block's experts, their weights described once."""

    def __init__(self, experts: Sequence[Pair], dtype: torch.dtype,
                 kernels: native.NativeKernels) -> None:
        self.dtype, self.count = dtype, len(experts)
        self.hidden = experts[0][1].out_features
        self._call = kernels.moe_experts  # bound by models.kernels.native_interface
        # Pointers to the weights as they are now: built after they are placed and planned.
        self.gate_up = (LinearDesc * len(experts))(*(linear_desc(g) for g, _ in experts))
        self.down = (LinearDesc * len(experts))(*(linear_desc(d) for _, d in experts))
        linears = [linear for pair in experts for linear in pair]
        self.buckets = tuple(all(m.kernels is not None and m.kernels[b] == "native"
                                 for m in linears) for b in range(len(BUCKETS)))

    @classmethod
    def build(cls, experts: Sequence[Pair], dtype: torch.dtype,
              fused_silu: bool) -> NativeExperts | None:
        """The call for these experts, or None where it cannot run them."""
        kernels = native.load()
        reason = None
        if os.environ.get(DISABLE_ENV, "1") == "0":
            reason = f"disabled by {DISABLE_ENV}=0"
        elif kernels is None:
            reason = f"no native kernels ({native.status().detail})"
        elif dtype not in native.DTYPES or not fused_silu:
            reason = "it runs SiLU experts in float32 or bfloat16"
        elif not all(_takes(m, dtype) for pair in experts for m in pair):
            reason = "an expert's linear is not one it takes (CPU, no bias, model dtype)"
        if reason is not None:
            log.info("routed experts run through the modules: %s", reason)
            return None
        call = cls(experts, dtype, kernels)
        if not any(call.buckets):
            log.info("routed experts run through the modules: at no row count are all their "
                     "linears planned to run our kernels")
            return None
        return call

    def run(self, x: torch.Tensor, weights: torch.Tensor,
            experts: torch.Tensor) -> torch.Tensor | None:
        """x [m, H], weights [m, k] (x's dtype), experts [m, k] int64 -> the weighted sum of
        each token's experts [m, H], or None for a step the call does not take."""
        m = x.shape[0]
        if (m > native.FUSED_ROWS or x.dtype != self.dtype or x.device.type != "cpu"
                or not self.buckets[bucket_index(m)]):
            return None
        x = x.contiguous()
        weights = weights.to(x.dtype).contiguous()
        experts = experts.to(torch.int64).contiguous()
        out = torch.empty(m, self.hidden, dtype=x.dtype)
        status = self._call(self.gate_up, self.down, self.count, x.data_ptr(),
                            native.DTYPES[x.dtype], m, experts.data_ptr(), weights.data_ptr(),
                            experts.shape[1], out.data_ptr(), torch.get_num_threads())
        if status:
            if status == 1:
                raise MemoryError("native routed experts: out of memory for the step's "
                                  "intermediates")
            raise RuntimeError(f"native routed experts: a kernel refused its shapes ({status})")
        return out


def _takes(linear: object, dtype: torch.dtype) -> bool:
    if not isinstance(linear, Linear | QuantizedLinear) or linear.bias is not None:
        return False
    weight = linear.qweight if linear.is_quantized else linear.weight
    dense_ok = linear.is_quantized or weight.dtype == dtype
    return dense_ok and weight.device.type == "cpu" and weight.is_contiguous()
