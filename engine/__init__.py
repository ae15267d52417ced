"""The serving core: `from engine import LLM, AsyncLLM, SamplingParams`."""

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = [
    "LLM",
    "AsyncLLM",
    "EngineConfig",
    "EngineDeadError",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "PlaceholderInfo",
]
