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


@dataclass(frozen=True)
class Choice:
    """An option that takes one of a few values, all integers (e.g. a model's soft-token
    budgets) or all strings (e.g. a downsampling mode)."""

    values: tuple[int, ...] | tuple[str, ...]
    why: str = ""

    def __post_init__(self) -> None:
        kinds = {isinstance(v, str) for v in self.values}
        if len(kinds) > 1 or any(isinstance(v, bool) for v in self.values):
            raise ValueError(f"Choice values {self.values!r} mix kinds (all integers or all "
                             "strings)")

    def describe(self) -> str:
        if not self.values:
            return "not settable"
        return "one of " + ", ".join(repr(v) if isinstance(v, str) else str(v)
                                     for v in self.values)

    def check(self, name: str, value: Any) -> int | str:
        """``value`` itself; ValueError naming the option, the value and the choices (a value
        of the other kind, or a bool for an integer, is refused, not converted)."""
        strings = bool(self.values) and isinstance(self.values[0], str)
        kind_ok = isinstance(value, str) if strings else (
            isinstance(value, numbers.Integral) and not isinstance(value, bool))
        if not kind_ok or value not in self.values:
            why = f" ({self.why})" if self.why else ""
            raise ValueError(f"mm_processor_kwargs {name}={value!r} is not {self.describe()}"
                             f"{why}")
        return value if strings else int(value)


def check_mm_kwargs(
    mm_kwargs: Mapping[str, Any],
    accepted: Mapping[str, OptionRange | Flag | Choice] | tuple[str, ...],
    family: str,
) -> dict[str, int | float | bool | str | Any]:
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
