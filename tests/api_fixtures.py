"""Helpers for the OpenAI API tests: a real uvicorn server on 127.0.0.1, in-process clients,
a stand-in engine that fails on demand, and a wait for an engine to go idle."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
from fastapi import FastAPI

from tests.helpers import serve_in_thread


def running_server(app: FastAPI):
    """Serve `app` on a free 127.0.0.1 port in a thread (no lifespan); yields the base URL."""
    return serve_in_thread(app, lifespan="off", startup_timeout=10)


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
        self.processor = SimpleNamespace(tool_parser=None)
        self.engine = SimpleNamespace(model_id="failing", max_model_len=64,
                                      setup=SimpleNamespace(sampling_defaults={}))

    def stats(self) -> dict:
        return {"requests_waiting": 0}

    async def chat(self, messages, params, request_id, **template_kwargs):
        raise self.error
        yield  # makes this an async generator, like AsyncLLM.chat

    generate = chat

    async def abort(self, request_id: str) -> None:
        pass

