"""What agents and chat apps send, end to end with the official openai client over real HTTP:
structured output with `parse()` on several schemas with an image, tool calls in each family's
format (required, named and auto; streamed and not; a tool result fed back), reasoning on and
off (streamed as `reasoning_content` deltas), chat_template_kwargs checked, n > 1, logit_bias,
echo and suffix, the published schema, and a fuzzer's malformed content part as a 400.

The tiny models (testing/chat_formats.py) carry templates that render tools and thinking as
the real families' do; their random weights write no tool call unprompted, so the auto mode is
driven by a grammar that makes the model write one, which the family's parser must then find.
"""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api import create_app
from api.schema import ChatCompletion, Completion
from api.tool_calls import added_token_id
from engine import AsyncLLM
from engine.tools import PARSERS
from testing.chat_formats import build_chat_model, build_qwen3_5_chat_model
from tests.api_fixtures import running_server
from tests.media_fixtures import encode_image, gradient

FAMILIES = {"qwen3": "hermes", "mistral": "mistral", "llama3": "llama3", "gemma3": "pythonic"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}}}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Caption(Strict):
    caption: str = Field(max_length=20)
    objects: list[Literal["cat", "dog", "tree", "car"]] = Field(max_length=3)


class Scores(Strict):
    brightness: int = Field(ge=0, le=10)
    colorful: bool


class Verdict(Strict):
    label: Literal["photo", "drawing", "chart"]
    confidence: Literal["low", "high"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("agents")
    paths = {name: build_chat_model(root / name, name) for name in FAMILIES}
    paths["qwen3_5"] = build_qwen3_5_chat_model(root / "qwen3_5")
    llms = {name: AsyncLLM(path, max_model_len=2048) for name, path in paths.items()}
    yield llms
    for llm in llms.values():
        llm.shutdown()


@pytest.fixture(scope="module")
def base_url(engines):
    with running_server(create_app(engines)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def picture() -> dict:
    data = encode_image(gradient(64, 48), "PNG")
    import base64

    url = "data:image/png;base64," + base64.b64encode(data).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def with_image(picture: dict, text: str) -> list[dict]:
    return [{"role": "user", "content": [picture, {"type": "text", "text": text}]}]


# ---- structured output ------------------------------------------------------------------


@pytest.mark.parametrize("schema", [Caption, Scores, Verdict])
def test_parse_fits_the_schema_with_an_image(client, picture, schema):
    """Qwen3.5 thinks by default (its prompt opens <think>): the constrained reply closes the
    thinking first, and the answer is the object."""
    reply = client.chat.completions.parse(
        model="qwen3_5", messages=with_image(picture, "Describe the picture."),
        response_format=schema, max_tokens=120, temperature=1.0, seed=5)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, schema)
    assert reply.mmserve["placeholders"][0]["modality"] == "image"


def test_json_object_regex_and_choice_fields(client):
    reply = client.chat.completions.create(
        model="qwen3", messages=ASK, max_tokens=40, temperature=0,
        extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert reply.choices[0].message.content in ("sunny", "rainy")
    reply = client.chat.completions.create(
        model="qwen3", messages=ASK, max_tokens=40, temperature=0,
        extra_body={"guided_regex": "[0-9]{2} (C|F)"})
    assert reply.choices[0].message.content[-1] in "CF"


def test_a_schema_the_compiler_refuses_is_a_400_naming_why(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "not-a-format"}}}}}
    with pytest.raises(openai.BadRequestError, match="cannot be compiled.*not-a-format"):
        client.chat.completions.create(model="qwen3", messages=ASK, response_format=bad)
    with pytest.raises(openai.BadRequestError, match="one"):  # two constraints at once
        client.chat.completions.create(
            model="qwen3", messages=ASK, response_format={"type": "json_object"},
            extra_body={"guided_regex": "a+"})


# ---- tool calls -------------------------------------------------------------------------


def _check_call(call, tools=TOOLS) -> dict:
    fn = {t["function"]["name"]: t for t in tools}[call.function.name]
    args = json.loads(call.function.arguments)
    schema = fn["function"]["parameters"]
    assert set(args) <= set(schema["properties"]) and set(schema["required"]) <= set(args)
    assert call.id.startswith("call_") and call.type == "function"
    return args


def _streamed_calls(chunks) -> tuple[list[dict], str | None, str]:
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.index not in calls:  # the first delta of a call: id, type, name, no args
                assert d.id and d.type == "function" and d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("family", FAMILIES)
def test_required_and_named_tool_calls_streamed_and_not(client, family):
    reply = client.chat.completions.create(
        model=family, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _check_call(call)
    ChatCompletion.model_validate(reply.model_dump())

    named = {"type": "function", "function": {"name": "get_time"}}
    kwargs = dict(model=family, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=200,
                  temperature=1.0, seed=4)
    plain = client.chat.completions.create(**kwargs).choices[0]
    (call,) = plain.message.tool_calls
    assert call.function.name == "get_time" and _check_call(call)["zone"] in ("UTC", "CET", "JST")
    calls, finish, _ = _streamed_calls(client.chat.completions.create(**kwargs, stream=True))
    assert finish == "tool_calls" and [c["name"] for c in calls] == ["get_time"]
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_mode_finds_the_calls_the_model_writes(client, engines, family):
    """A grammar makes the model write its family's call (Hermes after some text); the auto
    parser must find it, whole and as it streams."""
    parser = PARSERS[FAMILIES[family]]
    grammar = parser.grammar([WEATHER], False, added_token_id(engines[family].tokenizer))
    if family == "qwen3":
        grammar = grammar.replace("start: block", 'start: "Let me check." block')
    kwargs = dict(model=family, messages=ASK, tools=TOOLS, max_tokens=200, temperature=1.0,
                  seed=8, extra_body={"structured_outputs": {"grammar": grammar}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and _check_call(call)
    assert message.content == ("Let me check." if family == "qwen3" else None)
    calls, finish, content = _streamed_calls(client.chat.completions.create(**kwargs,
                                                                            stream=True))
    assert finish == "tool_calls" and content.strip() == (message.content or "")
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)


@pytest.mark.parametrize(("family", "rendered"), [
    ("qwen3", "<tool_response>\n18 C, sunny\n</tool_response>"),
    ("mistral", '[TOOL_RESULTS]{"content": "18 C, sunny", "call_id": "call_1"}'),
    ("llama3", "<|start_header_id|>ipython<|end_header_id|>\n\n18 C, sunny<|eot_id|>"),
    ("gemma3", "```tool_output\n18 C, sunny\n```"),
])
def test_a_tool_result_is_fed_back(client, engines, family, rendered):
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    reply = client.chat.completions.create(
        model=family, messages=messages, tools=TOOLS, max_tokens=4, temperature=0,
        extra_body={"return_token_ids": True})
    prompt = engines[family].tokenizer.decode(reply.prompt_token_ids)
    assert rendered in prompt and "get_weather" in prompt
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_tools_are_refused_where_the_template_renders_none(client, base_url):
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="qwen3", messages=ASK, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="not one of the tools"):
        client.chat.completions.create(
            model="qwen3", messages=ASK, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}})


# ---- reasoning --------------------------------------------------------------------------


def test_reasoning_on_and_off_with_an_image(client, picture):
    """Qwen3.5's prompt opens the thinking: unconstrained, the tiny model never closes it, so
    all it writes is reasoning; with enable_thinking false, all is the answer."""
    kwargs = dict(model="qwen3_5", messages=with_image(picture, "What is it?"), max_tokens=12,
                  temperature=0, extra_body={"ignore_eos": True})
    thinking = client.chat.completions.create(**kwargs).choices[0].message
    assert thinking.reasoning_content and not thinking.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in chunks if c.choices)
    assert streamed == thinking.reasoning_content
    off = dict(kwargs, extra_body={"ignore_eos": True,
                                   "chat_template_kwargs": {"enable_thinking": False}})
    answer = client.chat.completions.create(**off).choices[0].message
    assert answer.content and getattr(answer, "reasoning_content", None) is None


def test_qwen3_reasoning_the_model_opens_is_split_streamed_and_not(client, engines):
    ids = added_token_id(engines["qwen3"].tokenizer)
    grammar = (f'start: <[{ids("<think>")}]> /[a-z ]{{4,30}}/ <[{ids("</think>")}]> "\\n\\n" '
               '/[a-z ]{3,20}/')
    kwargs = dict(model="qwen3", messages=ASK, max_tokens=80, temperature=1.0, seed=2,
                  extra_body={"structured_outputs": {"grammar": grammar}})
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content and message.content
    assert "<think>" not in message.content and "</think>" not in message.reasoning_content
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == message.content


def test_chat_template_kwargs_take_only_what_the_template_reads(client):
    with pytest.raises(openai.BadRequestError, match="enable_thinking") as info:
        client.chat.completions.create(model="qwen3", messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"enable_thiking": 0}})
    assert "enable_thiking" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="set by the server"):
        client.chat.completions.create(model="qwen3", messages=ASK, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"messages": []}})


# ---- sampling fields --------------------------------------------------------------------


def test_n_choices_logit_bias_and_penalties(client, engines):
    kwargs = dict(model="qwen3", messages=ASK, max_tokens=5, temperature=1.0, seed=1, n=3,
                  presence_penalty=0.5, frequency_penalty=0.5, extra_body={"ignore_eos": True})
    reply = client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert reply.usage.completion_tokens == 15
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    text = {i: "".join(c.choices[0].delta.content or "" for c in chunks
                       if c.choices and c.choices[0].index == i) for i in range(3)}
    assert text == {c.index: c.message.content for c in reply.choices}
    token = engines["qwen3"].tokenizer.convert_tokens_to_ids("<tool_call>")
    forced = client.chat.completions.create(
        model="qwen3", messages=ASK, max_tokens=3, temperature=0,
        logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].message.content == "<tool_call>" * 3


def test_echo_and_suffix(client):
    echoed = client.completions.create(model="qwen3", prompt="The quick brown fox",
                                       max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("The quick brown fox")
    Completion.model_validate(echoed.model_dump())
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="qwen3", prompt="The quick brown fox", max_tokens=4, temperature=0, echo=True,
        stream=True) if c.choices)
    assert streamed == echoed.choices[0].text
    filled = client.completions.create(model="qwen3", prompt="def main():\n", suffix="\n",
                                       max_tokens=4, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert filled.usage.completion_tokens >= 1
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        client.completions.create(model="mistral", prompt="a", suffix="b", max_tokens=2)


# ---- the published schema ---------------------------------------------------------------


def test_openapi_publishes_the_request_and_response_bodies(base_url):
    doc = httpx.get(f"{base_url}/openapi.json").json()
    for path, fields in (("/v1/chat/completions", ("messages", "response_format", "tools",
                                                   "tool_choice", "chat_template_kwargs", "n")),
                         ("/v1/completions", ("prompt", "echo", "suffix", "logit_bias"))):
        post = doc["paths"][path]["post"]
        ref = post["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        props = doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
        assert set(fields) <= set(props), path
        assert "200" in post["responses"] and "400" in post["responses"]


def test_a_content_part_whose_type_is_not_a_string_is_a_400(base_url):
    body = {"model": "qwen3", "messages": [{"role": "user", "content": [
        {"type": {}, "text": "x"}]}]}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "messages.0.content" in error["message"]
