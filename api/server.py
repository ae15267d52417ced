"""Serving helpers: the API-only FastAPI app, the API-key environment variable, uvicorn."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import uvicorn
from fastapi import FastAPI

from api.guards import APICORS
from api.routes import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, build_router
from engine import AsyncLLM

API_KEY_ENV = "MMSERVE_API_KEY"


def api_key_from_env() -> str | None:
    """The API key set in $MMSERVE_API_KEY; None (no key required) when unset or empty."""
    return os.environ.get(API_KEY_ENV) or None


def create_app(
    engines: Mapping[str, AsyncLLM],
    *,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_waiting: int = DEFAULT_MAX_WAITING,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """An app serving only the OpenAI API (see `build_router` for the options). It does not
    own the engines: the caller shuts them down.

    allowed_origins: web origins (scheme://host[:port], or "*") granted CORS on /v1; none by
        default, so that no web page can read the API's answers or send it JSON.
    """
    app = FastAPI(title="mmserve OpenAI-compatible API")
    app.include_router(
        build_router(
            engines, api_key=api_key, max_body_bytes=max_body_bytes, max_waiting=max_waiting,
            allowed_hosts=allowed_hosts,
        )
    )
    if allowed_origins:
        app.add_middleware(APICORS, origins=allowed_origins)
    return app


def serve(
    app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info"
) -> None:
    """Run `app` (API-only, or with the UI mounted) with uvicorn until interrupted. It binds to
    the local host only unless `host` says otherwise."""
    uvicorn.run(app, host=host, port=port, log_level=log_level)
