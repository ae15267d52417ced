"""Download a media URL under the server-side request forgery policy of ``MediaLimits``, within
one deadline for the whole fetch and the byte caps, enforced while the body is decoded.

Every hop (the URL, then each redirect) has its host resolved and checked, and the connection
goes to the checked address, so that no second lookup can rebind the name to a private one.
The deadline bounds the lookups, the connections, TLS handshakes and every read and write
together: each blocking network call gets what is left of it, not a timeout of its own. A body
sent with a content encoding is inflated chunk by chunk, never past the item's byte cap.
"""

from __future__ import annotations

import io
import ipaddress
import socket
import ssl
import time
import typing
import zlib
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import httpcore
import httpx

from engine.media.budget import RequestBudget
from engine.media.limits import MediaError, MediaFetchError, MediaLimits, check_item_bytes

# Host lookups run here so that a slow resolver cannot outlast the deadline (see
# _checked_address); an abandoned lookup finishes in its thread, bounded by the resolver's own
# timeouts.
_RESOLVER = ThreadPoolExecutor(max_workers=4, thread_name_prefix="media-dns")

_PRIVATE_HINT = (
    "host resolves to a private or loopback address; "
    "set MediaLimits.allow_private_networks=True to allow it"
)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_ENCODINGS = ("identity", "gzip", "deflate")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_TIMEOUTS = (httpcore.TimeoutException, socket.timeout)
_NETWORK_ERRORS = (
    httpcore.NetworkError,
    httpcore.ProtocolError,
    httpcore.UnsupportedProtocol,
    OSError,
)


def fetch_url(url: str, *, limits: MediaLimits, item: str, budget: RequestBudget) -> bytes:
    """The body of ``url`` (http or https), following at most ``limits.max_redirects``
    redirects, all within ``limits.url_timeout_s`` and ``limits.max_item_bytes``."""
    deadline = time.monotonic() + limits.url_timeout_s
    for _ in range(limits.max_redirects + 1):
        try:
            target = httpx.URL(url)
        except (httpx.InvalidURL, TypeError) as e:
            raise MediaError(f"{item}: invalid URL") from e
        address = _checked_address(target, limits, item, deadline)
        outcome = _get(target, address, deadline, limits, item, budget)
        if isinstance(outcome, bytes):
            return outcome
        try:
            url = str(target.join(outcome))
        except (httpx.InvalidURL, TypeError) as e:
            raise MediaError(f"{item}: the server redirected to an invalid URL") from e
    raise MediaError(
        f"{item}: more than {limits.max_redirects} redirects (MediaLimits.max_redirects)"
    )


# The host policy -------------------------------------------------------------------------


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address):
        # IPv6 forms that carry an IPv4 address a gateway would connect to.
        embedded = address.ipv4_mapped or address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
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

    The lookup counts against the deadline: getaddrinfo has no timeout of its own, so it runs
    in a resolver thread and is abandoned (left to finish there) when time is up.
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
    except (OSError, UnicodeError) as e:
        raise MediaFetchError(f"{item}: could not resolve the URL host") from e
    # An IPv6 link-local answer may carry a "%scope" suffix.
    addresses = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
    if not addresses:
        raise MediaFetchError(f"{item}: could not resolve the URL host")
    if not limits.allow_private_networks and not all(_is_public(a) for a in addresses):
        raise MediaError(f"{item}: URL {_PRIVATE_HINT}")
    return str(addresses[0])


# One hop ---------------------------------------------------------------------------------


def _tls_context() -> ssl.SSLContext:
    """The context https downloads verify certificates with (certifi's roots)."""
    return httpcore.default_ssl_context()


def _get(
    url: httpx.URL,
    address: str,
    deadline: float,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget,
) -> bytes | str:
    """GET ``url`` from the checked ``address``: the body, or a redirect's Location.

    The URL keeps its host name, so the Host header, TLS's server name and the certificate
    check all use the name, while the backend connects to the address.
    """
    pool = httpcore.ConnectionPool(
        ssl_context=_tls_context() if url.scheme == "https" else None,
        max_keepalive_connections=0,
        network_backend=_PinnedBackend(address, deadline),
    )
    target = httpcore.URL(
        scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path
    )
    # Identity encoding asked for; what a server sends anyway is inflated under the cap.
    headers = [
        (b"Host", url.netloc),
        (b"Accept-Encoding", b"identity"),
        (b"User-Agent", b"mmserve"),
    ]
    remaining = max(deadline - time.monotonic(), 0.001)
    timeouts = dict.fromkeys(("connect", "read", "write", "pool"), remaining)
    try:
        with pool, pool.stream(
            "GET", target, headers=headers, extensions={"timeout": timeouts}
        ) as response:
            fields: dict[bytes, str] = {}
            for name, value in response.headers:
                # A repeated header is one comma-separated list (RFC 9110).
                key = name.lower()
                text = value.decode("latin-1")
                fields[key] = f"{fields[key]}, {text}" if key in fields else text
            if response.status in _REDIRECTS:
                if not fields.get(b"location"):
                    raise MediaError(f"{item}: redirect without a Location header")
                return fields[b"location"]
            if response.status != 200:
                raise MediaFetchError(
                    f"{item}: download failed with HTTP status {response.status}"
                )
            return _read_body(response, fields, deadline, limits, item, budget)
    except _TIMEOUTS as e:
        raise _timeout(limits, item) from e
    except _NETWORK_ERRORS as e:
        raise MediaFetchError(f"{item}: could not download the URL ({type(e).__name__})") from e


def _read_body(
    response: httpcore.Response,
    fields: dict[bytes, str],
    deadline: float,
    limits: MediaLimits,
    item: str,
    budget: RequestBudget,
) -> bytes:
    declared = fields.get(b"content-length", "")
    if declared.isdigit():
        check_item_bytes(int(declared), limits, item)
    body = _Body(fields.get(b"content-encoding", "identity"), limits, item)
    for chunk in typing.cast(typing.Iterator[bytes], response.iter_stream()):
        for piece in body.feed(chunk):
            budget.charge(len(piece), item)
        if time.monotonic() > deadline:
            raise _timeout(limits, item)
    return body.finish()


class _Body:
    """A response body as it arrives, inflated per its content encoding, refused as soon as it
    passes the item's byte cap: it never holds more than the cap plus one chunk."""

    def __init__(self, encoding: str, limits: MediaLimits, item: str) -> None:
        name = encoding.strip().lower()
        if name not in (*_ENCODINGS, "x-gzip", ""):
            raise MediaFetchError(
                f"{item}: the server sent the body with content encoding {encoding!r}, which "
                f"is not accepted (accepted: {', '.join(_ENCODINGS)})"
            )
        # wbits 32 + 15 reads both the zlib ("deflate") and the gzip wrappings.
        self._inflate = None if name in ("identity", "") else zlib.decompressobj(32 + 15)
        self._limits = limits
        self._item = item
        self._out = io.BytesIO()  # getvalue() hands over its buffer without a copy

    def feed(self, chunk: bytes) -> typing.Iterator[bytes]:
        """Take the next raw chunk; yields the decoded pieces it adds to the body."""
        if self._inflate is None:
            yield self._add(chunk)
            return
        pending = chunk
        while pending and not self._inflate.eof:
            room = self._limits.max_item_bytes - self._out.tell()
            try:
                piece = self._inflate.decompress(pending, room + 1)
            except zlib.error as e:
                raise MediaFetchError(
                    f"{self._item}: the server sent a corrupted compressed body"
                ) from e
            pending = self._inflate.unconsumed_tail
            yield self._add(piece)

    def finish(self) -> bytes:
        if self._inflate is not None and not self._inflate.eof:
            raise MediaFetchError(f"{self._item}: the compressed body ends before its end")
        return self._out.getvalue()

    def _add(self, piece: bytes) -> bytes:
        check_item_bytes(self._out.tell() + len(piece), self._limits, self._item)
        self._out.write(piece)
        return piece


class _PinnedBackend(httpcore.NetworkBackend):
    """Connects to one checked address whatever host a request names, and bounds every
    blocking call of the connection by the download's deadline."""

    def __init__(self, address: str, deadline: float) -> None:
        self._address = address
        self._deadline = deadline
        self._sync = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._sync.connect_tcp(
            self._address,
            port,
            timeout=_left(self._deadline, timeout, httpcore.ConnectTimeout),
            local_address=local_address,
            socket_options=socket_options,
        )
        return _DeadlineStream(stream, self._deadline)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.NetworkStream:
        raise httpcore.ConnectError("media downloads never use unix sockets")

    def sleep(self, seconds: float) -> None:
        time.sleep(min(seconds, max(self._deadline - time.monotonic(), 0.0)))


class _DeadlineStream(httpcore.NetworkStream):
    """A connection whose reads, writes and TLS handshake get what is left of the deadline."""

    def __init__(self, stream: httpcore.NetworkStream, deadline: float) -> None:
        self._stream = stream
        self._deadline = deadline

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _left(self._deadline, timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, _left(self._deadline, timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        stream = self._stream.start_tls(
            ssl_context, server_hostname, _left(self._deadline, timeout, httpcore.ConnectTimeout)
        )
        return _DeadlineStream(stream, self._deadline)

    def get_extra_info(self, info: str) -> typing.Any:
        return self._stream.get_extra_info(info)


def _left(deadline: float, timeout: float | None, error: type[Exception]) -> float:
    """The smaller of ``timeout`` and the time left before ``deadline``; ``error`` if none."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise error("the download deadline has passed")
    return left if timeout is None else min(timeout, left)


def _timeout(limits: MediaLimits, item: str) -> MediaError:
    return MediaFetchError(
        f"{item}: download took longer than the limit of {limits.url_timeout_s} s "
        "(MediaLimits.url_timeout_s)"
    )
