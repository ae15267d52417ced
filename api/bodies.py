"""A request body read with a size limit: refused (413) up front from Content-Length and while
reading for bodies that declare none (chunked) or understate it."""

from __future__ import annotations

from fastapi import Request

from api.errors import APIError


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    return bytes(body)


def too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )
