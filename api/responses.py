"""OpenAI response bodies, built from the engine's RequestOutputs (api/streams.py builds the
server-sent-event chunks).

Token strings in logprobs are single tokens decoded with the tokenizer (special tokens kept);
a token that holds part of a multi-byte character decodes to U+FFFD, as in vLLM.

Beyond OpenAI's fields, responses carry what a front end needs to show the engine's work:
with `return_token_ids` (vLLM's request field, and its field names) the prompt's token ids
(`prompt_token_ids`: top level, in the first chunk of a stream) and the generated ids
(`token_ids` in each choice); always, an `mmserve` object (on the body; in a chat stream on
its first chunk and, updated, on the one with the finish_reason) with each media item's
placeholder and encoder-cache outcome and the request's stage timings; and in /v1/models
each model's modalities and batch width.
"""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from api.tool_calls import ToolPlan
from engine import AsyncLLM, RequestOutput

SSE_DONE = "data: [DONE]\n\n"
EXTENSION = "mmserve"  # the key of our fields in response bodies
# JSON has no infinity; a token the model rules out gets this floor instead (vLLM does the same).
_MIN_LOGPROB = -9999.0


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass(frozen=True)
class ResponseContext:
    """What every body and chunk of one request carries, and how to render its logprobs."""

    id: str
    model: str
    tokenizer: Any
    num_logprobs: int | None  # top alternatives per token; None: no logprobs
    include_usage: bool = False
    return_token_ids: bool = False
    tools: ToolPlan = field(default_factory=ToolPlan)
    echo: str | None = None  # completions with echo: the prompt's text
    created: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model}


def model_list(engines: Mapping[str, AsyncLLM], created: int) -> dict:
    """GET /v1/models: one entry per served model name."""
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "mmserve",
                "max_model_len": llm.engine.max_model_len,
                EXTENSION: {
                    "modalities": list(llm.processor.modalities),
                    "max_num_seqs": llm.engine.config.max_num_seqs,
                    "sampling_defaults": dict(llm.engine.setup.sampling_defaults),
                    # every setting read from the checkpoint, and the file it came from
                    "checkpoint_settings": [
                        {"component": c, "name": k, "value": v, "source": src}
                        for c, k, v, src in llm.engine.checkpoint_settings
                    ],
                },
            }
            for name, llm in engines.items()
        ],
    }


def usage(out: RequestOutput) -> dict:
    """OpenAI's usage; a request drafted for (speculative decoding) also reports its draft
    tokens in OpenAI's names for predicted tokens: those accepted, those rejected."""
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    body = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }
    drafted = sum(c.num_draft_tokens for c in out.outputs)
    if drafted:
        accepted = sum(c.num_accepted_tokens for c in out.outputs)
        body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                             "rejected_prediction_tokens": drafted - accepted}
    return body


def extension(out: RequestOutput) -> dict:
    """Our fields: each encoder item's span, content hash and encoder-cache outcome (null: its
    span's KV came from the prefix cache, so it was never looked up) and the media item it is
    part of (`item`, null: the identifier's part before ":"; `part`, its label), and the stage
    timings measured in the engine (seconds)."""
    return {
        "placeholders": [
            {"modality": p.modality, "offset": p.offset, "length": p.length,
             "num_embeds": p.num_embeds, "identifier": p.identifier, "cache_hit": p.cache_hit,
             "parts": [[name, n] for name, n in p.parts],
             "text_offsets": list(p.text_offsets), "item": p.item, "part": p.part}
            for p in out.multi_modal_placeholders
        ],
        "metrics": out.metrics.as_dict(),
    }


def chat_completion(ctx: ResponseContext, final: RequestOutput) -> dict:
    """The non-streaming chat.completion body: a choice per completion, with the reply's
    tool calls (when the request has tools) and its reasoning (thinking models)."""
    choices = []
    for c in final.outputs:
        content, calls = ctx.tools.message(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if c.reasoning_content:
            message["reasoning_content"] = c.reasoning_content
        if calls:
            message["tool_calls"] = calls
        choices.append({
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(ctx, c.token_ids, c.logprobs),
            "finish_reason": "tool_calls" if calls and c.finish_reason == "stop"
            else c.finish_reason,
        })
    return _body(ctx, "chat.completion", choices, final)


def text_completion(ctx: ResponseContext, final: RequestOutput) -> dict:
    """The non-streaming text_completion body (with `echo`, each text starts with the
    prompt)."""
    choices = [{
        "index": c.index,
        "text": (ctx.echo or "") + c.text,
        "logprobs": completion_logprobs(ctx, c.token_ids, c.logprobs, 0),
        "finish_reason": c.finish_reason,
    } for c in final.outputs]
    return _body(ctx, "text_completion", choices, final)


def _body(ctx: ResponseContext, object_name: str, choices: list[dict],
          final: RequestOutput) -> dict:
    body = {**ctx.envelope(object_name), "choices": choices, "usage": usage(final)}
    if ctx.return_token_ids:
        for choice, c in zip(choices, final.outputs, strict=True):
            choice["token_ids"] = c.token_ids
        body["prompt_token_ids"] = final.prompt_token_ids
    body[EXTENSION] = extension(final)
    return body


def chat_logprobs(ctx: ResponseContext, ids: list[int], entries: list[dict] | None):
    if entries is None:
        return None
    tok = ctx.tokenizer
    return {
        "content": [
            {
                **_token_logprob(tok, token, entry[token]),
                "top_logprobs": [_token_logprob(tok, t, v) for t, v in _top(entry, ctx)],
            }
            for token, entry in zip(ids, entries, strict=True)
        ]
    }


def completion_logprobs(
    ctx: ResponseContext, ids: list[int], entries: list[dict] | None, offset: int
):
    if entries is None:
        return None
    tokens = [_decode(ctx.tokenizer, t) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": [_finite(e[t]) for t, e in zip(ids, entries, strict=True)],
        "top_logprobs": [
            {_decode(ctx.tokenizer, t): _finite(v) for t, v in _top(e, ctx)} for e in entries
        ],
        "text_offset": list(itertools.accumulate(map(len, tokens), initial=offset))[:-1],
    }


def _top(entry: dict[int, float], ctx: ResponseContext) -> list[tuple[int, float]]:
    # The engine's entry holds the sampled token first, then the top k (the sampled token
    # once, even if it is among them): the k best of the entry are the top k.
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[: ctx.num_logprobs]


def _token_logprob(tokenizer, token: int, logprob: float) -> dict:
    text = _decode(tokenizer, token)
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}


def _decode(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=False)


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB
