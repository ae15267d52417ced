"""Real media generated in memory for the media and hashing tests (Pillow, PyAV, soundfile),
and a local HTTP server for URL tests."""

from __future__ import annotations

import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from fractions import Fraction

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from engine.media import MediaError


def gradient(width: int = 64, height: int = 48) -> Image.Image:
    """An RGB image whose every pixel differs from its neighbours."""
    x = np.linspace(0, 255, width, dtype=np.uint8)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height, dtype=np.uint8)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, 255 - x], axis=-1), "RGB")


def encode_image(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def marked_landscape() -> Image.Image:
    """64x32 grey image with a red block in the top-left corner."""
    image = Image.new("RGB", (64, 32), (128, 128, 128))
    image.paste((255, 0, 0), (0, 0, 16, 16))
    return image


def exif_rotated_jpeg() -> bytes:
    """``marked_landscape`` stored with EXIF orientation 6 (display rotated 90° clockwise),
    so upright it is 32x64 with the red block in the top-right corner."""
    exif = Image.Exif()
    exif[0x0112] = 6
    return encode_image(marked_landscape(), "JPEG", quality=95, exif=exif.tobytes())


def palette_png_with_transparency() -> bytes:
    """4x1 P-mode PNG: red, transparent, green, half-transparent blue."""
    image = Image.new("P", (4, 1))
    image.putpalette([255, 0, 0, 0, 0, 0, 0, 255, 0, 0, 0, 255])
    image.putdata([0, 1, 2, 3])
    return encode_image(image, "PNG", transparency=bytes([255, 0, 255, 128]))


def bomb_png(width: int, height: int) -> bytes:
    """A ~70-byte 1-bit PNG declaring a width x height canvas, built without allocating it."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + chunk(b"IEND", b"")
    )


# Video ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoSpec:
    """What ``encode_video`` writes. Frame i is a flat grey of level ``level(i)``."""

    fmt: str = "mp4"
    codec: str = "libx264"
    frames: int = 20
    fps: int = 10
    width: int = 64
    height: int = 48
    gop: int = 10
    bframes: int = 0  # libx264 only
    rotation: float | None = None
    hflip: bool = False
    pts_ms: tuple[int, ...] | None = None  # explicit times (variable frame rate), time base 1/1000
    audio_rate: int | None = None  # add a stereo AAC tone of audio_freq Hz at this rate
    audio_freq: float = 440.0
    pattern: Callable[[int], np.ndarray] | None = field(default=None, repr=False)


def level(index: int) -> int:
    return (index * 37) % 200 + 20


def encode_video(spec: VideoSpec) -> bytes:
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=spec.fmt) as container:
        stream = container.add_stream(spec.codec, rate=spec.fps)
        stream.width, stream.height = spec.width, spec.height
        stream.pix_fmt = "rgb8" if spec.codec == "gif" else "yuv420p"
        stream.gop_size = spec.gop
        if spec.codec == "libx264":
            stream.options = {"sc_threshold": "0", "bf": str(spec.bframes)}
        if spec.rotation is not None or spec.hflip:
            stream.set_display_rotation(spec.rotation or 0, hflip=spec.hflip)
        if spec.pts_ms is not None:
            stream.time_base = Fraction(1, 1000)
            stream.codec_context.time_base = Fraction(1, 1000)
        audio = container.add_stream("aac", rate=spec.audio_rate) if spec.audio_rate else None
        for index in range(spec.frames):
            pixels = (
                spec.pattern(index)
                if spec.pattern
                else np.full((spec.height, spec.width, 3), level(index), np.uint8)
            )
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            frame.pts = spec.pts_ms[index] if spec.pts_ms is not None else index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        if audio is not None:
            seconds = spec.frames / spec.fps
            samples = tone(spec.audio_freq, spec.audio_rate, seconds, 2)
            _encode_audio_stream(container, audio, samples)
    return buffer.getvalue()


# Audio ---------------------------------------------------------------------------------


def tone(freq: float, rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    """float32 sine at amplitude 0.5, [N] for mono or [N, C]."""
    t = np.arange(round(rate * seconds)) / rate
    wave = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return wave if channels == 1 else np.repeat(wave[:, None], channels, axis=1)


def encode_soundfile(samples: np.ndarray, rate: int, fmt: str, subtype: str | None = None) -> bytes:
    buffer = io.BytesIO()
    sf.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def encode_av_audio(samples: np.ndarray, rate: int, fmt: str, codec: str) -> bytes:
    """Encode mono or [N, C] float samples with FFmpeg (mp3, aac in mp4, opus in webm...)."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        layout = "mono" if samples.ndim == 1 else "stereo"
        stream = container.add_stream(codec, rate=rate, layout=layout)
        _encode_audio_stream(container, stream, samples)
    return buffer.getvalue()


def _encode_audio_stream(
    container: av.container.OutputContainer, stream: av.AudioStream, samples: np.ndarray
) -> None:
    planar = samples[None, :] if samples.ndim == 1 else samples.T
    frame_size = stream.codec_context.frame_size or 1024
    layout = "mono" if planar.shape[0] == 1 else "stereo"
    resampler = av.AudioResampler(
        format=stream.format.name, layout=stream.layout.name, rate=stream.rate
    )
    for start in range(0, planar.shape[1], frame_size):
        chunk = np.ascontiguousarray(planar[:, start : start + frame_size], dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate = stream.rate
        frame.pts = start
        for converted in resampler.resample(frame):
            container.mux(stream.encode(converted))
    container.mux(stream.encode())


def peak_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.argmax(spectrum) * rate / len(samples))


# HTTP ----------------------------------------------------------------------------------


@dataclass
class Route:
    """A canned response; ``body_size`` streams that many bytes without Content-Length,
    ``delay_s`` waits before answering, and ``drip_s`` sends the whole response (status line,
    headers and body) one byte at a time, ``drip_s`` seconds apart."""

    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    body_size: int | None = None
    delay_s: float = 0.0
    drip_s: float = 0.0


@dataclass
class LocalServer:
    """An HTTP server on 127.0.0.1 serving ``routes`` by path, recording what it saw."""

    routes: dict[str, Route]
    port: int = 0
    hosts: list[str] = field(default_factory=list)
    streamed: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@contextmanager
def local_server(routes: dict[str, Route]) -> Iterator[LocalServer]:
    state = LocalServer(routes)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            state.hosts.append(self.headers.get("Host", ""))
            route = state.routes.get(self.path, Route(status=404))
            time.sleep(route.delay_s)
            if route.drip_s:
                self._drip(route)
                return
            self.send_response(route.status)
            for name, value in route.headers.items():
                self.send_header(name, value)
            if route.body_size is None:
                self.send_header("Content-Length", str(len(route.body)))
                try:
                    self.end_headers()
                    self.wfile.write(route.body)
                except OSError:  # the client stopped reading (a refused download)
                    self.close_connection = True
                return
            self.send_header("Connection", "close")
            self.end_headers()
            sent = 0
            chunk = b"\0" * 65536
            try:
                while sent < route.body_size:
                    self.wfile.write(chunk)
                    sent += len(chunk)
            except OSError:
                pass
            finally:
                state.streamed.append(sent)
                state.done.set()

        def _drip(self, route: Route) -> None:
            head = [f"HTTP/1.1 {route.status} Dripping", f"Content-Length: {len(route.body)}"]
            head += [f"{name}: {value}" for name, value in route.headers.items()]
            response = ("\r\n".join(head) + "\r\n\r\n").encode() + route.body
            sent = 0
            try:
                for byte in response:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                    sent += 1
                    time.sleep(route.drip_s)
            except OSError:
                pass
            finally:
                state.streamed.append(sent)
                state.done.set()
                self.close_connection = True

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    # A short poll interval: shutdown() waits for one, and every test stops a server.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


# Assertions ----------------------------------------------------------------------------


def refused(call: Callable[[], object], *fragments: str) -> str:
    """Run ``call``, expect a MediaError whose message holds every fragment, and return it."""
    with pytest.raises(MediaError) as info:
        call()
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "Traceback" not in message and "\n" not in message, message
    return message
