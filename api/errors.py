"""API errors: the OpenAI error shape, and which HTTP status each failure maps to.

400 bad request (engine validation errors are ValueErrors, media refusals and undecodable media
among them), 401 bad API key, 413 body too large, 415 body not sent as application/json, 422
media URL that could not be fetched, 503 queue full or engine stopped, 500 anything else (a bug
of ours), with a message that reveals nothing of the server's internals.
"""

from __future__ import annotations

import logging

from fastapi.responses import JSONResponse

from engine import EngineDeadError
from engine.media import MediaFetchError

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send to the client as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        """The JSON body, also sent as the payload of an SSE event when a stream fails."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def from_exception(error: BaseException) -> APIError:
    """Classify an exception raised while serving a request."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineDeadError):
        return APIError(
            503, "the engine is not running; the server cannot generate until it is restarted",
            type="server_error", code="engine_unavailable",
        )
    if isinstance(error, MediaFetchError):
        return APIError(422, str(error), code="media_fetch_failed")
    if isinstance(error, ValueError):
        return APIError(400, str(error))
    log.error("unexpected error while serving a request", exc_info=error)
    return internal_error()


def internal_error() -> APIError:
    return APIError(
        500, "internal server error; see the server log", type="server_error", code="internal_error"
    )


def validation_error(errors: list[dict]) -> APIError:
    """A body that does not fit its schema: 400 naming the first offending field's path (the
    tags of discriminated unions, written `<...>`, left out)."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid body", "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"the request body is not valid JSON: {first.get('msg')}")
    loc = [str(p) for p in first.get("loc", ())
           if p != "body" and not (isinstance(p, str) and p.startswith("<"))]
    where = ".".join(loc)
    message = first.get("msg")
    if first.get("type") == "union_tag_not_found":  # pydantic: "Unable to extract tag ..."
        field = (first.get("ctx") or {}).get("discriminator", "'type'")
        message = f"Input should be an object with a string {field} saying its kind"
    return APIError(400, f"invalid request: {where or 'body'}: {message}",
                    param=loc[0] if loc else None)
