"""The Gradio Blocks: the chat (model choice, multimodal composer, Stop/Regenerate/Clear,
settings, examples) beside the live engine panels, and the event wiring between them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import gradio as gr

from engine.interface import ChatEngine, EngineInfo
from engine.load_progress import LoadProgress
from engine.media.limits import MODALITIES
from ui import panels
from ui.chat import EMPTY_DRAFT, Chat, ChatSettings, ChatUpdate
from ui.demo import ensure_samples, sample_examples
from ui.dictation import Dictation
from ui.lineup import Lineup, Loader
from ui.space import gpu
from ui.timing import timing_html
from ui.tools import DEMO_TOOL, TOOL_CHOICES

TITLE = "mmserve: multimodal chat with live engine panels"
_UNKNOWN_CONTEXT = 8192  # the max-tokens slider's end when no server reports a context length
_NO_REQUEST = '<div style="color:#6b7280;padding:6px">No request yet: send a message.</div>'
_LOAD_POLL_S = 0.25  # how often the model line shows a loading model's stage


def build_demo(
    engines: Mapping[str, ChatEngine] | ChatEngine,
    *,
    notes: Mapping[str, str] | None = None,
    examples: list[list] | None = None,
    available: Mapping[str, Loader] | None = None,
    dictation: Dictation | None = None,
) -> gr.Blocks:
    """The app's Blocks for existing engines, in-process or remote (a name -> engine mapping,
    or one engine named by its model). `notes` adds a line under a model's name (whether the
    demo's weights are random or real); `examples` are gr.Examples rows [textbox value, model
    name], by default the generated sample media; `available`: more models the picker lists,
    each loaded by its function when first chosen (ui/lineup.py), the model line showing its
    start-up stage meanwhile; `dictation`: a Whisper engine
    that writes the microphone's recording into the message box (ui/dictation.py). The queue is
    configured; call `.launch()` or mount it."""
    if not isinstance(engines, Mapping):
        engines = {engines.info.model: engines}
    if not engines:
        raise ValueError("build_demo needs at least one engine")
    chat = Chat(engines)
    lineup = Lineup(chat.engines, available)
    engines = chat.engines  # the models loaded when chosen join it
    notes = notes or {}
    names = list(engines)
    infos = {name: llm.info for name, llm in engines.items()}
    if examples is None:
        modalities = {name: MODALITIES if i.modalities is None else i.modalities
                      for name, i in infos.items()}
        examples = sample_examples(modalities, ensure_samples())
    longest = max(i.max_model_len or _UNKNOWN_CONTEXT for i in infos.values())

    def model_info(model: str) -> str:
        return _model_info(engines[model].info, notes.get(model))

    async def choose(model: str) -> AsyncIterator[str]:
        """The chosen model's line; a model of the stores is loaded first (once), the line
        saying which start-up stage it is at meanwhile."""
        if lineup.loaded(model):
            yield model_info(model)
            return
        load = asyncio.ensure_future(lineup.load(model))
        # Another choice may close this line's updates first: the load goes on, its error
        # is then the next choice's to show.
        load.add_done_callback(lambda task: task.cancelled() or task.exception())
        shown = None
        while True:
            line = _loading_line(model, lineup.loading(model))
            if line != shown:
                shown = line
                yield line
            done, _ = await asyncio.wait({load}, timeout=_LOAD_POLL_S)
            if done:
                break
        try:
            load.result()
        except Exception as e:  # noqa: BLE001 - any failure to load is shown, not raised
            yield f"**{model}** could not be loaded: {e}"
            return
        yield model_info(model)

    # No usage telemetry: a local app should not call home.
    with gr.Blocks(title="mmserve", fill_width=True, analytics_enabled=False) as demo:
        gr.Markdown(f"## {TITLE}")
        with gr.Row(equal_height=False):
            with gr.Column(scale=5):
                model = gr.Dropdown(lineup.choices(), value=names[0], label="Model",
                                    interactive=len(lineup.names()) > 1)
                info = gr.Markdown(model_info(names[0]), elem_id="model-info")
                chatbot = gr.Chatbot(label="Chat", height=440, elem_id="chatbot")
                composer = gr.MultimodalTextbox(
                    sources=["upload", "microphone"], file_count="multiple", show_label=False,
                    placeholder="Type a message; attach images, videos or audio (several at once)",
                    elem_id="composer",
                )
                with gr.Row():
                    stop = gr.Button("Stop", variant="stop", elem_id="stop")
                    regenerate = gr.Button("Regenerate", elem_id="regenerate")
                    clear = gr.Button("Clear", elem_id="clear")
                with gr.Accordion("Generation settings", open=False):
                    system = gr.Textbox("", label="System prompt", lines=2)
                    temperature = gr.Slider(0, 2, value=0.7, step=0.05, label="Temperature")
                    top_p = gr.Slider(0.05, 1, value=1.0, step=0.05, label="Top p")
                    max_tokens = gr.Slider(1, longest, value=min(256, longest), step=1,
                                           label="Max new tokens", elem_id="max-tokens")
                    seed = gr.Number(-1, precision=0, minimum=-1, label="Seed (-1: random)")
                    thinking = gr.Checkbox(True, label="Show the model's thinking (folded)",
                                           elem_id="show-thinking")
                if dictation is not None:
                    with gr.Accordion(f"Dictation ({dictation.name})", open=False):
                        speech = gr.Audio(sources=["microphone", "upload"], type="filepath",
                                          label="Speak or upload audio", elem_id="speech")
                        spoken = gr.Textbox("", label="Language (empty: detected)",
                                            elem_id="speech-language")
                        dictate = gr.Button("Transcribe into the message", elem_id="dictate")
                        dictated = gr.HTML("", elem_id="dictation")
                with gr.Accordion("Tools", open=False):
                    tool_choice = gr.Radio(
                        list(TOOL_CHOICES), value="off", elem_id="tool-choice",
                        label=f"Offer the demo tool {DEMO_TOOL['function']['name']}(city): off, "
                              "the model decides (auto), or it must call it (required)")
                with gr.Accordion("Webcam snapshot", open=False):
                    webcam = gr.Image(sources=["webcam"], type="filepath", elem_id="webcam",
                                      label="Captured frames are attached to your message")
                if examples:
                    gr.Examples(examples, inputs=[composer, model], cache_examples=False,
                                label="Examples (generated sample media)")
            with gr.Column(scale=4):
                gr.Markdown("### Prompt: placeholder ranges")
                placeholders = gr.HTML(_NO_REQUEST, elem_id="placeholders")
                items = gr.Dataframe(headers=panels.TABLE_COLUMNS, interactive=False,
                                     label="Media items", elem_id="items")
                gr.Markdown("### Cache")
                cache = gr.HTML(_NO_REQUEST, elem_id="cache")
                engine_panel = gr.HTML(panels.engine_html(engines[names[0]].stats()),
                                       elem_id="engine")
                gr.Markdown("### Timing")
                timing = gr.HTML(_NO_REQUEST, elem_id="timing")
        timer = gr.Timer(1.0)

        settings_inputs = [system, temperature, top_p, max_tokens, seed, thinking, tool_choice]
        turn_outputs = [composer, chatbot, placeholders, items, cache, engine_panel, timing]

        # Turns against a remote server need no GPU here: spaces.GPU would only reserve one.
        on_gpu = gpu if all(i.backend is None for i in infos.values()) else _as_is

        @on_gpu
        async def send(
            message: dict | None, history: list, name: str, system_prompt: str,
            temperature: float, top_p: float, max_new_tokens: int, seed_value: float | None,
            show_thinking: bool, tools: str, request: gr.Request,
        ) -> AsyncIterator[tuple]:
            settings = ChatSettings(system_prompt, temperature, top_p, max_new_tokens, seed_value,
                                    show_thinking, tools)
            view = _TurnView(chat.engine(name))
            async for update in chat.respond(message, history, name, settings, _session(request)):
                yield view(update)

        @on_gpu
        async def again(
            history: list, name: str, system_prompt: str, temperature: float, top_p: float,
            max_new_tokens: int, seed_value: float | None, show_thinking: bool, tools: str,
            request: gr.Request,
        ) -> AsyncIterator[tuple]:
            settings = ChatSettings(system_prompt, temperature, top_p, max_new_tokens, seed_value,
                                    show_thinking, tools)
            view = _TurnView(chat.engine(name))
            async for update in chat.regenerate(history, name, settings, _session(request)):
                yield view(update)

        async def stop_turn(request: gr.Request) -> None:
            await chat.stop(_session(request))

        async def clear_chat(name: str, request: gr.Request) -> tuple:
            await chat.stop(_session(request))
            return ([], EMPTY_DRAFT, _NO_REQUEST, None, _NO_REQUEST, engine_stats(name),
                    _NO_REQUEST)

        def engine_stats(name: str) -> str:
            return (panels.engine_html(engines[name].stats()) if lineup.loaded(name)
                    else _NO_REQUEST)

        def attach(snapshot: str | None, message: dict | None) -> tuple[dict, None]:
            message = message or EMPTY_DRAFT
            files = [*message.get("files", []), *([snapshot] if snapshot else [])]
            return {"text": message.get("text", ""), "files": files}, None

        # Generation events share one concurrency group as wide as the engines' batches: each
        # tab's turn then joins the running batch at once (continuous batching), while turns
        # beyond that wait in Gradio's queue, which shows their position, instead of piling
        # up decoded media in the engine.
        width = sum(i.max_num_seqs for i in infos.values())
        generate = dict(concurrency_id="generate", concurrency_limit=width)
        composer.submit(send, [composer, chatbot, model, *settings_inputs], turn_outputs,
                        api_name="chat", show_progress="hidden", **generate)
        regenerate.click(again, [chatbot, model, *settings_inputs], turn_outputs,
                         api_name="regenerate", show_progress="hidden", **generate)
        # Control and refresh events must never wait behind generations: no concurrency limit.
        instant = dict(concurrency_limit=None, show_progress="hidden")
        stop.click(stop_turn, None, None, api_name="stop", **instant)
        clear.click(clear_chat, model, [chatbot, composer, placeholders, items, cache,
                                        engine_panel, timing], api_name="clear", **instant)
        chatbot.clear(stop_turn, None, None, api_visibility="private", **instant)
        webcam.input(attach, [webcam, composer], [composer, webcam], api_visibility="private",
                     **instant)
        model.change(choose, model, info, api_visibility="private", **instant)
        if dictation is not None:
            dictate.click(dictation.into_message, [speech, composer, spoken],
                          [composer, dictated], api_name="dictate", show_progress="minimal",
                          **generate)
        timer.tick(engine_stats, model, engine_panel, api_name="engine_stats", **instant)

    # The default limit covers the remaining events (loading an example). max_size bounds the
    # backlog to about three more batches: past it, users are told at once that the app is busy.
    demo.queue(default_concurrency_limit=width, max_size=4 * width)
    return demo


def _model_info(info: EngineInfo, note: str | None) -> str:
    """The line under the model's name: media, context, where it runs, and the note."""
    if info.modalities is None:
        takes = ("Accepts media: **not reported by the server** (it refuses what the model "
                 "cannot take)")
    else:
        takes = f"Accepts **{', '.join(info.modalities) or 'text only'}**"
    context = ("**not reported**" if info.max_model_len is None
               else f"**{info.max_model_len}** tokens")
    where = "" if info.backend is None else f" · served by `{info.backend}`"
    return f"{takes} · context {context}{where}" + (f"\n\n{note}" if note else "")


def _loading_line(model: str, stage: LoadProgress | None) -> str:
    """The model line while `model` loads: what its start-up is doing, with a bar."""
    line = f"Loading **{model}** (its weights are read now; the chat waits for it) ..."
    return line if stage is None else f"{line}\n\n`{stage.line()}`"


def _as_is(fn):
    return fn


class _TurnView:
    """Maps a turn's ChatUpdates to the outputs; the prompt panels (which do not change while
    a request streams) are rendered once per request."""

    def __init__(self, llm: ChatEngine) -> None:
        self.llm = llm
        self.shown: str | None = None

    def __call__(self, update: ChatUpdate) -> tuple:
        draft = gr.skip() if update.draft is None else update.draft
        out = update.output
        if out is None:
            return (draft, update.history, *[gr.skip()] * 5)
        prompt: tuple = (gr.skip(), gr.skip())
        if out.request_id != self.shown or out.finished:
            self.shown = out.request_id
            prompt = (panels.placeholder_html(out, self.llm.tokenizer),
                      panels.placeholder_table(out))
        return (draft, update.history, *prompt, panels.cache_html(out),
                panels.engine_html(self.llm.stats()), timing_html(out))


def _session(request: gr.Request | None) -> str:
    return getattr(request, "session_hash", None) or "default"
