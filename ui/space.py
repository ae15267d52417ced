"""Hugging Face Spaces integration: the `spaces.GPU` decorator where the `spaces` package is
installed (on Spaces), and a no-op decorator everywhere else."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


def gpu(fn: F) -> F:
    """Mark `fn` as the GPU work entry point (a chat turn) for Spaces; `fn` itself elsewhere."""
    if importlib.util.find_spec("spaces") is None:
        return fn
    import spaces

    return spaces.GPU(fn)
