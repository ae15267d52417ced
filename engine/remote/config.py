"""RemoteConfig: where the OpenAI-compatible server is and how to talk to it; frozen, validated."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass

import httpx

from engine.media.limits import MediaLimits, MiB

# Base64 turns 3 bytes into 4; the rest of a request body (text, JSON) is kept under this.
_BODY_MARGIN = 256 * 1024


@dataclass(frozen=True)
class RemoteConfig:
    """Options of the remote engines of one server.

    base_url: the API's base URL, such as http://gpu-box:8000/v1; a URL without a path gets
        /v1 appended (what vLLM, SGLang and mmserve serve).
    api_key: sent as `Authorization: Bearer <api_key>`; None sends no header.
    timeout_s: the longest wait for the server to send anything (the first token after a
        long prefill included; between two tokens).
    connect_timeout_s: the longest wait to open a connection.
    max_body_bytes: the largest request body the server accepts (mmserve's default is 64 MiB;
        vLLM and SGLang set none, but a proxy in front may). Media is checked against what
        fits in it once base64-encoded, before anything is sent.
    max_num_seqs: requests this app runs at once per model (the UI sizes its queue by it).
    return_token_ids: ask for the prompt's and the reply's token ids (vLLM's
        `return_token_ids`, which mmserve honours too); turn off for servers that refuse
        unknown request fields.
    """

    base_url: str
    api_key: str | None = None
    timeout_s: float = 120.0
    connect_timeout_s: float = 10.0
    max_body_bytes: int = 64 * MiB
    max_num_seqs: int = 64
    return_token_ids: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "base_url", _normalize(self.base_url))
        if self.api_key is not None and (not self.api_key or any(c in self.api_key for c in
                                                                 "\r\n")):
            raise ValueError("RemoteConfig.api_key must be a non-empty single-line string")
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and value > 0
            ):
                raise ValueError(f"RemoteConfig.{name} must be a finite number > 0, got {value!r}")
        if not _is_int(self.max_body_bytes) or self.max_body_bytes < 1 * MiB:
            raise ValueError(
                f"RemoteConfig.max_body_bytes must be an integer >= {MiB} (1 MiB), "
                f"got {self.max_body_bytes!r}"
            )
        if not _is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            raise ValueError(
                f"RemoteConfig.max_num_seqs must be an integer >= 1, got {self.max_num_seqs!r}"
            )

    @property
    def root_url(self) -> str:
        """The server's root (the base URL without its /v1), where vLLM serves /tokenize."""
        return self.base_url.removesuffix("/v1")

    def headers(self) -> dict[str, str]:
        """The headers of every request: the key, when there is one."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def http_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)

    @property
    def media_limits(self) -> MediaLimits:
        """The default media limits, with the byte limits lowered to what fits in one request
        body once base64-encoded."""
        fits = (self.max_body_bytes - _BODY_MARGIN) * 3 // 4
        default = MediaLimits()
        return MediaLimits(
            max_item_bytes=min(default.max_item_bytes, fits),
            max_request_bytes=min(default.max_request_bytes, fits),
        )


def _normalize(url: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ValueError("RemoteConfig.base_url must be the server's URL, such as "
                         "http://127.0.0.1:8000/v1")
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"RemoteConfig.base_url must be an http:// or https:// URL with a host, got {url!r}"
        )
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(
            f"RemoteConfig.base_url must not carry a query, a fragment or credentials, got "
            f"{url!r} (pass the key as api_key)"
        )
    path = parts.path.rstrip("/") or "/v1"
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
