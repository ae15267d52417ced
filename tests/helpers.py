"""Test helpers shared by several modules: serving an app in a thread, waiting for an engine
to go idle or pacing its steps, checking that a request released everything, counting encoder
forwards, processing a chat the way the engine does."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import uvicorn


@contextmanager
def serve_in_thread(app, *, lifespan: str = "auto", startup_timeout: float = 30) -> Iterator[str]:
    """Yields the base URL while `app` is served; stops the server on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                            timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def engine_idle(stats: dict) -> bool:
    """Nothing running or waiting, and no KV block held."""
    return not (stats["requests_running"] or stats["requests_waiting"] or stats["kv_blocks_used"])


def wait_idle(llm, timeout: float = 10.0) -> dict:
    """The engine's stats once it is idle (blocking)."""
    deadline = time.monotonic() + timeout
    while not engine_idle(stats := llm.stats()):
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        time.sleep(0.02)
    return stats


async def wait_idle_async(llm, timeout: float = 10.0) -> dict:
    """The engine's stats once it is idle (awaiting)."""
    deadline = time.monotonic() + timeout
    while not engine_idle(stats := llm.stats()):
        assert time.monotonic() < deadline, f"the engine did not become idle: {stats}"
        await asyncio.sleep(0.02)
    return stats


def pace_steps(monkeypatch, llm, seconds: float) -> None:
    """Make each of `llm`'s engine steps take `seconds` longer (for this test), so the tiny
    model, which decodes about 100 tokens/s, streams at the pace of a real one."""
    engine = llm.engine
    step = engine.step

    def paced_step():
        time.sleep(seconds)
        return step()

    monkeypatch.setattr(engine, "step", paced_step)


def assert_released(llm) -> None:
    """The engine's bookkeeping is consistent and no KV block or encoder output is referenced."""
    llm.engine.check_integrity()
    stats = llm.stats()
    assert stats["kv_blocks_used"] == 0 and stats["encoder_cache_referenced"] == 0


def assert_top_logprobs(logprobs: list[dict[int, float]], ref, k: int) -> None:
    """Each step's top-k {token: logprob} equals the top k of `ref[step]` (a [steps, vocab]
    tensor of log-probabilities): the same tokens in order, values within 1e-4."""
    for step, entry in enumerate(logprobs):
        top = ref[step].topk(k)
        assert list(entry) == top.indices.tolist(), f"step {step}"
        torch.testing.assert_close(torch.tensor(list(entry.values())), top.values,
                                   atol=1e-4, rtol=0)


def count_calls(module) -> list[int]:
    """A one-element list that counts `module`'s forwards from now on."""
    calls = [0]

    def hook(*_):
        calls[0] += 1

    module.register_forward_hook(hook)
    return calls


def process_chat(llm, messages):
    """The engine's processed prompt for `messages`, and the decoded media behind it (the
    references need their sampling rates and samples)."""
    p = llm.engine.processor
    parsed = p.render_chat(messages)
    media = p.load_media_sync(parsed)
    return p.process(parsed, media), media
