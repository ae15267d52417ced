"""Contract 1: no host-device sync inside the model forward.

A TorchDispatchMode records the ATen ops that force a sync (reading a scalar back, nonzero,
boolean-mask indexing) while the forward runs; a source scan catches `.tolist()`/`.item()`/
`.cpu()`, which the dispatcher does not always see as such.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import torch

from engine import LLM
from models.layers.attention_metadata import build_metadata
from tests.model_fixtures import SyncRecorder

ROOT = Path(__file__).resolve().parents[1]
def forward_ops(model, starts, lens, tables) -> list[str]:
    ids = torch.arange(sum(lens)) % 50
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
    meta = build_metadata(starts, lens, tables, 16, torch.device("cpu"))
    with torch.inference_mode(), SyncRecorder() as rec:
        model.compute_logits(model(ids, pos, meta))
    return rec.seen


@pytest.mark.parametrize(
    "starts, lens, tables",
    [
        ([0], [20], [[0, 1]]),  # causal fast path
        ([20, 0, 5], [1, 9, 1], [[0, 1], [2], [3]]),  # decodes + a prefill in one batch
    ],
)
def test_decoder_forward_has_no_host_sync(qwen2_path, starts, lens, tables):
    model = LLM(qwen2_path, max_model_len=128).engine.runner.model
    assert forward_ops(model, starts, lens, tables) == []


def test_vision_tower_and_splice_have_no_host_sync(qwen2_vl_path):
    from engine.request import MultiModalFeature, PlaceholderRange, Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledChunk
    from models.encoders.qwen_vl import build_vision_batch

    runner = LLM(qwen2_vl_path, max_model_len=256).engine.runner
    model = runner.model
    grids = [(1, 8, 12), (2, 4, 4)]
    pixels = [torch.randn(t * h * w, 3 * 2 * 14 * 14) for t, h, w in grids]
    batch = build_vision_batch(pixels, grids, model.visual.cfg, torch.device("cpu"),
                               torch.float32)  # host side, before the forward
    with torch.inference_mode(), SyncRecorder() as rec:
        merged = model.visual(batch)
    assert rec.seen == [] and merged.shape[0] == sum(batch.sizes)

    span = PlaceholderRange(3, batch.sizes[0])
    feature = MultiModalFeature("image", "h0", span)
    runner.encoder_outputs["h0"] = merged[: batch.sizes[0]]
    req = Request("r", list(range(40, 70)), SamplingParams(), frozenset(), 4,
                  mm_features=[feature])
    ids = torch.tensor(req.all_token_ids[:20])
    chunk = ScheduledChunk(req, 0, 20)  # the span is cut by the chunk's end
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds, residuals = runner._splice_embeddings(ids, [chunk])
    assert rec.seen == [] and residuals is None
    torch.testing.assert_close(embeds[3:20], merged[:17])


def test_deepstack_tower_splice_and_decoder_have_no_host_sync(tmp_path):
    """Qwen3-VL: learned positions resampled per grid, DeepStack mergers, the residuals sliced
    by the splice and added inside the decoder, all without reading the device."""
    from engine.request import MultiModalFeature, PlaceholderRange, Request
    from engine.sampling_params import SamplingParams
    from engine.scheduler import ScheduledChunk
    from models.encoders.qwen_vl import build_vision_batch
    from testing.qwen3_vl import build_qwen3_vl_model

    runner = LLM(build_qwen3_vl_model(tmp_path / "m"), max_model_len=256).engine.runner
    model = runner.model
    grids = [(1, 4, 6), (2, 4, 4)]
    pixels = [torch.randn(t * h * w, 3 * 2 * 16 * 16) for t, h, w in grids]
    batch = build_vision_batch(pixels, grids, model.visual.cfg, torch.device("cpu"),
                               torch.float32)
    with torch.inference_mode(), SyncRecorder() as rec:
        merged = model.visual(batch)  # [1 + K, N, H]
    assert rec.seen == [] and merged.shape[:2] == (3, sum(batch.sizes))

    span = PlaceholderRange(2, batch.sizes[0])
    runner.encoder_outputs["h0"] = merged[:, : batch.sizes[0]]
    req = Request("r", list(range(40, 60)), SamplingParams(), frozenset(), 4,
                  mm_features=[MultiModalFeature("image", "h0", span)])
    ids = torch.tensor(req.all_token_ids[:5])
    meta = build_metadata([0], [5], [[0]], 16, torch.device("cpu"))
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds, residuals = runner._splice_embeddings(ids, [ScheduledChunk(req, 0, 5)])
        model(ids, torch.arange(5).expand(3, 5), meta, embeds, residuals)
    assert rec.seen == []
    assert residuals[0].tolist() == [2, 3, 4] and residuals[1].shape == (2, 3, 64)


def test_recorder_catches_a_sync():
    with SyncRecorder() as rec:
        t = torch.ones(3)
        t[t > 0].sum().item()
    assert "boolean index" in rec.seen and "_local_scalar_dense" in rec.seen


def _model_files() -> list[str]:
    """Every project file a registered model's forward can reach: the modules of its classes
    and, transitively, the `models.*` modules they import (a new family cannot escape)."""
    from models.registry import registered

    pending = {
        cls.__module__ for spec in registered().values() for cls in spec.model.__mro__
        if cls.__module__.startswith("models.")
    }
    seen: set[str] = set()
    while pending:
        module = pending.pop()
        seen.add(module)
        pending |= set(_imported_models_modules(_module_path(module).read_text())) - seen
    return sorted(str(_module_path(m).relative_to(ROOT)) for m in seen if not _host_only(m))


def _host_only(module: str) -> bool:
    """Preprocessing, which runs in worker threads on the host before any forward (a model may
    import its arithmetic, e.g. LLaVA-NeXT's unpadding bounds)."""
    return module.startswith("models.processing.") or module.rsplit(".", 1)[-1] in (
        "preprocess", "processor")


def _module_path(module: str) -> Path:
    base = ROOT / module.replace(".", "/")
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"


def _imported_models_modules(source: str) -> list[str]:
    """`models.*` modules a source imports at its top level: `from models.x.y import a` gives
    models.x.y, and `from models.x import y` gives models.x.y where y is a module."""
    found = []
    for node in ast.parse(source).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("models."):
            found.append(node.module)
            folder = ROOT / node.module.replace(".", "/")
            found += [f"{node.module}.{a.name}" for a in node.names
                      if (folder / f"{a.name}.py").exists()]
    return found


FORWARD_FILES = _model_files()
HOST_READS = re.compile(r"\.(tolist|item|cpu|numpy)\(\)|torch\.nonzero|\bint\(\w+\[")


def test_the_file_list_covers_every_family():
    for path in ("models/layers/attention.py", "models/layers/norm.py",
                 "models/layers/decoder.py", "models/qwen_vl/model.py",
                 "models/encoders/qwen_vl.py", "models/qwen2_audio/model.py",
                 "models/encoders/whisper.py"):
        assert path in FORWARD_FILES


@pytest.mark.parametrize("path", FORWARD_FILES)
def test_forward_sources_never_read_tensors_back(path):
    source = (ROOT / path).read_text()
    if path == "models/layers/attention.py":  # build_metadata runs on the host
        source = source[source.index("def paged_attention") :]
    if path == "models/layers/moe.py":  # reads counts of CPU tensors only (tested below)
        source = _without_function(source, "_grouped_on_host")
    if path == "models/layers/decoder.py":  # checkpoint names parsed while loading
        source = _without_function(source, "weight_map")
    if path == "models/kernels/ggml_blocks.py":  # gguf-py's fallback: blocks live on the host
        source = _without_function(source, "_gguf_dequantize")
    assert not HOST_READS.search(source), HOST_READS.search(source)


def _without_function(source: str, name: str) -> str:
    tree = ast.parse(source)
    (fn,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    lines = source.splitlines()
    return "\n".join(lines[: fn.lineno - 1] + lines[fn.end_lineno:])


def test_experts_read_counts_on_the_host_only_for_cpu_tensors():
    """The MoE block groups tokens by expert from counts read on the host only when its input
    is a CPU tensor; the formulation other devices run reads nothing back and gives the same
    result."""
    from models.layers.moe import MoEShape, SparseMoE

    source = (ROOT / "models/layers/moe.py").read_text()
    assert 'if x.device.type != "cpu":\n            return self._every_expert(' in source
    torch.manual_seed(0)
    block = SparseMoE(32, MoEShape(6, 2, 16, True, shared_expert_size=8), "silu").eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(9, 32)
    with torch.inference_mode():
        weights, experts = block.gate(x)
        grouped = block.routed(x, weights, experts)
        with SyncRecorder() as rec:
            every = block._every_expert(x, weights, experts)
    assert rec.seen == []
    torch.testing.assert_close(every, grouped, atol=1e-6, rtol=1e-6)


def test_audio_encoder_has_no_host_sync(qwen2_audio_path):
    from models.encoders.whisper import build_audio_batch, encoder_lengths, receptive_frames

    model = LLM(qwen2_audio_path, max_model_len=256).engine.runner.model
    frames = [3000, 201, 57]  # a full window and two shorter clips
    features = [torch.randn(128, receptive_frames(n, 3000)) for n in frames]
    batch = build_audio_batch(features, frames, torch.device("cpu"), torch.float32)  # host side
    with torch.inference_mode(), SyncRecorder() as rec:
        embeds = model.multi_modal_projector.linear(model.audio_tower(batch))
    assert rec.seen == []
    assert embeds.shape[0] == sum(encoder_lengths(n)[1] for n in frames)
    source = (ROOT / "models/encoders/whisper.py").read_text()
    assert not HOST_READS.search(source), HOST_READS.search(source)
