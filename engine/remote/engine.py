"""RemoteEngine: a model served by an OpenAI-compatible server (vLLM, SGLang, mmserve), behind
the same `ChatEngine` interface as the in-process engine. Torch-free.

Each request is one streamed POST /chat/completions, read by a task of its own that feeds the
caller's stream (as the engine thread feeds AsyncLLM's). `abort` cancels that task, which
closes the connection: vLLM, SGLang and mmserve abort a request whose client disconnected.
Each request opens its own connection, so engines work from any event loop (Gradio's, a
notebook's). The server's models are listed once, at `connect`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.interface import EngineDeadError, EngineInfo
from engine.outputs import RequestOutput
from engine.remote.config import RemoteConfig
from engine.remote.errors import BackendError, event_error, status_error, transport_error
from engine.remote.media_tokens import fetch_pad_ids, find_media_runs, runs_note
from engine.remote.models import ModelCard, list_models
from engine.remote.stream import StreamState, sse_data
from engine.remote.wire import WireRequest, request_body
from engine.sampling_params import SamplingParams


def connect(config: RemoteConfig, models: Sequence[str] | None = None) -> dict[str, RemoteEngine]:
    """A RemoteEngine for each model the server serves (or for each of `models`, in that
    order; ValueError naming the ones it does not serve)."""
    cards = {card.id: card for card in list_models(config)}
    if not cards:
        raise BackendError(f"the server at {config.base_url} serves no model")
    wanted = list(models) if models else list(cards)
    missing = [name for name in wanted if name not in cards]
    if missing:
        raise ValueError(f"the server at {config.base_url} does not serve "
                         f"{', '.join(map(repr, missing))}; it serves: {', '.join(cards)}")
    return {name: RemoteEngine(config, cards[name]) for name in wanted}


@dataclass
class _Flight:
    """One request in flight: the task reading its stream, and the queue it fills."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None
    aborted: bool = False
    settled: bool = False  # counted as finished or failed


class RemoteEngine:
    """One model of a remote server as a ChatEngine.

    >>> llm = RemoteEngine.connect("http://gpu-box:8000/v1")  # its first model
    >>> async for out in llm.chat(messages, SamplingParams(max_tokens=64)): ...
    """

    def __init__(self, config: RemoteConfig, card: ModelCard) -> None:
        self.config = config
        self.card = card
        self._flights: dict[str, _Flight] = {}
        self._counts = {"running": 0, "finished": 0, "failed": 0}
        self._closed = False
        # Media pad-token ids of the model (id -> modality), or why they are unknown.
        self._pad_ids: dict[int, str] | None = None
        self._pad_error: str | None = None

    @classmethod
    def connect(cls, base_url: str, *, model: str | None = None, **options: Any) -> RemoteEngine:
        """The engine for `model` (default: the server's first) at `base_url`; `options` are
        RemoteConfig's (api_key, timeout_s, ...)."""
        config = RemoteConfig(base_url, **options)
        engines = connect(config, [model] if model else None)
        return next(iter(engines.values()))

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.card.id,
            modalities=self.card.modalities,
            max_model_len=self.card.max_model_len,
            media_limits=self.config.media_limits,
            max_num_seqs=self.card.max_num_seqs or self.config.max_num_seqs,
            backend=self.config.base_url,
        )

    @property
    def tokenizer(self) -> None:
        """No tokenizer here: the panels show token counts, not token texts."""
        return None

    # ---- requests ----------------------------------------------------------------------------

    async def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the server's reply as RequestOutputs (see ChatEngine.chat)."""
        if self._closed:
            raise EngineDeadError("the remote engine was shut down")
        arrival = time.monotonic()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._flights:
            raise ValueError(f"request id {request_id!r} is already in use")
        flight = self._flights[request_id] = _Flight(asyncio.get_running_loop())
        self._counts["running"] += 1
        try:
            wire = await asyncio.to_thread(
                request_body, self.card.id, messages, sampling_params or SamplingParams(),
                self.config,
            )
            state = StreamState(request_id, arrival, time.monotonic() - arrival, wire.media,
                                from_mmserve=self.card.from_mmserve)
            if flight.aborted:  # stopped while its media was being encoded
                self._settle(flight, "finished")
                yield state.output(finished=True, finish_reason="abort", now=time.monotonic())
                return
            flight.task = asyncio.create_task(self._run(wire, state, flight))
            while not flight.settled:
                item = await flight.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:  # counted before the caller sees it, as the engine's stats
                    self._settle(flight, "finished")
                yield item
        finally:
            self._flights.pop(request_id, None)
            self._settle(flight, "failed")
            if flight.task is not None and not flight.task.done():
                flight.task.cancel()  # the caller left: closing the stream aborts the request
                with contextlib.suppress(asyncio.CancelledError):
                    await flight.task

    def _settle(self, flight: _Flight, outcome: str) -> None:
        if not flight.settled:
            flight.settled = True
            self._counts["running"] -= 1
            self._counts[outcome] += 1

    async def abort(self, request_id: str) -> None:
        """Close the request's stream (the server aborts it); its stream then ends with
        finish_reason "abort"."""
        flight = self._flights.get(request_id)
        if flight is None:
            return
        flight.aborted = True
        task = flight.task
        if task is None or task.done():
            return
        if flight.loop is asyncio.get_running_loop():
            task.cancel()
            await asyncio.wait([task])
        else:
            flight.loop.call_soon_threadsafe(task.cancel)

    def stats(self) -> dict[str, Any]:
        """This app's requests to the server (what the OpenAI API lets a client see)."""
        return {
            "backend": self.config.base_url,
            "model": self.card.id,
            "requests_running": self._counts["running"],
            "requests_finished": self._counts["finished"],
            "requests_failed": self._counts["failed"],
        }

    def shutdown(self) -> None:
        """Refuse new requests and close the streams of those in flight."""
        self._closed = True
        for flight in list(self._flights.values()):
            if flight.task is not None and not flight.loop.is_closed():
                flight.loop.call_soon_threadsafe(flight.task.cancel)

    # ---- one stream --------------------------------------------------------------------------

    async def _run(self, wire: WireRequest, state: StreamState, flight: _Flight) -> None:
        """Read the stream into `flight.queue`: outputs, then the final one, or an exception."""
        queue = flight.queue
        try:
            async for changed in self._chunks(wire, state):
                if changed:
                    queue.put_nowait(state.output())
            if state.finish_reason is None:
                raise BackendError(f"the server at {self.config.base_url} ended the stream "
                                   "before the reply finished")
            await self._locate_media(state)
            queue.put_nowait(state.output(finished=True, now=time.monotonic()))
        except asyncio.CancelledError:
            queue.put_nowait(state.output(finished=True, finish_reason="abort",
                                          now=time.monotonic()))
            raise
        except httpx.HTTPError as e:
            queue.put_nowait(transport_error(e, self.config.base_url, self.config.timeout_s))
        except Exception as e:  # noqa: BLE001 - the caller's stream raises it
            queue.put_nowait(e)

    async def _chunks(self, wire: WireRequest, state: StreamState) -> AsyncIterator[bool]:
        """POST the request and take each chunk into `state`; yields whether it carried
        output. Raises for an error status or an error event."""
        url = f"{self.config.base_url}/chat/completions"
        headers = {**self.config.headers(), "Content-Type": "application/json"}
        async with httpx.AsyncClient(timeout=self.config.http_timeout()) as http, http.stream(
            "POST", url, content=wire.body, headers=headers
        ) as response:
            if response.status_code != 200:
                raise status_error(response.status_code, await response.aread(),
                                   self.config.base_url)
            kind = response.headers.get("content-type", "")
            if not kind.startswith("text/event-stream"):
                raise BackendError(f"the server at {self.config.base_url} answered with "
                                   f"{kind or 'no content type'}, not an event stream")
            async for data in sse_data(response.aiter_lines()):
                if data.strip() == "[DONE]":
                    return
                chunk = _json(data, self.config.base_url)
                message = event_error(chunk)
                if message is not None:
                    raise BackendError(f"the server failed while generating: {message}")
                had_ids = state.prompt_token_ids is not None
                changed = state.add(chunk, time.monotonic())
                if not had_ids and state.prompt_token_ids is not None:
                    await self._locate_media(state)
                yield changed

    async def _locate_media(self, state: StreamState) -> None:
        """Placeholders from the prompt's token ids, for servers that send ids but not spans."""
        if (not state.media or state.prompt_token_ids is None or state.placeholders is not None
                or state.report is not None or self.card.from_mmserve):
            return
        if self._pad_ids is None and self._pad_error is None:  # asked once per model
            try:
                self._pad_ids = await fetch_pad_ids(self.config, self.card.id)
            except BackendError as e:
                self._pad_error = str(e)
        if self._pad_ids is None:
            state.placeholders_note = self._pad_error
            return
        state.placeholders = find_media_runs(state.prompt_token_ids, self._pad_ids)
        state.placeholders_note = runs_note(state.placeholders, state.media)


def _json(data: str, url: str) -> dict:
    try:
        chunk = json.loads(data)
    except ValueError as e:
        raise BackendError(f"the server at {url} sent an event that is not JSON") from e
    if not isinstance(chunk, dict):
        raise BackendError(f"the server at {url} sent an event that is not a JSON object")
    return chunk
