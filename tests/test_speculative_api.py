"""Speculative decoding over the OpenAI API, with the official client against a real server on
127.0.0.1: a request chooses it per request (`speculative_config`, vLLM's names), its usage
reports the draft tokens accepted and rejected (OpenAI's names for predicted tokens), its text
(streamed or not) is the one it gets without speculation, and bad values are a 400 naming the
field."""

from __future__ import annotations

import openai
import pytest

from api import create_app
from engine import AsyncLLM
from testing.speculative import ScriptedDrafter
from tests.api_fixtures import running_server

MESSAGES = [{"role": "user", "content": "Describe the image in detail."}]
GREEDY = {"temperature": 0, "max_tokens": 20}


@pytest.fixture(scope="module")
def engines(qwen2_path):
    spec = AsyncLLM(qwen2_path, max_model_len=512, speculative="ngram")
    plain = AsyncLLM(qwen2_path, max_model_len=512)
    yield spec, plain
    spec.shutdown()
    plain.shutdown()


@pytest.fixture(scope="module")
def client(engines):
    spec, plain = engines
    with running_server(create_app({"spec": spec, "plain": plain})) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _config(method: str | None = "ngram", n: int | None = 4) -> dict:
    return {"extra_body": {"ignore_eos": True, "return_token_ids": True, "speculative_config": {
        "method": method, "num_speculative_tokens": n}}}


def test_drafted_tokens_in_the_usage_and_the_text_unchanged(engines, client):
    spec, _ = engines
    off = client.chat.completions.create(model="spec", messages=MESSAGES, **GREEDY,
                                         **_config(n=0))
    assert off.usage.completion_tokens_details is None  # nothing was drafted for it
    reply = off.choices[0].message.content
    script = {(tuple(off.model_extra["prompt_token_ids"]), 0):
              off.choices[0].model_extra["token_ids"]}
    spec.engine.speculator.drafters["ngram"] = ScriptedDrafter(
        script, spec.engine.runner.vocab_size)
    spec.engine.speculator.costs.hold(0.08)  # drafts by acceptance alone, not by timing
    on = client.chat.completions.create(model="spec", messages=MESSAGES, **GREEDY, **_config())
    assert on.choices[0].message.content == reply
    details = on.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    metrics = on.model_extra["mmserve"]["metrics"]
    assert metrics["accepted_tokens"] == details.accepted_prediction_tokens
    assert metrics["draft_tokens"] == (details.accepted_prediction_tokens
                                       + details.rejected_prediction_tokens)
    stream = client.chat.completions.create(
        model="spec", messages=MESSAGES, stream=True, stream_options={"include_usage": True},
        **GREEDY, **_config())
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.parametrize(("model", "config", "field"), [
    ("spec", {"num_speculative_tokens": 99}, "num_speculative_tokens"),
    ("spec", {"method": "eagle"}, "method"),
    ("spec", {"method": "mtp"}, "mtp"),
    ("plain", {"num_speculative_tokens": 2}, "num_speculative_tokens"),
])
def test_bad_values_are_refused_by_name(client, model, config, field):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, **GREEDY,
                                       extra_body={"speculative_config": config})
    assert field in caught.value.message
