"""Read an item's encoded bytes from a path, URL, base64 text or buffer, under the byte caps
and the local-file and URL policies of ``MediaLimits``.

Everything here blocks; the loader runs it in worker threads.
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import os
import re
import socket
import stat
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import av
import httpx

from engine.media.limits import MediaError, MediaFetchError, MediaLimits

# Host lookups run here so that a slow resolver cannot outlast the download deadline (see
# _checked_address); an abandoned lookup finishes in its thread, bounded by the resolver's own
# timeouts.
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="media-dns")

Source = str | os.PathLike[str] | bytes | bytearray | memoryview

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Strings longer than this are never taken for a local path (base64 payloads are long).
_MAX_PATH_CHARS = 4096
_CHUNK_BYTES = 256 * 1024
_PRIVATE_HINT = (
    "host resolves to a private or loopback address; "
    "set MediaLimits.allow_private_networks=True to allow it"
)


class RequestBudget:
    """Encoded bytes read so far by the items of one request, shared across worker threads."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._lock = threading.Lock()

    def charge(self, nbytes: int, item: str) -> None:
        """Count ``nbytes`` more; raise MediaError once the request total passes the limit."""
        with self._lock:
            self._used += nbytes
            over = self._used > self._limit
        if over:
            raise MediaError(
                f"{item}: the request's media exceeds the limit of {self._limit} bytes "
                "(MediaLimits.max_request_bytes)"
            )


def read_source(
    src: Source, *, limits: MediaLimits, item: str, budget: RequestBudget | None = None
) -> bytes:
    """Return the encoded bytes of ``src``.

    ``src`` is a local path (str or PathLike), a ``file://``, ``http(s)://`` or ``data:`` URL,
    base64 text, or a bytes-like buffer. At most ``limits.max_item_bytes`` are read, and
    every read is charged to ``budget``, the request's shared budget (by default a new one).
    """
    budget = budget or RequestBudget(limits.max_request_bytes)
    if isinstance(src, bytes | bytearray | memoryview):
        nbytes = memoryview(src).nbytes
        _check_item_size(nbytes, limits, item)
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
            return _fetch_url(text, limits, item, budget)
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


def _check_item_size(nbytes: int, limits: MediaLimits, item: str) -> None:
    if nbytes > limits.max_item_bytes:
        raise MediaError(
            f"{item}: larger than the limit of {limits.max_item_bytes} bytes "
            "(MediaLimits.max_item_bytes)"
        )


def _strict_base64(text: str, limits: MediaLimits, item: str) -> bytes | None:
    compact = "".join(text.split())
    if not compact or len(compact) % 4:
        return None
    _check_item_size(len(compact) // 4 * 3 - compact[-2:].count("="), limits, item)
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
        _check_item_size(len(body), limits, item)
        payload = urllib.parse.unquote_to_bytes(body)
    budget.charge(len(payload), item)
    return payload


def open_container(data: bytes) -> av.container.InputContainer:
    """Open encoded audio or video with FFmpeg as one self-contained file.

    Playlists and concat scripts (HLS, ffconcat) make FFmpeg open further files or URLs,
    bypassing the local-file and URL policies. An empty protocol whitelist ("none" names no
    protocol) refuses every such open; the data itself is read through Python, not a protocol.
    """
    return av.open(
        io.BytesIO(data), metadata_errors="ignore", options={"protocol_whitelist": "none"}
    )


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
        _check_item_size(info.st_size, limits, item)
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
    _check_item_size(len(data), limits, item)
    return data


# URLs ----------------------------------------------------------------------------------


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is not None:
            return _is_public(embedded)
    return not (
        address.is_private
        or address.is_loopback
        or address.is_link_local
        or address.is_reserved
        or address.is_multicast
        or address.is_unspecified
        # Catches what the flags above miss, such as 100.64.0.0/10 (carrier-grade NAT).
        or not address.is_global
    )


def _domain_allowed(host: str, limits: MediaLimits) -> bool:
    if limits.allowed_domains is None:
        return True
    return any(host == d or host.endswith("." + d) for d in limits.allowed_domains)


def _checked_address(url: httpx.URL, limits: MediaLimits, item: str, deadline: float) -> str:
    """Resolve the URL's host, apply the host policy and return the address to connect to.

    The lookup counts against the download's deadline: getaddrinfo has no timeout of its own,
    so it runs in a resolver thread and is abandoned (left to finish there) when time is up.
    """
    if url.scheme not in ("http", "https"):
        raise MediaError(f"{item}: unsupported URL scheme {url.scheme!r}; use http or https")
    host = url.raw_host.decode("ascii").lower().rstrip(".")
    if not host:
        raise MediaError(f"{item}: URL has no host")
    if not _domain_allowed(host, limits):
        raise MediaError(f"{item}: URL host is not in MediaLimits.allowed_domains")
    port = url.port or (443 if url.scheme == "https" else 80)
    lookup = _RESOLVER.submit(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    try:
        infos = lookup.result(timeout=max(deadline - time.monotonic(), 0.001))
    except FutureTimeout as e:
        raise _timeout(limits, item) from e
    except (socket.gaierror, UnicodeError) as e:
        raise MediaFetchError(f"{item}: could not resolve the URL host") from e
    # An IPv6 link-local answer may carry a "%scope" suffix.
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise MediaFetchError(f"{item}: could not resolve the URL host")
    if not limits.allow_private_networks and not all(_is_public(a) for a in addresses):
        raise MediaError(f"{item}: URL {_PRIVATE_HINT}")
    return str(addresses[0])


def _fetch_url(url: str, limits: MediaLimits, item: str, budget: RequestBudget) -> bytes:
    deadline = time.monotonic() + limits.url_timeout_s
    # No connection reuse: a pooled connection to a checked address must not serve a
    # redirect to another host. trust_env=False keeps proxies from re-resolving the host.
    with httpx.Client(
        follow_redirects=False,
        trust_env=False,
        limits=httpx.Limits(max_keepalive_connections=0),
    ) as client:
        for _ in range(limits.max_redirects + 1):
            try:
                target = httpx.URL(url)
            except (httpx.InvalidURL, TypeError) as e:
                raise MediaError(f"{item}: invalid URL") from e
            address = _checked_address(target, limits, item, deadline)
            outcome = _get(client, target, address, deadline, limits, item, budget)
            if isinstance(outcome, bytes):
                return outcome
            url = str(target.join(outcome))
    raise MediaError(
        f"{item}: more than {limits.max_redirects} redirects (MediaLimits.max_redirects)"
    )


def _get(
    client: httpx.Client,
    url: httpx.URL,
    address: str,
    deadline: float,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget,
) -> bytes | str:
    """GET ``url`` from the already checked ``address``: the body, or a redirect's Location.

    Connecting to ``address`` rather than the name closes the DNS-rebinding gap between the
    check and the connection. The Host header keeps virtual hosting working, and for https
    the ``sni_hostname`` extension makes TLS send and verify the certificate for the real
    name.
    """
    extensions: dict[str, object] = {}
    if url.scheme == "https":
        extensions["sni_hostname"] = url.raw_host.decode("ascii")
    # Identity encoding: a compressed body would be inflated before the byte cap sees it.
    headers = {"Host": url.netloc.decode("ascii"), "Accept-Encoding": "identity"}
    remaining = deadline - time.monotonic()
    try:
        with client.stream(
            "GET",
            url.copy_with(host=address),
            headers=headers,
            extensions=extensions,
            timeout=max(remaining, 0.001),
        ) as response:
            if response.is_redirect:
                location = response.headers.get("location")
                if not location:
                    raise MediaError(f"{item}: redirect without a Location header")
                return location
            if response.status_code != 200:
                raise MediaFetchError(
                    f"{item}: download failed with HTTP status {response.status_code}"
                )
            return _read_body(response, deadline, limits, item, budget)
    except httpx.TimeoutException as e:
        raise _timeout(limits, item) from e
    except httpx.HTTPError as e:
        raise MediaFetchError(f"{item}: could not download the URL ({type(e).__name__})") from e


def _read_body(
    response: httpx.Response,
    deadline: float,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget,
) -> bytes:
    declared = response.headers.get("content-length", "")
    if declared.isdigit():
        _check_item_size(int(declared), limits, item)
    chunks: list[bytes] = []
    total = 0
    for chunk in response.iter_bytes(_CHUNK_BYTES):
        total += len(chunk)
        # Stop the download as soon as a cap is passed, not after the whole body.
        _check_item_size(total, limits, item)
        budget.charge(len(chunk), item)
        if time.monotonic() > deadline:
            raise _timeout(limits, item)
        chunks.append(chunk)
    return b"".join(chunks)


def _timeout(limits: MediaLimits, item: str) -> MediaError:
    return MediaFetchError(
        f"{item}: download took longer than the limit of {limits.url_timeout_s} s "
        "(MediaLimits.url_timeout_s)"
    )
