"""Speech to text with a Whisper engine: a clip of any length transcribed (or translated into
English) window by window, as openai-whisper and transformers' long-form generation do.

Each 30 s window is one engine request (models/whisper/processor.py); concurrent clips' windows
batch in the engine with everything else. The decoder prompt (models/whisper/prompt.py) carries
the language (detected from the first window when none is given on a multilingual model: the
most likely language token after `<|startoftranscript|>`), the task, `<|notimestamps|>` unless
timestamps are asked for, and after `<|startofprev|>` the user's prompt and the text of the
previous windows (its last 223 tokens). The generation config's suppressed tokens get a bias of
-100 (exp(-100): never drawn). With timestamps, the window's tokens split into segments at
timestamp pairs and the next window starts at the last complete segment's end (the whole
window when it ended on a lone timestamp, as openai-whisper seeks); without, each window is a
segment. A window whose text compresses more than 2.4 times (repetition) or whose mean
log-probability is below -1 is decoded again at the next temperature of the fallback list
(sampled with a fixed seed per attempt: a clip transcribes alike every time).

Not built: the timestamp logits rules (a timestamp forced to pair, monotonic timestamps, the
first timestamp bounded), the first-token suppression (`begin_suppress_tokens`), word-level
timestamps and the no-speech probability; greedy tokens then follow the model alone.
"""

from __future__ import annotations

import time
import uuid
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.sampling_params import SamplingParams
from models.checkpoint import GENERATION_CONFIG
from models.whisper.prompt import TASKS, WhisperTokens, decoder_prompt

RATE = 16000
WINDOW_S = 30
WINDOW = WINDOW_S * RATE
SECONDS_PER_TIMESTAMP = 0.02
PREVIOUS_TOKENS = 223  # openai-whisper: n_text_ctx // 2 - 1
SAMPLE_LEN = 224  # tokens per window at most (openai-whisper: n_text_ctx // 2)
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
SUPPRESSED = -100.0


@dataclass(frozen=True)
class TranscriptionOptions:
    """What a request asks: the task, the language (None: detected), a prompt, the fallback
    temperatures (the first is tried first), whether the segments carry timestamps."""

    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperatures: tuple[float, ...] = TEMPERATURES
    timestamps: bool = False
    compression_ratio_threshold: float = 2.4
    logprob_threshold: float = -1.0

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise ValueError(f"temperatures must be in [0, 2], got {self.temperatures}")


@dataclass
class Segment:
    """A stretch of the transcript with its times (seconds from the clip's start)."""

    id: int
    seek: int  # the window's start, in 10 ms mel frames (openai's unit)
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float


@dataclass
class Window:
    """One decoded window, for the panels: where it starts, what it took."""

    start: float
    seconds: float  # wall time of its decode (all attempts)
    attempts: int
    temperature: float
    cache_hit: bool | None  # whether the encoder's states for it were in the cache
    item: str = ""  # the encoder cache's key for the window (the clip's content hash)


@dataclass
class Transcript:
    text: str
    language: str | None
    duration: float
    segments: list[Segment] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)


def whisper_tokens(llm: Any) -> WhisperTokens:
    """The special tokens of `llm`'s model (an AsyncLLM or LLM), or a ValueError when it is not
    a speech-to-text model."""
    setup = llm.engine.setup
    if setup.architecture != "WhisperForConditionalGeneration":
        raise ValueError(f"model {llm.engine.model_id} is not a speech-to-text model "
                         f"({setup.architecture}); serve a Whisper checkpoint")
    return WhisperTokens.from_generation_config(setup.files.json(GENERATION_CONFIG))


def compression_ratio(text: str) -> float:
    raw = text.encode()
    return len(raw) / max(len(zlib.compress(raw)), 1)


def split_segments(tokens: Sequence[int], ids: WhisperTokens, offset: float
                   ) -> tuple[list[tuple[float, float, list[int]]], float | None]:
    """A window's tokens with timestamps -> (start, end, text tokens) segments, and where the
    next window starts (seconds into this one; None: after the whole window)."""
    begin = ids.timestamp_begin
    segments, current, start = [], [], None
    last_end = None
    for t in tokens:
        if t >= begin:
            time_s = (t - begin) * SECONDS_PER_TIMESTAMP
            if start is None:
                start = time_s
            else:
                segments.append((offset + start, offset + time_s, current))
                last_end, current, start = time_s, [], None
        elif t < ids.end:  # text (the special tokens all follow <|endoftext|>)
            current.append(t)
    if current:  # text after the last timestamp: up to the window's end
        segments.append((offset + (start or 0.0), offset + WINDOW_S, current))
        return segments, None
    ended_alone = start is not None  # a lone timestamp closes the window
    return segments, None if ended_alone or last_end is None else last_end


async def detect_language(llm: Any, ids: WhisperTokens, clip: np.ndarray) -> str:
    """The most likely language token after `<|startoftranscript|>` for the clip's first
    window (every language token raised by the same bias: their order is the model's)."""
    if not ids.multilingual:
        return "en"
    bias = tuple((token, 100.0) for token in ids.languages.values())
    params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=bias,
                            skip_special_tokens=False)
    out = await _last(llm.generate(_request([ids.start], clip[:WINDOW]), params,
                                   f"lang-{uuid.uuid4().hex[:12]}"))
    token = out.outputs[0].token_ids[0]
    return next(lang for lang, t in ids.languages.items() if t == token)


async def transcribe(llm: Any, samples: np.ndarray, options: TranscriptionOptions,
                     request_id: str | None = None) -> AsyncIterator[Segment | Transcript]:
    """Segments as each window is decoded, then the whole Transcript. `samples`: mono float32
    at 16 kHz."""
    ids = whisper_tokens(llm)
    rid = request_id or uuid.uuid4().hex
    tok = llm.tokenizer
    duration = len(samples) / RATE
    language = options.language
    if language is None and ids.multilingual:
        language = await detect_language(llm, ids, samples)
    history = tok.encode(" " + options.prompt.strip(), add_special_tokens=False) \
        if options.prompt else []
    suppress = tuple((t, SUPPRESSED) for t in ids.suppress if 0 <= t < len(tok))
    transcript = Transcript("", language if ids.multilingual else "en", duration)
    seek = 0
    while seek < len(samples):
        window = samples[seek : seek + WINDOW]
        if len(window) < RATE // 100:  # under one 10 ms frame: nothing left to hear
            break
        prompt = decoder_prompt(ids, language, options.task, options.timestamps,
                                history[-PREVIOUS_TOKENS:])
        t0 = time.perf_counter()
        attempts, out = 0, None
        for temperature in options.temperatures:
            attempts += 1
            # Seeded: a clip transcribes alike every time, fallbacks included.
            room = llm.engine.max_model_len - len(prompt)
            params = SamplingParams(max_tokens=min(SAMPLE_LEN, room), temperature=temperature,
                                    logprobs=0,
                                    logit_bias=suppress, skip_special_tokens=False,
                                    seed=attempts if temperature else None)
            out = await _last(llm.generate(_request(prompt, window), params,
                                           f"{rid}-{seek}-{attempts}"))
            if attempts == 1:  # the window's encoder entry: found or computed by this one
                (item,) = out.multi_modal_placeholders
            tokens = out.outputs[0].token_ids
            text_ids = [t for t in tokens if t < ids.end]
            text = tok.decode(text_ids)
            logprob = sum(next(iter(e.values())) for e in out.outputs[0].logprobs or [])
            avg = logprob / (len(tokens) + 1)
            ratio = compression_ratio(text)
            if ratio <= options.compression_ratio_threshold and (
                    avg >= options.logprob_threshold):
                break
        offset = seek / RATE
        if options.timestamps:
            parts, resume = split_segments(tokens, ids, offset)
        else:
            parts, resume = [(offset, offset + len(window) / RATE, text_ids)], None
        for start, end, part in parts:
            end = min(end, duration)  # a timestamp past the clip's end (no rule bounds it)
            start = min(start, end)
            segment = Segment(len(transcript.segments), seek // (RATE // 100), start, end,
                              tok.decode(part), list(part), temperature, avg, ratio)
            transcript.segments.append(segment)
            yield segment
        transcript.windows.append(Window(offset, time.perf_counter() - t0, attempts,
                                         temperature, item.cache_hit, item.identifier))
        history += text_ids
        advance = len(window) if resume is None or resume <= 0 else round(resume * RATE)
        seek += advance
    transcript.text = "".join(s.text for s in transcript.segments).strip()
    yield transcript


def _request(prompt: list[int], window: np.ndarray) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"audio": [(window, RATE)]}}


async def _last(outputs: AsyncIterator) -> Any:
    last = None
    async for out in outputs:
        last = out
    if last is None or last.error:
        raise RuntimeError(f"transcription request failed: {getattr(last, 'error', 'no output')}")
    return last
