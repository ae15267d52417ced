"""A model's start-up reports what it is doing (engine/load_progress.py): every stage that takes
time on a first start, in order, each from 0 to a total that counts its real steps (the
checkpoint's tensors, a GGUF's linears placed in their blocks); on a terminal one line rewritten
in place, elsewhere (CI) a log line as a stage starts and at each quarter."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from engine import LLM
from engine.checkpoint_setup import CheckpointSetup
from engine.config import EngineConfig
from engine.load_progress import LoadProgress, StartupProgress, TerminalProgress
from engine.model_loading import load_model
from models.loader import checkpoint_tensor_count

ENGINE_STAGES = [
    "reading weights",
    "placing the weights in huge pages",
    "loading the C kernels (built once per CPU)",
    "planning the linear kernels (timed once per CPU)",
    "choosing the decode attention kernel",
    "reserving the KV cache and state pools",
    "preparing the decode step",
]


def _runs(reports: list[LoadProgress]) -> dict[str, list[tuple[int, int]]]:
    """Each stage's (done, total) in order; fails if a stage's reports are not one run, or do
    not count from 0 to a fixed total one step at a time."""
    runs: dict[str, list[tuple[int, int]]] = {}
    last = None
    for r in reports:
        assert r.stage == last or r.stage not in runs, f"{r.stage!r} reported again later"
        runs.setdefault(r.stage, []).append((r.done, r.total))
        last = r.stage
    for stage, steps in runs.items():
        total = steps[0][1]
        assert steps == [(d, total) for d in range(total + 1)], (stage, steps)
    return runs


def test_an_engine_start_reports_its_stages_in_order(qwen2_path):
    reports: list[LoadProgress] = []
    llm = LLM(qwen2_path, device="cpu", load_progress=reports.append, kv_cache_bytes=4 << 20,
              max_model_len=128)
    assert llm.engine.max_model_len == 128
    runs = _runs(reports)
    assert list(runs) == ENGINE_STAGES
    tensors = checkpoint_tensor_count(qwen2_path)
    assert tensors > 10 and runs["reading weights"][-1] == (tensors, tensors)
    assert runs["reserving the KV cache and state pools"][-1] == (2, 2)


def test_a_gguf_start_reports_its_blocks_then_its_tensors(qwen2_path, tmp_path, monkeypatch):
    from testing.gguf import write_gguf

    path = write_gguf(qwen2_path, tmp_path / "m.gguf")
    monkeypatch.setattr("engine.model_loading.choose_linear_kernels", lambda model, dtype: {})
    setup = CheckpointSetup.load(path)
    reports: list[LoadProgress] = []
    load_model(path, setup.hf_config, setup.spec.model, EngineConfig(), torch.device("cpu"),
               torch.float32, 64, progress=StartupProgress([reports.append]))
    runs = _runs(reports)
    assert list(runs)[:2] == ["placing the file's blocks", "reading weights"]
    placed = runs["placing the file's blocks"][-1][0]
    read = runs["reading weights"][-1][0]
    assert placed > 0 and read > 0  # linears in their blocks, norms (and the rest) read


def test_a_stage_is_checked():
    with pytest.raises(ValueError, match="done=3 of total=2"):
        LoadProgress("reading weights", 3, 2)
    with pytest.raises(ValueError, match="total=0"):
        LoadProgress("reading weights", 0, 0)
    assert LoadProgress("x", 5, 20).line(width=4) == "x [#---] 5/20"


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stage(listener, name: str, total: int) -> None:
    progress = StartupProgress([listener])
    for done in range(total + 1):
        progress(name, done, total)


def test_the_terminal_line_is_rewritten_in_place_and_erased_when_done():
    screen = _Terminal()
    _stage(TerminalProgress(screen), "reading weights", 4)
    writes = screen.getvalue().split("\r")
    assert "\n" not in screen.getvalue()  # one line, never a new one
    shown = [w.removeprefix("\x1b[K") for w in writes if w]
    assert shown[:2] == ["loading: reading weights [--------------------] 0/4",
                         "loading: reading weights [#####---------------] 1/4"]
    assert shown[-1] == ""  # the stage done: its line erased


def test_without_a_terminal_a_log_line_per_quarter(caplog):
    stream = io.StringIO()  # not a terminal, as in CI
    with caplog.at_level(logging.INFO, logger="engine.load_progress"):
        _stage(TerminalProgress(stream), "reading weights", 10)
        _stage(TerminalProgress(stream), "planning", 1)
    assert stream.getvalue() == ""
    lines = [r.getMessage() for r in caplog.records]
    assert [line.rsplit(" ", 1)[1] for line in lines] == [
        "0/10", "3/10", "5/10", "8/10", "10/10", "0/1"]
    assert lines[0] == "loading: reading weights [--------------------] 0/10"
