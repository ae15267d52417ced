"""The README's API examples against the offline demo lineup, through the official openai
client on a real server: json_schema with an image and json_object (structured output on the
demo's family tokenizers), a tool call streamed and not in each demo format (Hermes on
Qwen2-VL, Llama 3's JSON on Llama 3.2 Vision, Mistral's [TOOL_CALLS] on LLaVA-NeXT, Phi-4's
<|tool_call|> list, Gemma 4's <|tool_call> blocks), reasoning split from the answer (MiniCPM-V
thinks; Gemma 4 in its thought channel), and n = 2.

The random weights write no call or thought unprompted: `tool_choice` required constrains the
reply to a call in the model's format, and a grammar makes Gemma 4 open its channel; the
format's parser must then find what was written."""

from __future__ import annotations

import base64
import json

import openai
import pytest

from api import create_app
from api.tool_calls import added_token_id
from engine import AsyncLLM
from tests.api_fixtures import running_server
from tests.ui_fixtures import ENGINE_OPTIONS, MLLAMA, VL, demo_root
from ui.demo import ensure_demo_models, ensure_samples

THINKER = "demo-minicpm-v-4.6"
LLAVA, PHI4, GEMMA4 = "demo-llava-next", "demo-phi4-multimodal", "demo-gemma4"
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
                   "required": ["city"], "additionalProperties": False}}}]
SCHEMA = {"type": "object", "properties": {
    "colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
    "required": ["colour", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = demo_root(tmp_path_factory)
    samples = ensure_samples(root)
    paths = ensure_demo_models(root)
    engines = {name: AsyncLLM(paths[name], **ENGINE_OPTIONS)
               for name in (VL, MLLAMA, THINKER, LLAVA, PHI4, GEMMA4)}
    try:
        with running_server(create_app(engines)) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=60), samples, engines
    finally:
        for llm in engines.values():
            llm.shutdown()


def image_part(path) -> dict:
    data = base64.b64encode(path.read_bytes()).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}


def test_json_schema_with_an_image_and_json_object(served):
    client, samples, _ = served
    reply = client.chat.completions.create(
        model=VL, max_tokens=64, seed=1,
        messages=[{"role": "user", "content": [image_part(samples.image),
                                               {"type": "text", "text": "Describe it."}]}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "scene", "schema": SCHEMA, "strict": True}})
    scene = json.loads(reply.choices[0].message.content)
    assert scene["colour"] in ("red", "green", "blue") and isinstance(scene["count"], int)
    for model in (VL, MLLAMA):
        reply = client.chat.completions.create(
            model=model, max_tokens=48, seed=2, response_format={"type": "json_object"},
            messages=[{"role": "user", "content": "Any JSON object."}])
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
        else:  # cut at max_tokens: still a JSON object's start
            assert reply.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("model", [VL, MLLAMA, LLAVA, PHI4, GEMMA4])
def test_a_tool_call_streamed_and_not(served, model):
    client, _, _ = served
    request = dict(model=model, max_tokens=160, seed=3, tools=WEATHER, tool_choice="required",
                   parallel_tool_calls=False,
                   messages=[{"role": "user", "content": "Weather in Paris?"}])
    reply = client.chat.completions.create(**request)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments)["city"], str)

    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [t for c in chunks if c.choices for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == call.function.arguments  # same seed, same call
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_reasoning_comes_back_apart_from_the_answer(served):
    client, _, _ = served
    messages = [{"role": "user", "content": "Think, then answer."}]
    # The prompt opens <think>; a reply ended by max_tokens is all reasoning.
    thinking = client.chat.completions.create(model=THINKER, max_tokens=12, seed=4,
                                              messages=messages)
    message = thinking.choices[0].message
    assert message.reasoning_content and not message.content
    # A constrained reply closes the thinking first: the answer is the JSON.
    answer = client.chat.completions.create(
        model=THINKER, max_tokens=48, seed=4, messages=messages,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})
    assert json.loads(answer.choices[0].message.content)["colour"] in ("red", "green", "blue")
    # Without thinking the template closes an empty block: no reasoning at all.
    plain = client.chat.completions.create(
        model=THINKER, max_tokens=8, seed=4, messages=messages,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert not getattr(plain.choices[0].message, "reasoning_content", None)
    assert plain.choices[0].message.content


def test_gemma4_thought_channel_comes_back_apart(served):
    """With enable_thinking the model opens its thought channel itself; a grammar makes the
    random model write one (<|channel>thought ... <channel|>, special tokens), then an answer."""
    client, _, engines = served
    ids = added_token_id(engines[GEMMA4].tokenizer)
    grammar = (f'start: <[{ids("<|channel>")}]> "thought\\n" /[a-z ]{{4,20}}/ '
               f'<[{ids("<channel|>")}]> /[a-z ]{{3,12}}/')
    request = dict(model=GEMMA4, max_tokens=60, seed=6, temperature=1.0,
                   messages=[{"role": "user", "content": "Think, then answer."}],
                   extra_body={"structured_outputs": {"grammar": grammar},
                               "chat_template_kwargs": {"enable_thinking": True}})
    message = client.chat.completions.create(**request).choices[0].message
    assert message.reasoning_content and message.content
    assert "channel" not in message.content and "thought" not in message.reasoning_content
    chunks = list(client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content
    # Thinking off: the prompt closes an empty channel; nothing is reasoning.
    plain = client.chat.completions.create(model=GEMMA4, max_tokens=6, seed=6,
                                           messages=request["messages"],
                                           extra_body={"ignore_eos": True})
    assert not getattr(plain.choices[0].message, "reasoning_content", None)


def test_n_completions_of_one_prompt(served):
    client, samples, _ = served
    reply = client.chat.completions.create(
        model=VL, max_tokens=6, n=2, seed=5, temperature=1.0, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [image_part(samples.image),
                                               {"type": "text", "text": "Describe it."}]}])
    assert [c.index for c in reply.choices] == [0, 1]
    assert [c.finish_reason for c in reply.choices] == ["length", "length"]
    assert reply.usage.completion_tokens == 12  # 6 each, from one prefill
