"""The chat handler and the panel functions, without a server: media routing, history with
earlier media, plain-English errors, Stop, Regenerate, and what the panels show."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import gradio as gr
import pytest

from tests.helpers import wait_idle
from tests.ui_fixtures import AUDIO, MLLAMA, NO_AUDIO, OMNI, VL, demo_engines, demo_root
from ui import build_demo, panels, show_result, timing
from ui.chat import EMPTY_DRAFT, Chat, ChatSettings, engine_messages, modality_of
from ui.demo import ensure_demo_models, ensure_samples, sample_examples

GREEDY = ChatSettings(temperature=0.0, max_tokens=12)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    with demo_engines(demo_root(tmp_path_factory)) as engines:
        yield engines


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    return ensure_samples(demo_root(tmp_path_factory))


@pytest.fixture
def chat(engines):
    return Chat(engines, update_interval=0.0)


async def run(stream) -> list:
    return [update async for update in stream]


def image_turn(samples, text="Describe this image.") -> dict:
    return {"text": text, "files": [str(samples.image)]}


# ---- media routing and history -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "modality"),
    [("a.png", "image"), ("b.JPG", "image"), ("c.mp4", "video"), ("d.webm", "video"),
     ("e.wav", "audio"), ("f.mp3", "audio"), ("g.flac", "audio")],
)
def test_files_are_routed_by_type(name, modality):
    assert modality_of(name) == modality


def test_unsupported_file_type_is_a_plain_error():
    with pytest.raises(gr.Error) as err:
        modality_of("/tmp/gradio/abc/report.pdf")
    assert err.value.message.startswith("report.pdf is not an image, video or audio file")


def test_history_keeps_earlier_media_in_the_prompt(samples, engines):
    history = [
        {"role": "user", "content": [{"path": str(samples.image)}, "What is this?"]},
        {"role": "assistant", "content": "A picture."},
        # Gradio's normalised form, as the Chatbot hands history back:
        {"role": "user", "content": [
            {"type": "file", "file": {"path": str(samples.video)}},
            {"type": "text", "text": "And this?"},
        ]},
        {"role": "user", "content": [{"type": "text", "text": "Compare them."}]},
    ]
    processor = engines[VL].processor
    messages, names = engine_messages(
        history, "Be brief.", processor.modalities, processor.media_limits
    )
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    first, _, last = messages[1:]
    assert first["content"][0] == {"type": "image", "image": samples.image.read_bytes()}
    assert messages[2]["content"] == "A picture."
    assert [p["type"] for p in last["content"]] == ["video", "text", "text"]
    assert names == {"image": ["shapes.png"], "video": ["bouncing-with-sound.mp4"]}


# ---- streaming turns ---------------------------------------------------------------------------


async def test_a_turn_streams_and_the_panels_show_its_image(chat, engines, samples):
    updates = await run(chat.respond(image_turn(samples), [], VL, GREEDY, "s-stream"))
    echo, *streamed = updates
    assert echo.draft == EMPTY_DRAFT and echo.output is None
    assert echo.history[-1]["role"] == "user"
    outputs = [u.output for u in streamed if u.output is not None]
    assert len(outputs) >= 3, "tokens should arrive in several updates"
    texts = [o.outputs[0].text for o in outputs]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    final = outputs[-1]
    assert final.finished and updates[-1].history[-1] == {"role": "assistant", "content": texts[-1]}

    (ph,) = final.multi_modal_placeholders
    table = panels.placeholder_table(final)
    assert table.to_dict("records") == [{
        "item": "image 1", "modality": "image", "offset": ph.offset, "length": ph.length,
        "embeds": ph.num_embeds, "hash": ph.identifier[:8], "cache": panels.MISS,
    }]
    strip = panels.placeholder_html(final, engines[VL].tokenizer)
    assert f"image 1 · @{ph.offset} ×{ph.length} · {ph.num_embeds} embeds" in strip
    assert ph.identifier[:8] in strip
    labels = [label for label, _, _ in timing.timing_rows(final)]
    for stage in ("media load", "preprocess", "hashing", "queue", "encoder",
                  "prefill chunk 1", "first token (TTFT)", "decode"):
        assert any(label.startswith(stage) for label in labels), stage
    assert "TTFT" in timing.timing_html(final) and "tok/s" in timing.timing_html(final)


async def test_an_anyres_image_shows_its_base_and_tiles(chat, engines, samples):
    """The LLaVA-NeXT demo: one span per image, made of the base view and its tile grid."""
    updates = await run(chat.respond(image_turn(samples), [], "demo-llava-next", GREEDY, "s-nx"))
    final = [u.output for u in updates if u.output is not None][-1]
    (ph,) = final.multi_modal_placeholders
    (base, base_n), (tiles, tiles_n) = ph.parts
    assert base == "base" and tiles.startswith("tiles ") and base_n + tiles_n == ph.length
    strip = panels.placeholder_html(final, engines["demo-llava-next"].tokenizer)
    assert f"base {base_n} + {tiles} {tiles_n}" in strip


async def test_a_cross_attended_image_and_the_states_it_holds(chat, engines, samples):
    """The Llama 3.2 Vision demo: the image is its one token, labelled with its tiles; the
    engine panel shows the cross-attention keys and values the image left in the cache."""
    updates = await run(chat.respond(image_turn(samples), [], MLLAMA, GREEDY, "s-mllama"))
    final = [u.output for u in updates if u.output is not None][-1]
    (ph,) = final.multi_modal_placeholders
    assert ph.length == 1 and ph.num_embeds == 0 and ph.part == "4 tiles, cross-attended"
    strip = panels.placeholder_html(final, engines[MLLAMA].tokenizer)
    assert "image 1 · 4 tiles, cross-attended" in strip
    engine = panels.engine_html(wait_idle(engines[MLLAMA]))
    assert "Cross-attention states (MiB)</b>: 0.03 / " in engine and "1 items, 0 in use" in engine
    assert "Encoder cache</b>" not in engine


async def test_second_turn_keeps_the_image_and_reuses_its_prefix(chat, samples):
    # Text after the image fills the KV block the image ends in, so the first turn's prompt
    # blocks cover the whole image (the blocks of the reply may not match when re-tokenized).
    turn = image_turn(samples, "Describe this image in detail: every shape and every colour.")
    first = await run(chat.respond(turn, [], VL, GREEDY, "s-history"))
    history = first[-1].history
    second = await run(chat.respond({"text": "More detail?"}, history, VL, GREEDY, "s-history"))
    final = second[-1].output
    (ph,) = final.multi_modal_placeholders
    assert final.num_cached_tokens >= ph.offset + ph.length
    assert panels.cache_status(final, ph) == panels.PREFIX
    assert len(second[-1].history) == 4


async def test_a_repeated_image_hits_the_encoder_cache(chat, samples):
    await run(chat.respond(image_turn(samples), [], VL, GREEDY, "s-hit"))
    # Another system prompt changes the prefix, so the image is looked up, not prefix-cached.
    other = dataclasses.replace(GREEDY, system_prompt="You are terse.")
    updates = await run(chat.respond(image_turn(samples), [], VL, other, "s-hit"))
    final = updates[-1].output
    assert panels.placeholder_table(final)["cache"].tolist() == [panels.HIT]
    assert final.metrics.encoder_cache_hits == 1
    assert ">hit</span> image 1" in panels.cache_html(final)


async def test_a_video_reaches_the_engine_as_frame_groups(chat, samples):
    video = {"text": "What happens?", "files": [str(samples.video)]}
    final = (await run(chat.respond(video, [], VL, GREEDY, "s-video")))[-1].output
    assert {p.modality for p in final.multi_modal_placeholders} == {"video"}
    assert panels.item_labels(final) == [f"video 1 · t{i}" for i in range(4)]


async def test_the_sample_video_is_heard_by_the_omni_model(chat, samples):
    video = {"text": "What do you see and hear?", "files": [str(samples.video)]}
    final = (await run(chat.respond(video, [], OMNI, GREEDY, "s-omni")))[-1].output
    labels = panels.item_labels(final)
    assert {p.modality for p in final.multi_modal_placeholders} == {"video", "audio"}
    assert "video 1 · sound 0-2 s" in labels and "video 1 · frames 0-1 s" in labels


async def test_audio_reaches_the_audio_model(chat, engines, samples):
    if AUDIO not in engines:
        pytest.skip(NO_AUDIO)
    audio = {"text": "Transcribe.", "files": [str(samples.audio)]}
    final = (await run(chat.respond(audio, [], AUDIO, GREEDY, "s-audio")))[-1].output
    assert [p.modality for p in final.multi_modal_placeholders] == ["audio"]


async def test_regenerate_replaces_the_last_reply(chat, samples):
    settings = dataclasses.replace(GREEDY, temperature=1.0, seed=7)
    first = await run(chat.respond(image_turn(samples), [], VL, settings, "s-regen"))
    history = first[-1].history
    again = await run(chat.regenerate(history, VL, settings, "s-regen"))
    assert again[0].history == history[:-1], "the old reply is removed first"
    assert again[-1].history[:-1] == history[:-1]
    assert again[-1].history[-1] == history[-1], "same seed, same reply"
    assert again[-1].output.multi_modal_placeholders, "the turn's image is kept"


async def test_stop_aborts_and_frees_the_engine(chat, engines, samples):
    long = dataclasses.replace(GREEDY, max_tokens=3000)
    updates = []
    async for update in chat.respond(image_turn(samples), [], VL, long, "s-stop"):
        updates.append(update)
        if update.output is not None and len(update.output.outputs[0].token_ids) >= 3:
            await chat.stop("s-stop")
    final = updates[-1].output
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert len(final.outputs[0].token_ids) < 3000
    stats = wait_idle(engines[VL])
    assert stats["encoder_cache_referenced"] == 0


# ---- errors ------------------------------------------------------------------------------------


async def error_of(stream) -> tuple[str, list]:
    updates = []
    with pytest.raises(gr.Error) as err:
        async for update in stream:
            updates.append(update)
    return err.value.message, updates


async def test_wrong_modality_is_refused_before_anything_changes(chat, samples):
    turn = {"text": "Listen.", "files": [str(samples.audio)]}
    message, updates = await error_of(chat.respond(turn, [], VL, GREEDY, "s-err"))
    assert message.startswith("This model does not accept audio inputs (it takes image and video)")
    assert updates == []


async def test_undecodable_media_names_the_file_and_restores_the_turn(chat, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    turn = {"text": "What is it?", "files": [str(bad)]}
    message, updates = await error_of(chat.respond(turn, [], VL, GREEDY, "s-err"))
    assert message.startswith("Image 1 (broken.png): could not decode the image")
    assert updates[-1].history == [] and updates[-1].draft == turn


async def test_too_large_and_too_long_are_plain_errors(chat, engines, samples):
    processor = engines[VL].processor
    limits = processor.media_limits
    processor.media_limits = dataclasses.replace(limits, max_item_bytes=1000)
    try:
        message, _ = await error_of(chat.respond(image_turn(samples), [], VL, GREEDY, "s-err"))
    finally:
        processor.media_limits = limits
    assert message.startswith("shapes.png is ") and "larger than the limit" in message

    essay = {"text": "word " * 5000}
    message, _ = await error_of(chat.respond(essay, [], VL, GREEDY, "s-err"))
    assert "max_model_len is 4096" in message and message.startswith("The prompt has")
    bad = dataclasses.replace(GREEDY, top_p=0.0)
    message, _ = await error_of(chat.respond({"text": "hi"}, [], VL, bad, "s-err"))
    assert message.startswith("Invalid setting: SamplingParams.top_p")


# ---- panels ------------------------------------------------------------------------------------


async def test_long_prompts_are_elided_and_the_engine_panel_counts(chat, engines):
    essay = {"text": "The quick brown fox jumps over the lazy dog. " * 40}
    final = (await run(chat.respond(essay, [], VL, GREEDY, "s-long")))[-1].output
    strip = panels.placeholder_html(final, engines[VL].tokenizer, max_run=50)
    assert f"… {len(final.prompt_token_ids) - 50} tokens …" in strip
    engine = panels.engine_html(wait_idle(engines[VL]))
    assert "KV blocks in use</b>: 0 /" in engine and "Encoder cache hit rate" in engine


async def test_show_result_renders_every_panel(chat, engines, samples):
    final = (await run(chat.respond(image_turn(samples), [], VL, GREEDY, "s-nb")))[-1].output
    view = show_result(engines[VL], final)
    html = view._repr_html_()
    for part in ("mm-placeholders", "<table", "This request", "mm-engine", "mm-timing"):
        assert part in html


def test_the_demo_is_generated_once_and_its_examples_fit_the_models(engines, tmp_path_factory):
    root = demo_root(tmp_path_factory)
    paths = ensure_demo_models(root)
    config = paths[VL] / "config.json"
    built = config.stat().st_mtime_ns
    assert ensure_demo_models(root) == paths and config.stat().st_mtime_ns == built
    modalities = {name: llm.processor.modalities for name, llm in engines.items()}
    rows = sample_examples(modalities, ensure_samples(root))
    by_files = {tuple(Path(f).suffix for f in message["files"]): model for message, model in rows
                if "hear" not in message["text"]}
    expected = {(".png",): VL, (".mp4",): VL, (".png", ".mp4"): VL}
    if AUDIO in engines:
        expected[(".wav",)] = AUDIO
    # The sample video heard with its sound: the first model taking video and audio (Omni).
    heard = [(message["text"], model) for message, model in rows if "hear" in message["text"]]
    assert heard == [("What do you see and hear in this video?", OMNI)]
    assert by_files == expected


def test_the_demo_tokenizers_are_their_families_kinds(engines):
    """Byte-level BPE (Qwen, Llama 3, InternVL, MiniCPM-V, Phi-4) or SentencePiece-style BPE
    with byte fallback (LLaVA-NeXT's Mistral, Gemma), as transformers' converters write them:
    every text encodes and decodes back, whatever its characters."""
    sentencepiece = {"demo-llava-next", "demo-gemma4"}
    text = 'A red ball, {"naïve": [1, 2]} 你好 😀'
    for name, llm in engines.items():
        backend = json.loads(llm.tokenizer.backend_tokenizer.to_str())
        kind = backend["decoder"]["type"]
        if name in sentencepiece:
            assert backend["model"]["byte_fallback"] and kind == "Sequence", name
        else:
            assert kind == "ByteLevel", name
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        assert llm.tokenizer.decode(ids) == text, name


async def test_a_demo_reply_reads_as_words(chat, samples):
    settings = dataclasses.replace(GREEDY, temperature=1.0, seed=3, max_tokens=64)
    final = (await run(chat.respond(image_turn(samples), [], VL, settings, "s-words")))[-1]
    text = final.output.outputs[0].text
    words = text.split()
    assert len(words) >= 8, text
    assert sum(w.strip(".,!?;:'\"()-").isalpha() for w in words) >= len(words) // 2, text


def test_build_demo_takes_one_engine_or_several(engines):
    assert isinstance(build_demo(engines[VL]), gr.Blocks)
    assert isinstance(build_demo(engines), gr.Blocks)
    with pytest.raises(ValueError, match="at least one engine"):
        build_demo({})


class _Vocab:
    """A tokenizer stand-in: token id -> its text."""

    all_special_ids: list[int] = []
    texts = {7: "hi", 9: "[IMG]", 10: "[IMG_BREAK]", 11: "[IMG_END]"}

    def batch_decode(self, sequences):
        return ["".join(self.texts[t] for t in seq) for seq in sequences]


def test_structure_tokens_inside_a_span_are_shown_apart_from_its_embeddings():
    """A Pixtral-style span: 2 rows of 2 [IMG] embeddings, a row break and an end token."""
    from engine.metrics import RequestMetrics
    from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput

    ids = [7, 9, 9, 10, 9, 9, 11, 7]
    ph = PlaceholderInfo("image", 1, 6, 4, "abcdef0123:x", False, text_offsets=(2, 5))
    output = RequestOutput("r", None, ids, [CompletionOutput(0, "", [])], False, 0,
                           RequestMetrics(), [ph])
    strip = panels.placeholder_html(output, _Vocab())
    assert "4 embeds + 2 text" in strip
    assert "text inside: [IMG_BREAK], [IMG_END]" in strip
    plain = dataclasses.replace(ph, text_offsets=(), num_embeds=6)
    output.multi_modal_placeholders = [plain]
    strip = panels.placeholder_html(output, _Vocab())
    assert "6 embeds ·" in strip and "text inside" not in strip


def _heard_video_output():
    """An image, a video heard with its sound (Qwen2.5-Omni style: frames and sound windows
    interleaved; the second window's span holds the last video patch between its tokens), then
    a clip alone. The placeholders are listed as the processor lists them: image, video
    patches, sound windows, clip."""
    from engine.metrics import RequestMetrics
    from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput

    img, v, a = 9, 20, 21
    ids = [7, img, img, 7, v, v, v, v, a, a, v, a, v, a, 7, a, a, 7]
    video = [
        PlaceholderInfo("video", 4, 2, 2, "vid:t0", False, item="vid", part="frames 0-1 s"),
        PlaceholderInfo("video", 6, 2, 2, "vid:t1", False, item="vid", part="frames 1-2 s"),
        PlaceholderInfo("video", 10, 1, 1, "vid:t2", False, item="vid", part="frames 2-3 s"),
        PlaceholderInfo("video", 12, 1, 1, "vid:t3", False, item="vid", part="frames 3-4 s"),
    ]
    sound = [
        PlaceholderInfo("audio", 8, 2, 2, "snd:w0", False, item="vid", part="sound 0-2 s"),
        # positions 11 (its own), 12 (video t3), 13 (its own): the mask leaves out 12
        PlaceholderInfo("audio", 11, 3, 2, "snd:w1", True, text_offsets=(1,), item="vid",
                        part="sound 2-4 s"),
    ]
    phs = [PlaceholderInfo("image", 1, 2, 2, "img", False), *video, *sound,
           PlaceholderInfo("audio", 15, 2, 2, "clip:w0", None)]
    return RequestOutput("r", None, ids, [CompletionOutput(0, "", [])], False, 0,
                         RequestMetrics(), phs)


class _OmniVocab(_Vocab):
    texts = {**_Vocab.texts, 20: "<|VIDEO|>", 21: "<|AUDIO|>"}


def test_a_video_heard_with_its_sound_is_one_item_of_interleaved_chips():
    output = _heard_video_output()
    labels = ["image 1", "video 1 · frames 0-1 s", "video 1 · frames 1-2 s",
              "video 1 · frames 2-3 s", "video 1 · frames 3-4 s", "video 1 · sound 0-2 s",
              "video 1 · sound 2-4 s", "audio 1 · w0"]
    assert panels.item_labels(output) == labels
    # Numbered by the prompt, not by the order the placeholders are listed in.
    reordered = dataclasses.replace(output,
                                    multi_modal_placeholders=output.multi_modal_placeholders[::-1])
    assert panels.item_labels(reordered) == labels[::-1]

    table = panels.placeholder_table(output)
    assert table["item"].tolist() == labels
    assert table["modality"].tolist() == ["image", *["video"] * 4, "audio", "audio", "audio"]
    assert table["hash"].tolist() == ["img", *["vid"] * 4, "snd", "snd", "clip"]

    strip = panels.placeholder_html(output, _OmniVocab())
    chips = re.findall(r'background:(#\w+);color:#fff;font-family[^>]*>\S+ ([^@<]+) · @', strip)
    c = panels.MODALITY_COLORS
    assert chips == [
        (c["image"], "image 1"), (c["video"], "video 1 · frames 0-1 s"),
        (c["video"], "video 1 · frames 1-2 s"), (c["audio"], "video 1 · sound 0-2 s"),
        (c["video"], "video 1 · frames 2-3 s"), (c["audio"], "video 1 · sound 2-4 s"),
        (c["video"], "video 1 · frames 3-4 s"), (c["audio"], "audio 1 · w0"),
    ]
    # The overlapping window: the video token inside it is not its text, and no text run is
    # drawn inside a span.
    assert "video 1 · sound 2-4 s · @11 ×3 · 2 embeds in 3 ·" in strip
    assert "text inside" not in strip
    shown = [int(k) for k in re.findall(r'title="#(\d+) id', strip)]
    assert shown == [0, 3, 14, 17]


def test_placeholders_without_item_or_part_label_as_before():
    output = _heard_video_output()
    output.multi_modal_placeholders = [
        dataclasses.replace(ph, item=None, part="") for ph in output.multi_modal_placeholders]
    assert panels.item_labels(output) == [
        "image 1", "video 1 · t0", "video 1 · t1", "video 1 · t2", "video 1 · t3",
        "audio 1 · w0", "audio 1 · w1", "audio 2 · w0"]
