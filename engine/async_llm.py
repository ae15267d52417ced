"""AsyncLLM: the streaming front door. One background thread steps the engine; any number of
asyncio callers (in any event loops) share its batch.

A call to `generate` decodes its media concurrently in worker threads and processes the prompt in
a worker thread, then hands the Request to the engine thread through a command queue and awaits
its outputs on an asyncio.Queue fed with `call_soon_threadsafe`. The engine thread is the only
one that touches the scheduler; it never waits on media. A caller that stops iterating
(disconnect, cancellation) aborts its request, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from engine.cross_attention_weights import cross_attention_weights
from engine.interface import EngineDeadError, EngineInfo
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processing import ParsedPrompt, PromptType
from engine.request import Request
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
STATS_EVERY_S = 0.5  # while steps run, stats() is read whole this often (counters every step)


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()


class AsyncLLM:
    """`async for out in llm.generate(prompt, params): print(out.outputs[0].delta_text)`.

    A `ChatEngine` (engine.interface): the front ends drive it through `info`, `chat`,
    `abort`, `stats` and `shutdown`.
    """

    def __init__(
        self, model: str | Path, *, device: str = "auto", dtype: str = "auto", **options: Any
    ) -> None:
        self.engine = LLMEngine(model, device=device, dtype=dtype, **options)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams
        self._stats: dict[str, Any] = self.engine.stats()
        self._stats_at = time.monotonic()  # when _stats was last read whole
        self._error: BaseException | None = None
        self._stopping = False
        self._preprocessing = 0  # touched only from event loops, under _lock
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def processor(self):
        return self.engine.processor

    @property
    def info(self) -> EngineInfo:
        """The model's name, modalities, context length, media limits and batch width (read
        afresh: the processor's media limits may be replaced at run time)."""
        return EngineInfo(
            model=self.engine.model_id,
            modalities=self.processor.modalities,
            max_model_len=self.engine.max_model_len,
            media_limits=self.processor.media_limits,
            max_num_seqs=self.engine.config.max_num_seqs,
        )

    # ---- front door -------------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs for one prompt until it finishes (the last has finished=True)."""
        arrival = time.monotonic()
        parsed = self.processor.parse(prompt)
        async with contextlib.aclosing(
            self._stream(parsed, sampling_params, request_id, arrival)
        ) as stream:
            async for out in stream:
                yield out

    async def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        **template_kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Like generate, for OpenAI-style messages rendered with the model's chat template."""
        arrival = time.monotonic()
        parsed = self.processor.render_chat(messages, **template_kwargs)
        async with contextlib.aclosing(
            self._stream(parsed, sampling_params, request_id, arrival)
        ) as stream:
            async for out in stream:
                yield out

    async def cross_attention_weights(self, prompt: PromptType,
                                      heads: Sequence[tuple[int, int]]) -> np.ndarray:
        """The attention probabilities [len(heads), T, n] of the (decoder layer, head) pairs
        over the prompt's one cross-attended item, teacher-forced over its T tokens
        (engine/cross_attention_weights.py; Whisper's alignment heads for word timestamps).
        Runs on the engine thread between steps."""
        self._raise_if_dead()
        parsed = self.processor.parse(prompt)
        media = await self.processor.load_media(parsed)
        processed = await asyncio.to_thread(self.processor.process, parsed, media)
        done: Future = Future()
        self._submit(("call", partial(cross_attention_weights, self.engine, processed, heads),
                      done))
        return await asyncio.wrap_future(done)

    async def abort(self, request_id: str) -> None:
        """Stop a request; returns once its KV blocks and cache references are freed."""
        done: Future = Future()
        self._submit(("abort", request_id, done))
        await asyncio.wrap_future(done)

    def stats(self) -> dict[str, Any]:
        """Engine-wide counters as of the last step (a snapshot; safe from any thread), plus
        `requests_preprocessing`: requests still loading media or being processed."""
        return {**self._stats, "requests_preprocessing": self._preprocessing}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; requests still in flight fail with EngineDeadError."""
        self._stopping = True
        self._submit(("wake",))
        self._thread.join(timeout)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()

    # ---- caller side ------------------------------------------------------------------------

    async def _stream(self, parsed: ParsedPrompt, params, request_id, arrival):
        self._raise_if_dead()
        request_id = request_id or uuid.uuid4().hex
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = self._streams[request_id] = _Stream(asyncio.get_running_loop())
        finished = False
        try:
            with self._lock:
                self._preprocessing += 1
            try:
                media = await self.processor.load_media(parsed)
                processed = await asyncio.to_thread(self.processor.process, parsed, media)
                req = self.engine.make_request(
                    processed, params or self.engine.default_sampling_params(), request_id,
                    arrival_time=arrival, thinking=parsed.thinking,
                )
                self._submit(("add", req))
            finally:
                with self._lock:
                    self._preprocessing -= 1
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:  # the caller went away or failed: free the request's resources
                self._submit(("abort", request_id, None))

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)

    def _raise_if_dead(self) -> None:
        if self._error is not None or self._stopping:
            raise EngineDeadError(f"the engine is not running ({self._error or 'shut down'})")

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                idle = not self.engine.has_unfinished()
                self._handle(self._commands.get() if idle else None)
                while not self._commands.empty():
                    self._handle(self._commands.get_nowait())
                outputs = []
                if self.engine.has_unfinished() and not self._stopping:
                    outputs = self.engine.step()
                # Refresh before delivering: a caller that sees a token also sees its request
                # counted in stats(). The whole of it (the pools' resident bytes take a walk
                # over their pages) when idle and every STATS_EVERY_S while steps run.
                now = time.monotonic()
                if not self.engine.has_unfinished() or now - self._stats_at >= STATS_EVERY_S:
                    self._stats, self._stats_at = self.engine.stats(), now
                else:
                    self._stats = {**self._stats, **self.engine.counters()}
                self._deliver(outputs)
        except BaseException as e:  # noqa: BLE001 - report to every waiting caller, then stop
            log.exception("engine loop died")
            self._error = e
        finally:
            dead = EngineDeadError(f"the engine stopped ({self._error or 'shut down'})")
            self._fail_all(dead)
            while not self._commands.empty():  # jobs never run: their callers are told
                command = self._commands.get_nowait()
                if command[0] == "call" and not command[2].done():
                    command[2].set_exception(dead)

    def _handle(self, command: tuple | None) -> None:
        if command is None:
            return
        kind = command[0]
        if kind == "add":
            req: Request = command[1]
            try:
                self.engine.add_request(req)
            except ValueError as e:
                self._deliver_error(req.request_id, e)
        elif kind == "call":  # a job that must not run beside a step
            _, job, done = command
            try:
                result = job()
            except Exception as e:  # noqa: BLE001 - the caller's error, not the engine's
                done.set_exception(e)
            else:
                done.set_result(result)
        elif kind == "abort":
            _, request_id, done = command
            out = self.engine.abort_request(request_id)
            self._stats = self.engine.stats()
            if out is not None:
                self._deliver([out])
            if done is not None and not done.done():  # the awaiting caller may be cancelled
                done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their callers' loops, one thread-safe call per loop per step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that caller's loop is closed; its requests are orphaned
                for _, out in items:
                    if not out.finished:
                        self.engine.abort_request(out.request_id)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.items())
        for _, stream in streams:
            try:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
            except RuntimeError:
                pass


def _put_all(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
