"""Helpers for the OpenAI API tests: a real uvicorn server on 127.0.0.1, in-process clients,
a stand-in engine that fails on demand, and a wait for an engine to go idle."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import uvicorn
from fastapi import FastAPI

from engine import AsyncLLM


@contextmanager
def running_server(app: FastAPI) -> Iterator[str]:
    """Serve `app` with uvicorn on a free 127.0.0.1 port in a thread; yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def in_process_client(app: FastAPI, api_key: str = "unused") -> openai.AsyncOpenAI:
    """An AsyncOpenAI client that calls `app` directly (no socket; responses are buffered)."""
    transport = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), timeout=30)
    return openai.AsyncOpenAI(
        base_url="http://in-process/v1", api_key=api_key, max_retries=0, http_client=transport
    )


class FailingEngine:
    """Stands in for an AsyncLLM whose requests fail with `error` at their first iteration,
    for the error paths the text model cannot reach (media fetch and decode, internal bugs)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.tokenizer = None
        self.engine = SimpleNamespace(model_id="failing", max_model_len=64)

    def stats(self) -> dict:
        return {"requests_waiting": 0}

    async def chat(self, messages, params, request_id):
        raise self.error
        yield  # makes this an async generator, like AsyncLLM.chat

    generate = chat

    async def abort(self, request_id: str) -> None:
        pass


async def wait_idle(llm: AsyncLLM, timeout: float = 5.0) -> dict:
    """The engine's stats once nothing runs, waits or holds a KV block."""
    deadline = time.monotonic() + timeout
    while True:
        stats = llm.stats()
        if not (stats["requests_running"] or stats["requests_waiting"] or stats["kv_blocks_used"]):
            return stats
        assert time.monotonic() < deadline, f"engine did not become idle: {stats}"
        await asyncio.sleep(0.02)
