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
from models.mapped_files import is_mapped
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
        state = loaded.model.state_dict()
        # while the model lives (it holds the mapping): do its weights view a mapped file?
        load.mapped = [is_mapped(v) for v in state.values() if v.nbytes]
        return state, len(calls)

    return load


def _entries(tmp_path):
    return sorted((tmp_path / "weights").glob("*.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_second_start_reads_the_quantized_weights_back(loads, tmp_path):
    first, quantized = loads()
    assert quantized > 0 and len(_entries(tmp_path)) == 1
    assert all(loads.mapped)  # the first start too runs the entry it kept, mapped
    assert loads.stages[:3] == ["reading weights, quantizing linears to int4",
                                "quantizing the LM head to int4",
                                "keeping the quantized weights on disk for the next start"]
    second, again = loads()
    assert again == 0 and _same(first, second)
    assert loads.stages[0] == "reading the quantized weights kept on disk"
    assert not any("quantizing" in stage for stage in loads.stages)
    assert any(v.dtype == torch.uint8 for v in second.values())  # the int4 packs
    # read back as views of the entry's mapping: nothing copied into the process's memory
    assert all(loads.mapped)


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
    reference = {k: v.clone() for k, v in reference.items()}  # not views of the entry
    (entry,) = _entries(tmp_path)
    # a half-written entry left by a crash: a new file (truncating the mapped one in place
    # would take the pages from under the views still mapping it)
    half = entry.read_bytes()[: entry.stat().st_size // 2]
    entry.unlink()
    entry.write_bytes(half)
    with caplog.at_level(logging.WARNING, logger="engine.weight_cache"):
        rebuilt, quantized = loads()
    assert "cannot be read back" in caplog.text
    assert quantized > 0 and _same(reference, rebuilt)
    _, again = loads()
    assert again == 0


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.Parameter(torch.arange(6, dtype=torch.float64))
        self.register_buffer("mask", torch.tensor([True, False, True]))


def test_an_entry_round_trips_tied_and_mixed_dtype_tensors(tmp_path):
    from engine import weight_cache

    torch.manual_seed(0)
    model = _Tied().to(torch.bfloat16)
    model.norm.data = torch.arange(6, dtype=torch.float64)
    entry = tmp_path / "entry.safetensors"
    weight_cache.save(entry, model, "a summary")
    back, summary = weight_cache.load(entry, _Tied, torch.device("cpu"), torch.bfloat16)
    assert summary == "a summary" and _same(model.state_dict(), back.state_dict())
    assert back.head.weight.data_ptr() == back.embed.weight.data_ptr()  # still one tensor
    assert back.norm.dtype == torch.float64 and back.mask.dtype == torch.bool
    assert all(is_mapped(t) for t in back.state_dict().values())


def test_every_tensor_of_an_entry_is_aligned_as_process_memory(tmp_path):
    """Each tensor starts at a multiple of 64 bytes of the mapping (PyTorch's int8 kernel
    faults on a weight 8 bytes off): a float32 scalar and an odd-sized bfloat16 tensor before
    an int8 weight, read back as views and run through that kernel."""
    from engine import weight_cache

    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.ones(3), "b": torch.ones(5, dtype=torch.bfloat16),
               "w": torch.randint(-127, 128, (1812, 64), dtype=torch.int8, generator=gen),
               "s": torch.rand(1812, generator=gen).to(torch.bfloat16)}
    entry = tmp_path / "entry.safetensors"
    weight_cache._write(entry, tensors, {"format": str(weight_cache.FORMAT), "aliases": "{}"})
    _, state, mapping = weight_cache._read(entry)
    assert state.keys() == tensors.keys()  # the padding is not a tensor of the model's
    assert all(mapping.holds(t) and t.data_ptr() % 64 == 0 for t in state.values())
    assert all(torch.equal(state[k], tensors[k]) for k in tensors)
    x = torch.randn(4, 64, generator=gen).to(torch.bfloat16)
    out = torch.ops.aten._weight_int8pack_mm(x, state["w"], state["s"])
    torch.testing.assert_close(out, torch.ops.aten._weight_int8pack_mm(x, tensors["w"],
                                                                      tensors["s"]))


@pytest.mark.parametrize(("value", "where"), [
    ("0", None), ("off", None), ("False", None), ("1", "default"), ("on", "default"),
    ("", "default"), ("~/kept", "given")])
def test_the_cache_folder_setting(monkeypatch, value, where):
    """$MMSERVE_WEIGHT_CACHE: a folder, or the words for off and on (never a folder named 1)."""
    from engine import weight_cache

    monkeypatch.setenv("MMSERVE_WEIGHT_CACHE", value)
    default = weight_cache.cache_path().parent / "weights"
    expected = {None: None, "default": default, "given": weight_cache.Path(value)}[where]
    assert weight_cache.cache_dir() == expected
