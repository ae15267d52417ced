"""Device and dtype chosen once at start-up, and the one way host tensors reach the device."""

from __future__ import annotations

import torch

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """'auto' picks CUDA when present, else the CPU; an unavailable CUDA is a clear error."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use 'cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
    return dev


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, checkpoint_dtype=None):
    """'auto': float32 on the CPU (decode there is bandwidth-bound and bfloat16 matrix-vector
    products measured slower than float32); on CUDA the checkpoint's dtype, else bfloat16."""
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        if isinstance(checkpoint_dtype, str):
            checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
        chosen = checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else (
            torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        )
    elif dtype in _DTYPES:
        chosen = _DTYPES[dtype]
    else:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    if chosen not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {chosen}")
    return chosen


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a host tensor built this step: pinned + non_blocking on CUDA, as-is on the CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
