"""Inline styles and small HTML helpers shared by the panels (self-contained HTML: every style
inline, so that the panels look the same in the web UI and in a notebook)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

BOX = (
    "font-family: ui-sans-serif, system-ui, sans-serif; font-size: 13px; line-height: 1.5; "
    "color: #111827; background: #ffffff; border: 1px solid #e5e7eb; border-radius: 8px; "
    "padding: 8px 10px; margin: 4px 0;"
)
CHIP = "display: inline-block; border-radius: 4px; padding: 0 4px; margin: 1px; "
MUTED = "color: #6b7280;"


def section(title: str, lines: list[str], css_class: str = "mm-cache") -> str:
    """A titled box with one line per entry."""
    body = "".join(f'<div style="margin:2px 0">{line}</div>' for line in lines)
    return (
        f'<div class="{css_class}" style="{BOX}"><div style="font-weight:600;margin-bottom:2px">'
        f"{title}</div>{body}</div>"
    )


def count(n: int | None) -> str:
    return "?" if n is None else str(n)


def ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def pct(frac: float) -> str:
    return f"{100 * frac:.0f}%"


def unreported(output: RequestOutput, key: str) -> str:
    """The output's sentence on why `key` is not known, muted."""
    return f'<span style="{MUTED}">{html.escape(output.unreported[key])}</span>'
