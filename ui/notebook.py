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


class ApiServer:
    """mmserve's OpenAI API for `engines`, served on a free 127.0.0.1 port from a background
    thread (a notebook's own server, for the remote-engine cells); `url` is its /v1 base.
    `close()` stops it (the engines stay the caller's)."""

    def __init__(self, engines: dict[str, ChatEngine], startup_timeout_s: float = 30) -> None:
        import socket
        import threading
        import time

        import uvicorn

        from api import create_app

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        config = uvicorn.Config(create_app(engines), log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("the notebook's API server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}/v1"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)
        self._socket.close()
