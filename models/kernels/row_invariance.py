"""Off the CPU, a linear's rows summed alike at any row count: what speculative decoding needs
of a decode step there (a verification's rows must sum as decodes of their tokens do: see
models.kernels.linear_choice.pin_decode_rows for the CPU's way).

The GPU libraries pick a GEMM by its shape and each sums a row in its own order (on an H200,
cuBLAS's float32 products at 2 to 64 rows differed from the one-row product in the last bits;
its bfloat16 ones did not), so whether a layer's rows depend on their count is measured, once
per kind of layer at start-up: every row count below the padded one against the first rows of
a product at that many, on random inputs. Only the layers whose rows differ run an input of
fewer rows padded to that many (one shape, so one kernel: models.kernels.linear.run_kernel).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from models.kernels import native
from models.kernels.linear import Linear, run_kernel
from models.kernels.quantization import QuantizedLinear

log = logging.getLogger(__name__)

RowLinear = Linear | QuantizedLinear


def rows_vary(layer: RowLinear, rows: int, dtype: torch.dtype, seed: int = 0) -> bool:
    """Whether `layer`'s output rows for an input of fewer than `rows` rows differ (to the bit)
    from the same rows of an input of `rows` rows: each count from 1 to rows - 1, on random
    inputs of `dtype` (the model's) on the layer's device, run unpadded."""
    kept, layer.pad_rows = layer.pad_rows, None
    device = (layer.qweight if layer.is_quantized else layer.weight).device
    try:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(rows, layer.in_features, generator=gen).to(device, dtype)
        with torch.inference_mode():
            full = run_kernel(layer, x)
            return any(not torch.equal(run_kernel(layer, x[:n]), full[:n])
                       for n in range(1, rows))
    finally:
        layer.pad_rows = kept


def pad_device_rows(model: nn.Module, dtype: torch.dtype,
                    rows: int | None = native.FUSED_ROWS, measure: bool = True) -> int:
    """Off the CPU, the linears of `model` (run in `dtype`) whose rows vary with their count
    (`rows_vary`, one layer of each kind measured; every linear when not `measure`) run an
    input of fewer than `rows` rows padded to `rows`; the others, and all with `rows` None,
    unpadded. Returns how many linears are padded."""
    layers = [m for m in model.modules() if isinstance(m, RowLinear)]
    verdicts: dict[tuple, bool] = {}
    padded = 0
    for layer in layers:
        pad = rows is not None and (not measure or _verdict(layer, rows, dtype, verdicts))
        layer.pad_rows = rows if pad else None
        padded += pad
    if rows is not None:
        why = (f"{sum(verdicts.values())} of {len(verdicts)} kinds measured to sum a row by "
               "the row count" if measure else "all, unmeasured")
        log.info("speculative decoding: %d of %d linears run inputs of fewer than %d rows "
                 "padded to %d (%s)", padded, len(layers), rows, rows, why)
    return padded


def _verdict(layer: RowLinear, rows: int, dtype: torch.dtype,
             verdicts: dict[tuple, bool]) -> bool:
    """rows_vary, once per kind of layer (class, shape, bias, quantization)."""
    key = (type(layer), layer.in_features, layer.out_features, layer.bias is not None,
           layer.is_quantized and (layer.mode, layer.group_size))
    if key not in verdicts:
        verdicts[key] = rows_vary(layer, rows, dtype)
    return verdicts[key]
