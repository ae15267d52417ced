"""The /v1 routes: thin handlers over request parsing (protocol), the engines and response
building (responses).

A generation request is admitted only while its model's queue has room (else 503). It is tied
to its HTTP connection: when the client disconnects, a watcher aborts the engine request at
once, which frees its KV blocks and cache references (streaming or not, even mid-prefill).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.types import Receive

from api import responses
from api.errors import APIError, from_exception, internal_error
from api.guards import host_checker, key_checker, require_json
from api.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from api.responses import ChatStream, CompletionStream, ResponseContext
from engine import AsyncLLM, RequestOutput

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_MAX_WAITING = 256

Outputs = AsyncGenerator[RequestOutput, None]


def build_router(
    engines: Mapping[str, AsyncLLM],
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting: int = DEFAULT_MAX_WAITING,
    allowed_hosts: Sequence[str] | None = None,
) -> APIRouter:
    """The OpenAI-compatible API under /v1, serving `engines` by model name.

    Request bodies must be sent as `Content-Type: application/json` (else 415; see api.guards
    for why this matters to a server on 127.0.0.1).
    api_key: when set, every route requires `Authorization: Bearer <api_key>` (else 401).
    allowed_hosts: when set, requests whose Host header names another host are refused (400),
        which defeats DNS rebinding; app.py sets the loopback names when it binds 127.0.0.1.
    max_body_bytes: larger request bodies are refused with 413.
    max_waiting: a model whose queue holds this many requests refuses new ones with 503; the
        queue is the engine's waiting requests, or, when larger, this router's requests that
        have not produced their first token yet (which also covers a burst between two steps).
    """
    if not engines:
        raise ValueError("build_router needs at least one engine")
    gate = _Gate(dict(engines), max_waiting)
    created = int(time.time())
    guards = [Depends(key_checker(api_key))] if api_key is not None else []
    if allowed_hosts is not None:
        guards.append(Depends(host_checker(allowed_hosts)))
    router = APIRouter(prefix="/v1", route_class=_OpenAIRoute, dependencies=guards)
    json_body = [Depends(require_json)]

    @router.get("/models")
    async def list_models() -> Response:
        return JSONResponse(responses.model_list(gate.engines, created))

    @router.post("/chat/completions", dependencies=json_body)
    async def chat_completions(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await _read_body(request, max_body_bytes))
        llm = gate.engine(body.model)
        params = body.sampling_params(llm.engine.setup.sampling_defaults)
        ctx = _context("chatcmpl", body, llm)
        outputs = llm.chat(body.engine_messages(), params, ctx.id, **body.template_kwargs())
        first, rest = await gate.start(request, body.model, outputs, ctx.id)
        if body.stream:
            return _event_stream(first, rest, ChatStream(ctx))
        return JSONResponse(responses.chat_completion(ctx, await _last(first, rest)))

    @router.post("/completions", dependencies=json_body)
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await _read_body(request, max_body_bytes))
        llm = gate.engine(body.model)
        params = body.sampling_params(llm.engine.setup.sampling_defaults)
        ctx = _context("cmpl", body, llm)
        outputs = llm.generate(body.engine_prompt(), params, ctx.id)
        first, rest = await gate.start(request, body.model, outputs, ctx.id)
        if body.stream:
            return _event_stream(first, rest, CompletionStream(ctx))
        return JSONResponse(responses.text_completion(ctx, await _last(first, rest)))

    return router


class _OpenAIRoute(APIRoute):
    """Renders every failure of a route (its dependencies included) in the OpenAI shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as e:  # noqa: BLE001 - every error becomes an OpenAI error body
                return from_exception(e).response()

        return handle


class _Gate:
    """Finds a model's engine, refuses work when its queue is full, and starts requests."""

    def __init__(self, engines: dict[str, AsyncLLM], max_waiting: int) -> None:
        self.engines = engines
        self.max_waiting = max_waiting
        self._pending: Counter[str] = Counter()  # admitted, no output yet

    def engine(self, model: str) -> AsyncLLM:
        if model not in self.engines:
            raise APIError(
                400, f"model {model!r} is not served here; loaded models: "
                f"{', '.join(self.engines)}", param="model", code="model_not_found",
            )
        return self.engines[model]

    async def start(
        self, request: Request, model: str, outputs: Outputs, request_id: str
    ) -> tuple[RequestOutput, Outputs]:
        """Await the first output (validation errors surface here); returns it and the rest."""
        llm = self.engines[model]
        waiting = max(llm.stats()["requests_waiting"], self._pending[model])
        if waiting >= self.max_waiting:
            raise APIError(
                503, f"the server is busy: {waiting} requests are waiting for model {model!r} "
                f"(max_waiting={self.max_waiting}); retry later",
                type="server_error", code="queue_full", headers={"Retry-After": "1"},
            )
        watched = _abort_on_disconnect(outputs, llm, request_id, request.receive)
        self._pending[model] += 1
        try:
            first = await anext(watched)
        finally:
            self._pending[model] -= 1
        return first, watched


async def _abort_on_disconnect(
    outputs: Outputs, llm: AsyncLLM, request_id: str, receive: Receive
) -> Outputs:
    """The engine's outputs, with the request aborted as soon as the client disconnects.

    Starlette cancels a StreamingResponse on disconnect, which closes the engine's iterator
    (and so aborts) too; the watcher also covers non-streaming requests and the wait for the
    first token, during which no response exists yet."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        # Shielded: the watcher is cancelled when the stream ends; the abort must complete.
        await asyncio.shield(llm.abort(request_id))

    watcher = asyncio.create_task(watch())
    try:
        async for out in outputs:
            if out.outputs[0].finish_reason == "error":
                log.error("request %s failed in the engine: %s", request_id, out.error)
                raise internal_error()
            yield out
    finally:
        watcher.cancel()
        await outputs.aclose()


def _event_stream(
    first: RequestOutput, rest: Outputs, stream: ChatStream | CompletionStream
) -> StreamingResponse:
    return StreamingResponse(
        _events(first, rest, stream),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(
    first: RequestOutput, rest: Outputs, stream: ChatStream | CompletionStream
) -> AsyncIterator[str]:
    """The SSE body: the chunks of every output, an error event if generation fails after
    the response started, then [DONE]."""
    try:
        for chunk in stream.chunks(first):
            yield responses.sse(chunk)
        async for out in rest:
            for chunk in stream.chunks(out):
                yield responses.sse(chunk)
    except Exception as e:  # noqa: BLE001 - the status is sent already; report in-band
        yield responses.sse(from_exception(e).body())
    finally:
        await rest.aclose()
    yield responses.SSE_DONE


async def _last(first: RequestOutput, rest: Outputs) -> RequestOutput:
    final = first
    async for out in rest:
        final = out
    return final


def _context(
    prefix: str, body: ChatCompletionRequest | CompletionRequest, llm: AsyncLLM
) -> ResponseContext:
    return ResponseContext(
        id=f"{prefix}-{uuid.uuid4().hex}",
        model=body.model,
        tokenizer=llm.tokenizer,
        num_logprobs=body.num_logprobs,
        include_usage=body.include_usage,
        return_token_ids=body.return_token_ids,
    )


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes: up front from Content-Length, and
    while reading for bodies that declare none (chunked) or understate it."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )
