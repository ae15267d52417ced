"""Helpers for the UI tests: the demo lineup as small engines, the app served on a free
127.0.0.1 port in a thread, and a wait for an engine to go idle."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI

from engine import AsyncLLM
from ui.demo import ensure_demo_models, ensure_samples

VL, AUDIO = "demo-qwen2-vl", "demo-qwen2-audio"
NO_AUDIO = "no audio demo model: models.tiny has no build_qwen2_audio_model yet"
# Small KV caches and batches: the tests need a few sequences, not the defaults' memory.
ENGINE_OPTIONS = dict(kv_cache_bytes=16 << 20, max_num_seqs=8)


def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One demo directory per test session (checkpoints and samples are built once)."""
    return tmp_path_factory.getbasetemp() / "ui-demo"


@contextmanager
def demo_engines(root: Path) -> Iterator[dict[str, AsyncLLM]]:
    """The demo lineup as engines (shut down on exit), with the sample media generated."""
    ensure_samples(root)
    engines = {name: AsyncLLM(path, **ENGINE_OPTIONS)
               for name, path in ensure_demo_models(root).items()}
    try:
        yield engines
    finally:
        for llm in engines.values():
            llm.shutdown()


@contextmanager
def running_app(app: FastAPI) -> Iterator[str]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a thread (lifespan on: Gradio's
    queue starts with it); yields the base URL and stops the server on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the app did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_idle(llm: AsyncLLM, timeout: float = 10.0) -> dict:
    """The engine's stats once nothing runs, waits or holds a KV block."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if not (stats["requests_running"] or stats["requests_waiting"] or stats["kv_blocks_used"]):
            return stats
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        time.sleep(0.02)
