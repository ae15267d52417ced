"""Speech to text with a Whisper engine: a clip of any length transcribed (or translated into
English) window by window, as openai-whisper and transformers' long-form generation do.

Each 30 s window is one engine request (models/whisper/processor.py); concurrent clips' windows
batch in the engine with everything else. The decoder prompt (models/whisper/prompt.py) carries
the language (detected from the first window when none is given on a multilingual model: the
most likely language token after `<|startoftranscript|>`), the task, `<|notimestamps|>` unless
timestamps are asked for, and after `<|startofprev|>` the user's prompt and the tokens of the
previous windows' segments (timestamps included, the last 223, as transformers'
`condition_on_prev_tokens` and openai-whisper's `condition_on_previous_text`; dropped after a
window decoded at temperature 0.5 or more). The generation config's token rules apply to every
step (models/whisper/rules.py: suppressed tokens, and with timestamps the timestamp rules), so
greedy tokens are transformers' `generate`'s.

With timestamps, a window's tokens split into segments as transformers' `_retrieve_segment`
does (`split_segments`): at each pair of consecutive timestamps; the next window starts at the
last complete segment's end timestamp, or after the whole window when it ended on a single
timestamp or had no pair. Without, each window is one segment. A window whose text compresses
more than 2.4 times (repetition) or whose mean log-probability is below -1 is decoded again at
the next temperature of the fallback list (sampled with a fixed seed per attempt: a clip
transcribes alike every time). Each window's no-speech probability is that of
`<|nocaptions|>` after `<|startoftranscript|>` (one more one-token request, the encoder's states
cached); a window above 0.6 whose mean log-probability is also below -1 is skipped as silence
(openai-whisper's defaults).

With word timestamps (`word_timestamps`, which needs the generation config's
`alignment_heads`, as transformers does), once a window's tokens are decided one teacher-forced
pass of the decoder over its prompt and tokens, against the window's cached encoder states,
returns the alignment heads' cross-attention probabilities (AsyncLLM.cross_attention_weights);
token times come from them as transformers' `_extract_token_timestamps` computes them
(models/whisper/timing.py: standardized per head along the tokens, median-filtered, averaged,
dynamic time warping), and each segment's text tokens are grouped into words as openai-whisper
and transformers' tokenizer group them (models/whisper/words.py). A word spans from the time of
the token before its first token to the time of its last token (transformers' pipeline), within
the clip.

Past a clip's first window (and for its first, when it is longer than one), each request sends
the whole clip and the window's first 10 ms frame (`WindowAudio`): the log-mel features are
computed once over the whole clip and sliced per window, zero-padded past the clip's end
(models/whisper/processor.py), as transformers' long-form generation and openai-whisper compute
them (the -8 floor under the clip's peak, not a window's). A clip of one window or less is sent
alone for its first window, as their short-form path takes it.

Not built: beam search.
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
from models.whisper.timing import MEDIAN_FILTER_WIDTH, token_times
from models.whisper.words import Decode, group_words

RATE = 16000
WINDOW_S = 30
WINDOW = WINDOW_S * RATE
FRAME = RATE // 100  # samples per 10 ms log-mel frame (the unit of `seek`)
SECONDS_PER_TIMESTAMP = 0.02
FRAMES_PER_TIMESTAMP = 2
PREVIOUS_TOKENS = 223  # max_target_positions // 2 - 1 (transformers and openai-whisper)
SAMPLE_LEN = 224  # tokens per window at most (openai-whisper: n_text_ctx // 2)
TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
NO_SPEECH_BIAS = 100.0  # the no-speech token drawn, its probability read unbiased


@dataclass(frozen=True)
class TranscriptionOptions:
    """What a request asks: the task, the language (None: detected), a prompt, the fallback
    temperatures (the first is tried first), whether the segments carry timestamps, and
    openai-whisper's thresholds (None: that check is off)."""

    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    temperatures: tuple[float, ...] = TEMPERATURES
    timestamps: bool = False
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6
    condition_on_previous_text: bool = True
    word_timestamps: bool = False

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.task!r}")
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise ValueError(f"temperatures must be in [0, 2], got {self.temperatures}")
        if self.no_speech_threshold is not None and not 0.0 <= self.no_speech_threshold <= 1.0:
            raise ValueError(f"no_speech_threshold must be in [0, 1], got "
                             f"{self.no_speech_threshold}")


@dataclass(frozen=True)
class Word:
    """A word and its times (seconds from the clip's start); `word` keeps its leading space, so
    a segment's words join to its text."""

    word: str
    start: float
    end: float


@dataclass
class Segment:
    """A stretch of the transcript with its times (seconds from the clip's start), shaped as
    OpenAI's verbose_json segments: `tokens` include its timestamp tokens, the other fields are
    its window's."""

    id: int
    seek: int  # the window's start, in 10 ms mel frames (openai's unit)
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] = field(default_factory=list)  # with word timestamps only


@dataclass
class Window:
    """One decoded window, for the panels: where it starts, what it took."""

    start: float
    seconds: float  # wall time of its decode (all attempts, the words' alignment pass)
    attempts: int
    temperature: float
    cache_hit: bool | None  # whether the encoder's states for it were in the cache
    item: str = ""  # the encoder cache's key for the window (the clip's content hash)
    skipped: bool = False  # judged silence (no-speech probability and low log-probability)


@dataclass
class Transcript:
    text: str
    language: str | None
    duration: float
    segments: list[Segment] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)

    @property
    def words(self) -> list[Word]:
        """Every segment's words, in order (empty without word timestamps)."""
        return [w for s in self.segments for w in s.words]


@dataclass(frozen=True)
class Cut:
    """One segment of a window: its times (seconds from the clip's start) and tokens (its
    timestamps included)."""

    start: float
    end: float
    tokens: list[int]


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


def split_segments(tokens: Sequence[int], begin: int, offset: float, frames: int
                   ) -> tuple[list[Cut], int]:
    """A window's generated tokens (its final `<|endoftext|>` removed) -> its segments, and how
    many 10 ms frames the next window starts after this one's start, as transformers'
    `_retrieve_segment` does. `begin`: `<|0.00|>`'s id; `offset`: the window's start (s);
    `frames`: the window's length in frames."""
    stamp = [t >= begin for t in tokens]
    single_ending = stamp[-2:] == [False, True]
    slices = [i + 1 for i in range(len(stamp) - 1) if stamp[i] and stamp[i + 1]]
    if not slices:  # no pair: the whole window is one segment, up to its last timestamp
        stamps = [t for t in tokens if t >= begin]
        end = frames / 100
        if stamps and stamps[-1] != begin:
            end = (stamps[-1] - begin) * SECONDS_PER_TIMESTAMP
        return [Cut(offset, offset + end, list(tokens))], frames
    if single_ending:
        slices.append(len(tokens))
    else:  # the last pair's second timestamp closes the last segment
        slices[-1] += 1
    cuts, last = [], 0
    for n, cut in enumerate(slices):
        part = list(tokens[last:cut])
        closing = part[-1] if n < len(slices) - 1 or single_ending else part[-2]
        cuts.append(Cut(offset + (part[0] - begin) * SECONDS_PER_TIMESTAMP,
                        offset + (closing - begin) * SECONDS_PER_TIMESTAMP, part))
        last = cut
    if single_ending:  # nothing spoken after the last timestamp: the whole window is done
        return cuts, frames
    # the unfinished text after the last pair is dropped; the next window starts at the pair
    return cuts, (tokens[last - 2] - begin) * FRAMES_PER_TIMESTAMP


def previous_tokens(cuts: Sequence[Cut], begin: int) -> list[int]:
    """The segments' tokens as the next window's prompt continues them: a segment closed by two
    timestamps contributes only the first (transformers' `skip_ending_double_timestamps`)."""
    out: list[int] = []
    for cut in cuts:
        doubled = len(cut.tokens) > 2 and cut.tokens[-2] >= begin
        out += cut.tokens[:-1] if doubled else cut.tokens
    return out


@dataclass(frozen=True)
class WindowAudio:
    """What a window's requests send: a clip of at most one window as it is (`first_frame`
    None), else the whole clip and the window's first 10 ms frame in it."""

    samples: np.ndarray
    first_frame: int | None = None

    @classmethod
    def of(cls, clip: np.ndarray, seek: int) -> WindowAudio:
        """The window of `clip` starting at sample `seek` (a whole number of frames): the clip
        alone when it is one window from its start, else a slice of the whole clip's."""
        if seek == 0 and len(clip) <= WINDOW:
            return cls(clip)
        return cls(clip, seek // FRAME)


async def detect_language(llm: Any, ids: WhisperTokens, clip: np.ndarray) -> str:
    """The most likely language token after `<|startoftranscript|>` for the clip's first
    window (every language token raised by the same bias: their order is the model's)."""
    if not ids.multilingual:
        return "en"
    bias = tuple((token, 100.0) for token in ids.languages.values())
    params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=bias,
                            skip_special_tokens=False)
    out = await _last(llm.generate(_request([ids.start], WindowAudio.of(clip, 0)), params,
                                   f"lang-{uuid.uuid4().hex[:12]}"))
    token = out.outputs[0].token_ids[0]
    return next(lang for lang, t in ids.languages.items() if t == token)


async def no_speech_probability(llm: Any, ids: WhisperTokens, prompt: Sequence[int],
                                window: WindowAudio, request_id: str) -> float:
    """The probability of `<|nocaptions|>` right after `<|startoftranscript|>` (the model's
    own, before any rule), for the decoder prompt `prompt` (cut after its start token)."""
    token = ids.no_timestamps - 1
    head = list(prompt[:list(prompt).index(ids.start) + 1])
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0,
                            logit_bias=((token, NO_SPEECH_BIAS),), skip_special_tokens=False)
    out = (await _last(llm.generate(_request(head, window), params, request_id))).outputs[0]
    if out.token_ids[0] != token:  # more than 100 below the best: a probability under e^-100
        return 0.0
    return float(np.exp(out.logprobs[0][token]))


def alignment_heads(llm: Any, ids: WhisperTokens) -> tuple[tuple[int, int], ...]:
    """The (decoder layer, head) pairs word timestamps read, from the generation config; a
    ValueError naming the setting when it has none (transformers refuses too)."""
    if not ids.alignment_heads:
        raise ValueError(f"model {llm.engine.model_id} has no alignment_heads in its generation "
                         "settings (generation_config.json, or a CTranslate2 folder's "
                         "config.json): word timestamps read those cross-attention heads")
    return ids.alignment_heads


async def window_token_times(llm: Any, prompt: Sequence[int], generated: Sequence[int],
                             window: WindowAudio, frames: int,
                             heads: Sequence[tuple[int, int]]) -> np.ndarray:
    """The times (s from the window's start) of a window's generated tokens (its end token
    included, if sampled) from the alignment heads' cross-attention over the window (of
    `frames` 10 ms frames of audio)."""
    rows = list(prompt) + list(generated[:-1])  # the last token is fed to nothing
    weights = await llm.cross_attention_weights(_request(rows, window), heads)
    width = getattr(llm.engine.setup.hf_config, "median_filter_width", MEDIAN_FILTER_WIDTH)
    return token_times(weights, len(prompt), frames, width)


def cut_words(cut: Cut, first: int, times: np.ndarray, ids: WhisperTokens, decode: Decode,
              language: str | None, offset: float, duration: float) -> list[Word]:
    """A segment's words with their times; `first`: the index of its first token among the
    window's generated tokens (whose times `times` holds); `offset`: the window's start."""
    where = [first + i for i, t in enumerate(cut.tokens) if t < ids.end]
    text = [cut.tokens[i - first] for i in where]
    words = []
    for group in group_words(text, decode, language):
        a, b = where[group.indices[0]], where[group.indices[-1]]
        start = offset + (float(times[a - 1]) if a > 0 else 0.0)
        end = offset + float(times[b])
        words.append(Word(group.text, min(start, duration), min(end, duration)))
    return words


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
    rules = ids.rules(options.timestamps)
    heads = alignment_heads(llm, ids) if options.word_timestamps else ()
    transcript = Transcript("", language if ids.multilingual else "en", duration)
    kept = min(PREVIOUS_TOKENS, llm.engine.max_model_len // 2 - 1)  # transformers' cut-off
    seek = 0  # in samples; a whole number of frames
    while seek < len(samples):
        window = samples[seek : seek + WINDOW]
        if len(window) < FRAME:  # under one 10 ms frame: nothing left to hear
            break
        frames = -(-len(window) // FRAME)
        audio = WindowAudio.of(samples, seek)
        prompt = decoder_prompt(ids, language, options.task, options.timestamps,
                                history[-kept:] if kept > 0 else [])
        t0 = time.perf_counter()
        attempts, out = 0, None
        for temperature in options.temperatures:
            attempts += 1
            room = llm.engine.max_model_len - len(prompt)
            # Seeded: a clip transcribes alike every time, fallbacks included.
            params = SamplingParams(max_tokens=min(SAMPLE_LEN, room), temperature=temperature,
                                    logprobs=0, token_rules=rules, skip_special_tokens=False,
                                    seed=attempts if temperature else None)
            out = await _last(llm.generate(_request(prompt, audio), params,
                                           f"{rid}-{seek}-{attempts}"))
            if attempts == 1:  # the window's encoder entry: found or computed by this one
                (item,) = out.multi_modal_placeholders
            generated = list(out.outputs[0].token_ids)
            tokens = list(generated)
            if tokens and tokens[-1] == ids.end:
                tokens.pop()
            text = tok.decode([t for t in tokens if t < ids.end])
            # openai-whisper's: the end token's log-probability counted, over len + 1
            logprob = sum(next(iter(e.values())) for e in out.outputs[0].logprobs or [])
            avg = logprob / (len(tokens) + 1)
            ratio = compression_ratio(text)
            repetitive = (options.compression_ratio_threshold is not None
                          and ratio > options.compression_ratio_threshold)
            unlikely = options.logprob_threshold is not None and avg < options.logprob_threshold
            if not (repetitive or unlikely):
                break
        no_speech = await no_speech_probability(llm, ids, prompt, audio, f"{rid}-{seek}-ns")
        offset = seek / RATE
        record = Window(offset, time.perf_counter() - t0, attempts, temperature,
                        item.cache_hit, item.identifier)
        transcript.windows.append(record)
        if options.no_speech_threshold is not None and no_speech > options.no_speech_threshold \
                and (options.logprob_threshold is None or avg <= options.logprob_threshold):
            record.skipped = True  # silence: nothing said in this window
            seek += frames * FRAME
            continue
        if options.timestamps:
            cuts, advance = split_segments(tokens, ids.timestamp_begin, offset, frames)
        else:
            cuts, advance = [Cut(offset, offset + len(window) / RATE, tokens)], frames
        times = None
        if heads and generated:
            times = await window_token_times(llm, prompt, generated, audio, frames, heads)
            record.seconds = time.perf_counter() - t0  # the alignment pass counted
        first = 0  # the cut's first token among the window's generated tokens
        for cut in cuts:
            end = min(cut.end, duration)  # a timestamp past the clip's end
            segment = Segment(len(transcript.segments), seek // FRAME, min(cut.start, end), end,
                              tok.decode([t for t in cut.tokens if t < ids.end]),
                              list(cut.tokens), temperature, avg, ratio, no_speech)
            if times is not None:
                segment.words = cut_words(cut, first, times, ids, tok.decode,
                                          transcript.language, offset, duration)
            first += len(cut.tokens)
            transcript.segments.append(segment)
            yield segment
        if options.condition_on_previous_text and temperature < 0.5:
            history += previous_tokens(cuts, ids.timestamp_begin)
        else:  # a window decoded hot: the next one starts afresh (openai-whisper's reset)
            history = []
        seek += max(advance, 1) * FRAME
    transcript.text = "".join(s.text for s in transcript.segments).strip()
    yield transcript


def _request(prompt: list[int], window: WindowAudio) -> dict:
    request = {"prompt_token_ids": prompt,
               "multi_modal_data": {"audio": [(window.samples, RATE)]}}
    if window.first_frame is not None:
        request["mm_processor_kwargs"] = {"clip_window": window.first_frame}
    return request


async def _last(outputs: AsyncIterator) -> Any:
    last = None
    async for out in outputs:
        last = out
    if last is None or last.error:
        raise RuntimeError(f"transcription request failed: {getattr(last, 'error', 'no output')}")
    return last
