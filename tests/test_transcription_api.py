"""Speech to text over the OpenAI API with the official client (`audio.transcriptions.create`,
`audio.translations.create`) against a real server: the transcript is the one
engine.transcription produces, every response format renders it, a clip past 30 s is cut into
windows with their times, and bad uploads are a 4xx naming the problem or the limit. With the
real Whisper tiny.en installed (and espeak-ng), a spoken sentence comes back exactly."""

from __future__ import annotations

import asyncio
import io

import numpy as np
import openai
import pytest
import soundfile

from api import create_app
from engine import AsyncLLM
from engine.transcription import TranscriptionOptions, transcribe
from tests.api_fixtures import running_server

RATE = 16000
T = 0.5  # one sampled attempt per window (0, the default, falls back through six)
LIMIT = 4_000_000  # the test server's body limit


def wav(samples: np.ndarray, rate: int = RATE) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


CLIP = (0.3 * np.random.default_rng(7).standard_normal(RATE * 2)).astype(np.float32)


@pytest.fixture(scope="module")
def whisper_path(tmp_path_factory):
    from testing.whisper import build_whisper_model

    return build_whisper_model(tmp_path_factory.mktemp("ckpt") / "whisper",
                               alignment_heads=[(0, 1), (1, 0), (1, 3)])


@pytest.fixture(scope="module")
def server(whisper_path):
    llm = AsyncLLM(whisper_path, max_model_len=24)  # short windows: a random model rambles
    with running_server(create_app({"whisper": llm}, max_body_bytes=LIMIT)) as url:
        yield llm, openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                 timeout=120)
    llm.shutdown()


def test_transcripts_in_every_format(server):
    llm, client = server
    data = wav(CLIP)
    decoded = np.asarray(soundfile.read(io.BytesIO(data), dtype="float32")[0])

    async def ours(options):
        last = None
        async for item in transcribe(llm, decoded, options):
            last = item
        return last

    want = asyncio.run(ours(TranscriptionOptions(language="en")))  # the engine's own loop
    got = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                             language="en")
    assert got.text == want.text
    assert isinstance(got.text, str)
    verbose = client.audio.transcriptions.create(
        model="whisper", file=("a.wav", data), language="en", response_format="verbose_json",
        temperature=T,
        timestamp_granularities=["segment"])
    assert verbose.language == "en" and verbose.duration == pytest.approx(2.0)
    assert verbose.segments and all(0 <= s.start <= s.end <= 2.0 for s in verbose.segments)
    srt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                             language="en", response_format="srt",
                                             temperature=T)
    assert srt.startswith("1\n00:00:0") and " --> " in srt
    vtt = client.audio.transcriptions.create(model="whisper", file=("a.wav", data),
                                             language="en", response_format="vtt",
                                             temperature=T)
    assert vtt.startswith("WEBVTT\n\n00:00:0")
    text = client.audio.translations.create(model="whisper", file=("a.wav", data),
                                            response_format="text", temperature=T)
    assert isinstance(text, str)


def test_word_timestamps_in_verbose_json(server):
    """timestamp_granularities=["word"]: OpenAI's `words` (no segments unless asked), the words
    the engine's own loop finds, in order, inside the clip, joining to the text."""
    llm, client = server
    data = wav(CLIP)
    decoded = np.asarray(soundfile.read(io.BytesIO(data), dtype="float32")[0])

    async def ours(options):
        return [item async for item in transcribe(llm, decoded, options)][-1]

    want = asyncio.run(ours(TranscriptionOptions(language="en", timestamps=True,
                                                 temperatures=(T,), word_timestamps=True)))
    got = client.audio.transcriptions.create(
        model="whisper", file=("a.wav", data), language="en", response_format="verbose_json",
        temperature=T, timestamp_granularities=["word"])
    assert got.segments is None and got.text == want.text
    assert [(w.word, w.start, w.end) for w in got.words] == [
        (w.word.strip(), w.start, w.end) for w in want.words]
    assert len(want.words) > 1 and "".join(w.word for w in want.words).strip() == want.text
    assert all(0.0 <= w.start <= w.end <= 2.0 for w in got.words)
    assert [w.start for w in got.words] == sorted(w.start for w in got.words)
    both = client.audio.transcriptions.create(
        model="whisper", file=("a.wav", data), language="en", response_format="verbose_json",
        temperature=T, timestamp_granularities=["word", "segment"])
    assert both.words == got.words and both.segments


def test_a_long_clip_is_cut_into_windows(server):
    _, client = server
    long = np.tile(CLIP, 18)  # 36 s
    out = client.audio.transcriptions.create(model="whisper", file=("a.wav", wav(long)),
                                             language="de", response_format="verbose_json",
                                             temperature=T)
    assert out.duration == pytest.approx(36.0)
    assert any(s.start >= 30.0 for s in out.segments)  # the second window's segment(s)


def test_long_form_windows_start_at_the_last_complete_segment(server):
    """A 36 s clip with timestamps: the first window's segments are its tokens cut as
    transformers cuts them, the second window starts where the last complete one ended, and
    the second window's prompt carries the first's segments (timestamps included)."""
    from engine.sampling_params import SamplingParams
    from engine.transcription import WINDOW, previous_tokens, split_segments, whisper_tokens
    from models.whisper.prompt import decoder_prompt

    llm, _ = server
    long = np.tile(CLIP, 18)
    options = TranscriptionOptions(language="en", timestamps=True, temperatures=(0.0,),
                                   no_speech_threshold=None)

    async def run():
        items = [item async for item in transcribe(llm, long, options)]
        ids = whisper_tokens(llm)
        prompt = decoder_prompt(ids, "en", timestamps=True)
        params = SamplingParams(max_tokens=24 - len(prompt), temperature=0, logprobs=0,
                                token_rules=ids.rules(True), skip_special_tokens=False)
        request = {"prompt_token_ids": prompt, "multi_modal_data": {"audio": [
            (long[:WINDOW], RATE)]}}
        first = [out async for out in llm.generate(request, params, "first-window")][-1]
        return items[-1], ids, first.outputs[0].token_ids

    transcript, ids, tokens = asyncio.run(run())
    tokens = tokens[:-1] if tokens and tokens[-1] == ids.end else tokens
    cuts, advance = split_segments(tokens, ids.timestamp_begin, 0.0, 3000)
    assert 0 < advance < 3000  # cut off mid-window: the unfinished segment is decoded again
    assert len(transcript.windows) >= 2
    head = transcript.segments[:len(cuts)]
    assert [s.tokens for s in head] == [c.tokens for c in cuts]
    assert [(s.start, s.end) for s in head] == [(c.start, c.end) for c in cuts]
    assert transcript.windows[1].start == pytest.approx(advance / 100)
    assert all(s.seek == advance for s in transcript.segments[len(cuts):][:1])
    assert previous_tokens(cuts, ids.timestamp_begin)  # what the second window's prompt holds


def test_bad_uploads_are_refused_naming_the_problem(server):
    _, client = server
    with pytest.raises(openai.BadRequestError, match="could not decode"):
        client.audio.transcriptions.create(model="whisper", file=("a.wav", b"RIFF" + bytes(64)))
    with pytest.raises(openai.BadRequestError, match="response_format must be one of"):
        client.audio.transcriptions.create(model="whisper", file=("a.wav", wav(CLIP)),
                                           response_format="docx")
    with pytest.raises(openai.BadRequestError, match="word timestamps come in response_format "
                       "verbose_json, got 'json'"):
        client.audio.transcriptions.create(model="whisper", file=("a.wav", wav(CLIP)),
                                           timestamp_granularities=["word"])
    with pytest.raises(openai.APIStatusError, match=f"limit of {LIMIT} bytes") as e:
        client.audio.transcriptions.create(model="whisper",
                                           file=("a.wav", wav(np.zeros(RATE * 130, np.float32))))
    assert e.value.status_code == 413


def test_dictation_writes_the_transcript_into_the_message(server, tmp_path):
    from ui.dictation import Dictation

    llm, _ = server
    path = tmp_path / "speech.wav"
    fresh = (0.3 * np.random.default_rng(11).standard_normal(RATE)).astype(np.float32)
    path.write_bytes(wav(fresh))  # a clip the other tests have not sent: not in the cache yet
    dictation = Dictation(llm, "whisper")
    draft = {"text": "Note:", "files": ["x.png"]}
    first, panel = asyncio.run(dictation.into_message(str(path), draft, "en"))
    assert first["files"] == ["x.png"] and first["text"].startswith("Note:")
    assert "language en" in panel and "(encoded)" in panel
    again, panel = asyncio.run(dictation.into_message(str(path), None, "en"))
    assert "(cache hit)" in panel  # the clip's encoder states were kept
    assert again["text"] == first["text"].removeprefix("Note:").strip()
