"""The chat handler: Gradio chat history -> OpenAI-style messages with media parts -> an engine
stream -> incremental chat updates, with Stop and Regenerate, and errors as plain gr.Errors.

Uploaded files are read here and handed to the engine as bytes, so the engine's own media
limits and decoders judge them and no local directory has to be opened to the engine. The
engine is any `ChatEngine`: the in-process one, or a remote server's (which sends the bytes on
as data URLs).
"""

from __future__ import annotations

import mimetypes
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import gradio as gr

from engine.interface import ChatEngine, EngineDeadError, EngineError
from engine.media.limits import MediaLimits
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.tools import ToolParser
from ui.tools import TOOL_CALL, call_messages, tool_request

EMPTY_DRAFT: dict[str, Any] = {"text": "", "files": []}
THINKING = "Thinking"  # the title of a reply's folded reasoning message
_ITEM = re.compile(r"^(image|video|audio) (\d+):")


@dataclass(frozen=True)
class ChatSettings:
    """The accordion's generation settings; a negative or missing seed means a random one.
    `show_thinking`: a thinking model's reasoning is shown, folded, above its answer.
    `tool_choice`: whether the demo tool is offered ("off", "auto", "required": ui/tools.py)."""

    system_prompt: str | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 256
    seed: int | None = None
    show_thinking: bool = True
    tool_choice: str = "off"

    def sampling_params(self) -> SamplingParams:
        """SamplingParams for these settings; gr.Error naming the bad value if one is out of
        range."""
        try:
            return SamplingParams(
                max_tokens=int(self.max_tokens),
                temperature=float(self.temperature),
                top_p=float(self.top_p),
                seed=None if self.seed is None or self.seed < 0 else int(self.seed),
            )
        except ValueError as e:
            raise gr.Error(f"Invalid setting: {e}") from e


@dataclass(frozen=True)
class ChatUpdate:
    """One step of a turn: the chat to show, the request's newest engine output (None before
    the first token), and the textbox value to show (None leaves the textbox as it is)."""

    history: list[dict]
    output: RequestOutput | None = None
    draft: dict[str, Any] | None = None


@dataclass
class _Active:
    llm: ChatEngine
    request_id: str
    stopped: bool = False


def modality_of(path: str | os.PathLike[str]) -> str:
    """"image", "video" or "audio" from a file's name; gr.Error for anything else."""
    mime = mimetypes.guess_type(os.fspath(path))[0] or ""
    kind = mime.split("/")[0]
    if kind in ("image", "video", "audio"):
        return kind
    raise gr.Error(
        f"{Path(path).name} is not an image, video or audio file; attach one of those "
        "(for example PNG, JPEG, MP4, WebM, WAV, MP3 or FLAC)."
    )


def user_turn(message: Mapping[str, Any]) -> dict:
    """The chatbot message for a MultimodalTextbox value: its files, then its text."""
    content: list[Any] = [{"path": os.fspath(f)} for f in message.get("files") or []]
    if (message.get("text") or "").strip():
        content.append(message["text"])
    return {"role": "user", "content": content}


def engine_messages(
    history: list[dict],
    system_prompt: str | None,
    accepted: tuple[str, ...] | None,
    limits: MediaLimits,
) -> tuple[list[dict], dict[str, list[str]]]:
    """OpenAI-style messages for the engine from the chatbot history (every turn's media kept),
    and the file names of each modality's items in prompt order (to name items in errors).
    `accepted` is None when the engine cannot tell which media the model takes.

    Consecutive messages of one role are merged, as chat templates expect turns to alternate.
    Raises gr.Error for a file of the wrong type or modality, or one over the size limit.
    """
    messages: list[dict] = []
    if system_prompt and system_prompt.strip():
        messages.append({"role": "system", "content": system_prompt.strip()})
    names: dict[str, list[str]] = {}
    for message in history:
        role = message["role"]
        title = (message.get("metadata") or {}).get("title") or ""
        if title == THINKING or title.startswith(TOOL_CALL):
            continue  # shown, not sent back: templates keep only the answers of past turns
        parts = []
        for kind, value in _contents(message["content"]):
            if kind == "text":
                parts.append({"type": "text", "text": value})
            elif role == "user":
                modality = modality_of(value)
                _check_accepted(modality, accepted, value)
                names.setdefault(modality, []).append(Path(value).name)
                parts.append({"type": modality, modality: _read(value, limits)})
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"].extend(parts)
        else:
            messages.append({"role": role, "content": parts})
    for message in messages:
        if message["role"] == "assistant":  # plain text, as every template handles it
            message["content"] = "".join(p["text"] for p in message["content"])
    return messages, names


def _contents(content: Any) -> list[tuple[str, str]]:
    """("text", text) and ("file", path) items of a chatbot message's content, in whichever
    form Gradio hands it over (plain, or normalised into typed parts)."""
    items = content if isinstance(content, list) else [content]
    out = []
    for item in items:
        if isinstance(item, str):
            out.append(("text", item))
        elif isinstance(item, dict) and item.get("type") == "text":
            out.append(("text", item["text"]))
        elif isinstance(item, dict) and isinstance(item.get("file"), dict):
            out.append(("file", item["file"]["path"]))
        elif isinstance(item, dict) and "path" in item:
            out.append(("file", item["path"]))
    return out


def _check_accepted(modality: str, accepted: tuple[str, ...] | None, path: str) -> None:
    if accepted is None or modality in accepted:  # None: the server judges
        return
    takes = " and ".join(accepted) if accepted else "text only"
    raise gr.Error(
        f"This model does not accept {modality} inputs (it takes {takes}): remove "
        f"{Path(path).name}, or choose a model that accepts {modality}, or press Clear."
    )


def _read(path: str, limits: MediaLimits) -> bytes:
    """The file's bytes; one over the engine's per-item limit is refused before reading it."""
    name = Path(path).name
    try:
        size = os.path.getsize(path)
        if size > limits.max_item_bytes:
            raise gr.Error(
                f"{name} is {size / 2**20:.1f} MiB, larger than the limit of "
                f"{limits.max_item_bytes / 2**20:.0f} MiB per file."
            )
        return Path(path).read_bytes()
    except OSError as e:
        raise gr.Error(f"{name} could not be read (was it removed?); attach it again.") from e


def _plain(error: ValueError, names: Mapping[str, list[str]]) -> str:
    """The engine's message, with the file name added to an "image 2: ..." item reference."""
    text = str(error)
    match = _ITEM.match(text)
    if match:
        modality, n = match.group(1), int(match.group(2))
        if n <= len(names.get(modality, [])):
            text = f"{match.group(0)[:-1]} ({names[modality][n - 1]}):{text[match.end():]}"
    return _sentence(text)


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def reply_messages(out: RequestOutput, settings: ChatSettings,
                   parser: ToolParser | None = None) -> list[dict]:
    """The chatbot messages of a reply: a thinking model's reasoning as a folded message
    (Gradio renders a message with a metadata title collapsible; "pending" while the model
    is still thinking), then the answer; with the demo tool offered (`parser`), the answer's
    text before any call, then each call folded under its name."""
    completion = out.outputs[0]
    text, calls = completion.text, []
    if parser is not None:
        text, calls = call_messages(out, parser)
        text = text or ""
    messages = []
    if completion.reasoning_content and settings.show_thinking:
        thinking = not completion.text and not out.finished
        messages.append({"role": "assistant", "content": completion.reasoning_content,
                         "metadata": {"title": THINKING,
                                      "status": "pending" if thinking else "done"}})
    if text or not (messages or calls):
        messages.append({"role": "assistant", "content": text})
    return messages + calls


class Chat:
    """Runs chat turns against named engines; one generation at a time per browser session,
    which Stop aborts in the engine (its KV blocks and cache references are freed at once)."""

    def __init__(
        self, engines: Mapping[str, ChatEngine], *, update_interval: float = 0.05
    ) -> None:
        self.engines = dict(engines)
        self.update_interval = update_interval
        self._active: dict[str, _Active] = {}

    def engine(self, model: str) -> ChatEngine:
        if model not in self.engines:
            raise gr.Error(f"Unknown model {model!r}; choose one of: {', '.join(self.engines)}.")
        return self.engines[model]

    async def respond(
        self,
        message: Mapping[str, Any] | None,
        history: list[dict],
        model: str,
        settings: ChatSettings,
        session: str,
    ) -> AsyncIterator[ChatUpdate]:
        """A new user turn: echo it (clearing the textbox), then stream the reply. On an error
        the chat and the textbox are restored before the gr.Error is raised."""
        message = message or EMPTY_DRAFT
        if not (message.get("text") or "").strip() and not message.get("files"):
            gr.Warning("Type a message or attach a file first.")
            return
        turn = [*history, user_turn(message)]
        restore = ChatUpdate(list(history), draft=dict(message))
        async with aclosing(self._stream(turn, model, settings, session, restore)) as stream:
            accepted = await anext(stream)  # an invalid turn raises here, before any echo
            yield replace(accepted, draft=EMPTY_DRAFT)
            async for update in stream:
                yield update

    async def regenerate(
        self, history: list[dict], model: str, settings: ChatSettings, session: str
    ) -> AsyncIterator[ChatUpdate]:
        """Drop the last reply and generate it again (with the current settings)."""
        turn = list(history)
        while turn and turn[-1]["role"] == "assistant":
            turn.pop()
        if not turn:
            gr.Warning("Nothing to regenerate yet.")
            return
        async with aclosing(self._stream(turn, model, settings, session, ChatUpdate(history))) as s:
            async for update in s:
                yield update

    async def stop(self, session: str) -> None:
        """Abort the session's running generation, if any."""
        active = self._active.get(session)
        if active is not None:
            active.stopped = True
            await active.llm.abort(active.request_id)

    async def _stream(
        self,
        turn: list[dict],
        model: str,
        settings: ChatSettings,
        session: str,
        restore: ChatUpdate,
    ) -> AsyncIterator[ChatUpdate]:
        """Validate the turn, then stream it: the first update (no output yet) means the turn
        was accepted; throttled updates follow, always including the last output."""
        llm = self.engine(model)
        params = settings.sampling_params()
        parser, params, template_kwargs = tool_request(llm, model, settings.tool_choice, params)
        info = llm.info
        messages, names = engine_messages(
            turn, settings.system_prompt, info.modalities, info.media_limits
        )
        await self.stop(session)  # a session runs one generation at a time
        active = self._active[session] = _Active(llm, f"ui-{uuid.uuid4().hex}")
        try:
            yield ChatUpdate(turn)
            last = 0.0
            replies = llm.chat(messages, params, active.request_id, **template_kwargs)
            async with aclosing(replies) as outputs:
                async for out in outputs:
                    if active.stopped and not out.finished:  # stopped before the engine had it
                        await llm.abort(active.request_id)
                    now = time.monotonic()
                    if out.finished or now - last >= self.update_interval:
                        last = now
                        yield ChatUpdate([*turn, *reply_messages(out, settings, parser)], out)
        except ValueError as e:
            yield restore
            raise gr.Error(_plain(e, names)) from e
        except EngineDeadError as e:
            yield restore
            raise gr.Error(f"The engine for {model} has stopped; restart the app.") from e
        except EngineError as e:  # a server that failed or could not be reached
            yield restore
            raise gr.Error(_sentence(str(e))) from e
        finally:
            if self._active.get(session) is active:
                del self._active[session]
        if out.outputs[0].finish_reason == "error":
            gr.Warning(f"Generation failed inside the engine: {out.error}")
