"""A minimal stand-in for a vLLM OpenAI-compatible server (0.10.2 and later), to pin the
vLLM-specific parsing of the remote engine without a GPU: its /v1/models entry (owned_by,
root, max_model_len), its /tokenize, and its streamed chat completion: a role chunk carrying
`prompt_token_ids` (with `return_token_ids`), one chunk per token with `token_ids`, the
finish_reason on the last token's chunk, then the `include_usage` chunk (`choices: []`) whose
`prompt_tokens_details` appears only with --enable-prompt-tokens-details and a non-zero
count, then [DONE]. Errors use vLLM's `{"error": {message, type, param, code}}` body.

The "model" writes a fixed sentence, one word per token; its prompt is a few text tokens,
then per image a vision_start, `IMAGE_TOKENS` image pads and a vision_end (Qwen2-VL's ids).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL = "Qwen/Qwen2-VL-7B-Instruct"
MAX_MODEL_LEN = 32768
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653
IMAGE_TOKENS, VIDEO_TOKENS = 16, 24
WORDS = "A red ball rolls across the blue table in the light of the morning sun".split()
BLOCK = 16  # prefix-cache granularity, as vLLM's default block size


@dataclass
class StandIn:
    """The stand-in's behaviour and what it saw."""

    prompt_tokens_details: bool = True  # as `--enable-prompt-tokens-details`
    legacy_errors: bool = False  # vLLM before 0.10: {"object": "error", "message": ...}
    token_delay_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    disconnected: list[int] = field(default_factory=list)  # indices of requests cut short
    finished: list[int] = field(default_factory=list)
    _prefixes: list[list[int]] = field(default_factory=list)

    def app(self) -> FastAPI:
        app = FastAPI()
        app.get("/v1/models")(self.models)
        app.post("/tokenize")(self.tokenize)
        app.post("/v1/chat/completions")(self.chat)
        return app

    async def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": MODEL, "object": "model", "created": int(time.time()), "owned_by": "vllm",
            "root": MODEL, "parent": None, "max_model_len": MAX_MODEL_LEN,
            "permission": [{"id": "modelperm-0", "object": "model_permission"}],
        }]}

    async def tokenize(self, request: Request) -> dict:
        body = await request.json()
        text = body["prompt"]
        special = {"<|image_pad|>": IMAGE_PAD, "<|video_pad|>": VIDEO_PAD}
        tokens = [special[text]] if text in special else [ord(c) for c in text]
        return {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens,
                "token_strs": None}

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        index = len(self.requests)
        self.requests.append(body)
        if body.get("model") != MODEL:
            return self._error(404, f"The model `{body.get('model')}` does not exist.",
                               "NotFoundError", "model")
        prompt = self._prompt(body["messages"])
        if prompt is None:
            return self._error(400, "Only image_url parts are supported by this stand-in",
                               "BadRequestError", None)
        cached = self._cached(prompt)
        return StreamingResponse(self._events(body, index, prompt, cached),
                                 media_type="text/event-stream")

    def _prompt(self, messages: list[dict]) -> list[int] | None:
        ids = [151644, 872, 198]  # <|im_start|>user\n
        for message in messages:
            content = message["content"]
            parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
            for part in parts:
                if part["type"] == "text":
                    ids += [1000 + len(word) for word in part["text"].split()]
                elif part["type"] == "image_url":
                    ids += [VISION_START, *[IMAGE_PAD] * IMAGE_TOKENS, VISION_END]
                elif part["type"] == "video_url":
                    ids += [VISION_START, *[VIDEO_PAD] * VIDEO_TOKENS, VISION_END]
                else:
                    return None
        return [*ids, 151645, 198, 151644, 77091, 198]  # <|im_end|>\n<|im_start|>assistant\n

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for seen in self._prefixes:
            n = 0
            while n < min(len(seen), len(prompt)) and seen[n] == prompt[n]:
                n += 1
            best = max(best, n // BLOCK * BLOCK)
        self._prefixes.append(prompt)
        return min(best, (len(prompt) - 1) // BLOCK * BLOCK)

    async def _events(self, body: dict, index: int, prompt: list[int], cached: int):
        with_ids = bool(body.get("return_token_ids"))
        envelope = {"id": f"chatcmpl-{index}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": MODEL}
        first = {**envelope, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""},
                                          "logprobs": None, "finish_reason": None}]}
        if with_ids:
            first["prompt_token_ids"] = prompt
        try:
            yield _sse(first)
            n = body.get("max_tokens") or 16
            for i in range(n):
                await asyncio.sleep(self.token_delay_s)
                word = WORDS[i % len(WORDS)]
                choice = {"index": 0, "delta": {"content": f" {word}" if i else word},
                          "logprobs": None, "finish_reason": None}
                if i == n - 1:
                    choice.update(finish_reason="length", stop_reason=None)
                if with_ids:
                    choice["token_ids"] = [2000 + i]
                yield _sse({**envelope, "choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n,
                         "completion_tokens": n}
                if self.prompt_tokens_details and cached:
                    usage["prompt_tokens_details"] = {"cached_tokens": cached}
                yield _sse({**envelope, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
            self.finished.append(index)
        except asyncio.CancelledError:  # the client closed the connection
            self.disconnected.append(index)
            raise

    def _error(self, status: int, message: str, kind: str, param: str | None) -> JSONResponse:
        if self.legacy_errors:
            body = {"object": "error", "message": message, "type": kind, "param": param,
                    "code": status}
        else:
            body = {"error": {"message": message, "type": kind, "param": param,
                              "code": status}}
        return JSONResponse(body, status_code=status)


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
