"""Serving until Ctrl-C: the app `launch.web` builds (or the API alone, --api-only) on uvicorn,
or, with --share, on Gradio's own launcher, which opens the public link."""

from __future__ import annotations

import argparse
import logging
from typing import TYPE_CHECKING

from launch.engines import is_local, refused_models, stored_models
from launch.web import build_app, guard_options, served_models, warn_if_exposed

if TYPE_CHECKING:
    from engine.interface import ChatEngine
    from ui.dictation import Dictation

log = logging.getLogger("mmserve")


def serve(
    args: argparse.Namespace, engines: dict[str, ChatEngine], notes: dict[str, str],
    dictation: Dictation | None = None,
) -> None:
    """Serve until Ctrl-C (or SIGTERM)."""
    import uvicorn

    api_key = None
    if is_local(engines):  # a remote server guards its own API
        from api import api_key_from_env

        api_key = args.api_key or api_key_from_env()
        warn_if_exposed(args.host, api_key, share=args.share)
    guards = guard_options(args) if is_local(engines) else {}
    if args.api_only:
        from api import create_app

        app = create_app(served_models(engines, dictation), api_key=api_key, **guards)
    elif args.share:
        return _serve_shared(args, engines, notes, api_key)
    else:
        available = {**refused_models(engines, notes), **stored_models(args, engines)}
        app = build_app(engines, api_key=api_key, notes=notes, available=available,
                        dictation=dictation, **guards)
    where = "API" if args.api_only else "UI and API" if is_local(engines) else "UI"
    log.info("serving the %s on http://%s:%d (Ctrl-C stops)", where, args.host, args.port)
    # A short graceful timeout: open streams (a browser tab's event stream) must not hold up
    # Ctrl-C; the engines abort whatever is still running when they shut down.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=2)
    uvicorn.Server(config).run()


def _serve_shared(
    args: argparse.Namespace, engines: dict[str, ChatEngine], notes: dict[str, str],
    api_key: str | None,
) -> None:
    """--share needs Gradio's own launcher (it opens the tunnel); the API joins its app."""
    from ui import build_demo

    available = {**refused_models(engines, notes), **stored_models(args, engines)}
    demo = build_demo(engines, notes=notes, available=available)
    demo.launch(server_name=args.host, server_port=args.port, share=True,
                prevent_thread_lock=True)
    if is_local(engines):
        from api import build_router

        demo.app.include_router(build_router(engines, api_key=api_key))
    try:
        demo.block_thread()
    finally:
        demo.close()
