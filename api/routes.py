"""The /v1 routes: thin handlers over the typed request bodies (protocol: the published
schema), the engines and response building (responses, streams).

Before FastAPI parses a body, every POST is checked for `Content-Type: application/json` (415)
and read within the size limit (413); a body that does not fit its schema is a 400 naming the
first field's path.

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
from dataclasses import replace

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.types import Receive

from api import responses
from api.bodies import read_body
from api.errors import APIError, from_exception, internal_error, validation_error
from api.guards import host_checker, key_checker, require_json
from api.messages import refuse_unaccepted_media
from api.protocol import ChatCompletionRequest, CompletionRequest
from api.responses import ResponseContext
from api.schema import DOCUMENTED, ChatCompletion, Completion, ModelList
from api.streams import ChatStream, CompletionStream
from api.tool_calls import ToolPlan
from api.transcriptions import add_audio_routes
from engine import AsyncLLM, RequestOutput
from engine.fim import fim_prompt

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
    router = APIRouter(prefix="/v1", route_class=_route_class(max_body_bytes),
                       dependencies=guards)

    @router.get("/models", response_model=ModelList, responses=DOCUMENTED)
    async def list_models() -> Response:
        return JSONResponse(responses.model_list(gate.engines, created))

    @router.post("/chat/completions", response_model=ChatCompletion, responses=DOCUMENTED)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """A chat reply; with `stream`, server-sent `chat.completion.chunk` events."""
        llm = gate.engine(body.model)
        accepted = getattr(llm.processor, "modalities", None)  # None: the engine checks
        if accepted is not None:
            refuse_unaccepted_media(body.messages, tuple(accepted), body.model)
        tools = ToolPlan.of(body, llm.processor.tool_parser, llm.tokenizer)
        params = body.sampling_params(llm.engine.setup.sampling_defaults, tools.constraint)
        if tools.parser is not None and params.skip_special_tokens:
            # a call's marker may be a special token ([TOOL_CALLS]): the parser must see it
            params = replace(params, skip_special_tokens=False)
        ctx = _context("chatcmpl", body, llm, tools=tools)
        outputs = llm.chat(body.engine_messages(), params, ctx.id, **body.template_kwargs())
        first, rest = await gate.start(request, body.model, outputs, ctx.id)
        if body.stream:
            return _event_stream(first, rest, ChatStream(ctx))
        return JSONResponse(responses.chat_completion(ctx, await _last(first, rest)))

    @router.post("/completions", response_model=Completion, responses=DOCUMENTED)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """A text completion; with `stream`, server-sent `text_completion` events."""
        llm = gate.engine(body.model)
        params = body.sampling_params(llm.engine.setup.sampling_defaults)
        prompt = body.engine_prompt()
        echo = None
        if body.echo:
            echo = prompt if isinstance(prompt, str) else llm.tokenizer.decode(prompt)
        if body.suffix:
            prompt = {"prompt": fim_prompt(llm.tokenizer, prompt, body.suffix),
                      "add_special_tokens": False}
        ctx = _context("cmpl", body, llm, echo=echo)
        outputs = llm.generate(prompt, params, ctx.id)
        first, rest = await gate.start(request, body.model, outputs, ctx.id)
        if body.stream:
            return _event_stream(first, rest, CompletionStream(ctx))
        return JSONResponse(responses.text_completion(ctx, await _last(first, rest)))

    add_audio_routes(router, gate.engine, max_body_bytes)  # speech to text (multipart forms)
    return router


def _route_class(max_body_bytes: int) -> type[APIRoute]:
    class Route(_OpenAIRoute):
        limit = max_body_bytes

    return Route


class _OpenAIRoute(APIRoute):
    """Checks a POST body's type and size before FastAPI reads it, and renders every failure
    of a route (its dependencies and body validation included) in the OpenAI shape."""

    limit: int = DEFAULT_MAX_BODY_BYTES

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            try:
                if request.method == "POST":
                    await require_json(request)
                    # FastAPI reads the body it parses from here (Starlette caches it).
                    request._body = await read_body(request, self.limit)
                return await handler(request)
            except RequestValidationError as e:
                return validation_error(e.errors()).response()
            except HTTPException as e:  # FastAPI could not parse the body (not UTF-8 ...)
                return APIError(e.status_code, f"the request body is not valid JSON: "
                                f"{e.detail}").response()
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
    prefix: str, body: ChatCompletionRequest | CompletionRequest, llm: AsyncLLM, **extra
) -> ResponseContext:
    return ResponseContext(
        id=f"{prefix}-{uuid.uuid4().hex}",
        model=body.model,
        tokenizer=llm.tokenizer,
        num_logprobs=body.num_logprobs,
        include_usage=body.include_usage,
        return_token_ids=body.return_token_ids,
        **extra,
    )
