"""LLM: the blocking front door (vLLM's offline API): generate() and chat() over a batch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.cross_attention_weights import cross_attention_weights
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.processing import ParsedPrompt, PromptType
from engine.sampling_params import SamplingParams


class LLM:
    """Run a batch of prompts to completion in the calling thread.

    >>> llm = LLM("path/to/checkpoint", max_num_batched_tokens=512)
    >>> out = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
    """

    def __init__(
        self, model: str | Path, *, device: str = "auto", dtype: str = "auto", **options: Any
    ) -> None:
        self.engine = LLMEngine(model, device=device, dtype=dtype, **options)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        All prompts are validated (and their media decoded) before any is scheduled, so a bad
        prompt raises ValueError and nothing runs.
        """
        batch = _as_batch(prompts)
        parsed = [self.engine.processor.parse(p) for p in batch]
        return self._run(parsed, sampling_params)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """One conversation (a list of OpenAI-style messages) or a list of conversations."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        parsed = [self.engine.processor.render_chat(c, **template_kwargs) for c in conversations]
        return self._run(parsed, sampling_params)

    def cross_attention_weights(self, prompt: PromptType,
                                heads: Sequence[tuple[int, int]]) -> np.ndarray:
        """The attention probabilities [len(heads), T, n] of the (decoder layer, head) pairs
        over the prompt's one cross-attended item, teacher-forced over its T tokens
        (engine/cross_attention_weights.py; Whisper's alignment heads for word timestamps)."""
        processor = self.engine.processor
        parsed = processor.parse(prompt)
        processed = processor.process(parsed, processor.load_media_sync(parsed))
        return cross_attention_weights(self.engine, processed, heads)

    def _run(self, parsed: list[ParsedPrompt], sampling_params) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(parsed), self.engine.default_sampling_params())
        processor = self.engine.processor
        reqs = []
        for p, sp in zip(parsed, params, strict=True):
            arrival = time.monotonic()
            media = processor.load_media_sync(p)
            reqs.append(self.engine.make_request(processor.process(p, media), sp,
                                                 arrival_time=arrival, thinking=p.thinking))
        for req in reqs:
            self.engine.add_request(req)
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[r.request_id] for r in reqs]

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()


def _as_batch(prompts: PromptType | list[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return list(prompts)


def _per_prompt(params, n: int, default: SamplingParams) -> list[SamplingParams]:
    if params is None:
        return [default] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return list(params)
