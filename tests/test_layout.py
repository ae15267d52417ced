"""The house rules of the layout (docs/architecture.md), checked on the sources: the arrows between
the top-level parts point one way, no module imports itself back through others (imports inside
functions count: a lazy import hides a cycle, it does not remove it), and every module says what
it is for in a docstring."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "models", "ui", "api", "launch", "testing", "bench")


def _modules() -> dict[str, Path]:
    found = {"app": ROOT / "app.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


MODULES = _modules()


def _imports(path: Path) -> set[str]:
    """Project modules a file imports anywhere in it: `import a.b`; `from a.b import c` gives
    a.b.c where c is a module, else a.b (a package's own __init__ running first is Python's
    doing, not an arrow of the importer's)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= submodules
            if len(submodules) < len(node.names):  # names defined in the module itself
                out.add(node.module)
    return {m for m in out if m in MODULES}


GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert _cycles(GRAPH) == []


def test_the_import_scan_sees_lazy_and_from_imports():
    assert "models.kernels.native" in GRAPH["models.layers.norm"]  # from a package import a module
    assert "models.registry" in GRAPH["engine.checkpoint_setup"]
    assert "testing.tiny" in GRAPH["bench.common"]  # imported inside a function


@pytest.mark.parametrize(
    ("part", "never"),
    [
        ("models", ("engine", "ui", "api", "launch", "app", "bench")),
        ("engine", ("ui", "api", "launch", "app", "bench")),
        ("ui", ("api", "launch", "app", "bench")),
        ("api", ("ui", "launch", "app", "bench")),
        ("launch", ("app", "bench")),
    ],
)
def test_arrows_point_one_way(part, never):
    wrong = sorted(
        f"{m} -> {d}" for m, deps in GRAPH.items() if m.split(".")[0] == part
        for d in deps if d.split(".")[0] in never
    )
    assert wrong == []


def test_the_configuration_imports_no_engine_machinery():
    """engine/config.py sits below the parts that read it: it imports no engine sub-package
    (the `speculative` option it checks is parsed in engine/speculative_option.py)."""
    assert sorted(d for d in GRAPH["engine.config"] if d.startswith("engine.")
                  and d.count(".") > 1) == []


def test_every_family_folder_holds_its_model():
    """One folder per family under models/, each with its model; a processor where the family
    takes media. The registry builds nothing from elsewhere but the shared decoder."""
    from models.registry import registered

    assert FAMILIES, "no family folders"
    for family in FAMILIES:
        assert (ROOT / "models" / family / "model.py").exists(), family
    for spec in registered().values():
        home = spec.model.__module__
        assert home == "models.layers.decoder" or home.split(".")[1] in FAMILIES, home
        if spec.processor is not None:
            assert spec.processor.__module__.split(".")[1] in FAMILIES


ROLES = {"kernels", "layers", "encoders", "processing", "gguf"}
FAMILIES = {p.name for p in (ROOT / "models").iterdir()
            if p.is_dir() and (p / "__init__.py").exists()} - ROLES


def test_families_never_import_each_other():
    wrong = sorted(
        f"{m} -> {d}" for m, deps in GRAPH.items() if m.split(".")[:2][-1] in FAMILIES
        for d in deps if d.startswith("models.") and d.split(".")[1] in FAMILIES
        and d.split(".")[1] != m.split(".")[1]
    )
    assert wrong == []


def test_shared_folders_never_import_a_family():
    shared = [m for m in GRAPH if m.split(".")[:2][-1] in ROLES]
    wrong = sorted(f"{m} -> {d}" for m in shared for d in GRAPH[m]
                   if d.startswith("models.") and d.split(".")[1] in FAMILIES)
    assert wrong == []


@pytest.mark.parametrize("name", ["native", "native_build", "native_interface", "linear", "choice",
                                  "quantization"])
def test_the_core_kernel_modules_know_no_layer(name):
    assert not {d for d in GRAPH[f"models.kernels.{name}"] if d.startswith("models.layers")}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_states_its_job(name):
    tree = ast.parse(MODULES[name].read_text())
    if MODULES[name].name == "__init__.py" and not tree.body:
        return  # an empty package marker
    assert ast.get_docstring(tree), f"{MODULES[name].relative_to(ROOT)} has no module docstring"
