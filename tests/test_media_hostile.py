"""Hostile media at the decoders: formats outside the allow-lists are refused by name without
being parsed (no Ghostscript, no exotic demuxer), and every family of decoder failure (unknown
codec, unsupported pixel format, truncation, headers that lie about size, duration, rate or
channels) is a MediaError that names the problem and leaks nothing. Decoded sizes are
reserved from headers against the request's budget before anything is decoded."""

from __future__ import annotations

import base64
import io
import os
import stat

import numpy as np
import pytest
import soundfile as sf
from PIL import EpsImagePlugin, Image, ImageFile

from engine.media import (
    MediaError,
    MediaLimits,
    image,
    load_audio_sync,
    load_image_sync,
    load_request_media_sync,
    load_video_sync,
)
from engine.media.formats import IMAGE_FORMATS
from tests.hostile_media import (
    EPS,
    bmp_with_depth,
    dds_with_unknown_pixel_format,
    mkv_with_duration,
    png_with_header,
    tiff_with_tag,
    wav_with_field,
)
from tests.media_fixtures import (
    VideoSpec,
    bomb_png,
    encode_av_audio,
    encode_image,
    encode_soundfile,
    encode_video,
    gradient,
    refused,
    tone,
)

ACCEPTED_IMAGES = "(accepted formats: JPEG, PNG, WEBP, GIF, BMP, TIFF"
ACCEPTED_CONTAINERS = "(accepted containers: MP4/MOV/M4A, Matroska/WebM, AVI, GIF"


def assert_clean(message: str) -> None:
    """No traceback, object address, server path or library message in an error."""
    for leak in ("Traceback", " at 0x", "object at", "/tmp", "/usr", "/work", "site-packages"):
        assert leak not in message, message


def refused_clean(call, *fragments: str) -> str:
    message = refused(call, *fragments)
    assert_clean(message)
    return message


# Formats outside the allow-list -------------------------------------------------------------


def test_eps_never_reaches_ghostscript(tmp_path, monkeypatch) -> None:
    # A stand-in "gs" on PATH that records every run.
    runs = tmp_path / "gs-runs"
    fake = tmp_path / "bin" / "gs"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {runs}\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)
    # Control: Pillow left to itself hands this file to Ghostscript.
    with pytest.raises(Exception):  # noqa: B017 - whatever the fake gs makes Pillow raise
        Image.open(io.BytesIO(EPS)).load()
    assert runs.exists()
    runs.unlink()
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)

    message = refused_clean(
        lambda: load_image_sync(f"data:image/png;base64,{_b64(EPS)}"),
        "image 1: the data looks like EPS, an image format that is not accepted",
        ACCEPTED_IMAGES,
    )
    assert "PNG" in message  # the MIME type is not trusted: the content is what counts
    assert not runs.exists()


@pytest.mark.parametrize(
    ("data", "name"),
    [
        pytest.param(dds_with_unknown_pixel_format(), "DDS", id="dds-unknown-pixel-format"),
        pytest.param(encode_image(gradient(16, 16), "ICO"), "ICO", id="ico"),
        pytest.param(encode_image(gradient(16, 16), "PCX"), "PCX", id="pcx"),
        pytest.param(encode_image(gradient(16, 16), "PPM"), "PPM", id="ppm"),
        pytest.param(b"8BPS\0\1" + b"\0" * 40, "PSD", id="psd"),
        pytest.param(b"%PDF-1.4\n1 0 obj\n", "PDF", id="pdf"),
        pytest.param(b"<svg xmlns='http://www.w3.org/2000/svg'/>", "SVG", id="svg"),
        pytest.param(b"\0\0\0\x18ftypheic\0\0\0\0mif1heic" + b"\0" * 32, "HEIC", id="heic"),
    ],
)
def test_image_formats_outside_the_allow_list_are_refused_by_name(data: bytes, name: str) -> None:
    refused_clean(
        lambda: load_image_sync(data),
        f"image 1: the data looks like {name}, an image format that is not accepted",
        ACCEPTED_IMAGES,
    )


def test_every_allowed_image_format_decodes() -> None:
    source = gradient(32, 24)
    for fmt in IMAGE_FORMATS:
        decoded = load_image_sync(encode_image(source, fmt))
        assert decoded.size == (32, 24) and decoded.mode == "RGB", fmt


@pytest.mark.parametrize(
    ("data", "name", "what", "load"),
    [
        pytest.param(encode_video(VideoSpec(fmt="flv", codec="flv", frames=4)), "FLV", "video",
                     load_video_sync, id="flv"),
        pytest.param(encode_video(VideoSpec(fmt="mpegts", frames=4)), "MPEG transport stream",
                     "video", load_video_sync, id="mpeg-ts"),
        pytest.param(encode_video(VideoSpec(fmt="nut", codec="mpeg4", frames=4)), "NUT",
                     "video", load_video_sync, id="nut"),
        pytest.param(b"#EXTM3U\n#EXTINF:10,\nhttp://169.254.169.254/latest/meta-data\n",
                     "HLS playlist", "video", load_video_sync, id="hls-to-metadata"),
        pytest.param(b"#EXTM3U\n#EXTINF:10,\nfile:///etc/passwd\n", "HLS playlist", "audio",
                     load_audio_sync, id="hls-to-file"),
        pytest.param(encode_soundfile(tone(440, 16000, 0.2), 16000, "AIFF"), "AIFF", "audio",
                     load_audio_sync, id="aiff"),
        pytest.param(encode_soundfile(tone(440, 16000, 0.2), 16000, "AU"), "Sun AU", "audio",
                     load_audio_sync, id="au"),
    ],
)
def test_containers_outside_the_allow_list_are_refused_by_name(data, name, what, load) -> None:
    refused_clean(
        lambda: load(data),
        f"{what} 1: the data looks like {name}, a format that is not accepted for {what}",
        ACCEPTED_CONTAINERS,
    )


# Families of decoder failure -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "load", "fragment"),
    [
        pytest.param(encode_video(VideoSpec(frames=4)).replace(b"avc1", b"zzzz"),
                     load_video_sync, "video 1: the video stream uses a codec unknown to this "
                     "server (accepted video codecs: av1, gif, h264", id="mp4-unknown-video"),
        pytest.param(encode_av_audio(tone(440, 16000, 0.5), 16000, "matroska", "flac")
                     .replace(b"A_FLAC", b"A_FLAQ"), load_audio_sync,
                     "audio 1: the audio stream uses a codec unknown to this server (accepted "
                     "audio codecs: aac, alac, flac", id="mkv-unknown-audio"),
        pytest.param(encode_video(VideoSpec(fmt="matroska", codec="ffv1", frames=4)),
                     load_video_sync, "video 1: the ffv1 video codec is not accepted",
                     id="mkv-ffv1"),
        pytest.param(encode_av_audio(tone(440, 48000, 0.5), 48000, "matroska", "ac3"),
                     load_audio_sync, "audio 1: the ac3 audio codec is not accepted",
                     id="mkv-ac3"),
    ],
)
def test_unknown_and_refused_codecs(data: bytes, load, fragment: str) -> None:
    refused_clean(lambda: load(data), fragment)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(png_with_header(4, 4, 8, 5, b"\0" * 40), id="png-color-type-5"),
        pytest.param(png_with_header(4, 4, 4, 2, b"\0" * 40), id="png-4-bit-rgb"),
        pytest.param(tiff_with_tag(262, 9), id="tiff-photometric-9"),
        pytest.param(tiff_with_tag(258, 12), id="tiff-12-bit-grey"),
    ],
)
def test_unsupported_pixel_formats(data: bytes) -> None:
    refused_clean(lambda: load_image_sync(data), "image 1: could not decode the image")


def test_unsupported_bmp_pixel_depth() -> None:
    refused_clean(lambda: load_image_sync(bmp_with_depth(64)), "image 1: could not decode")


@pytest.mark.parametrize("fmt", IMAGE_FORMATS)
def test_truncated_images(fmt: str) -> None:
    data = encode_image(gradient(64, 48), fmt)
    refused_clean(lambda: load_image_sync(data[: len(data) // 2]), "could not decode the image")


@pytest.mark.parametrize(
    ("data", "load"),
    [
        pytest.param(encode_soundfile(tone(440, 16000, 0.5), 16000, "FLAC"), load_audio_sync,
                     id="flac"),
        pytest.param(encode_av_audio(tone(440, 16000, 0.5), 16000, "mp3", "libmp3lame"),
                     load_audio_sync, id="mp3"),
        pytest.param(encode_video(VideoSpec(fmt="webm", codec="libvpx", frames=8)),
                     load_video_sync, id="webm"),
    ],
)
def test_truncated_audio_and_video(data: bytes, load) -> None:
    for cut in (len(data) // 2, 40):
        try:
            load(data[:cut])
        except MediaError as e:
            assert_clean(str(e))
        # A lenient decoder may return what it could read; it must not raise anything else.


@pytest.mark.parametrize("error", [KeyError, RuntimeError, NotImplementedError, MemoryError,
                                   IndexError, TypeError])
def test_any_exception_of_a_decoder_is_a_media_error(monkeypatch, error) -> None:
    def failing(*args, **kwargs):
        raise error("decoder internals at /usr/lib/libfoo.so 0x7f00deadbeef")

    monkeypatch.setattr(image.ImageOps, "exif_transpose", failing)
    message = refused_clean(lambda: load_image_sync(encode_image(gradient(), "PNG")),
                            "image 1: could not decode the image")
    assert "libfoo" not in message and "deadbeef" not in message


def test_ffmpeg_refuses_frames_past_the_limit_that_the_header_did_not_show() -> None:
    # A raw H.264 stream that switches from 64x48 to 640x480 part-way: the header (the first
    # parameter set) is within the limit, the later frames are not.
    small = encode_video(VideoSpec(fmt="h264", frames=10, width=64, height=48))
    large = encode_video(VideoSpec(fmt="h264", frames=10, width=640, height=480))
    limits = MediaLimits(max_video_frame_pixels=64 * 48 * 2)
    assert load_video_sync(small, fps=25, limits=limits).frames.shape == (10, 48, 64, 3)
    refused_clean(lambda: load_video_sync(small + large, fps=25, limits=limits),
                  "video 1: could not decode the video")


def test_header_that_lies_about_the_duration_is_believed_and_refused() -> None:
    assert load_video_sync(mkv_with_duration(1.0)).duration_s == pytest.approx(1.0)
    refused_clean(lambda: load_video_sync(mkv_with_duration(1e6)),
                  "video 1: duration 1000000.0 s exceeds the limit of 600 s")


def test_wav_headers_that_lie_about_size_and_channels() -> None:
    # The data chunk's "size" far past the end of the file: what is there is decoded.
    assert len(load_audio_sync(wav_with_field(40, "<I", 0xFFFFFFF0)).samples) == 1600
    # 1000 channels: the real data makes one frame.
    assert len(load_audio_sync(wav_with_field(22, "<H", 1000)).samples) <= 2


# Decoded sizes are reserved before decoding ----------------------------------------------------


def test_request_decoded_budget_refuses_before_decoding(monkeypatch) -> None:
    loads = []
    real_load = ImageFile.ImageFile.load

    def counting_load(self):
        loads.append(self.size)
        return real_load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting_load)
    # 8000x4000 1-bit canvas in 70 bytes: within max_image_pixels, 96 MB once decoded to RGB.
    bomb = bomb_png(8000, 4000)
    limits = MediaLimits(max_request_decoded_bytes=64 << 20)
    refused_clean(
        lambda: load_image_sync(bomb, limits=limits),
        "image 1: decoding it would bring the request's decoded media to 96000000 bytes, more "
        "than the limit of 67108864 bytes (MediaLimits.max_request_decoded_bytes)",
    )
    assert loads == []


def test_request_decoded_budget_spans_items_and_modalities() -> None:
    png = encode_image(gradient(64, 48), "PNG")
    mp4 = encode_video(VideoSpec(frames=20))  # 2 s: 4 frames of 64x48 at 2 fps
    wav = encode_soundfile(tone(440, 16000, 1.0), 16000, "WAV")
    image_bytes, video_bytes = 64 * 48 * 3, 4 * 64 * 48 * 3
    enough = MediaLimits(max_request_decoded_bytes=2 * image_bytes + video_bytes + 16000 * 4 + 64)
    request = {"image": [png, png], "video": [mp4], "audio": [wav]}
    loaded = load_request_media_sync(request, limits=enough)
    assert [len(loaded[m]) for m in ("image", "video", "audio")] == [2, 1, 1]
    short = MediaLimits(max_request_decoded_bytes=2 * image_bytes + video_bytes)
    with pytest.raises(MediaError) as info:
        load_request_media_sync(request, limits=short)
    assert "(MediaLimits.max_request_decoded_bytes)" in str(info.value)


def test_audio_reservation_follows_the_samples_when_the_header_has_no_length() -> None:
    # MP3 without a length header: the reservation grows while decoding.
    mp3 = encode_av_audio(tone(440, 16000, 2.0), 16000, "mp3", "libmp3lame")
    assert load_audio_sync(mp3).duration_s == pytest.approx(2.0, abs=0.1)
    refused_clean(
        lambda: load_audio_sync(mp3, limits=MediaLimits(max_request_decoded_bytes=16000 * 4)),
        "audio 1: decoding it would bring the request's decoded media to",
    )


def test_soundfile_blocks_stay_small_whatever_the_channel_count() -> None:
    # 64 channels x 0.5 s: decoded a bounded block at a time, downmixed to mono.
    wave = np.repeat(tone(440, 16000, 0.5)[:, None], 64, axis=1)
    buffer = io.BytesIO()
    sf.write(buffer, wave, 16000, format="WAV", subtype="FLOAT")
    clip = load_audio_sync(buffer.getvalue())
    assert len(clip.samples) == 8000 and np.abs(clip.samples).max() == pytest.approx(0.5, abs=0.01)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
