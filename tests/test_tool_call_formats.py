"""The tool-call parsers and the thinking split on literal replies in the real formats (plain
Python): Gemma 4's <|tool_call>call:NAME{...}<tool_call|> blocks (bare_keys), Phi-4's
<|tool_call|>[...]<|/tool_call|> list (tagged_list), Mistral's [TOOL_CALLS] list, and Gemma 4's
thought channel; a malformed call comes back as the reply's text, whole or streamed, in the API
and the app. The demo templates name their formats (detect)."""

from __future__ import annotations

import json

import pytest

from api.tool_calls import ToolStream
from engine.reasoning import ReasoningSplitter, ThinkingFormat
from engine.tools import PARSERS, detect
from testing.demo_checkpoints import TEMPLATES

Q = '<|"|>'
GEMMA_CALLS = (f"Let me check.<|tool_call>call:get_weather{{city:{Q}Paris, FR{Q},days:3,"
               f"metric:true,extra:null,where:{{lat:48.85,tags:[{Q}a{Q},2]}}}}<tool_call|>"
               "<|tool_call>call:get_time{}<tool_call|>")
PHI_CALLS = ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
             '{"name": "get_time", "arguments": {}}]<|/tool_call|>')


def streamed(parser, text: str, step: int = 3) -> tuple[str, list]:
    """The reply fed to a ToolStream `step` characters at a time: its content and calls."""
    stream, content, calls = ToolStream(parser), "", {}
    for i in range(0, len(text), step):
        piece, deltas = stream.feed(text[i:i + step], i + step >= len(text))
        content += piece
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d["function"].get("name") or call["name"]
            call["arguments"] += d["function"]["arguments"]
    return content, [(c["name"], c["arguments"]) for c in calls.values()]


def test_gemma4_calls_read_whole_and_streamed():
    parser = PARSERS["bare_keys"]
    content, calls = parser.calls(GEMMA_CALLS)
    assert content == "Let me check."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {
        "city": "Paris, FR", "days": 3, "metric": True, "extra": None,
        "where": {"lat": 48.85, "tags": ["a", 2]}}
    assert calls[1].arguments == "{}"
    assert streamed(parser, GEMMA_CALLS) == (
        "Let me check.", [(c.name, c.arguments) for c in calls])


def test_phi4_and_mistral_lists_read_whole_and_streamed():
    phi = PARSERS["tagged_list"]
    content, calls = phi.calls("Sure. " + PHI_CALLS)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert streamed(phi, PHI_CALLS) == ("", [(c.name, c.arguments) for c in calls])
    _, calls = PARSERS["mistral"].calls(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("parser, reply", [
    ("bare_keys", "<|tool_call>call:get_weather{city:Paris}<tool_call|>"),  # a bare word
    ("bare_keys", f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>"),  # open string
    ("bare_keys", "<|tool_call>get_weather{}<tool_call|>"),  # no "call:"
    ("bare_keys", "<|tool_call>call:get_weather{city:1} and more<tool_call|>"),
    ("tagged_list", '<|tool_call|>[{"name": "get_weather", "arguments": {city: 1}}]'
                    "<|/tool_call|>"),
])
def test_a_malformed_call_is_the_replys_text(parser, reply):
    text = "Hm. " + reply
    assert PARSERS[parser].calls(text) == (text, [])
    if parser == "bare_keys":  # a block is judged whole; a JSON call's name streams early
        assert streamed(PARSERS[parser], text) == (text, [])


def test_the_app_shows_a_gemma4_call_folded_and_a_malformed_one_as_text():
    from engine.metrics import RequestMetrics
    from engine.outputs import CompletionOutput, RequestOutput
    from ui.tools import call_messages

    def finished(text: str) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, [1], "stop")], True, 0,
                             RequestMetrics())

    content, messages = call_messages(finished(GEMMA_CALLS), PARSERS["bare_keys"])
    assert content == "Let me check."
    assert [m["metadata"]["title"] for m in messages] == [
        "Tool call: get_weather", "Tool call: get_time"]
    bad = "<|tool_call>call:get_weather{city:Paris}<tool_call|>"
    assert call_messages(finished(bad), PARSERS["bare_keys"]) == (bad, [])


def test_the_bare_keys_grammar_names_what_it_cannot_enforce():
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "format": "date"}}}}}
    with pytest.raises(ValueError, match=r"tools\.f\.s: .*cannot enforce format"):
        PARSERS["bare_keys"].grammar([tool], False, lambda marker: None)


def test_demo_templates_name_their_formats():
    formats = {name: detect((TEMPLATES / name).read_text())
               for name in ("gemma4.jinja", "phi4_multimodal.jinja")}
    assert {k: v.name for k, v in formats.items()} == {
        "gemma4.jinja": "bare_keys", "phi4_multimodal.jinja": "tagged_list"}
    from testing.chat_formats import llava_next_mistral_template

    assert detect(llava_next_mistral_template()).name == "mistral"
    thinking = ThinkingFormat.of_template((TEMPLATES / "gemma4.jinja").read_text())
    assert (thinking.start, thinking.end) == ("<|channel>thought\n", "<channel|>")
    assert ThinkingFormat.of_template((TEMPLATES / "phi4_multimodal.jinja").read_text()) is None


def test_gemma4_thought_channel_split_as_it_streams():
    fmt = ThinkingFormat.of_template((TEMPLATES / "gemma4.jinja").read_text())
    reply = "<|channel>thought\nThe user wants weather.<channel|>It is sunny."
    splitter = ReasoningSplitter(fmt, in_reasoning=False)
    for i in range(0, len(reply), 4):
        splitter.feed(reply[i:i + 4], finished=i + 4 >= len(reply))
    assert (splitter.reasoning, splitter.content) == ("The user wants weather.", "It is sunny.")
    plain = ReasoningSplitter(fmt, in_reasoning=False)
    plain.feed("No thinking here.", finished=True)
    assert (plain.reasoning, plain.content) == ("", "No thinking here.")
