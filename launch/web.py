"""The one FastAPI app `python app.py` serves: the Gradio UI at / and, for engines run here, the
OpenAI-compatible API under /v1, with the browser-safety options of /v1 the command line asks
for (`guard_options`) and a loud warning when the API is open to other machines without a key."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from launch.engines import is_local

if TYPE_CHECKING:  # the heavy imports wait until the app is built
    from fastapi import FastAPI

    from engine.interface import ChatEngine
    from ui.dictation import Dictation
    from ui.lineup import Loader

log = logging.getLogger("mmserve")


def build_app(
    engines: Mapping[str, ChatEngine],
    *,
    api_key: str | None = None,
    notes: Mapping[str, str] | None = None,
    examples: list[list] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    available: Mapping[str, Loader] | None = None,
    dictation: Dictation | None = None,
) -> FastAPI:
    """One FastAPI app: the Gradio UI at / and, for in-process engines, the OpenAI-compatible
    API under /v1 (a remote server serves its own API), guarded by allowed_hosts and
    allowed_origins as in `api.create_app`; `available`: models the UI's picker lists and
    loads when chosen (served in the UI); `dictation`: a ui.dictation.Dictation, whose Whisper
    engine the API serves too."""
    import gradio as gr
    from fastapi import FastAPI

    from ui import build_demo

    app = FastAPI(title="mmserve")
    if is_local(engines):
        from api import build_router
        from api.guards import APICORS

        # Before the UI's catch-all "/".
        app.include_router(build_router(served_models(engines, dictation), api_key=api_key,
                                        allowed_hosts=allowed_hosts))
        if allowed_origins:
            app.add_middleware(APICORS, origins=allowed_origins)
    demo = build_demo(engines, notes=notes, examples=examples, available=available,
                      dictation=dictation)
    # Gradio refuses uploads the engines would refuse anyway, before storing them.
    largest = max(llm.info.media_limits.max_item_bytes for llm in engines.values())
    return gr.mount_gradio_app(app, demo, path="/", max_file_size=largest)


def served_models(engines: Mapping[str, ChatEngine], dictation: Dictation | None
                  ) -> dict[str, Any]:
    """The models /v1 serves by name: the chat engines and the dictation's Whisper engine."""
    return {**engines, **({dictation.name: dictation.llm} if dictation else {})}


def guard_options(args: argparse.Namespace) -> dict[str, Any]:
    """The browser-safety options of /v1 (see api.guards): the origins granted CORS and, when
    the server is bound to this machine only, its loopback names as the only Host headers
    served, which defeats DNS rebinding."""
    from api.guards import LOOPBACK_HOSTS, is_loopback

    local = is_loopback(args.host) and not args.share
    return {
        "allowed_hosts": LOOPBACK_HOSTS if local else None,
        "allowed_origins": tuple(args.allowed_origins),
    }


def warn_if_exposed(host: str, api_key: str | None, *, share: bool = False) -> bool:
    """Log a loud warning when the API is reachable from other machines without an API key;
    returns whether it did."""
    from api.guards import is_loopback

    if api_key or (is_loopback(host) and not share):
        return False
    where = "through a public gradio.live link" if share else f"on {host}"
    log.warning(
        "\n%s\nWARNING: the OpenAI API at /v1 is served %s WITHOUT an API key.\nAnyone who "
        "can reach this port can run the models and make the server fetch media URLs.\n"
        "Set --api-key (or $MMSERVE_API_KEY), or bind to 127.0.0.1.\n%s",
        "!" * 78, where, "!" * 78,
    )
    return True
