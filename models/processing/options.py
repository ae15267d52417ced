"""Per-request processor options (`mm_processor_kwargs`): the names a model's processor accepts
and the range each value may take, checked before any media is decoded or processed. Shared by
every family's processor."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptionRange:
    """The values one option may take: a number (or an integer) in [low, high].

    ``low_open`` excludes ``low`` itself (fps > 0); ``high`` None leaves it unbounded above.
    ``why`` names what sets the bounds, for the error message.
    """

    low: float
    high: float | None = None
    integer: bool = False
    low_open: bool = False
    why: str = ""

    def __post_init__(self) -> None:
        if self.high is not None and self.high < self.low:
            raise ValueError(f"OptionRange: high {self.high} is below low {self.low}")

    def describe(self) -> str:
        """The range in words, e.g. "an integer in [784, 12845056]"."""
        kind = "an integer" if self.integer else "a number"
        if self.high is None:
            return f"{kind} {'>' if self.low_open else '>='} {_number(self.low)}"
        opening = "(" if self.low_open else "["
        return f"{kind} in {opening}{_number(self.low)}, {_number(self.high)}]"

    def check(self, name: str, value: Any) -> int | float:
        """``value`` as an int or a float; ValueError naming the option, the value and the
        range when it is of the wrong type or outside the range."""
        kind = numbers.Integral if self.integer else numbers.Real
        valid = (
            isinstance(value, kind)
            and not isinstance(value, bool)
            and math.isfinite(value)
            and (value > self.low if self.low_open else value >= self.low)
            and (self.high is None or value <= self.high)
        )
        if not valid:
            why = f" ({self.why})" if self.why else ""
            raise ValueError(
                f"mm_processor_kwargs {name}={value!r} is not {self.describe()}{why}"
            )
        return int(value) if self.integer else float(value)


@dataclass(frozen=True)
class Choice:
    """An option that takes one of a few integers (e.g. a model's soft-token budgets)."""

    values: tuple[int, ...]
    why: str = ""

    def describe(self) -> str:
        return "one of " + ", ".join(map(str, self.values)) if self.values else "not settable"

    def check(self, name: str, value: Any) -> int:
        """``value`` itself; ValueError naming the option, the value and the choices."""
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or (
                value not in self.values):
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"mm_processor_kwargs {name}={value!r} is not {self.describe()}"
                             f"{why}")
        return int(value)


@dataclass(frozen=True)
class Flag:
    """An option that is true or false (a JSON boolean; 0 and 1 are refused, not guessed)."""

    why: str = ""

    def describe(self) -> str:
        return "true or false"

    def check(self, name: str, value: Any) -> bool:
        """``value`` itself; ValueError naming the option and the value when not a bool."""
        if not isinstance(value, bool):
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"mm_processor_kwargs {name}={value!r} is not true or false{why}")
        return value


def check_mm_kwargs(
    mm_kwargs: Mapping[str, Any],
    accepted: Mapping[str, OptionRange | Choice | Flag] | tuple[str, ...],
    family: str,
) -> dict[str, int | float | bool | Any]:
    """Refuse options a model's processor does not know (naming those it does) and, where
    ``accepted`` maps names to ranges, values outside them. Returns the checked options."""
    if not isinstance(mm_kwargs, Mapping):
        raise ValueError(
            f"mm_processor_kwargs must be a mapping of option names to values, got "
            f"{type(mm_kwargs).__name__}"
        )
    unknown = set(mm_kwargs) - set(accepted)
    if unknown:
        raise ValueError(
            f"unknown mm_processor_kwargs {', '.join(sorted(map(str, unknown)))} "
            f"({family} accepts {', '.join(accepted)})"
        )
    if not isinstance(accepted, Mapping):
        return dict(mm_kwargs)
    return {name: accepted[name].check(name, value) for name, value in mm_kwargs.items()}


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"
