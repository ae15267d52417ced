"""Bench-only: FLOP counts of a model's stages and the machine's GEMM peak, the rulers a compute
stage's time is read against.

`LinearFlops` counts, while active, 2 x rows x in x out for every call of a linear (an
`nn.Linear`, our `Linear`, or a quantized one), split into the vision / audio towers (with
their projectors) and the decoder by module name; the decoder's causal attention is added
from its shape, the towers' (`ViTAttention`: QK^T and PV within each segment, both ways) from
the segments each call attends over. Convolutions and element-wise work are not counted.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from bench.common import median


class LinearFlops:
    """Counts the FLOPs of every linear call, and of every tower attention call, under `model`
    while the context is open: `counts[part]`, part being "tower" (modules whose name holds
    one of TOWER_WORDS) or "decoder"."""

    TOWER_WORDS = ("visual", "vision", "audio", "tower", "encoder", "projector")

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.counts = {"tower": 0.0, "decoder": 0.0}
        self._hooks: list = []

    def __enter__(self) -> LinearFlops:
        from models.kernels.quantization import QuantizedLinear
        from models.layers.vit import ViTAttention

        for name, module in self.model.named_modules():
            if isinstance(module, (nn.Linear, QuantizedLinear)):
                part = "tower" if any(w in name for w in self.TOWER_WORDS) else "decoder"
                self._hooks.append(module.register_forward_hook(self._hook(part)))
            elif isinstance(module, ViTAttention):
                self._hooks.append(module.register_forward_hook(self._attention,
                                                                with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _hook(self, part: str):
        def hook(module: nn.Module, inputs, output) -> None:
            rows = inputs[0].numel() // module.in_features
            self.counts[part] += 2.0 * rows * module.in_features * module.out_features
        return hook

    def _attention(self, module: nn.Module, args: tuple, kwargs: dict, output) -> None:
        seg = args[1] if len(args) > 1 else kwargs["seg"]
        width = module.num_heads * module.head_dim
        self.counts["tower"] += 4.0 * sum(n * n for n in seg.lengths) * width


def causal_attention_flops(cfg, tokens: int) -> float:
    """QK^T and PV of a causal prefill of `tokens` over every decoder layer."""
    pairs = tokens * (tokens + 1) / 2
    return 4.0 * pairs * cfg.num_heads * cfg.head_dim * cfg.num_layers


def gemm_peak(dtype: torch.dtype, rows: int = 2048, size: int = 4096, repeats: int = 5) -> float:
    """FLOP/s of a [rows x size] x [size x size] product through the fastest dense formulation
    the engine has for `dtype` on this machine (models.kernels.linear.KERNELS, those that take
    any row count)."""
    from models.kernels import native
    from models.kernels.linear import KERNELS, Linear
    from models.kernels.linear_choice import onednn_prepacks

    layer = Linear(size, size, bias=False).to(dtype)
    x = torch.randn(rows, size, dtype=dtype)
    names = ["F.linear", "matmul_t"]
    if dtype == torch.bfloat16:
        names.append("widened")
    if native.load() is not None:
        names.append("native_gemm")
    if onednn_prepacks(dtype):
        layer.packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), 1)
        names.append("onednn")
    best = float("inf")
    with torch.inference_mode():
        for name in names:
            kernel = KERNELS[name]
            kernel(layer, x)
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                kernel(layer, x)
                samples.append(time.perf_counter() - t0)
            best = min(best, median(samples))
    return 2.0 * rows * size * size / best
