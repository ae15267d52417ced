"""The server's model list (GET /models): each model's name and what the server says about it
(vLLM and SGLang: the context length; mmserve also: modalities and batch width)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from engine.remote.config import RemoteConfig
from engine.remote.errors import BackendError, status_error, transport_error
from engine.remote.stream import EXTENSION


@dataclass(frozen=True)
class ModelCard:
    """One entry of the server's /models: what it says about a model (None: not said)."""

    id: str
    max_model_len: int | None = None
    modalities: tuple[str, ...] | None = None  # mmserve says; vLLM and SGLang do not
    max_num_seqs: int | None = None  # mmserve says
    from_mmserve: bool = False

    @classmethod
    def parse(cls, entry: Mapping[str, Any]) -> ModelCard:
        ours = entry.get(EXTENSION)
        length = entry.get("max_model_len")
        card = cls(str(entry["id"]), length if _positive_int(length) else None)
        if not isinstance(ours, dict):
            return card
        modalities = ours.get("modalities")
        seqs = ours.get("max_num_seqs")
        return cls(
            card.id, card.max_model_len,
            tuple(modalities) if isinstance(modalities, list) else None,
            seqs if _positive_int(seqs) else None, from_mmserve=True,
        )


def list_models(config: RemoteConfig) -> list[ModelCard]:
    """GET /models (blocking, for start-up). BackendError when the server cannot be reached,
    refuses the key, or does not answer like an OpenAI-compatible API."""
    url = f"{config.base_url}/models"
    try:
        with httpx.Client(timeout=config.http_timeout(), headers=config.headers()) as http:
            response = http.get(url)
    except httpx.HTTPError as e:
        raise transport_error(e, config.base_url, config.timeout_s) from e
    if response.status_code == 404:
        raise BackendError(
            f"no OpenAI-compatible API at {config.base_url} (GET {url} answered 404); the URL "
            "should end with the API's prefix, usually /v1"
        )
    if response.status_code != 200:
        error = status_error(response.status_code, response.content, config.base_url)
        raise error if isinstance(error, BackendError) else BackendError(str(error))
    try:
        return [ModelCard.parse(m) for m in response.json()["data"]]
    except (ValueError, KeyError, TypeError) as e:
        raise BackendError(f"the server at {config.base_url} answered GET /models with "
                           "something other than an OpenAI model list") from e


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
