"""What keeps other parties, web pages in a user's browser above all, from driving the API: the
API key, JSON-only request bodies, the Host header check against DNS rebinding, and CORS only
for origins the operator names.

A page on any site can POST to http://127.0.0.1 without asking first, as long as the request is
a "simple" one (a text/plain or form body); the browser only asks the server first (a CORS
preflight) for an application/json body. Accepting nothing but application/json therefore
means a page must ask, and the API answers no unless its origin is configured. A page whose
host name the attacker re-points at 127.0.0.1 (DNS rebinding) needs no preflight, since it is
then "same-origin"; its requests still carry the attacker's host name, which the Host check
refuses.
"""

from __future__ import annotations

import hmac
import ipaddress
import urllib.parse
from collections.abc import Callable, Sequence

from fastapi import Request
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import APIError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


def key_checker(api_key: str) -> Callable:
    """A route dependency requiring `Authorization: Bearer <api_key>` (else 401)."""
    expected = f"Bearer {api_key}".encode()

    async def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise APIError(
                401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                type="authentication_error", code="invalid_api_key",
            )

    return check


def host_checker(allowed_hosts: Sequence[str]) -> Callable:
    """A route dependency refusing (400) a Host header that names none of ``allowed_hosts``
    (names or addresses, without ports)."""
    allowed = frozenset(h.strip("[]").lower().rstrip(".") for h in allowed_hosts)

    async def check(request: Request) -> None:
        if host_name(request.headers.get("host", "")) not in allowed:
            raise APIError(
                400, "this server does not serve the host name in the request's Host header "
                "(start it with the host you use, or with an API key)", code="invalid_host",
            )

    return check


def host_name(header: str) -> str:
    """The host of a Host header, lower case, without port, brackets or trailing dot."""
    try:
        return (urllib.parse.urlsplit(f"//{header}").hostname or "").rstrip(".")
    except ValueError:
        return ""


def is_loopback(host: str) -> bool:
    """Whether binding to ``host`` serves this machine only."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


async def require_json(request: Request) -> None:
    """Refuse (415) a request body not declared as application/json: a web page can send any
    other type cross-site without the browser asking the server first."""
    declared = request.headers.get("content-type", "")
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        shown = repr(media_type[:80]) if media_type else "none"
        raise APIError(
            415, f"the request body must be JSON sent with 'Content-Type: application/json' "
            f"(got {shown})", code="unsupported_media_type",
        )


def check_origins(origins: Sequence[str]) -> tuple[str, ...]:
    """Origins for CORS, each "*" or scheme://host[:port] with nothing after; ValueError
    naming the first that is not."""
    checked = []
    for origin in origins:
        parts = urllib.parse.urlsplit(origin)
        plain = parts.scheme in ("http", "https") and parts.netloc and not (
            parts.path or parts.query or parts.fragment or "@" in parts.netloc)
        if origin != "*" and not plain:
            raise ValueError(
                f"allowed origin {origin!r} must be '*' or scheme://host[:port], such as "
                "https://app.example.com"
            )
        checked.append(origin.rstrip("/"))
    return tuple(checked)


class APICORS:
    """ASGI middleware granting CORS to ``origins`` on the paths under ``prefix`` only (the
    UI next to the API keeps its own policy)."""

    def __init__(self, app: ASGIApp, *, origins: Sequence[str], prefix: str = "/v1") -> None:
        self.app = app
        self.prefix = prefix
        self.cors = CORSMiddleware(
            app,
            allow_origins=list(check_origins(origins)),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["Authorization", "Content-Type"],
            max_age=600,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path == self.prefix or path.startswith(self.prefix + "/")):
            await self.cors(scope, receive, send)
        else:
            await self.app(scope, receive, send)
