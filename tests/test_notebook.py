"""The example notebook, run top to bottom in a fresh kernel as a user's "Run All" would: with
no MMSERVE_BACKEND its remote cell starts mmserve's own API server for the demo model and
drives it (one with an unreachable server says it skipped), and every cell after it runs."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests.ui_fixtures import demo_root

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"


def run_notebook(monkeypatch, tmp_path_factory, backend: str | None):
    monkeypatch.setenv("MMSERVE_DEMO_DIR", str(demo_root(tmp_path_factory)))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    monkeypatch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
    if backend is None:
        monkeypatch.delenv("MMSERVE_BACKEND", raising=False)
    else:
        monkeypatch.setenv("MMSERVE_BACKEND", backend)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(ROOT)}}).execute()
    return notebook


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.append(str(out.get("data", {}).get("text/html", "")))
    return "".join(parts)


@pytest.mark.timeout(600)
def test_the_notebook_runs_top_to_bottom(monkeypatch, tmp_path_factory):
    notebook = run_notebook(monkeypatch, tmp_path_factory, None)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code)  # every cell ran
    remote = next(c for c in code if "RemoteEngine.connect" in c.source)
    assert "Skipped" not in outputs_text(remote)
    assert "Engine (remote)" in outputs_text(remote)  # the remote engine's panels
    view = next(c for c in code if c.source.startswith("view = show_result"))
    assert "mm-placeholders" in outputs_text(view)  # the in-process engine's panels

