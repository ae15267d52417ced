"""The request loader (counts, request byte budget, concurrency off the event loop, async
and sync fronts) and MediaLimits validation."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from PIL import Image

from engine.media import (
    AudioClip,
    MediaError,
    MediaLimits,
    VideoFrames,
    load_audio,
    load_image,
    load_request_media,
    load_request_media_sync,
    load_video,
    loader,
)
from tests.media_fixtures import (
    VideoSpec,
    encode_image,
    encode_soundfile,
    encode_video,
    gradient,
    refused,
    tone,
)

PNG = encode_image(gradient(), "PNG")
WAV = encode_soundfile(tone(440, 16000, 0.5), 16000, "WAV")
MP4 = encode_video(VideoSpec())


# MediaLimits -----------------------------------------------------------------------------


def test_limit_defaults_and_hashability() -> None:
    limits = MediaLimits()
    assert limits.max_item_bytes == 64 << 20 and limits.max_request_bytes == 256 << 20
    assert limits.max_image_pixels == 33_177_600 and limits.min_image_side == 1
    assert (limits.max_items("image"), limits.max_items("video"), limits.max_items("audio")) == (
        16,
        4,
        8,
    )
    assert not limits.allow_private_networks and limits.allowed_local_dirs == ()
    custom = MediaLimits(
        max_items_per_modality={"video": 1, "image": 2, "audio": 3},
        allowed_domains=["CDN.Example."],
        allowed_local_dirs=["/srv/media"],
    )
    assert custom.max_items("image") == 2
    assert custom.allowed_domains == ("cdn.example",)
    assert hash(custom) == hash(
        MediaLimits(
            max_items_per_modality={"image": 2, "video": 1, "audio": 3},
            allowed_domains=("cdn.example",),
            allowed_local_dirs=("/srv/media",),
        )
    )


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_item_bytes": 0}, "MediaLimits.max_item_bytes must be an integer >= 1, got 0"),
        ({"max_image_pixels": 1.5}, "MediaLimits.max_image_pixels must be an integer"),
        ({"max_redirects": -1}, "MediaLimits.max_redirects must be an integer >= 0"),
        ({"url_timeout_s": 0}, "MediaLimits.url_timeout_s must be a finite number > 0"),
        ({"max_video_duration_s": float("inf")}, "max_video_duration_s must be a finite"),
        ({"min_audio_sample_rate": 50_000, "max_audio_sample_rate": 8000}, "must be <="),
        ({"max_items_per_modality": {"image": 1}}, "max_items_per_modality must give a count"),
        (
            {"max_items_per_modality": {"image": -1, "video": 1, "audio": 1}},
            "max_items_per_modality['image'] must be an integer >= 0",
        ),
        ({"allowed_domains": "example.com"}, "allowed_domains must be None or a sequence"),
        ({"allowed_domains": ["https://cdn.example"]}, "must hold bare domain names"),
        ({"allowed_local_dirs": "/srv"}, "allowed_local_dirs must be a sequence"),
        ({"allowed_local_dirs": ["media"]}, "allowed_local_dirs must hold absolute paths"),
        ({"allow_private_networks": 1}, "allow_private_networks must be a bool"),
    ],
)
def test_invalid_limits(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        MediaLimits(**kwargs)
    assert fragment in str(info.value)
    assert not isinstance(info.value, MediaError)


# Requests --------------------------------------------------------------------------------


async def test_request_with_every_modality() -> None:
    loaded = await load_request_media(
        {"image": [PNG, gradient()], "video": MP4, "audio": [(tone(440, 8000, 1.0), 8000), WAV]},
        video_kwargs={"fps": 5, "max_frames": 4},
        audio_kwargs={"sample_rate": 8000},
    )
    assert [type(x) for x in loaded["image"]] == [Image.Image, Image.Image]
    assert isinstance(loaded["video"][0], VideoFrames)
    assert loaded["video"][0].frames.shape[0] == 4
    assert [type(x) for x in loaded["audio"]] == [AudioClip, AudioClip]
    assert [len(a.samples) for a in loaded["audio"]] == [8000, 4000]


async def test_errors_name_the_item() -> None:
    with pytest.raises(MediaError, match=r"^image 3: could not decode the image"):
        await load_request_media({"image": [PNG, PNG, b"garbage"]})
    with pytest.raises(MediaError, match=r"^video 2: "):
        await load_request_media({"video": [MP4, WAV]})
    loaded = await load_request_media({"image": [PNG]})
    assert loaded["image"][0].size == (64, 48)


async def test_item_counts_are_checked_before_loading(monkeypatch) -> None:
    monkeypatch.setattr(loader, "_image", lambda *a: pytest.fail("nothing may load"))
    limits = MediaLimits(max_items_per_modality={"image": 2, "video": 1, "audio": 1})
    with pytest.raises(MediaError) as info:
        await load_request_media({"image": [PNG] * 3}, limits=limits)
    assert str(info.value) == (
        "the request has 3 image items, more than the limit of 2 "
        "(MediaLimits.max_items_per_modality['image'])"
    )
    with pytest.raises(MediaError, match="unknown modality 'text'"):
        await load_request_media({"text": ["hi"]})


async def test_request_byte_budget_spans_items() -> None:
    limits = MediaLimits(max_request_bytes=len(PNG) * 2 + 10)
    assert len((await load_request_media({"image": [PNG, PNG]}, limits=limits))["image"]) == 2
    with pytest.raises(MediaError) as info:
        await load_request_media({"image": [PNG, PNG, PNG]}, limits=limits)
    assert "the request's media exceeds the limit of" in str(info.value)
    assert "(MediaLimits.max_request_bytes)" in str(info.value)


async def test_bad_kwargs_fail_before_loading() -> None:
    with pytest.raises(MediaError, match="video 1: fps must be"):
        await load_request_media({"video": [MP4]}, video_kwargs={"fps": -1})
    with pytest.raises(MediaError, match="audio 1: requested sample rate 5 Hz"):
        await load_request_media({"audio": [WAV]}, audio_kwargs={"sample_rate": 5})
    with pytest.raises(TypeError, match="unexpected audio_kwargs"):
        await load_request_media({"audio": [WAV]}, audio_kwargs={"rate": 5})


async def test_decoding_runs_concurrently_in_worker_threads(monkeypatch) -> None:
    loop_thread = threading.get_ident()
    decode_threads: list[int] = []
    # Three decodes must be inside the decoder at the same time to pass this barrier.
    barrier = threading.Barrier(3, timeout=10)
    decode_image = loader.decode_image

    def blocking_decode(data, **kwargs):
        decode_threads.append(threading.get_ident())
        barrier.wait()
        time.sleep(0.2)  # the event loop must keep ticking meanwhile
        return decode_image(data, **kwargs)

    monkeypatch.setattr(loader, "decode_image", blocking_decode)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    task = asyncio.create_task(ticker())
    loaded = await load_request_media({"image": [PNG, PNG, PNG]})
    task.cancel()
    assert len(loaded["image"]) == 3
    assert loop_thread not in decode_threads and len(set(decode_threads)) == 3
    assert ticks >= 5  # the event loop kept running meanwhile


def test_sync_request_twin() -> None:
    loaded = load_request_media_sync({"image": PNG, "audio": WAV})
    assert loaded["image"][0].size == (64, 48)
    assert loaded["audio"][0].sample_rate == 16000
    refused(lambda: load_request_media_sync({"audio": [WAV, b"junk"]}), "audio 2: could not")
    assert load_request_media_sync({"image": [], "video": None}) == {"image": [], "video": []}


async def test_single_item_async_loaders_run_off_the_loop(monkeypatch) -> None:
    loop_thread = threading.get_ident()
    seen: list[int] = []
    decode_image = loader.decode_image

    def recording_decode(data, **kwargs):
        seen.append(threading.get_ident())
        return decode_image(data, **kwargs)

    monkeypatch.setattr(loader, "decode_image", recording_decode)
    assert (await load_image(PNG)).size == (64, 48)
    assert seen and loop_thread not in seen
    assert (await load_video(MP4, fps=1)).frames.shape[0] == 2
    assert (await load_audio(WAV, sample_rate=8000)).sample_rate == 8000
    with pytest.raises(MediaError, match="image 9: could not decode"):
        await load_image(b"nope", item="image 9")


def test_video_frames_given_as_a_nested_list() -> None:
    frames = [np.full((4, 4, 3), i, np.uint8) for i in range(4)]
    loaded = load_request_media_sync({"video": [frames]}, video_kwargs={"fps": 2})
    assert loaded["video"][0].frames.shape == (4, 4, 4, 3)


def test_the_decoders_load_with_the_first_loader_not_with_the_engine():
    """An engine serving text starts without PyAV and soundfile (engine.media's names load on
    first use); the limits come without them, a loader brings them."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import engine.llm_engine, engine.processing\n"
        "from engine.media import MediaLimits, MediaError\n"
        "assert 'av' not in sys.modules and 'soundfile' not in sys.modules, 'eager'\n"
        "from engine.media import load_audio_sync\n"
        "assert 'av' in sys.modules and callable(load_audio_sync)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
