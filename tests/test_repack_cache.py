"""A GGUF file's blocks repacked for our kernels are kept on disk (engine/weight_cache.py,
models/gguf/repacks.py): the second start maps them back (nothing repacked: the same bytes and
the same tokens), the first start runs the kept copy too, a changed file misses, a corrupt entry
is rebuilt, and a kept layout this build would not make is not used."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from gguf import GGMLQuantizationType

from engine import LLM
from engine.sampling_params import SamplingParams
from models.gguf.repacks import Repacker
from models.kernels import ggml_blocks, native
from models.kernels.ggml_blocks import BLOCK_TYPES, BlockEmbedding, BlockPart

TYPES = {r"token_embd": GGMLQuantizationType.Q6_K, r"attn_[qk]$": GGMLQuantizationType.Q4_K,
         r"attn_v": GGMLQuantizationType.Q8_0, r"attn_output": GGMLQuantizationType.Q5_0,
         r"ffn": GGMLQuantizationType.Q4_K}
PROMPTS = ["The quick brown fox", "1, 2, 3,"]
PARAMS = SamplingParams(max_tokens=10, temperature=0)


def _repacks_here() -> bool:
    kernels = native.load()
    return kernels is not None and bool(kernels.ggml_repack_takes(BLOCK_TYPES["Q4_K"].code,
                                                                   256, 256))


@pytest.fixture(scope="module")
def tied_file(tmp_path_factory):
    """A tiny Qwen2 whose head is tied to a Q6_K table, its linears Q4_K, Q8_0 and Q5_0: every
    type our kernels repack."""
    if not _repacks_here():
        pytest.skip("this build repacks no block type (its vector path is not AVX2 or up)")
    from testing.gguf import write_gguf
    from testing.tiny import build_text_model

    root = tmp_path_factory.mktemp("repacks")
    checkpoint = build_text_model(root / "qwen2", "qwen2", hidden_size=256,
                                  intermediate_size=512, tie_word_embeddings=True)
    return write_gguf(checkpoint, root / "tied.gguf", types=TYPES)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "weights"
    monkeypatch.setenv("MMSERVE_WEIGHT_CACHE", str(folder))
    return folder


def _repacked(llm: LLM) -> list[BlockPart | BlockEmbedding]:
    return [m for m in llm.engine.runner.model.modules()
            if isinstance(m, (BlockPart, BlockEmbedding)) and m.kernel_type != m.type_name]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _entries(folder):
    return sorted(folder.glob("*.repacked.safetensors"))


def _source(entry) -> str:
    from models.checkpoint import safetensors_header

    return safetensors_header(entry)["__metadata__"]["source"]


def test_the_second_start_maps_the_kept_blocks(tied_file, cache, monkeypatch):
    first = LLM(tied_file, max_model_len=128)
    entry, = _entries(cache)
    model = first.engine.runner.model
    kept = next(m for m in model.mapped_files if m.path == entry)
    made = _repacked(first)
    assert {m.kernel_type for m in made} == {"Q4_Kx8", "Q6_Kx8", "Q8_0x8", "Q5_0x8"}
    # the first start runs the entry's copy too: every repacked weight views its mapping
    assert all(kept.holds(m.blocks) for m in made)
    assert model.lm_head.parts[0].blocks.data_ptr() == model.embed_tokens.blocks.data_ptr()
    tokens = _tokens(first)

    def no_repacking(*args):
        raise AssertionError("the second start repacked a weight")

    monkeypatch.setattr(ggml_blocks, "repack", no_repacking)
    second = LLM(tied_file, max_model_len=128)
    assert _entries(cache) == [entry]
    again = _repacked(second)
    assert [(m.kernel_type, m.blocks.shape) for m in again] == [
        (m.kernel_type, m.blocks.shape) for m in made]
    assert all(torch.equal(a.blocks, b.blocks) for a, b in zip(again, made, strict=True))
    head, table = second.engine.runner.model.lm_head, second.engine.runner.model.embed_tokens
    assert head.parts[0].blocks.data_ptr() == table.blocks.data_ptr()
    assert _tokens(second) == tokens
    # and as repacked in memory, with no cache
    monkeypatch.undo()
    monkeypatch.setenv("MMSERVE_WEIGHT_CACHE", "0")
    alone = LLM(tied_file, max_model_len=128)
    assert not any(m.path.suffix == ".safetensors"
                   for m in alone.engine.runner.model.mapped_files)
    assert all(torch.equal(a.blocks, b.blocks)
               for a, b in zip(_repacked(alone), made, strict=True))
    assert _tokens(alone) == tokens


def test_a_changed_file_misses_and_a_corrupt_entry_is_rebuilt(tied_file, cache, tmp_path,
                                                              caplog):
    """A changed file (its modification time) misses and replaces its earlier entry (another
    file of the same name keeps its own); a truncated entry is removed and rebuilt."""
    path = tmp_path / "copy.gguf"
    path.write_bytes(tied_file.read_bytes())
    tokens = _tokens(LLM(path, max_model_len=128))
    entry, = _entries(cache)
    size = entry.stat().st_size
    stat = path.stat()
    other = tmp_path / "other" / "copy.gguf"  # the same name, another file: kept apart
    other.parent.mkdir()
    other.write_bytes(tied_file.read_bytes())
    assert _tokens(LLM(other, max_model_len=128)) == tokens
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # "changed"
    assert _tokens(LLM(path, max_model_len=128)) == tokens
    entries = _entries(cache)  # the entry of the file's earlier state removed, the other kept
    assert len(entries) == 2 and entry not in entries
    new, = [e for e in entries if _source(e) == str(path.resolve())]
    with open(new, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING):
        rebuilt = LLM(path, max_model_len=128)
    assert "cannot be read back" in caplog.text and "repacking anew" in caplog.text
    assert new.stat().st_size == size
    assert all(any(m.path == new and m.holds(p.blocks)
                   for m in rebuilt.engine.runner.model.mapped_files)
               for p in _repacked(rebuilt))
    assert _tokens(rebuilt) == tokens


class _Store:
    """A RepackStore in memory that hands back what it was given at first."""

    def __init__(self, kept: dict[str, tuple[str, torch.Tensor]]) -> None:
        self.kept, self.put_keys = kept, []

    def get(self, key):
        return self.kept.get(key)

    def put(self, key, kernel_type, blocks):
        self.put_keys.append(key)

    def save(self):
        return False

    def mappings(self):
        return []


def test_a_kept_layout_this_build_would_not_make_is_not_used(monkeypatch):
    if not _repacks_here():
        pytest.skip("this build repacks no block type (its vector path is not AVX2 or up)")
    from tests.test_gguf_blocks import random_blocks

    blocks = torch.from_numpy(random_blocks("Q4_K", 16, 256))
    made = ggml_blocks.repack(blocks, "Q4_K", 256)[1]
    # another layout's name, or the right name at another shape: repacked anew, and put
    for wrong in [("Q6_Kx8", made.clone()), ("Q4_Kx8", made[:8].clone())]:
        store = _Store({"w": wrong})
        part = Repacker(store).part("w", "Q4_K", blocks, 256)
        assert part.kernel_type == "Q4_Kx8" and torch.equal(part.blocks, made)
        assert store.put_keys == ["w"]
    # the right layout is taken as it is
    store = _Store({"w": ("Q4_Kx8", made)})
    assert Repacker(store).part("w", "Q4_K", blocks, 256).blocks is made
    # where this build does not repack the type (a lower vector path), the file's blocks
    monkeypatch.setattr("models.gguf.repacks.repacked_as", lambda *args: None)
    monkeypatch.setattr(ggml_blocks, "repacked_as", lambda *args: None)
    part = Repacker(store).part("w", "Q4_K", blocks, 256)
    assert part.kernel_type == "Q4_K" and part.blocks.data_ptr() == blocks.data_ptr()
