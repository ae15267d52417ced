"""Weights mapped from their files (models/mapped_files.py): one read-only mapping per file,
whose views a write cannot change (the process faults; the file is untouched), and safetensors
tensors at the model dtype loaded as views of it (a whole parameter; ties kept), while fused
rows and converted dtypes are copied and their pages leave the resident set. GGUF blocks as
views: tests/test_gguf_blocks.py."""

from __future__ import annotations

import signal
import subprocess
import sys

import torch
from safetensors.torch import save_file
from torch import nn

from models.loader import Shard, load_weights, read_safetensors
from models.mapped_files import is_mapped, keep, map_file


def test_one_read_only_mapping_per_file(tmp_path):
    path = tmp_path / "w.bin"
    path.write_bytes(bytes(range(256)) * 16)
    mapping = map_file(path)
    assert map_file(path) is mapping  # the live one, shared
    view = mapping.view(256, 16)
    assert is_mapped(view) and view.tolist() == list(range(16))
    assert not is_mapped(view.clone())
    # a write faults: the process stops, and the file keeps its bytes
    code = ("import sys; from models.mapped_files import map_file; "
            "v = map_file(sys.argv[1]).view(0, 64); v.add_(1)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True)
    assert done.returncode == -signal.SIGSEGV, done.stderr[-300:]
    assert path.read_bytes() == bytes(range(256)) * 16


H = 4096  # rows of whole pages: the copied tensors' pages leave the resident set


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, H)
        self.head = nn.Linear(H, 4, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.fused = nn.Linear(H, 24, bias=False)  # rows 0..8 and 8..24 from two tensors
        self.norm = nn.Parameter(torch.empty(H))


def resident_bytes(start: int) -> int:
    """Rss of the mapping at address `start`, from /proc/self/smaps."""
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split(" ")[0]
        if "-" in head and ":" not in head and int(head.split("-")[0], 16) == start:
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1]) * 1024
    raise AssertionError("mapping not found")


def test_safetensors_at_the_model_dtype_are_views_of_the_file(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {"embed": torch.randn(4, H, generator=gen).to(torch.bfloat16),
               "a": torch.randn(8, H, generator=gen).to(torch.bfloat16),
               "b": torch.randn(16, H, generator=gen).to(torch.bfloat16),
               "norm": torch.randn(H, generator=gen)}  # float32: converted
    file = tmp_path / "model.safetensors"
    save_file(tensors, file)
    targets = {"embed": ("embed.weight", None), "a": ("fused.weight", Shard(0, 8)),
               "b": ("fused.weight", Shard(8, 16)), "norm": ("norm", None)}
    model = Tiny().to(torch.bfloat16)
    mappings = []
    load_weights(model, read_safetensors(file, "", torch.bfloat16, mappings), targets.get)
    mapping, = mappings
    assert resident_bytes(mapping.start) >= 24 * H * 2  # a and b read through it, copied
    keep(model, mappings)
    assert model.mapped_files == (mapping,) and map_file(file) is mapping
    # the copied tensors' pages leave the resident set (at most the embedding's stay: the
    # kernel maps pages around a faulting one)
    assert resident_bytes(mapping.start) <= 4 * H * 2 + 2 * 4096
    assert is_mapped(model.embed.weight) and model.head.weight is model.embed.weight
    assert torch.equal(model.embed.weight, tensors["embed"])
    assert not is_mapped(model.fused.weight) and not is_mapped(model.norm)
    assert torch.equal(model.fused.weight, torch.cat([tensors["a"], tensors["b"]]))
    assert torch.equal(model.norm, tensors["norm"].to(torch.bfloat16))
    x = torch.randn(3, H, generator=gen).to(torch.bfloat16)
    assert torch.equal(model.head(x), x @ tensors["embed"].T)
    # without a mapped dtype, every tensor is read into memory of its own
    plain = Tiny().to(torch.bfloat16)
    load_weights(plain, read_safetensors(file), targets.get)
    assert not is_mapped(plain.embed.weight) and torch.equal(plain.embed.weight,
                                                             tensors["embed"])


def test_an_engine_runs_on_weights_mapped_from_its_checkpoint(tmp_path, monkeypatch):
    """A float32 checkpoint at float32: whole parameters view the file (not moved into huge
    pages), fused ones are copied, and the model holds the mapping and generates."""
    from engine import LLM, SamplingParams
    from models.kernels.linear_policy import PLAN_SECONDS_ENV
    from testing.tiny import build_text_model

    monkeypatch.setenv(PLAN_SECONDS_ENV, "0")  # about weights, not kernel choice: untimed
    path = build_text_model(tmp_path / "qwen2", "qwen2")
    llm = LLM(path, dtype="float32", max_model_len=64)
    model = llm.engine.runner.model
    mapping, = model.mapped_files
    assert mapping.path == path / "model.safetensors"
    layer = model.layers[0]
    assert mapping.holds(model.embed_tokens.weight) and mapping.holds(layer.self_attn.o_proj.weight)
    assert not mapping.holds(layer.self_attn.qkv_proj.weight)  # q, k and v in one: copied
    out = llm.generate(["Hello there"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4
