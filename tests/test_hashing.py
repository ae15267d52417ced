"""Content identity: equal decoded content hashes equal; any difference in content, sampling,
processor options or model id hashes different."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from PIL import Image

from engine.media import AudioClip, VideoFrames, VideoSampling, load_image_sync, load_video_sync
from models.processing.hashing import hash_audio, hash_image, hash_item, hash_video
from tests.media_fixtures import VideoSpec, encode_image, encode_video, gradient


def clip(samples: np.ndarray, rate: int = 16000) -> AudioClip:
    return AudioClip(samples=samples, sample_rate=rate)


def frames(array: np.ndarray, timestamps: np.ndarray | None = None) -> VideoFrames:
    count = array.shape[0]
    return VideoFrames(
        frames=array,
        timestamps=np.arange(count, dtype=np.float64) if timestamps is None else timestamps,
        sampled_fps=1.0,
        source_fps=1.0,
        duration_s=float(count),
        source_frame_count=count,
        sampling=VideoSampling(target_fps=1.0, min_frames=1, max_frames=count),
    )


def test_same_pixels_from_png_and_lossless_webp_hash_equal() -> None:
    png = load_image_sync(encode_image(gradient(), "PNG"))
    webp = load_image_sync(encode_image(gradient(), "WEBP", lossless=True))
    assert hash_image(png) == hash_image(webp) == hash_image(gradient())


def test_digest_is_stable_hex() -> None:
    digest = hash_image(gradient())
    assert digest == hash_image(gradient().copy())
    assert len(digest) == 64 and int(digest, 16) >= 0


def test_image_differences_change_the_hash() -> None:
    base = gradient()
    variants = {
        "base": base,
        "mode": base.convert("L").convert("RGB"),
        "grey": base.convert("L"),
        "size": base.resize((32, 24)),
        "crop": base.crop((0, 0, 63, 48)),
        "pixel": base.copy(),
    }
    variants["pixel"].putpixel((0, 0), (1, 2, 3))
    digests = {name: hash_image(image) for name, image in variants.items()}
    assert len(set(digests.values())) == len(digests)


def test_palette_is_part_of_the_identity() -> None:
    first = Image.new("P", (4, 4))
    first.putpalette([255, 0, 0] * 256)
    second = first.copy()
    second.putpalette([0, 0, 255] * 256)
    assert first.tobytes() == second.tobytes()
    assert hash_image(first) != hash_image(second)


def test_same_bytes_in_a_different_mode_or_shape_differ() -> None:
    grey = Image.frombytes("L", (6, 4), bytes(range(24)))
    assert hash_image(grey) != hash_image(Image.frombytes("L", (4, 6), bytes(range(24))))
    assert hash_image(grey) != hash_image(Image.frombytes("P", (6, 4), bytes(range(24))))


def test_model_and_processor_options_are_part_of_the_identity() -> None:
    image = gradient()
    plain = hash_image(image)
    assert hash_image(image, model_id="qwen2-vl-2b") != plain
    assert hash_image(image, model_id="qwen2-vl-2b") != hash_image(image, model_id="qwen2-vl-7b")
    options = {"max_pixels": 1024, "min_pixels": 256}
    assert hash_image(image, processor_kwargs=options) != plain
    assert hash_image(image, processor_kwargs=options) == hash_image(
        image, processor_kwargs={"min_pixels": 256, "max_pixels": 1024}
    )
    assert hash_image(image, processor_kwargs={"max_pixels": 1025}) != hash_image(
        image, processor_kwargs={"max_pixels": 1024}
    )
    # Fields are length-prefixed: moving text between them cannot collide.
    assert hash_image(image, model_id="ab", processor_kwargs=None) != hash_image(
        image, model_id="a", processor_kwargs={"b": None}
    )


def test_non_json_processor_options_are_rejected() -> None:
    with pytest.raises(TypeError, match="JSON-serialisable"):
        hash_image(gradient(), processor_kwargs={"x": object()})


def test_video_identity() -> None:
    data = encode_video(VideoSpec())
    video = load_video_sync(data, fps=5)
    assert hash_video(video) == hash_video(load_video_sync(data, fps=5))
    other_frames = load_video_sync(data, fps=2)
    assert hash_video(video) != hash_video(other_frames)
    same_frames_other_request = load_video_sync(data, fps=5, max_frames=10)
    assert np.array_equal(same_frames_other_request.frames, video.frames)
    assert hash_video(video) != hash_video(same_frames_other_request)
    shifted = dataclasses.replace(video, timestamps=video.timestamps + 0.01)
    assert hash_video(video) != hash_video(shifted)


def test_reshaped_frame_bytes_differ() -> None:
    array = np.random.default_rng(0).integers(0, 256, (4, 6, 8, 3), dtype=np.uint8)
    stamps = np.arange(4, dtype=np.float64)
    assert hash_video(frames(array, stamps)) != hash_video(
        frames(array.reshape(4, 8, 6, 3), stamps)
    )
    assert hash_video(frames(array, stamps)) == hash_video(frames(array.copy(), stamps))
    # A non-contiguous view hashes as its contents.
    flipped = array[:, ::-1]
    assert hash_video(frames(flipped, stamps)) == hash_video(
        frames(np.ascontiguousarray(flipped), stamps)
    )


def test_audio_identity() -> None:
    samples = np.random.default_rng(1).standard_normal(16000).astype(np.float32)
    assert hash_audio(clip(samples)) == hash_audio(clip(samples.copy()))
    assert hash_audio(clip(samples)) != hash_audio(clip(samples, rate=8000))
    assert hash_audio(clip(samples)) != hash_audio(clip(samples.astype(np.float64)))
    assert hash_audio(clip(samples)) != hash_audio(clip(samples.reshape(2, 8000)))
    assert hash_audio(clip(samples)) != hash_audio(clip(samples[:-1]))


def test_modalities_never_share_digests() -> None:
    array = np.zeros((1, 2, 2, 3), np.uint8)
    image = Image.fromarray(array[0])
    assert len({hash_item("image", image), hash_item("video", frames(array))}) == 2


def test_hash_item_dispatches() -> None:
    image = gradient()
    assert hash_item("image", image, model_id="m") == hash_image(image, model_id="m")
    samples = np.zeros(10, np.float32)
    assert hash_item("audio", clip(samples)) == hash_audio(clip(samples))
    with pytest.raises(ValueError, match="unknown modality 'text'"):
        hash_item("text", image)
