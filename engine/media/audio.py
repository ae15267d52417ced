"""Decode audio, or take an in-memory waveform, as mono float32 samples at a requested rate."""

from __future__ import annotations

import io
import itertools
import math
from fractions import Fraction

import av
import numpy as np
import soundfile as sf

from engine.media.budget import RequestBudget
from engine.media.formats import (
    AUDIO_CODECS,
    SOUNDFILE_FORMATS,
    SOUNDFILE_SIGNATURES,
    check_codec,
    open_container,
)
from engine.media.limits import MediaError, MediaLimits, decoder_errors
from models.media_inputs import AudioClip

DEFAULT_SAMPLE_RATE = 16000
_BLOCK_FRAMES = 1 << 16
# Samples (frames x channels) read from libsndfile at once: a header claiming hundreds of
# channels cannot make one block large.
_BLOCK_SAMPLES = 1 << 18
_FLOAT32_BYTES = 4


def check_sample_rate(rate: object, limits: MediaLimits, item: str, what: str) -> int:
    """``rate`` as an int, refused outside [min_audio_sample_rate, max_audio_sample_rate]."""
    low, high = limits.min_audio_sample_rate, limits.max_audio_sample_rate
    if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or not low <= rate <= high:
        raise MediaError(
            f"{item}: {what} {rate!r} Hz is outside the allowed range {low}-{high} Hz "
            "(MediaLimits.min_audio_sample_rate/max_audio_sample_rate)"
        )
    return int(rate)


def decode_audio(
    data: bytes,
    *,
    sample_rate: int,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None = None,
) -> AudioClip:
    """Decode ``data`` to mono at ``sample_rate`` Hz.

    libsndfile reads WAV, FLAC and Ogg (recognised by their signatures; it is handed nothing
    else); everything else (MP3, AAC, M4A, Opus in WebM, the audio track of a video) goes
    through FFmpeg, in an allowed container and codec. Duration and sample rate are checked
    from the header where it has them, and the duration again while decoding; the output is
    reserved in ``budget`` (by default a budget of its own) from the header's duration and
    again as it grows.
    """
    output = _Output(budget or RequestBudget.for_limits(limits), sample_rate, item)
    with decoder_errors(item, "audio"):
        sound = None
        if data[:4] in SOUNDFILE_SIGNATURES:
            try:
                sound = sf.SoundFile(io.BytesIO(data))
            except sf.SoundFileError:
                sound = None
        if sound is None or sound.format not in SOUNDFILE_FORMATS:
            if sound is not None:
                sound.close()
            return _decode_with_ffmpeg(data, sample_rate, limits, item, output)
        with sound:
            return _decode_with_soundfile(sound, sample_rate, limits, item, output)


class _Output:
    """Reserves a clip's float32 output in the request budget as its known duration grows."""

    def __init__(self, budget: RequestBudget, sample_rate: int, item: str) -> None:
        self._budget = budget
        self._rate = sample_rate
        self._item = item

    def reserve(self, seconds: float) -> None:
        samples = math.ceil(seconds * self._rate) + 1
        self._budget.reserve_decoded(samples * _FLOAT32_BYTES, self._item)


def clip_from_waveform(
    waveform: np.ndarray,
    source_rate: int,
    *,
    sample_rate: int,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None = None,
) -> AudioClip:
    """Resample an in-memory waveform to mono at ``sample_rate`` Hz.

    ``waveform`` is [N] or two-dimensional, [C, N] or [N, C], the shorter axis taken as the
    channels. Integer samples are scaled to [-1, 1) by their type's range.
    """
    source_rate = check_sample_rate(source_rate, limits, item, "source sample rate")
    samples = _as_float32(waveform, item)
    if samples.ndim == 2:
        channel_axis = 0 if samples.shape[0] <= samples.shape[1] else 1
        samples = samples.mean(axis=channel_axis, dtype=np.float32)
    if samples.ndim != 1:
        raise MediaError(
            f"{item}: waveforms must be shaped [N], [C, N] or [N, C], got {list(waveform.shape)}"
        )
    _check_duration(len(samples) / source_rate, limits, item)
    output = _Output(budget or RequestBudget.for_limits(limits), sample_rate, item)
    output.reserve(len(samples) / source_rate)
    resampler = _MonoResampler(source_rate, sample_rate)
    resampler.push(samples)
    return _finished(resampler, item)


def _decode_with_soundfile(
    sound: sf.SoundFile, sample_rate: int, limits: MediaLimits, item: str, output: _Output
) -> AudioClip:
    source_rate = check_sample_rate(sound.samplerate, limits, item, "sample rate")
    _check_duration(sound.frames / source_rate, limits, item)
    output.reserve(sound.frames / source_rate)
    resampler = _MonoResampler(source_rate, sample_rate)
    read = 0
    blocksize = max(1, _BLOCK_SAMPLES // max(sound.channels, 1))
    # The header's frame count may be wrong, so the duration is checked again while reading.
    for block in sound.blocks(blocksize=blocksize, dtype="float32", always_2d=True):
        read += len(block)
        _check_duration(read / source_rate, limits, item)
        output.reserve(read / source_rate)
        resampler.push(block.mean(axis=1, dtype=np.float32))
    return _finished(resampler, item)


def decode_sound_track(
    data: bytes,
    *,
    sample_rate: int,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None = None,
) -> AudioClip | None:
    """Decode the first audio stream of a video's ``data`` to mono at ``sample_rate`` Hz;
    None when the container has no audio stream.

    The FFmpeg path of ``decode_audio``, with its codec, sample-rate and duration checks and
    its reservation in ``budget``; a refusal reads "<item>: its sound track: ...", and the
    sound is reserved apart from the item's frames.
    """
    track = f"{item}: its sound track"
    output = _Output(budget or RequestBudget.for_limits(limits), sample_rate, track)
    with decoder_errors(track, "audio"), open_container(data, track, "audio") as container:
        if not container.streams.audio:
            return None
        return _decode_stream(container, sample_rate, limits, track, output)


def _decode_with_ffmpeg(
    data: bytes, sample_rate: int, limits: MediaLimits, item: str, output: _Output
) -> AudioClip:
    with open_container(data, item, "audio") as container:
        if not container.streams.audio:
            raise MediaError(f"{item}: the file contains no audio stream")
        return _decode_stream(container, sample_rate, limits, item, output)


def _decode_stream(
    container: av.container.InputContainer,
    sample_rate: int,
    limits: MediaLimits,
    item: str,
    output: _Output,
) -> AudioClip:
    """Decode ``container``'s first audio stream, checked against the limits as it goes."""
    stream = container.streams.audio[0]
    check_codec(stream, AUDIO_CODECS, item, "audio")
    check_sample_rate(stream.sample_rate, limits, item, "sample rate")
    if stream.duration and stream.time_base:
        declared = float(stream.duration * stream.time_base)
    elif container.duration:
        declared = container.duration / av.time_base
    else:
        declared = 0.0
    _check_duration(declared, limits, item)
    output.reserve(declared)
    # Planar float32 at the source rate and layout; downmix and rate change follow.
    to_float = av.AudioResampler(format="fltp")
    resampler: _MonoResampler | None = None
    seconds = 0.0
    # The trailing None flushes the converter.
    for frame in itertools.chain(container.decode(stream), [None]):
        for converted in to_float.resample(frame):
            if resampler is None:
                rate = check_sample_rate(converted.sample_rate, limits, item, "sample rate")
                resampler = _MonoResampler(rate, sample_rate)
            seconds += converted.samples / converted.sample_rate
            _check_duration(seconds, limits, item)
            output.reserve(seconds)
            resampler.push(converted.to_ndarray().mean(axis=0, dtype=np.float32))
    if resampler is None:
        raise MediaError(f"{item}: the audio contains no samples")
    return _finished(resampler, item)


def _finished(resampler: _MonoResampler, item: str) -> AudioClip:
    samples = resampler.finish()
    if not len(samples):
        raise MediaError(f"{item}: the audio contains no samples")
    return AudioClip(samples=samples, sample_rate=resampler.target_rate)


def _check_duration(duration: float, limits: MediaLimits, item: str) -> None:
    if duration > limits.max_audio_duration_s:
        raise MediaError(
            f"{item}: duration {duration:.1f} s exceeds the limit of "
            f"{limits.max_audio_duration_s:g} s (MediaLimits.max_audio_duration_s)"
        )


def _as_float32(waveform: np.ndarray, item: str) -> np.ndarray:
    if waveform.dtype.kind in "iu":
        info = np.iinfo(waveform.dtype)
        # Unsigned PCM is centred on its midpoint.
        middle = (int(info.max) + 1) // 2 if waveform.dtype.kind == "u" else 0
        scale = float(info.max) + 1 - middle
        return ((waveform.astype(np.float64) - middle) / scale).astype(np.float32)
    if waveform.dtype.kind != "f":
        raise MediaError(f"{item}: waveforms must hold integer or float samples")
    samples = waveform.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise MediaError(f"{item}: the waveform contains NaN or infinite samples")
    return samples


class _MonoResampler:
    """Feeds mono float32 chunks at one rate through libswresample to another rate."""

    def __init__(self, source_rate: int, target_rate: int) -> None:
        self.target_rate = target_rate
        self._source_rate = source_rate
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=target_rate)
        self._pts = 0
        self._out: list[np.ndarray] = []

    def push(self, samples: np.ndarray) -> None:
        """Resample the next chunk: float32 [n]."""
        for start in range(0, len(samples), _BLOCK_FRAMES):
            chunk = np.ascontiguousarray(samples[start : start + _BLOCK_FRAMES])
            frame = av.AudioFrame.from_ndarray(chunk[None, :], format="flt", layout="mono")
            frame.sample_rate = self._source_rate
            frame.time_base = Fraction(1, self._source_rate)
            frame.pts = self._pts
            self._pts += len(chunk)
            self._collect(self._resampler.resample(frame))

    def finish(self) -> np.ndarray:
        """All resampled samples, float32 [round(n * target / source)] (after the flush)."""
        self._collect(self._resampler.resample(None))
        if not self._out:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(self._out)

    def _collect(self, frames: list[av.AudioFrame]) -> None:
        # Packed mono "flt" frames come out as [1, n].
        self._out.extend(f.to_ndarray()[0] for f in frames)
