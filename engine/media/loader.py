"""Load media items: route each source to its decoder and, for a whole request, decode every
item concurrently in worker threads, off the event loop, under the request-wide limits."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import numpy as np
from PIL import Image

from engine.media.audio import (
    DEFAULT_SAMPLE_RATE,
    AudioClip,
    check_sample_rate,
    clip_from_waveform,
    decode_audio,
    decode_sound_track,
)
from engine.media.budget import RequestBudget
from engine.media.image import decode_image, image_from_pixels
from engine.media.limits import MODALITIES, MediaError, MediaLimits
from engine.media.sampling import DEFAULT_FPS, VideoSampling, video_sampling
from engine.media.sources import read_source
from engine.media.video import VideoFrames, decode_video, frames_from_pixels

DEFAULT_LIMITS = MediaLimits()

# Bounded so that a burst of requests queues work instead of spawning threads; decoders
# release the GIL, so a few threads per core keep the cores busy.
_EXECUTOR = ThreadPoolExecutor(
    max_workers=max(4, min(16, 2 * (os.cpu_count() or 1))),
    thread_name_prefix="media-decode",
)

T = TypeVar("T")


# One item, blocking ---------------------------------------------------------------------


def load_image_sync(
    src: Any, *, limits: MediaLimits = DEFAULT_LIMITS, item: str = "image 1"
) -> Image.Image:
    """Load one image as a fully decoded, upright RGB PIL image.

    ``src``: a local path, ``file://``, ``http(s)://`` or ``data:`` URL, base64 text, bytes,
    a PIL image, or a uint8 array or tensor ([H, W], [H, W, C] or [C, H, W]).
    """
    return _image(src, limits, item, None)


def load_video_sync(
    src: Any,
    *,
    fps: float = DEFAULT_FPS,
    min_frames: int = 1,
    max_frames: int | None = None,
    audio_sample_rate: int | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
    item: str = "video 1",
) -> VideoFrames:
    """Sample one video at ``fps`` frames per second, clamped to [min_frames, max_frames]
    frames (``max_frames`` defaults to ``limits.max_video_frames``; a larger one is refused).

    ``src``: any encoded source ``load_image_sync`` takes, or in-memory frames: a uint8
    array or tensor [N, H, W, 3] or [N, 3, H, W], or a list of PIL images (played at
    ``fps``).

    ``audio_sample_rate`` (default None: frames only) also decodes the sound track of an
    encoded source, from the same bytes read once, as mono float32 at that rate into
    ``VideoFrames.audio`` with ``has_audio_track`` True; a source without one, or in-memory
    frames, give ``audio`` None and ``has_audio_track`` False. A sound track that is refused
    (codec, sample rate, ``limits.max_audio_duration_s``, corrupt data) raises MediaError.
    """
    sampling = video_sampling(
        fps=fps, min_frames=min_frames, max_frames=max_frames, limits=limits, item=item
    )
    audio_rate = _audio_rate(audio_sample_rate, limits, item)
    return _video(src, sampling, audio_rate, limits, item, None)


def load_audio_sync(
    src: Any,
    *,
    sample_rate: int = DEFAULT_SAMPLE_RATE,
    limits: MediaLimits = DEFAULT_LIMITS,
    item: str = "audio 1",
) -> AudioClip:
    """Load one audio item as mono float32 at ``sample_rate`` Hz.

    ``src``: any encoded source ``load_image_sync`` takes (an audio or video file), or a
    ``(waveform, sample_rate)`` tuple whose waveform, array or tensor, is [N], [C, N] or
    [N, C].
    """
    sample_rate = check_sample_rate(sample_rate, limits, item, "requested sample rate")
    return _audio(src, sample_rate, limits, item, None)


# One item, async ------------------------------------------------------------------------


async def load_image(
    src: Any, *, limits: MediaLimits = DEFAULT_LIMITS, item: str = "image 1"
) -> Image.Image:
    """``load_image_sync`` in a worker thread."""
    return await _in_worker(partial(load_image_sync, src, limits=limits, item=item))


async def load_video(
    src: Any,
    *,
    fps: float = DEFAULT_FPS,
    min_frames: int = 1,
    max_frames: int | None = None,
    audio_sample_rate: int | None = None,
    limits: MediaLimits = DEFAULT_LIMITS,
    item: str = "video 1",
) -> VideoFrames:
    """``load_video_sync`` in a worker thread (``audio_sample_rate``: its sound track too)."""
    return await _in_worker(
        partial(
            load_video_sync,
            src,
            fps=fps,
            min_frames=min_frames,
            max_frames=max_frames,
            audio_sample_rate=audio_sample_rate,
            limits=limits,
            item=item,
        )
    )


async def load_audio(
    src: Any,
    *,
    sample_rate: int = DEFAULT_SAMPLE_RATE,
    limits: MediaLimits = DEFAULT_LIMITS,
    item: str = "audio 1",
) -> AudioClip:
    """``load_audio_sync`` in a worker thread."""
    return await _in_worker(
        partial(load_audio_sync, src, sample_rate=sample_rate, limits=limits, item=item)
    )


# A whole request --------------------------------------------------------------------------


async def load_request_media(
    mm_data: Mapping[str, Any],
    *,
    limits: MediaLimits = DEFAULT_LIMITS,
    video_kwargs: Mapping[str, Any] | None = None,
    audio_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, list[Any]]:
    """Load every item of ``{"image": [...], "video": [...], "audio": [...]}`` concurrently.

    A list holds several items; any other value is one item (so a video given as frames is
    a list inside the list). Item counts are checked first; then each item is decoded in a
    worker thread and all of them are awaited together, their encoded bytes counted
    against ``limits.max_request_bytes``. ``video_kwargs`` (fps, min_frames, max_frames,
    spread, audio_sample_rate) and ``audio_kwargs`` (sample_rate) apply to every item of their
    modality; ``audio_sample_rate`` (default None: frames only) also decodes each encoded
    video's sound track from the same bytes, read once (see ``load_video_sync``). Returns the
    loaded items under the same keys, in order; the first failure raises its MediaError.
    """
    jobs = _plan(mm_data, limits, video_kwargs or {}, audio_kwargs or {})
    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(_EXECUTOR, job) for _, job in jobs]
    try:
        results = await asyncio.gather(*futures)
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return _by_modality(mm_data, jobs, results)


def load_request_media_sync(
    mm_data: Mapping[str, Any],
    *,
    limits: MediaLimits = DEFAULT_LIMITS,
    video_kwargs: Mapping[str, Any] | None = None,
    audio_kwargs: Mapping[str, Any] | None = None,
) -> dict[str, list[Any]]:
    """``load_request_media`` for callers without an event loop; blocks until done.

    Not to be called from a media worker thread: it waits on that same pool.
    """
    jobs = _plan(mm_data, limits, video_kwargs or {}, audio_kwargs or {})
    futures: list[Future[Any]] = [_EXECUTOR.submit(job) for _, job in jobs]
    try:
        results = [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return _by_modality(mm_data, jobs, results)


def _plan(
    mm_data: Mapping[str, Any],
    limits: MediaLimits,
    video_kwargs: Mapping[str, Any],
    audio_kwargs: Mapping[str, Any],
) -> list[tuple[str, Callable[[], Any]]]:
    """Check the counts and arguments, and bind one job per item, in request order."""
    unknown = sorted(set(mm_data) - set(MODALITIES))
    if unknown:
        raise MediaError(f"unknown modality {unknown[0]!r}; expected one of {MODALITIES}")
    items = {modality: _as_list(mm_data.get(modality)) for modality in MODALITIES}
    for modality, sources in items.items():
        if len(sources) > limits.max_items(modality):
            raise MediaError(
                f"the request has {len(sources)} {modality} items, more than the limit of "
                f"{limits.max_items(modality)} (MediaLimits.max_items_per_modality"
                f"[{modality!r}])"
            )
    unexpected = sorted(set(audio_kwargs) - {"sample_rate"})
    if unexpected:
        raise TypeError(f"unexpected audio_kwargs {unexpected}")
    budget = RequestBudget.for_limits(limits)
    jobs: list[tuple[str, Callable[[], Any]]] = []
    for modality, sources in items.items():
        for number, src in enumerate(sources, start=1):
            item = f"{modality} {number}"
            if modality == "image":
                job = partial(_image, src, limits, item, budget)
            elif modality == "video":
                options = dict(video_kwargs)
                audio_rate = _audio_rate(options.pop("audio_sample_rate", None), limits, item)
                sampling = video_sampling(**options, limits=limits, item=item)
                job = partial(_video, src, sampling, audio_rate, limits, item, budget)
            else:
                rate = audio_kwargs.get("sample_rate", DEFAULT_SAMPLE_RATE)
                rate = check_sample_rate(rate, limits, item, "requested sample rate")
                job = partial(_audio, src, rate, limits, item, budget)
            jobs.append((modality, job))
    return jobs


def _audio_rate(rate: object, limits: MediaLimits, item: str) -> int | None:
    """A video's validated ``audio_sample_rate``; None asks for no sound track."""
    if rate is None:
        return None
    return check_sample_rate(rate, limits, item, "requested audio sample rate")


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _by_modality(
    mm_data: Mapping[str, Any], jobs: list[tuple[str, Callable[[], Any]]], results: Sequence[Any]
) -> dict[str, list[Any]]:
    loaded: dict[str, list[Any]] = {modality: [] for modality in mm_data}
    for (modality, _), result in zip(jobs, results, strict=True):
        loaded[modality].append(result)
    return loaded


async def _in_worker(job: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, job)


# Routing ----------------------------------------------------------------------------------


def _image(src: Any, limits: MediaLimits, item: str, budget: RequestBudget | None) -> Image.Image:
    budget = budget or RequestBudget.for_limits(limits)
    pixels = src if isinstance(src, Image.Image) else _as_numpy(src)
    if pixels is not None:
        return image_from_pixels(pixels, limits=limits, item=item, budget=budget)
    data = read_source(src, limits=limits, item=item, budget=budget)
    return decode_image(data, limits=limits, item=item, budget=budget)


def _video(
    src: Any,
    sampling: VideoSampling,
    audio_rate: int | None,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget | None,
) -> VideoFrames:
    budget = budget or RequestBudget.for_limits(limits)
    pixels = _in_memory_frames(src)
    data = None
    if pixels is not None:
        video = frames_from_pixels(
            pixels, sampling=sampling, limits=limits, item=item, budget=budget
        )
    else:
        data = read_source(src, limits=limits, item=item, budget=budget)
        video = decode_video(data, sampling=sampling, limits=limits, item=item, budget=budget)
    if audio_rate is not None:
        if data is not None:
            video.audio = decode_sound_track(
                data, sample_rate=audio_rate, limits=limits, item=item, budget=budget
            )
        video.has_audio_track = video.audio is not None
    return video


def _in_memory_frames(src: Any) -> np.ndarray | list[Any] | None:
    """Frames given in memory (a PIL image, a list of images, arrays or tensors, an array or
    a tensor), tensors as arrays; None for an encoded source."""
    if isinstance(src, Image.Image):
        src = [src]
    if isinstance(src, list | tuple):
        return [_as_numpy(frame) if _is_tensor(frame) else frame for frame in src]
    return _as_numpy(src)


def _audio(
    src: Any, sample_rate: int, limits: MediaLimits, item: str, budget: RequestBudget | None
) -> AudioClip:
    budget = budget or RequestBudget.for_limits(limits)
    if isinstance(src, tuple):
        waveform = _as_numpy(src[0]) if len(src) == 2 else None
        if waveform is None:
            raise MediaError(f"{item}: in-memory audio must be a (waveform, sample_rate) tuple")
        return clip_from_waveform(
            waveform, src[1], sample_rate=sample_rate, limits=limits, item=item, budget=budget
        )
    data = read_source(src, limits=limits, item=item, budget=budget)
    return decode_audio(
        data, sample_rate=sample_rate, limits=limits, item=item, budget=budget
    )


def _as_numpy(value: Any) -> np.ndarray | None:
    """An ndarray for a numpy array or a torch tensor; None for anything else."""
    if isinstance(value, np.ndarray):
        return value
    if _is_tensor(value):
        return value.detach().cpu().numpy()
    return None


def _is_tensor(value: Any) -> bool:
    # Duck-typed so that torch stays an optional dependency.
    return all(hasattr(value, name) for name in ("detach", "cpu", "numpy"))
