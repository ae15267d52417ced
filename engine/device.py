"""Device and dtype chosen once at start-up, and how device work is timed. (`to_device`, the one
way host-built tensors reach the device, lives with the model layers, which use it too.)"""

from __future__ import annotations

import time

import torch

from models.layers.transfer import to_device

__all__ = ["DeviceTimer", "resolve_device", "resolve_dtype", "to_device", "wait_for_device"]

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
    """'auto' is the checkpoint's own dtype, corrected for the device.

    On the CPU: a bfloat16 checkpoint stays bfloat16 where the CPU computes bfloat16 natively
    (AMX or AVX512-BF16) or our kernels are built (they widen bfloat16 in registers for the
    decode step, and the planner's "widened" GEMM in cache for prefill, so the weights keep half
    of float32's memory at float32's speed); without either, float32. float16 becomes bfloat16
    where the CPU computes bfloat16 natively, else float32. On CUDA: the checkpoint's half
    dtype, else bfloat16 (float16 where bfloat16 is unsupported).
    """
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype)
    if isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        if device.type == "cpu":
            if checkpoint_dtype == torch.bfloat16 and (cpu_has_native_bf16()
                                                       or native_kernels_built()):
                return torch.bfloat16
            if checkpoint_dtype == torch.float16 and cpu_has_native_bf16():
                return torch.bfloat16
            return torch.float32
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


def native_kernels_built() -> bool:
    """Whether our CPU kernels are built for this machine (models.kernels.native)."""
    from models.kernels import native  # built on first use: only when a CPU dtype is chosen

    return native.load() is not None


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AMX tiles or AVX512-BF16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


class DeviceTimer:
    """Duration of the device work enqueued between `start()` and `stop()`.

    On the CPU work runs as it is enqueued, so this is wall-clock time. On CUDA kernels run
    asynchronously: events are recorded on the stream, and `seconds()` must only be called
    once the stream has passed `stop()` (after the step's sync), so that timing adds no sync.
    """

    def __init__(self, device: torch.device) -> None:
        self._events = None
        if device.type == "cuda":
            self._events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
        self._wall = [0.0, 0.0]

    def start(self) -> DeviceTimer:
        self._mark(0)
        return self

    def stop(self) -> DeviceTimer:
        self._mark(1)
        return self

    def seconds(self) -> float:
        if self._events is not None:
            return self._events[0].elapsed_time(self._events[1]) / 1e3  # ms -> s
        return self._wall[1] - self._wall[0]

    def _mark(self, i: int) -> None:
        if self._events is not None:
            self._events[i].record()
        else:
            self._wall[i] = time.perf_counter()


def wait_for_device(device: torch.device) -> None:
    """Block until the device has finished the work enqueued so far (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
