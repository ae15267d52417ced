"""Start-up memory: what the host can give (MemAvailable, cgroup limits), and a context fitted to
the KV budget when no max_model_len is given (an explicit one that does not fit is refused)."""

from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams
from engine.host_memory import host_memory

GIB = 1 << 30
MEMINFO = """MemTotal:       16000000 kB
MemFree:         1200000 kB
MemAvailable:    9500000 kB
Buffers:          100000 kB
Cached:          8000000 kB
"""


def _host(tmp_path, meminfo: str | None = MEMINFO, cgroup: str = "0::/user.slice/app\n",
          files: dict[str, str] | None = None):
    proc, root = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    root.mkdir()
    if meminfo is not None:
        (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in (files or {}).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return host_memory(proc, root)


def test_available_memory_is_memavailable_not_free_pages(tmp_path):
    found = _host(tmp_path)
    assert found.available == 9500000 * 1024  # the page cache counts: the kernel gives it back
    assert "MemAvailable" in found.source


def test_a_cgroup_v2_limit_lowers_it(tmp_path):
    files = {"user.slice/app/memory.max": f"{4 * GIB}\n",
             "user.slice/app/memory.current": f"{GIB}\n"}
    found = _host(tmp_path, files=files)
    assert found.available == 3 * GIB and "cgroup v2" in found.source
    unlimited = {"user.slice/app/memory.max": "max\n", "user.slice/app/memory.current": "5\n"}
    assert _host(tmp_path / "b", files=unlimited).available == 9500000 * 1024


def test_a_cgroup_v1_limit_lowers_it(tmp_path):
    files = {"memory/docker/x/memory.limit_in_bytes": f"{2 * GIB}\n",
             "memory/docker/x/memory.usage_in_bytes": f"{GIB // 2}\n"}
    found = _host(tmp_path, cgroup="4:memory:/docker/x\n1:cpu,cpuacct:/docker/x\n", files=files)
    assert found.available == 3 * GIB // 2 and "cgroup v1" in found.source
    no_limit = {"memory/docker/x/memory.limit_in_bytes": "9223372036854771712\n"}
    assert _host(tmp_path / "b", cgroup="4:memory:/docker/x\n",
                 files=no_limit).available == 9500000 * 1024


def test_without_meminfo_free_pages_are_the_fallback(tmp_path):
    found = _host(tmp_path, meminfo=None)
    assert found.available > 0 and "free pages" in found.source


# The tiny qwen2 at float32: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 x 4 bytes a block.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


@pytest.fixture
def small_host(monkeypatch):
    """A host whose automatic KV budget (a quarter of what is available) is 6 blocks."""
    import engine.memory_plan as plan
    from engine.host_memory import HostMemory

    monkeypatch.setattr(plan, "host_memory", lambda: HostMemory(4 * (6 * BLOCK_BYTES + 100),
                                                                "test"))


def test_a_context_longer_than_the_budget_starts_at_what_fits(qwen2_path, small_host, caplog):
    with caplog.at_level(logging.WARNING, logger="engine.memory_plan"):
        llm = LLM(qwen2_path, dtype="float32")
    engine = llm.engine
    assert engine.max_model_len == 96 and engine.runner.layout.fitted_from == 1024
    assert "context 96 of the model's 1024 tokens" in caplog.text
    assert "context 96 of the model's 1024" in llm.stats()["context_fit"]
    with pytest.raises(ValueError, match="max_model_len is 96"):
        llm.generate([list(range(1, 101))])
    out = llm.generate([list(range(1, 41))], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


def test_an_explicit_max_model_len_that_does_not_fit_is_refused(qwen2_path, small_host):
    with pytest.raises(ValueError, match="fewer than max_model_len=1024; raise kv_cache_bytes"):
        LLM(qwen2_path, dtype="float32", max_model_len=1024)


def test_inspect_says_the_context_the_engine_will_start_at(qwen2_path, small_host):
    from engine import inspect

    report = inspect.inspect(qwen2_path, dtype="float32")
    assert report.fitted_context == 96 and report.max_model_len == 1024
    assert "holds 96 tokens of the model's 1024: the engine starts at 96" in inspect.render(report)
