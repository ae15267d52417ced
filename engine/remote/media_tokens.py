"""Placeholder ranges from a prompt's token ids, for servers that return the ids (vLLM's
`return_token_ids`) but not the ranges: each media item is a run of its model's media pad
token, so the runs of those tokens, in order, are the items' spans.

Which token is a model's pad token is looked up by name: the pad tokens of the families
vLLM and SGLang serve are listed here, and the server's tokenizer (vLLM's /tokenize) says
which of them is one token of this model's vocabulary.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import httpx

from engine.outputs import PlaceholderInfo
from engine.remote.config import RemoteConfig
from engine.remote.errors import BackendError

# Media pad tokens by modality: Qwen2-VL, Qwen2.5-VL and Qwen3-VL (<|image_pad|>,
# <|video_pad|>), LLaVA and LLaVA-OneVision (<image>, <video>), Gemma 3 and 3n
# (<image_soft_token>, <audio_soft_token>), InternVL (<IMG_CONTEXT>), Llama 4 (<|patch|>),
# Pixtral ([IMG], whose rows [IMG_BREAK] splits into runs), Qwen2-Audio (<|AUDIO|>),
# Qwen2.5-Omni (<|audio_pad|>), Ultravox (<|audio|>).
PAD_TOKENS: dict[str, tuple[str, ...]] = {
    "image": ("<|image_pad|>", "<image>", "<image_soft_token>", "<IMG_CONTEXT>", "<|patch|>",
              "[IMG]"),
    "video": ("<|video_pad|>", "<video>"),
    "audio": ("<|AUDIO|>", "<|audio_pad|>", "<audio_soft_token>", "<|audio|>"),
}


def find_media_runs(
    token_ids: Sequence[int], pad_ids: Mapping[int, str]
) -> list[PlaceholderInfo]:
    """One placeholder per maximal run of a pad token (`pad_ids`: token id -> modality), in
    prompt order. Every position of a run is an embedding position; the content hash and
    the encoder-cache outcome are not known from ids (None)."""
    runs: list[PlaceholderInfo] = []
    start = 0
    n = len(token_ids)
    while start < n:
        modality = pad_ids.get(token_ids[start])
        if modality is None:
            start += 1
            continue
        end = start + 1
        while end < n and token_ids[end] == token_ids[start]:
            end += 1
        runs.append(PlaceholderInfo(modality, start, end - start, end - start, None, None))
        start = end
    return runs


def runs_note(runs: Sequence[PlaceholderInfo], sent: Sequence[str]) -> str | None:
    """A sentence when the runs found do not match the media sent one to one (a model that
    splits one item into several runs, or a pad token not in PAD_TOKENS); None when they
    match."""
    found = [r.modality for r in runs]
    if found == list(sent):
        return None
    counts = ", ".join(f"{found.count(m)} {m}" for m in PAD_TOKENS if m in found) or "none"
    sent_counts = ", ".join(f"{list(sent).count(m)} {m}" for m in PAD_TOKENS if m in sent)
    return (f"The prompt's media-token runs ({counts}) do not match the media sent "
            f"({sent_counts}): each run is shown as found, labelled by modality and order.")


async def fetch_pad_ids(config: RemoteConfig, model: str) -> dict[int, str]:
    """The model's media pad tokens (token id -> modality): each name of PAD_TOKENS that the
    server's /tokenize turns into one token. BackendError, with a sentence for the panel,
    when the server cannot say or none of them is a token of the model."""
    names = [(modality, name) for modality, names in PAD_TOKENS.items() for name in names]
    try:
        async with httpx.AsyncClient(timeout=config.http_timeout(),
                                     headers=config.headers()) as http:
            tokens = await asyncio.gather(*(_tokenize(http, config, model, n) for _, n in names))
    except (httpx.HTTPError, BackendError) as e:
        raise BackendError(f"The media spans cannot be located: the server did not name the "
                           f"model's media tokens ({e}).") from e
    found = {ids[0]: modality for (modality, _), ids in zip(names, tokens, strict=True)
             if ids is not None and len(ids) == 1}
    if not found:
        raise BackendError("The media spans cannot be located: none of the media tokens this "
                           "app knows is a token of this model.")
    return found


async def _tokenize(
    http: httpx.AsyncClient, config: RemoteConfig, model: str, text: str
) -> list[int] | None:
    response = await http.post(f"{config.root_url}/tokenize", json={
        "model": model, "prompt": text, "add_special_tokens": False})
    if response.status_code in (404, 405):
        raise BackendError("it has no /tokenize endpoint")
    if response.status_code != 200:
        return None
    tokens = response.json().get("tokens")
    return tokens if isinstance(tokens, list) else None
