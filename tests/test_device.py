"""engine.device: the device and dtype rules, and timing of device work (CPU side)."""

from __future__ import annotations

import time

import pytest
import torch

from engine import device as dev
from engine.device import DeviceTimer, resolve_device, resolve_dtype, wait_for_device

CPU = torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the rules without CUDA")
def test_auto_device_is_the_cpu_without_cuda():
    assert resolve_device("auto") == CPU
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match="'auto', 'cpu' or 'cuda"):
        resolve_device("meta")


@pytest.mark.parametrize(
    ("checkpoint", "native_bf16", "ours", "expected"),
    [
        (torch.float32, True, True, torch.float32),
        (None, True, True, torch.float32),
        (torch.bfloat16, True, False, torch.bfloat16),
        ("float16", True, True, torch.bfloat16),
        ("float16", False, True, torch.float32),
        # AVX2: bfloat16 weights stay bfloat16 when our kernels widen them; float32 otherwise
        (torch.bfloat16, False, True, torch.bfloat16),
        (torch.bfloat16, False, False, torch.float32),
    ],
)
def test_auto_dtype_on_the_cpu(monkeypatch, checkpoint, native_bf16, ours, expected):
    monkeypatch.setattr(dev, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.setattr(dev, "native_kernels_built", lambda: ours)
    assert resolve_dtype("auto", CPU, checkpoint) == expected


def test_explicit_dtypes_and_errors():
    assert resolve_dtype("bf16", CPU) == torch.bfloat16
    assert resolve_dtype(torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("int8", CPU)
    with pytest.raises(ValueError, match="dtype must be float32, bfloat16 or float16"):
        resolve_dtype(torch.int8, CPU)


def test_device_timer_on_the_cpu_is_wall_time():
    timer = DeviceTimer(CPU).start()
    time.sleep(0.05)
    wait_for_device(CPU)  # a no-op on the CPU
    assert 0.04 < timer.stop().seconds() < 1.0
