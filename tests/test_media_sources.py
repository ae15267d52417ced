"""Sources: bytes, base64, data: URLs, local files under allowed dirs, and URLs under the
server-side request forgery policy (a local HTTP server; names resolved by a fake resolver)."""

from __future__ import annotations

import base64
import http.server
import ipaddress
import shutil
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from engine.media import MediaError, MediaFetchError, MediaLimits, fetch, load_image_sync, sources
from tests.media_fixtures import Route, encode_image, gradient, local_server, refused

PNG = encode_image(gradient(), "PNG")
EXPECTED = np.asarray(gradient())
PRIVATE = "host resolves to a private or loopback address; set MediaLimits.allow_private_networks"
LOCAL = MediaLimits(allow_private_networks=True)


def assert_good(image) -> None:
    assert np.array_equal(np.asarray(image), EXPECTED)


@pytest.fixture
def resolver(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Names mapped here resolve to the given address; anything else resolves normally."""
    names: dict[str, str] = {}
    real = socket.getaddrinfo

    def fake(host, port, *args, **kwargs):
        return real(names.get(host, host), port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return names


@pytest.fixture
def server():
    routes = {
        "/a.png": Route(body=PNG),
        "/to-a": Route(status=302, headers={"Location": "/a.png"}),
        "/loop": Route(status=302, headers={"Location": "/loop"}),
        "/missing-location": Route(status=302),
        "/big": Route(body_size=64 << 20),
        "/declared-big": Route(body=b"\0" * (2 << 20)),
    }
    with local_server(routes) as state:
        yield state


# Bytes, base64, data: URLs --------------------------------------------------------------


def test_buffers_and_text_encodings() -> None:
    b64 = base64.b64encode(PNG).decode()
    for src in (
        PNG,
        bytearray(PNG),
        memoryview(PNG),
        b64,
        "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76)),
        f"data:image/png;base64,{b64}",
    ):
        assert_good(load_image_sync(src))


def test_bad_text_sources() -> None:
    refused(lambda: load_image_sync("data:image/png;base64,@@@"), "image 1: data: URL has invalid")
    refused(lambda: load_image_sync("data:image/png"), "image 1: malformed data: URL")
    refused(lambda: load_image_sync("ftp://example.com/a.png"), "unsupported URL scheme 'ftp'")
    refused(lambda: load_image_sync(12345), "image 1: unsupported source type int")
    assert_good(load_image_sync(PNG))


def test_item_byte_cap_on_buffers_and_base64() -> None:
    limits = MediaLimits(max_item_bytes=100)
    for src in (PNG, base64.b64encode(PNG).decode()):
        refused(
            lambda src=src: load_image_sync(src, limits=limits),
            "image 1: larger than the limit of 100 bytes (MediaLimits.max_item_bytes)",
        )


# Local files ----------------------------------------------------------------------------


@pytest.fixture
def media_dir(tmp_path: Path) -> Path:
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(PNG)
    return root


def test_local_files_under_allowed_dirs(media_dir: Path) -> None:
    limits = MediaLimits(allowed_local_dirs=(str(media_dir),))
    path = media_dir / "a.png"
    for src in (path, str(path), path.as_uri()):
        assert_good(load_image_sync(src, limits=limits))


def test_local_files_are_refused_by_default(media_dir: Path) -> None:
    message = refused(
        lambda: load_image_sync(media_dir / "a.png"),
        "image 1: local file paths are disabled; set MediaLimits.allowed_local_dirs",
    )
    assert str(media_dir) not in message
    refused(lambda: load_image_sync((media_dir / "a.png").as_uri()), "paths are disabled")


def test_paths_outside_allowed_dirs(media_dir: Path, tmp_path: Path) -> None:
    limits = MediaLimits(allowed_local_dirs=(str(media_dir),))
    outside = tmp_path / "secret.png"
    outside.write_bytes(PNG)
    (media_dir / "link.png").symlink_to(outside)
    sibling = tmp_path / "media-other"
    sibling.mkdir()
    (sibling / "b.png").write_bytes(PNG)
    for src in (
        outside,
        media_dir / ".." / "secret.png",
        media_dir / "link.png",  # a symlink escaping the allowed dir
        sibling / "b.png",  # shares the allowed dir's name as a prefix
        "/etc/passwd",
    ):
        message = refused(
            lambda src=src: load_image_sync(src, limits=limits),
            "image 1: local file is outside MediaLimits.allowed_local_dirs",
        )
        assert str(tmp_path) not in message
    assert_good(load_image_sync(media_dir / "a.png", limits=limits))


def test_symlink_inside_allowed_dir_is_followed(media_dir: Path, tmp_path: Path) -> None:
    (media_dir / "alias.png").symlink_to(media_dir / "a.png")
    limits = MediaLimits(allowed_local_dirs=(str(media_dir),))
    assert_good(load_image_sync(media_dir / "alias.png", limits=limits))


def test_missing_directory_and_oversized_files(media_dir: Path) -> None:
    limits = MediaLimits(allowed_local_dirs=(str(media_dir),), max_item_bytes=1 << 20)
    refused(lambda: load_image_sync(media_dir / "nope.png", limits=limits), "local file not found")
    (media_dir / "sub").mkdir()
    refused(lambda: load_image_sync(media_dir / "sub", limits=limits), "not a regular file")
    huge = media_dir / "huge.png"
    with open(huge, "wb") as f:
        f.truncate(8 << 30)  # sparse: refused from its size, never read
    refused(
        lambda: load_image_sync(huge, limits=limits),
        "image 1: larger than the limit of 1048576 bytes (MediaLimits.max_item_bytes)",
    )
    assert_good(load_image_sync(media_dir / "a.png", limits=limits))


# URLs ------------------------------------------------------------------------------------


def test_download_from_an_allowed_private_server(server) -> None:
    assert_good(load_image_sync(server.url("/a.png"), limits=LOCAL))
    assert_good(load_image_sync(server.url("/to-a"), limits=LOCAL))


def test_private_addresses_are_refused_by_default(server, resolver) -> None:
    resolver["cdn.example"] = "127.0.0.1"
    for url in (
        server.url("/a.png"),
        server.url("/a.png", host="localhost"),
        server.url("/a.png", host="cdn.example"),  # a public-looking name, private address
        "http://10.0.0.1/a.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/a.png",
        "http://[::ffff:127.0.0.1]/a.png",
        "http://0.0.0.0/a.png",
        "http://100.64.0.1/a.png",
        "https://192.168.1.1/a.png",
    ):
        message = refused(lambda url=url: load_image_sync(url, item="image 2"), "image 2: URL")
        assert PRIVATE in message
        assert "127.0.0.1" not in message.replace(url, "")
    assert server.hosts == []  # nothing reached the server


@pytest.mark.parametrize(
    ("address", "public"),
    [
        ("8.8.8.8", True),
        ("2606:4700::1111", True),
        ("127.0.0.1", False),
        ("10.1.2.3", False),
        ("172.16.0.1", False),
        ("192.168.0.1", False),
        ("169.254.169.254", False),
        ("100.64.0.1", False),
        ("224.0.0.1", False),
        ("240.0.0.1", False),
        ("0.0.0.0", False),
        ("::1", False),
        ("::", False),
        ("fe80::1", False),
        ("fc00::1", False),
        ("ff02::1", False),
        ("::ffff:10.0.0.1", False),
        ("::ffff:8.8.8.8", True),
        ("2002:0a00:0001::", False),  # 6to4 wrapping 10.0.0.1
    ],
)
def test_address_classification(address: str, public: bool) -> None:
    assert fetch._is_public(ipaddress.ip_address(address)) is public


def test_connection_goes_to_the_checked_address(server, resolver) -> None:
    # "cdn.example" exists only in the fake resolver: the request must use the address
    # that was checked (no second lookup) while still naming the host in the Host header.
    resolver["cdn.example"] = "127.0.0.1"
    assert_good(load_image_sync(server.url("/a.png", host="cdn.example"), limits=LOCAL))
    assert server.hosts == [f"cdn.example:{server.port}"]


def test_redirects_are_checked_hop_by_hop(server, resolver, monkeypatch) -> None:
    # Treat the local server as public so that only the redirect target is private.
    resolver["cdn.example"] = "127.0.0.1"
    resolver["internal.example"] = "10.0.0.7"
    is_public = fetch._is_public
    monkeypatch.setattr(fetch, "_is_public", lambda a: str(a) == "127.0.0.1" or is_public(a))
    server.routes["/to-internal"] = Route(
        status=301, headers={"Location": "http://internal.example/secret"}
    )
    server.routes["/to-metadata"] = Route(
        status=307, headers={"Location": "http://169.254.169.254/latest/"}
    )
    for path in ("/to-internal", "/to-metadata"):
        message = refused(
            lambda path=path: load_image_sync(server.url(path, host="cdn.example")), PRIVATE
        )
        assert "10.0.0.7" not in message and "169.254" not in message
    assert_good(load_image_sync(server.url("/to-a", host="cdn.example")))


def test_redirect_limits(server) -> None:
    refused(
        lambda: load_image_sync(server.url("/loop"), limits=LOCAL),
        "image 1: more than 5 redirects (MediaLimits.max_redirects)",
    )
    no_redirects = MediaLimits(allow_private_networks=True, max_redirects=0)
    refused(lambda: load_image_sync(server.url("/to-a"), limits=no_redirects), "more than 0")
    refused(
        lambda: load_image_sync(server.url("/missing-location"), limits=LOCAL),
        "redirect without a Location",
    )
    assert_good(load_image_sync(server.url("/a.png"), limits=LOCAL))


def test_allowed_domains(server, resolver) -> None:
    resolver["img.cdn.example"] = "127.0.0.1"
    resolver["cdn.example.evil"] = "127.0.0.1"
    limits = MediaLimits(allow_private_networks=True, allowed_domains=("cdn.example",))
    assert_good(load_image_sync(server.url("/a.png", host="img.cdn.example"), limits=limits))
    for host in ("cdn.example.evil", "127.0.0.1"):
        refused(
            lambda host=host: load_image_sync(server.url("/a.png", host=host), limits=limits),
            "image 1: URL host is not in MediaLimits.allowed_domains",
        )
    server.routes["/away"] = Route(status=302, headers={"Location": "http://other.example/"})
    refused(
        lambda: load_image_sync(server.url("/away", host="img.cdn.example"), limits=limits),
        "not in MediaLimits.allowed_domains",
    )


def test_http_errors(server) -> None:
    refused(
        lambda: load_image_sync(server.url("/nope"), limits=LOCAL),
        "image 1: download failed with HTTP status 404",
    )
    refused(lambda: load_image_sync("http://unresolvable.invalid/"), "could not resolve")


def test_fetch_failures_are_told_apart_from_refusals(server) -> None:
    """The API answers 422 for a URL that could not be fetched, 400 for one refused."""
    with pytest.raises(MediaFetchError):
        load_image_sync(server.url("/nope"), limits=LOCAL)
    with pytest.raises(MediaFetchError):
        load_image_sync("http://unresolvable.invalid/")
    with pytest.raises(MediaError) as refusal:
        load_image_sync(server.url("/a.png"))  # private address, refused by default
    assert not isinstance(refusal.value, MediaFetchError)


def test_slow_server_times_out(server) -> None:
    server.routes["/slow"] = Route(body=PNG, delay_s=2.0)
    limits = MediaLimits(allow_private_networks=True, url_timeout_s=0.3)
    started = time.monotonic()
    refused(
        lambda: load_image_sync(server.url("/slow"), limits=limits),
        "image 1: download took longer than the limit of 0.3 s (MediaLimits.url_timeout_s)",
    )
    assert time.monotonic() - started < 1.5
    assert_good(load_image_sync(server.url("/a.png"), limits=limits))


def test_slow_host_lookup_times_out(server, monkeypatch) -> None:
    """getaddrinfo has no timeout; the lookup counts against url_timeout_s like the download."""
    real = socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if host == "slow-dns.test":
            time.sleep(2.0)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    limits = MediaLimits(allow_private_networks=True, url_timeout_s=0.3)
    started = time.monotonic()
    refused(
        lambda: load_image_sync(server.url("/a.png", host="slow-dns.test"), limits=limits),
        "image 1: download took longer than the limit of 0.3 s (MediaLimits.url_timeout_s)",
    )
    assert time.monotonic() - started < 1.5


def test_declared_oversized_download_is_refused(server) -> None:
    limits = MediaLimits(allow_private_networks=True, max_item_bytes=1 << 20)
    refused(
        lambda: load_image_sync(server.url("/declared-big"), limits=limits),
        "image 1: larger than the limit of 1048576 bytes (MediaLimits.max_item_bytes)",
    )


def test_streamed_download_stops_at_the_cap(server) -> None:
    limits = MediaLimits(allow_private_networks=True, max_item_bytes=1 << 20)
    refused(
        lambda: load_image_sync(server.url("/big"), limits=limits),
        "larger than the limit of 1048576 bytes",
    )
    assert server.done.wait(10)
    # 64 MiB were on offer; only the cap plus what socket buffers held was sent.
    assert server.streamed[0] < 32 << 20


def test_https_keeps_the_name_for_sni_and_certificate(tmp_path, resolver, monkeypatch) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=cdn.example"]
        + ["-addext", "subjectAltName=DNS:cdn.example"],
        check=True,
        capture_output=True,
    )

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    trusting = ssl.create_default_context(cafile=str(cert))
    monkeypatch.setattr(fetch, "_tls_context", lambda: trusting)
    resolver["cdn.example"] = resolver["other.example"] = "127.0.0.1"
    port = httpd.server_address[1]
    try:
        url = f"https://cdn.example:{port}/a.png"
        assert_good(load_image_sync(url, limits=LOCAL))
        # Same address, but the certificate is not valid for this name.
        refused(
            lambda: load_image_sync(f"https://other.example:{port}/a.png", limits=LOCAL),
            "image 1: could not download the URL",
        )
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_request_budget_is_shared() -> None:
    budget = sources.RequestBudget(1000)
    data = b"\0" * 600
    sources.read_source(data, limits=MediaLimits(), item="image 1", budget=budget)
    refused(
        lambda: sources.read_source(data, limits=MediaLimits(), item="image 2", budget=budget),
        "image 2: the request's media exceeds the limit of 1000 bytes",
        "(MediaLimits.max_request_bytes)",
    )


def test_environment_proxies_are_ignored(server, monkeypatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://10.9.9.9:3128")
    monkeypatch.setenv("http_proxy", "http://10.9.9.9:3128")
    # The unreachable proxy is not used: the request goes straight to the checked address.
    assert_good(load_image_sync(server.url("/a.png"), limits=LOCAL))
