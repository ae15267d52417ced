"""Read an item's encoded bytes from a path, URL, base64 text or buffer, under the byte caps
and the local-file and URL policies of ``MediaLimits`` (URLs are fetched by ``fetch``).

Everything here blocks; the loader runs it in worker threads.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
import urllib.parse
import urllib.request

from engine.media.budget import RequestBudget
from engine.media.fetch import fetch_url
from engine.media.limits import MediaError, MediaLimits, check_item_bytes

Source = str | os.PathLike[str] | bytes | bytearray | memoryview

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Strings longer than this are never taken for a local path (base64 payloads are long).
_MAX_PATH_CHARS = 4096


def read_source(
    src: Source, *, limits: MediaLimits, item: str, budget: RequestBudget | None = None
) -> bytes:
    """Return the encoded bytes of ``src``.

    ``src`` is a local path (str or PathLike), a ``file://``, ``http(s)://`` or ``data:`` URL,
    base64 text, or a bytes-like buffer. At most ``limits.max_item_bytes`` are read, and
    every read is charged to ``budget``, the request's shared budget (by default a new one).
    """
    budget = budget or RequestBudget.for_limits(limits)
    if isinstance(src, bytes | bytearray | memoryview):
        nbytes = memoryview(src).nbytes
        check_item_bytes(nbytes, limits, item)
        budget.charge(nbytes, item)
        return bytes(src)
    if isinstance(src, os.PathLike):
        return _read_local(os.fspath(src), limits, item, budget)
    if isinstance(src, str):
        return _read_text(src.strip(), limits, item, budget)
    raise MediaError(f"{item}: unsupported source type {type(src).__name__}")


def _read_text(text: str, limits: MediaLimits, item: str, budget: RequestBudget) -> bytes:
    if text[:5].lower() == "data:":
        return _read_data_url(text, limits, item, budget)
    scheme = _SCHEME.match(text)
    if scheme:
        name = scheme.group(1).lower()
        if name in ("http", "https"):
            return fetch_url(text, limits=limits, item=item, budget=budget)
        if name == "file":
            return _read_local(_file_url_path(text, item), limits, item, budget)
        raise MediaError(f"{item}: unsupported URL scheme {name!r}; use http, https or file")
    if len(text) <= _MAX_PATH_CHARS and _is_allowed_file(text, limits):
        return _read_local(text, limits, item, budget)
    payload = _strict_base64(text, limits, item)
    if payload is not None:
        budget.charge(len(payload), item)
        return payload
    # Neither an allowed file nor base64: report it as the path it most likely is.
    return _read_local(text, limits, item, budget)


def _strict_base64(text: str, limits: MediaLimits, item: str) -> bytes | None:
    compact = "".join(text.split())
    if not compact or len(compact) % 4:
        return None
    check_item_bytes(len(compact) // 4 * 3 - compact[-2:].count("="), limits, item)
    try:
        return base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return None


def _read_data_url(url: str, limits: MediaLimits, item: str, budget: RequestBudget) -> bytes:
    header, comma, body = url[5:].partition(",")
    if not comma:
        raise MediaError(f"{item}: malformed data: URL (no comma)")
    if header.lower().endswith(";base64"):
        payload = _strict_base64(body, limits, item)
        if payload is None:
            raise MediaError(f"{item}: data: URL has invalid base64 content")
    else:
        check_item_bytes(len(body), limits, item)
        payload = urllib.parse.unquote_to_bytes(body)
    budget.charge(len(payload), item)
    return payload


# Local files ---------------------------------------------------------------------------


def _file_url_path(url: str, item: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise MediaError(f"{item}: file: URLs must not name a remote host")
    return urllib.request.url2pathname(parts.path)


def _is_allowed_file(path: str, limits: MediaLimits) -> bool:
    """Whether ``path`` is an existing regular file under an allowed dir."""
    real = _contained_realpath(path, limits)
    return real is not None and os.path.isfile(real)


def _contained_realpath(path: str, limits: MediaLimits) -> str | None:
    # Both sides are resolved, so a symlink that leaves an allowed dir is caught.
    try:
        real = os.path.realpath(path)
    except (OSError, ValueError):
        return None
    for root in limits.allowed_local_dirs:
        root_real = os.path.realpath(root)
        try:
            if os.path.commonpath([real, root_real]) == root_real:
                return real
        except ValueError:
            continue
    return None


def _read_local(path: str, limits: MediaLimits, item: str, budget: RequestBudget) -> bytes:
    if not limits.allowed_local_dirs:
        raise MediaError(
            f"{item}: local file paths are disabled; set MediaLimits.allowed_local_dirs to "
            "allow them"
        )
    real = _contained_realpath(path, limits)
    if real is None:
        raise MediaError(f"{item}: local file is outside MediaLimits.allowed_local_dirs")
    try:
        info = os.stat(real)
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(f"{item}: local path is not a regular file")
        check_item_bytes(info.st_size, limits, item)
        budget.charge(info.st_size, item)
        with open(real, "rb") as f:
            data = f.read(limits.max_item_bytes + 1)
    except FileNotFoundError as e:
        raise MediaError(f"{item}: local file not found") from e
    except PermissionError as e:
        raise MediaError(f"{item}: local file is not readable") from e
    except OSError as e:
        raise MediaError(f"{item}: could not read local file") from e
    # The file may have grown since stat().
    check_item_bytes(len(data), limits, item)
    return data
