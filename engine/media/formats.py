"""Which encoded formats the decoders may parse: the allow-lists of image formats, containers
and codecs, the FFmpeg options that enforce them, and the names of refused formats.

A request never chooses a parser the allow-lists do not name. Pillow gets the image formats
through ``Image.open(..., formats=...)``; FFmpeg gets the containers and decoders through its
``format_whitelist`` and ``codec_whitelist`` options, and the decoders are checked again before
any frame is decoded. Naming a refused format only runs signature checks on the first bytes
(Pillow's ``_accept`` prefix tests and the table below), never a parser.
"""

from __future__ import annotations

import functools
import io

import av
from PIL import Image, features

from engine.media.limits import MediaError

# JPEG, PNG, WebP, GIF, BMP, TIFF, and AVIF where Pillow was built with libavif (its own
# plugin). HEIC would need pillow-heif, which is not a dependency, so it is refused by name.
IMAGE_FORMATS: tuple[str, ...] = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF") + (
    ("AVIF",) if "avif" in features.modules and features.check_module("avif") else ()
)

# Display name -> FFmpeg demuxer names (matched against a demuxer's comma-separated names).
CONTAINERS: dict[str, tuple[str, ...]] = {
    "MP4/MOV/M4A": ("mov",),
    "Matroska/WebM": ("matroska",),
    "AVI": ("avi",),
    "GIF": ("gif",),
    "raw H.264/HEVC": ("h264", "hevc"),
    "WAV": ("wav",),
    "FLAC": ("flac",),
    "Ogg": ("ogg",),
    "MP3": ("mp3",),
    "AAC (ADTS)": ("aac",),
}

# FFmpeg canonical codec names (what a stream's codec is, whichever decoder implements it).
VIDEO_CODECS: frozenset[str] = frozenset(
    {"h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video", "mjpeg", "gif"}
)
AUDIO_CODECS: frozenset[str] = frozenset(
    {"aac", "mp3", "opus", "vorbis", "flac", "alac"}
    | {f"pcm_{kind}" for kind in ("u8", "s16le", "s24le", "s32le", "f32le", "f64le")}
    | {f"pcm_{kind}" for kind in ("s16be", "s24be", "s32be", "f32be", "mulaw", "alaw")}
)

# libsndfile reads these (by their signature at offset 0); everything else goes to FFmpeg.
SOUNDFILE_SIGNATURES: tuple[bytes, ...] = (b"RIFF", b"RF64", b"fLaC", b"OggS")
SOUNDFILE_FORMATS: frozenset[str] = frozenset({"WAV", "WAVEX", "RF64", "FLAC", "OGG"})

# Signatures of common formats, to name a refused one: (offset, bytes, name), checked in order,
# the first match wins. Accepted formats are listed too (under their CONTAINERS names), so that
# a corrupted file of an accepted format is reported as corrupted, not as refused.
_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"%!PS", "PostScript/EPS"),
    (0, b"\xc5\xd0\xd3\xc6", "EPS"),
    (0, b"%PDF", "PDF"),
    (0, b"<svg", "SVG"),
    (0, b"<?xml", "XML/SVG"),
    (0, b"FLV\x01", "FLV"),
    (0, b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "ASF/WMV"),
    (0, b".RMF", "RealMedia"),
    (0, b"#EXTM3U", "HLS playlist"),
    (0, b"ffconcat", "ffconcat script"),
    (0, b"nut/multimedia container", "NUT"),
    (0, b"\x06\x0e\x2b\x34", "MXF"),
    (0, b"\x00\x00\x01\xba", "MPEG program stream"),
    (0, b"\x1a\x45\xdf\xa3", "Matroska/WebM"),
    (0, b"caff", "CAF"),
    (0, b".snd", "Sun AU"),
    (0, b"MThd", "MIDI"),
    (0, b"wvpk", "WavPack"),
    (0, b"MAC ", "Monkey's Audio"),
    (0, b"#!AMR", "AMR"),
    (0, b"fLaC", "FLAC"),
    (0, b"OggS", "Ogg"),
    (0, b"ID3", "MP3"),
    (0, b"GIF8", "GIF"),
    (8, b"AIFF", "AIFF"),
    (8, b"AIFC", "AIFF-C"),
    (8, b"AVI ", "AVI"),
    (8, b"WAVE", "WAV"),
    (4, b"ftypheic", "HEIC"),
    (4, b"ftypheix", "HEIC"),
    (4, b"ftyphevc", "HEIC"),
    (4, b"ftypmif1", "HEIF"),
    (4, b"ftyp", "MP4/MOV/M4A"),
)


_PREFIX_BYTES = 512


def allowed_containers() -> str:
    """The accepted containers, for messages."""
    return ", ".join(CONTAINERS)


def allowed_image_formats() -> str:
    """The accepted image formats, for messages."""
    return ", ".join(IMAGE_FORMATS)


def image_format_name(prefix: bytes) -> str | None:
    """The name of the image format ``prefix`` (the first bytes of a file) looks like, from
    Pillow's signature tests or the table above; None when nothing matches."""
    Image.init()
    for name, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(prefix):
                return name
        except Exception:  # noqa: BLE001 - a signature test that fails names nothing
            continue
    return signature_name(prefix)


def signature_name(prefix: bytes) -> str | None:
    """The name of a format recognised from the table of signatures, or None."""
    if len(prefix) >= 376 and prefix[0] == prefix[188] == 0x47:
        return "MPEG transport stream"
    for offset, magic, name in _SIGNATURES:
        if prefix[offset : offset + len(magic)] == magic:
            return name
    return None


def open_container(data: bytes, item: str, what: str) -> av.container.InputContainer:
    """Open encoded audio or video with FFmpeg as one self-contained file in an allowed
    container (see ``ffmpeg_options``). A refusal names the container when it is known."""
    try:
        return av.open(io.BytesIO(data), metadata_errors="ignore", options=ffmpeg_options())
    except Exception as e:  # noqa: BLE001 - whatever FFmpeg says, the data was not accepted
        name = signature_name(data[:_PREFIX_BYTES])
        if name is not None and name not in CONTAINERS:
            raise MediaError(
                f"{item}: the data looks like {name}, a format that is not accepted for {what} "
                f"(accepted containers: {allowed_containers()})"
            ) from e
        raise MediaError(
            f"{item}: could not decode the {what} (unrecognised, truncated or corrupted data; "
            f"accepted containers: {allowed_containers()})"
        ) from e


def check_codec(stream: av.stream.Stream, allowed: frozenset[str], item: str, what: str) -> None:
    """Refuse a stream whose codec FFmpeg does not know or that ``allowed`` does not name,
    before any of its packets reaches a decoder."""
    context = stream.codec_context
    if context is None:
        raise MediaError(
            f"{item}: the {what} stream uses a codec unknown to this server (accepted "
            f"{what} codecs: {_codec_list(allowed)})"
        )
    name = context.codec.canonical_name
    if name not in allowed:
        raise MediaError(
            f"{item}: the {name} {what} codec is not accepted (accepted {what} codecs: "
            f"{_codec_list(allowed)})"
        )


def _codec_list(codecs: frozenset[str]) -> str:
    names = sorted(c for c in codecs if not c.startswith("pcm_"))
    return ", ".join(names + (["PCM"] if len(names) < len(codecs) else []))


def ffmpeg_options() -> dict[str, str]:
    """Options for ``av.open``: only the allowed demuxers and decoders, and no protocol.

    Playlists and concat scripts (HLS, ffconcat) make FFmpeg open further files or URLs,
    bypassing the local-file and URL policies; an empty protocol whitelist ("none" names no
    protocol) refuses every such open, while the data itself is read through Python.
    """
    return {
        "protocol_whitelist": "none",
        "format_whitelist": ",".join(name for names in CONTAINERS.values() for name in names),
        "codec_whitelist": ",".join(_decoders(VIDEO_CODECS | AUDIO_CODECS)),
    }


@functools.cache
def _decoders(codecs: frozenset[str]) -> tuple[str, ...]:
    """The FFmpeg decoders (implementations) of ``codecs``; FFmpeg's codec_whitelist names
    decoders, not codecs (libdav1d decodes av1, mp3float decodes mp3)."""
    names = []
    for name in sorted(av.codecs_available):
        try:
            codec = av.codec.Codec(name, "r")
        except (av.FFmpegError, ValueError):
            continue  # an encoder only
        if codec.canonical_name in codecs:
            names.append(name)
    return tuple(names)
