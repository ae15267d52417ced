"""Downloads under attack, against real HTTP servers on 127.0.0.1 that the tests start (and
allow for themselves through MediaLimits): one deadline for the whole fetch, byte caps while
inflating content encodings, and server-side request forgery through address spellings,
multi-address answers and redirects."""

from __future__ import annotations

import gzip
import socket
import time
import tracemalloc
import zlib

import brotli  # installed with gradio
import numpy as np
import pytest

from engine.media import MediaError, MediaFetchError, MediaLimits, load_image_sync
from tests.media_fixtures import Route, encode_image, gradient, local_server, refused

PNG = encode_image(gradient(), "PNG")
LOCAL = MediaLimits(allow_private_networks=True)
PRIVATE = "host resolves to a private or loopback address"
MiB = 1 << 20


def assert_good(image) -> None:
    assert np.array_equal(np.asarray(image), np.asarray(gradient()))


def gzip_bomb(inflated: int) -> bytes:
    """A gzip stream of ``inflated`` zero bytes (about 1000x smaller), built 1 MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    zeros = b"\0" * MiB
    return b"".join([packer.compress(zeros) for _ in range(inflated // MiB)] + [packer.flush()])


@pytest.fixture
def server():
    with local_server({"/a.png": Route(body=PNG)}) as state:
        yield state


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """Names mapped here resolve to all the given addresses; anything else resolves normally."""
    names: dict[str, list[str]] = {}
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        if host not in names:
            return real(host, port, *args, **kwargs)
        return [info for address in names[host] for info in real(address, port, *args, **kwargs)]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return names


# One deadline for the whole fetch ---------------------------------------------------------


@pytest.mark.parametrize(
    "route",
    [
        pytest.param(Route(body=PNG, drip_s=0.5), id="one-byte-per-half-second"),
        pytest.param(Route(status=302, headers={"Location": "/a.png"}, drip_s=0.05),
                     id="slow-redirect-headers"),
    ],
)
def test_a_dripping_server_is_cut_off_at_the_deadline(server, route: Route) -> None:
    # Every read returns within any per-read timeout; only a deadline over the whole fetch
    # stops this.
    server.routes["/drip"] = route
    limits = MediaLimits(allow_private_networks=True, url_timeout_s=1.0)
    started = time.monotonic()
    refused(
        lambda: load_image_sync(server.url("/drip"), limits=limits),
        "image 1: download took longer than the limit of 1.0 s (MediaLimits.url_timeout_s)",
    )
    assert time.monotonic() - started < 1.8
    assert_good(load_image_sync(server.url("/a.png"), limits=limits))


def test_the_deadline_spans_redirects(server) -> None:
    # Each hop is quick on its own; together they take longer than the deadline.
    for hop in range(6):
        server.routes[f"/hop{hop}"] = Route(
            status=302, headers={"Location": f"/hop{hop + 1}"}, delay_s=0.25
        )
    server.routes["/hop6"] = Route(body=PNG)
    limits = MediaLimits(allow_private_networks=True, url_timeout_s=0.8, max_redirects=10)
    started = time.monotonic()
    refused(lambda: load_image_sync(server.url("/hop0"), limits=limits), "took longer than")
    assert time.monotonic() - started < 1.3
    assert len(server.hosts) <= 4


# Content encodings --------------------------------------------------------------------------


def _peak_while(call) -> int:
    """Bytes of peak traced allocation while running ``call`` (which must raise MediaError)."""
    tracemalloc.start()
    try:
        with pytest.raises(MediaError) as info:
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "Traceback" not in str(info.value)
    return peak


def test_gzip_bomb_is_refused_while_inflating(server) -> None:
    bomb = gzip_bomb(64 * MiB)
    assert len(bomb) < 100_000
    server.routes["/bomb"] = Route(body=bomb, headers={"Content-Encoding": "gzip"})
    limits = MediaLimits(allow_private_networks=True, max_item_bytes=MiB)
    peak = _peak_while(lambda: load_image_sync(server.url("/bomb"), limits=limits))
    # The item cap plus a constant (a chunk, the inflater's window, buffer growth); inflating
    # the whole body first would have taken 64 MiB.
    assert peak < 3 * MiB, peak
    refused(
        lambda: load_image_sync(server.url("/bomb"), limits=limits),
        "image 1: larger than the limit of 1048576 bytes (MediaLimits.max_item_bytes)",
    )


@pytest.mark.parametrize("encoding", ["gzip", "x-gzip", "deflate"])
def test_compressed_bodies_within_the_cap_are_inflated(server, encoding: str) -> None:
    # Servers may compress although identity was asked for.
    body = gzip.compress(PNG) if "gzip" in encoding else zlib.compress(PNG)
    server.routes["/packed"] = Route(body=body, headers={"Content-Encoding": encoding})
    assert_good(load_image_sync(server.url("/packed"), limits=LOCAL))


def test_corrupted_or_truncated_compressed_bodies(server) -> None:
    packed = gzip.compress(PNG)
    server.routes["/cut"] = Route(body=packed[:-20], headers={"Content-Encoding": "gzip"})
    server.routes["/bad"] = Route(body=b"\x1f\x8b" + b"\xff" * 64,
                                  headers={"Content-Encoding": "gzip"})
    for path, fragment in (("/cut", "ends before its end"), ("/bad", "corrupted compressed")):
        with pytest.raises(MediaFetchError) as info:
            load_image_sync(server.url(path), limits=LOCAL)
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("encoding", "body"),
    [
        pytest.param("br", brotli.compress(b"\0" * (64 * MiB), quality=1), id="brotli-bomb"),
        pytest.param("zstd", b"\x28\xb5\x2f\xfd" + b"\0" * 64, id="zstd"),
        pytest.param("gzip, br", b"\0" * 64, id="stacked"),
        pytest.param("compress", b"\0" * 64, id="compress"),
    ],
)
def test_other_content_encodings_are_refused_unread(server, encoding: str, body: bytes) -> None:
    server.routes["/enc"] = Route(body=body, headers={"Content-Encoding": encoding})
    limits = MediaLimits(allow_private_networks=True, max_item_bytes=MiB)
    peak = _peak_while(lambda: load_image_sync(server.url("/enc"), limits=limits))
    assert peak < 3 * MiB, peak
    with pytest.raises(MediaFetchError) as info:
        load_image_sync(server.url("/enc"), limits=limits)
    assert f"content encoding {encoding!r}, which is not accepted" in str(info.value)
    assert "(accepted: identity, gzip, deflate)" in str(info.value)


# Server-side request forgery -----------------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "2130706433",  # 127.0.0.1 as one decimal number
        "0x7f000001",  # ... as one hexadecimal number
        "0177.0.0.1",  # octal first byte
        "127.1",  # short form
        "[::ffff:7f00:1]",  # IPv4-mapped IPv6, hexadecimal
        "[0:0:0:0:0:ffff:127.0.0.1]",  # IPv4-mapped IPv6, long form
        "[::127.0.0.1]",  # IPv4-compatible IPv6
        "[64:ff9b::7f00:1]",  # NAT64
        "[2002:7f00:1::]",  # 6to4
        "[::]",
        "0",
        "localhost.",
        "LOCALHOST",
        "user:secret@127.0.0.1",
        "public.example@127.0.0.1",
    ],
)
def test_address_spellings_of_loopback_are_refused(server, host: str) -> None:
    url = f"http://{host}:{server.port}/a.png"
    with pytest.raises(MediaError) as info:
        load_image_sync(url)
    message = str(info.value)
    # Refused by policy, or not a valid URL at all; never fetched.
    assert PRIVATE in message or "invalid URL" in message, message
    assert not isinstance(info.value, MediaFetchError)
    assert "Traceback" not in message
    assert server.hosts == []


def test_one_private_address_among_public_ones_is_refused(server, resolver) -> None:
    resolver["cdn.example"] = ["93.184.216.34", "127.0.0.1"]
    resolver["rebind.example"] = ["127.0.0.1", "93.184.216.34"]
    for name in ("cdn.example", "rebind.example"):
        message = refused(lambda name=name: load_image_sync(server.url("/a.png", host=name)),
                          PRIVATE)
        assert "127.0.0.1" not in message and "93.184" not in message
    assert server.hosts == []


@pytest.mark.parametrize(
    ("status", "location", "fragment"),
    [
        (303, "http://[::1]:{port}/a.png", PRIVATE),
        (308, "http://167772161:{port}/a.png", PRIVATE),  # 10.0.0.1 as one number
        (302, "http://[64:ff9b::a00:1]/", PRIVATE),  # NAT64 of 10.0.0.1
        (301, "file:///etc/passwd", "unsupported URL scheme 'file'"),
        (302, "data:image/png;base64,AAAA", "unsupported URL scheme 'data'"),
        (307, "gopher://127.0.0.1:{port}/_GET", "unsupported URL scheme 'gopher'"),
        (302, "http://[zz::1]/", "invalid URL"),
    ],
)
def test_redirects_to_private_or_other_schemes_are_refused(
    server, resolver, monkeypatch, status: int, location: str, fragment: str
) -> None:
    from engine.media import fetch

    # The first hop goes to a "public" name (the local server, made public for this test).
    resolver["cdn.example"] = ["127.0.0.1"]
    is_public = fetch._is_public
    monkeypatch.setattr(fetch, "_is_public", lambda a: str(a) == "127.0.0.1" or is_public(a))
    server.routes["/go"] = Route(
        status=status, headers={"Location": location.format(port=server.port)}
    )
    message = refused(lambda: load_image_sync(server.url("/go", host="cdn.example")), fragment)
    assert "/etc/passwd" not in message and "::1" not in message
    assert len(server.hosts) == 1  # the redirect itself, and nothing after it


def test_refusals_and_failures_name_no_resolved_address(server, resolver) -> None:
    resolver["internal.example"] = ["10.1.2.3"]
    resolver["down.example"] = ["127.0.0.1"]
    messages = [
        refused(lambda: load_image_sync("http://internal.example/x.png"), PRIVATE),
        # A port nothing listens on: the connection fails.
        refused(
            lambda: load_image_sync(f"http://down.example:{_free_port()}/x.png", limits=LOCAL),
            "could not download the URL",
        ),
    ]
    for message in messages:
        assert "10.1.2.3" not in message and "127.0.0.1" not in message


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
