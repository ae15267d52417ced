"""The app shows a thinking model's reasoning folded above its answer (a Gradio message with a
metadata title: collapsible, "pending" while the model thinks), hides it when the setting is
off, and never sends it back to the model; a remote server's `reasoning_content` deltas reach
the same fields."""

from __future__ import annotations

from engine.media.limits import MediaLimits
from engine.metrics import RequestMetrics
from engine.outputs import CompletionOutput, RequestOutput
from engine.remote.stream import StreamState
from ui.chat import THINKING, ChatSettings, engine_messages, reply_messages


def output(text: str, reasoning: str | None, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, text, [1, 2], "stop" if finished else None,
                                  reasoning_content=reasoning)
    return RequestOutput("r", None, [1], [completion], finished, 0, RequestMetrics())


def test_reasoning_is_folded_above_the_answer_and_never_sent_back():
    shown = ChatSettings()
    thinking = reply_messages(output("", "Let me see", False), shown)
    assert thinking == [{"role": "assistant", "content": "Let me see",
                         "metadata": {"title": THINKING, "status": "pending"}}]
    done = reply_messages(output("A cat.", "Let me see", True), shown)
    assert done[0]["metadata"]["status"] == "done" and done[1] == {
        "role": "assistant", "content": "A cat."}
    hidden = reply_messages(output("A cat.", "Let me see", True),
                            ChatSettings(show_thinking=False))
    assert hidden == [{"role": "assistant", "content": "A cat."}]
    assert reply_messages(output("Hi", None, True), shown) == [
        {"role": "assistant", "content": "Hi"}]
    history = [{"role": "user", "content": "What is it?"}, *done,
               {"role": "user", "content": "Sure?"}]
    messages, _ = engine_messages(history, None, None, MediaLimits())
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["content"] == "A cat."


def test_a_remote_servers_reasoning_deltas_are_kept_apart():
    state = StreamState("r", arrival_time=0.0, encode_seconds=0.0, media=())
    for delta in ({"reasoning_content": "Let "}, {"reasoning_content": "me see"},
                  {"content": "A cat."}):
        state.add({"choices": [{"index": 0, "delta": delta}]}, 0.0)
    out = state.output(finished=True, finish_reason="stop")
    assert out.outputs[0].reasoning_content == "Let me see"
    assert out.outputs[0].text == "A cat."


def test_a_tool_call_is_folded_under_its_name_and_never_sent_back():
    """The demo tool offered: a reply's Hermes call shows as a message titled with the call's
    name (its arguments as JSON; "pending" while they stream), after the text before it."""
    from engine.tools import HERMES
    from ui.tools import TOOL_CALL

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    done = reply_messages(output("Let me check. " + call, None, True), ChatSettings(), HERMES)
    assert done[0] == {"role": "assistant", "content": "Let me check."}
    assert done[1]["metadata"] == {"title": f"{TOOL_CALL}: get_weather", "status": "done"}
    assert '"city": "Paris"' in done[1]["content"]
    partial = reply_messages(output(call[:60], None, False), ChatSettings(), HERMES)
    assert [m["metadata"]["status"] for m in partial] == ["pending"]
    history = [{"role": "user", "content": "Weather?"}, *done]
    messages, _ = engine_messages(history, None, None, MediaLimits())
    assert messages[1]["content"] == "Let me check."
