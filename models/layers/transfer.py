"""The one way a tensor built on the host for this step reaches the device: pinned memory and a
non-blocking copy on CUDA, the tensor itself on the CPU."""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Move a host tensor built this step: pinned + non_blocking on CUDA, as-is on the CPU."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)
