"""requirements.txt (what a Hugging Face Space installs) stays in step with pyproject.toml: the
front end's dependencies plus the in-process engine's (the `engine` extra)."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
# The Space's Gradio comes from the README's sdk_version and brings these with it.
FROM_GRADIO = {"gradio", "fastapi", "uvicorn", "pydantic"}


def _name(requirement: str) -> str:
    for i, ch in enumerate(requirement):
        if ch in "<>=!~[; ":
            return requirement[:i].lower().replace("_", "-")
    return requirement.lower().replace("_", "-")


def test_space_requirements_match_the_runtime_dependencies():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = [*project["dependencies"], *project["optional-dependencies"]["engine"]]
    wanted = {_name(r): r for r in runtime if _name(r) not in FROM_GRADIO}
    lines = (ROOT / "requirements.txt").read_text().splitlines()
    listed = {_name(line): line for line in lines if line.strip() and not line.startswith("#")}
    assert listed == wanted


def test_the_native_kernel_sources_ship_with_the_package():
    """models/kernels/native_build.py compiles the C sources under models/kernels/cpu/ at run
    time: a wheel must carry every one of them (the package-data globs match each source it
    builds)."""
    from models.kernels import native_build

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package = ROOT / "models" / "kernels"
    shipped = {p for glob in config["package-data"]["models.kernels"] for p in package.glob(glob)}
    needed = {*native_build.SOURCES, native_build.HEADER}
    assert all(p.exists() for p in needed)
    assert needed <= shipped
