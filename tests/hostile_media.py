"""Malformed and hostile media built in memory, for the hardening tests of the decoders and the
API: formats outside the allow-lists, unknown codecs, unsupported pixel formats, truncations
and headers that lie."""

from __future__ import annotations

import struct
import zlib

import numpy as np

from tests.media_fixtures import (
    VideoSpec,
    bomb_png,
    encode_av_audio,
    encode_image,
    encode_soundfile,
    encode_video,
    gradient,
    tone,
)

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n0 0 moveto 16 16 lineto stroke\n"


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_with_header(width: int, height: int, depth: int, color: int, rows: bytes) -> bytes:
    """A PNG whose IHDR says what it is told, whatever the rows hold."""
    header = struct.pack(">IIBBBBB", width, height, depth, color, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", header)
        + png_chunk(b"IDAT", zlib.compress(rows))
        + png_chunk(b"IEND", b"")
    )


def dds_with_unknown_pixel_format() -> bytes:
    """A DDS header whose FourCC names no pixel format Pillow knows."""
    header = struct.pack("<7I", 124, 0x1007, 4, 4, 0, 0, 0) + b"\0" * 44
    pixel_format = struct.pack("<2I4s5I", 32, 0x4, b"XXXX", 0, 0, 0, 0, 0)
    return b"DDS " + header + pixel_format + struct.pack("<5I", 0x1000, 0, 0, 0, 0) + b"\0" * 64


def tiff_with_tag(tag: int, value: int) -> bytes:
    """A 4x4 grey TIFF with one SHORT tag overwritten."""
    data = bytearray(encode_image(gradient(4, 4).convert("L"), "TIFF"))
    at = data.find(struct.pack("<HH", tag, 3))
    data[at + 8 : at + 10] = struct.pack("<H", value)
    return bytes(data)


def bmp_with_depth(bits: int) -> bytes:
    data = bytearray(encode_image(gradient(8, 8), "BMP"))
    data[28:30] = struct.pack("<H", bits)
    return bytes(data)


def mkv_with_duration(seconds: float) -> bytes:
    """A Matroska video whose Segment Info claims ``seconds`` of duration."""
    mkv = bytearray(encode_video(VideoSpec(fmt="matroska", frames=10)))
    at = mkv.find(b"\x44\x89\x88")  # Duration, an 8-byte float in milliseconds
    mkv[at + 3 : at + 11] = struct.pack(">d", seconds * 1000)
    return bytes(mkv)


def wav_with_field(offset: int, fmt: str, value: int) -> bytes:
    """0.1 s of a 16 kHz tone as WAV with one header field overwritten."""
    wav = bytearray(encode_soundfile(tone(440, 16000, 0.1), 16000, "WAV"))
    wav[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, value)
    return bytes(wav)


def corpus() -> list[tuple[str, str, bytes]]:
    """(name, modality, data) of malformed or refused media, several per failure family."""
    png = encode_image(gradient(64, 48), "PNG")
    jpeg = encode_image(gradient(64, 48), "JPEG")
    mp4 = encode_video(VideoSpec(frames=6))
    flac = encode_soundfile(tone(440, 16000, 0.5), 16000, "FLAC")
    mkv_flac = encode_av_audio(tone(440, 16000, 0.5), 16000, "matroska", "flac")
    noise = np.random.default_rng(14).bytes(4096)
    return [
        ("eps", "image", EPS),
        ("dds-unknown-pixel-format", "image", dds_with_unknown_pixel_format()),
        ("ico", "image", encode_image(gradient(16, 16), "ICO")),
        ("svg", "image", b"<svg xmlns='http://www.w3.org/2000/svg'/>"),
        ("png-color-type-5", "image", png_with_header(4, 4, 8, 5, b"\0" * 40)),
        ("bmp-64-bit", "image", bmp_with_depth(64)),
        ("tiff-photometric-9", "image", tiff_with_tag(262, 9)),
        ("png-truncated", "image", png[: len(png) // 2]),
        ("jpeg-truncated", "image", jpeg[: len(jpeg) // 2]),
        ("png-bomb-header", "image", bomb_png(100_000, 100_000)),
        ("image-empty", "image", b""),
        ("image-noise", "image", noise),
        ("mp4-unknown-codec", "video", mp4.replace(b"avc1", b"zzzz")),
        ("mkv-ffv1", "video", encode_video(VideoSpec(fmt="matroska", codec="ffv1", frames=4))),
        ("flv", "video", encode_video(VideoSpec(fmt="flv", codec="flv", frames=4))),
        ("hls-playlist", "video", b"#EXTM3U\n#EXTINF:1,\nhttp://169.254.169.254/latest/\n"),
        ("ffconcat", "video", b"ffconcat version 1.0\nfile /etc/passwd\n"),
        ("mp4-truncated", "video", mp4[: len(mp4) // 2]),
        ("mkv-duration-lie", "video", mkv_with_duration(1e9)),
        ("video-noise", "video", noise),
        ("mkv-unknown-audio-codec", "audio", mkv_flac.replace(b"A_FLAC", b"A_FLAQ")),
        ("mkv-ac3", "audio", encode_av_audio(tone(440, 48000, 0.5), 48000, "matroska", "ac3")),
        ("aiff", "audio", encode_soundfile(tone(440, 16000, 0.2), 16000, "AIFF")),
        ("flac-truncated-header", "audio", flac[:30]),
        ("wav-rate-lie", "audio", wav_with_field(24, "<I", 10_000_000)),
        ("wav-no-samples", "audio", encode_soundfile(np.zeros(0, np.float32), 16000, "WAV")),
        ("audio-noise", "audio", noise),
    ]
