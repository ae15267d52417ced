"""The seam between front ends and engines: `ChatEngine`, what the web UI and the notebook
helper call, implemented by the in-process `AsyncLLM` and by `RemoteEngine` (an
OpenAI-compatible server). Front ends import this module, never an implementation, so that a
front end for a remote server loads no torch. Pure Python.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from engine.media.limits import MODALITIES, MediaLimits
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """A request failed for a reason outside the request itself (an engine that stopped, a
    server that could not be reached); the message says what happened in plain words.
    Problems with the request itself (bad media, a prompt too long) are ValueErrors."""


class EngineDeadError(EngineError):
    """The engine thread stopped (shut down, or an internal error); no request can run."""


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know about one served model.

    model: the model's name (a Hub id, a path, or the name a server serves it under).
    modalities: the media it accepts, in ("image", "video", "audio"); None when the engine
        cannot tell (a server that does not say): then the server judges each request.
    max_model_len: longest sequence, prompt + output, in tokens; None when not reported.
    media_limits: the limits media is checked against before it reaches the model.
    max_num_seqs: how many requests it runs at once (the UI sizes its queue by it).
    backend: the server's base URL for a remote engine; None for the in-process engine.
    """

    model: str
    modalities: tuple[str, ...] | None
    max_model_len: int | None
    media_limits: MediaLimits
    max_num_seqs: int
    backend: str | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("EngineInfo.model must be a non-empty name")
        if self.modalities is not None:
            unknown = sorted(set(self.modalities) - set(MODALITIES))
            if unknown:
                raise ValueError(
                    f"EngineInfo.modalities: unknown modality {unknown[0]!r} "
                    f"(expected some of {', '.join(MODALITIES)})"
                )
            object.__setattr__(self, "modalities", tuple(self.modalities))
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"EngineInfo.max_model_len must be >= 1, got {self.max_model_len}")
        if self.max_num_seqs < 1:
            raise ValueError(f"EngineInfo.max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def accepts(self, modality: str) -> bool | None:
        """Whether the model takes `modality`; None when the engine cannot tell."""
        return None if self.modalities is None else modality in self.modalities


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the panels use to show a prompt's tokens."""

    @property
    def all_special_ids(self) -> list[int]: ...

    def batch_decode(self, sequences: Sequence[Sequence[int]]) -> list[str]: ...


@runtime_checkable
class ChatEngine(Protocol):
    """A model that streams chat replies: the one interface of local and remote engines."""

    @property
    def info(self) -> EngineInfo:
        """The model's name, accepted media, context length and limits."""
        ...

    @property
    def tokenizer(self) -> TokenizerLike | None:
        """The model's tokenizer, to show token texts; None when it is not at hand."""
        ...

    def chat(
        self,
        messages: list[dict],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the reply to OpenAI-style `messages` (content parts: text, image_url,
        video_url, input_audio, audio_url, or {"type": "image" | "video" | "audio", <modality>:
        bytes or a source}); the last output has finished=True. A bad request raises
        ValueError naming the problem; an engine that cannot serve raises EngineError."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request: its stream then ends with finish_reason "abort"."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for the engine panel (a snapshot, cheap: the UI polls it every second)."""
        ...

    def shutdown(self) -> None:
        """Release the engine; requests still in flight fail."""
        ...
