"""The serving core: `from engine import LLM, AsyncLLM, SamplingParams`.

Names are imported on first use (PEP 562), so light modules such as `engine.media`,
`engine.scheduler`, `engine.outputs`, `engine.interface` or `engine.remote` can be imported without
loading torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLM": "engine.async_llm",
    "EngineDeadError": "engine.interface",
    "EngineError": "engine.interface",
    "EngineInfo": "engine.interface",
    "ChatEngine": "engine.interface",
    "RemoteEngine": "engine.remote",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "PlaceholderInfo": "engine.outputs",
}

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineDeadError",
    "EngineError",
    "EngineInfo",
    "ChatEngine",
    "RemoteEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "PlaceholderInfo",
]

if TYPE_CHECKING:
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from engine.interface import ChatEngine, EngineDeadError, EngineError, EngineInfo
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput
    from engine.remote import RemoteEngine
    from engine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
