"""How a remote server's failures reach the front end: the request's own problems (HTTP 400,
404, 413, 422 with their OpenAI error messages) as ValueErrors, like the in-process engine's;
everything else (a refused key, a busy or failing server, timeouts, refused connections, a
stream cut short) as BackendError, an EngineError with a plain sentence."""

from __future__ import annotations

import json

import httpx

from engine.interface import EngineError

# Statuses that mean "this request is wrong" (the server is fine): bad request, unknown
# model (vLLM answers 404), body too large, unfetchable media URL (mmserve's 422).
_REQUEST_STATUSES = (400, 404, 413, 422)
_KEY_HINT = "pass the server's key with --backend-key (RemoteConfig.api_key)"


class BackendError(EngineError):
    """The server could not be reached, refused us, failed, or cut the reply short."""


class RequestRefusedError(ValueError):
    """The server refused the request itself; the message is the server's own."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def error_message(body: bytes) -> str | None:
    """The message of an error body in any of the shapes servers send: OpenAI's (mmserve,
    vLLM from 0.10) `{"error": {"message": ...}}`, older vLLM's and SGLang's
    `{"object": "error", "message": ...}`, FastAPI's `{"detail": ...}`; None otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return event_error(data) if isinstance(data, dict) else None


def event_error(data: dict) -> str | None:
    """The message when a JSON object (a body, or an event of a stream) is an error."""
    error = data.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    if data.get("object") == "error" and isinstance(data.get("message"), str):
        return data["message"]
    detail = data.get("detail")
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):  # FastAPI 422
        first = detail[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return f"{where}: {first.get('msg', 'invalid')}" if where else str(first.get("msg"))
    return None


def status_error(status: int, body: bytes, url: str) -> Exception:
    """The exception for an HTTP error status from `url`."""
    message = error_message(body) or _snippet(body) or "no message"
    if status in _REQUEST_STATUSES:
        return RequestRefusedError(status, message)
    if status in (401, 403):
        return BackendError(f"the server at {url} refused the API key ({status}: {message}); "
                            f"{_KEY_HINT}")
    if status in (429, 503):
        return BackendError(f"the server at {url} is busy ({status}: {message}); "
                            "try again in a moment")
    return BackendError(f"the server at {url} failed ({status}: {message})")


def transport_error(error: httpx.HTTPError, url: str, timeout_s: float) -> BackendError:
    """A plain sentence for a network failure talking to `url`."""
    if isinstance(error, httpx.ConnectTimeout):
        text = f"could not connect to the server at {url} in time (is it up and reachable?)"
    elif isinstance(error, httpx.ConnectError):
        text = f"could not connect to the server at {url} (is it running, and is the URL right?)"
    elif isinstance(error, httpx.TimeoutException):
        text = (f"the server at {url} sent nothing for {timeout_s:g} s (RemoteConfig.timeout_s, "
                "--backend-timeout)")
    elif isinstance(error, httpx.RemoteProtocolError | httpx.ReadError):
        text = f"the server at {url} closed the connection before the reply finished"
    else:
        text = f"the request to the server at {url} failed ({type(error).__name__})"
    return BackendError(text)


def _snippet(body: bytes, limit: int = 200) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "…"
