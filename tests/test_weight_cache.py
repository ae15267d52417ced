"""Weights quantized at load are kept on disk: the second start reads them back (the same
tensors, nothing quantized), a changed setting or file misses, a corrupt entry is rebuilt."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import models.kernels.quantization as quantization
from engine import model_loading
from engine.checkpoint_setup import CheckpointSetup
from engine.config import EngineConfig
from engine.load_progress import StartupProgress
from engine.model_loading import load_model
from testing.tiny import build_text_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_text_model(tmp_path_factory.mktemp("wc") / "m", "qwen2")


@pytest.fixture
def loads(checkpoint, tmp_path, monkeypatch):
    """load(group_size) -> (state dict, linears quantized in that start); the cache in tmp;
    `load.stages`: the start-up stages the last start reported."""
    monkeypatch.setenv("MMSERVE_WEIGHT_CACHE", str(tmp_path / "weights"))
    # placement and the kernel plan come after the cache and do not change what it holds
    monkeypatch.setattr(model_loading, "place_weights", lambda model: 0)
    monkeypatch.setattr(model_loading, "choose_linear_kernels", lambda model, dtype: {})
    calls = []
    real = quantization.quantize_linear
    monkeypatch.setattr(quantization, "quantize_linear",
                        lambda *args: calls.append(1) or real(*args))
    setup = CheckpointSetup.load(checkpoint)

    def load(group_size: int = 32):
        calls.clear()
        reports = []
        config = EngineConfig(quantization="int4", quantization_group_size=group_size)
        loaded = load_model(checkpoint, setup.hf_config, setup.spec.model, config,
                            torch.device("cpu"), torch.float32, 64,
                            progress=StartupProgress([reports.append]))
        load.stages = list(dict.fromkeys(r.stage for r in reports))
        return loaded.model.state_dict(), len(calls)

    return load


def _entries(tmp_path):
    return sorted((tmp_path / "weights").glob("*.pt"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_second_start_reads_the_quantized_weights_back(loads, tmp_path):
    first, quantized = loads()
    assert quantized > 0 and len(_entries(tmp_path)) == 1
    assert loads.stages[:3] == ["reading weights, quantizing linears to int4",
                                "quantizing the LM head to int4",
                                "keeping the quantized weights on disk for the next start"]
    second, again = loads()
    assert again == 0 and _same(first, second)
    assert loads.stages[0] == "reading the quantized weights kept on disk"
    assert not any("quantizing" in stage for stage in loads.stages)
    assert any(v.dtype == torch.uint8 for v in second.values())  # the int4 packs


def test_a_changed_setting_or_file_misses(loads, checkpoint, tmp_path):
    loads()
    _, quantized = loads(group_size=64)
    assert quantized > 0 and len(_entries(tmp_path)) == 2
    weights = checkpoint / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _, quantized = loads()
    assert quantized > 0 and len(_entries(tmp_path)) == 3


def test_a_corrupt_entry_is_rebuilt(loads, tmp_path, caplog):
    reference, _ = loads()
    (entry,) = _entries(tmp_path)
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="engine.weight_cache"):
        rebuilt, quantized = loads()
    assert "cannot be read back" in caplog.text
    assert quantized > 0 and _same(reference, rebuilt)
    _, again = loads()
    assert again == 0
