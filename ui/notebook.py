"""Notebook display of one result's engine panels, without a web server: `show_result(llm, out)`
for an in-process or a remote engine."""

from __future__ import annotations

from dataclasses import dataclass

from engine.interface import ChatEngine
from engine.outputs import RequestOutput
from ui.panels import result_html


@dataclass(frozen=True)
class ResultView:
    """Displays as the panels' HTML in Jupyter (`_repr_html_`); `.html` holds the markup."""

    html: str

    def _repr_html_(self) -> str:
        return self.html


def show_result(llm: ChatEngine, output: RequestOutput) -> ResultView:
    """The placeholder, cache and timing panels for `output` (a finished RequestOutput of
    `llm`), with the engine's current counters; the last expression of a cell displays it."""
    return ResultView(result_html(output, llm.stats(), llm.tokenizer))
