"""An OpenAI-compatible HTTP API (/v1/models, /v1/chat/completions, /v1/completions) over
AsyncLLM engines, as a FastAPI router to mount next to the UI or as an API-only app."""

from api.protocol import DEFAULT_MAX_TOKENS
from api.routes import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_WAITING, build_router
from api.server import API_KEY_ENV, api_key_from_env, create_app, serve

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_MAX_WAITING",
    "api_key_from_env",
    "build_router",
    "create_app",
    "serve",
]
