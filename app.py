"""Command line: `python app.py [--model ...]` loads the engines and serves the Gradio UI at / and
the OpenAI-compatible API at /v1 on one server (`--api-only`: the API alone). With no model
it serves the offline demo lineup. Run `python app.py --help` for the options."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the heavy imports wait until the arguments are parsed (fast --help)
    from fastapi import FastAPI

    from engine import AsyncLLM

log = logging.getLogger("mmserve")

MODEL_ENV = "MODEL"

_ENGINE_OPTIONS = {  # flag -> (engine option, type, help)
    "--max-model-len": ("max_model_len", int, "longest sequence, prompt + output (tokens)"),
    "--max-num-seqs": ("max_num_seqs", int, "most requests in one batch"),
    "--max-num-batched-tokens": ("max_num_batched_tokens", int, "token budget of one step"),
    "--kv-cache-bytes": ("kv_cache_bytes", int, "bytes for the paged KV cache"),
    "--block-size": ("block_size", int, "tokens per KV-cache block"),
    "--encoder-cache-size": ("encoder_cache_size", int, "encoder-output cache, in embeddings"),
    "--max-num-encoder-input-tokens": (
        "max_num_encoder_input_tokens", int, "encoder budget of one step, in embeddings"),
    "--processed-cache-items": ("processed_cache_items", int, "processed-input cache, in items"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="Multimodal chat UI with live engine panels, plus an OpenAI-compatible API "
        "at /v1. Without --model (or $MODEL) it serves tiny random-weight demo models, "
        "generated once into $MMSERVE_DEMO_DIR (default ~/.cache/mmserve/demo).",
    )
    parser.add_argument(
        "--model", action="append", metavar="ID_OR_PATH",
        help="a Hugging Face Hub id or a local checkpoint directory; repeat for several "
        f"models (chosen in the UI). Default: ${MODEL_ENV} (comma-separated), else the demo",
    )
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto")
    parser.add_argument(
        "--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
        help="address to bind (default $GRADIO_SERVER_NAME or 127.0.0.1, this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)),
        help="port (default $GRADIO_SERVER_PORT or 7860)",
    )
    parser.add_argument(
        "--share", action="store_true", help="also open a public gradio.live link for the UI"
    )
    parser.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1 (default $MMSERVE_API_KEY; the UI "
        "is not protected by it). Binding to anything but this machine without one is warned "
        "about: anyone who can reach the port can use the API",
    )
    parser.add_argument(
        "--allowed-origins", action="append", default=[], metavar="ORIGIN",
        help="a web origin (https://app.example.com, or *) whose pages may call /v1 from a "
        "browser (CORS); repeat for several. Default: none",
    )
    parser.add_argument("--api-only", action="store_true", help="serve the /v1 API without UI")
    for flag, (_, kind, text) in _ENGINE_OPTIONS.items():
        parser.add_argument(flag, type=kind, help=f"engine option: {text}")
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="engine option: disable prefix caching"
    )
    return parser.parse_args(argv)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (the rest keep the engine's defaults)."""
    options = {
        option: getattr(args, flag[2:].replace("-", "_"))
        for flag, (option, _, _) in _ENGINE_OPTIONS.items()
    }
    options = {k: v for k, v in options.items() if v is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    return options


def model_sources(args: argparse.Namespace) -> dict[str, str | Path]:
    """Served name -> Hub id or path, from --model, else $MODEL; empty for the demo. A local
    directory is served under its own name, a Hub id under the id."""
    given = args.model or [m.strip() for m in os.environ.get(MODEL_ENV, "").split(",")]
    sources: dict[str, str | Path] = {}
    for source in filter(None, given):
        path = Path(source).expanduser()
        name = path.name if path.is_dir() and path.name not in sources else source
        sources[name] = source
    return sources


def build_app(
    engines: Mapping[str, AsyncLLM],
    *,
    api_key: str | None = None,
    notes: Mapping[str, str] | None = None,
    examples: list[list] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:
    """One FastAPI app: the OpenAI-compatible API under /v1 and the Gradio UI at /.

    allowed_hosts and allowed_origins guard /v1 as in `api.create_app`.
    """
    import gradio as gr
    from fastapi import FastAPI

    from api import build_router
    from api.guards import APICORS
    from ui import build_demo

    app = FastAPI(title="mmserve")
    # Before the UI's catch-all "/".
    app.include_router(build_router(engines, api_key=api_key, allowed_hosts=allowed_hosts))
    if allowed_origins:
        app.add_middleware(APICORS, origins=allowed_origins)
    demo = build_demo(engines, notes=notes, examples=examples)
    # Gradio refuses uploads the engines would refuse anyway, before storing them.
    largest = max(llm.processor.media_limits.max_item_bytes for llm in engines.values())
    return gr.mount_gradio_app(app, demo, path="/", max_file_size=largest)


def load_engines(args: argparse.Namespace) -> tuple[dict[str, AsyncLLM], dict[str, str]]:
    """The engines to serve and, for demo models, the note that says their weights are random."""
    from engine import AsyncLLM
    from ui.demo import DEMO_NOTE, ensure_demo_models

    sources = model_sources(args)
    notes = {}
    if not sources:
        sources = dict(ensure_demo_models())
        notes = dict.fromkeys(sources, DEMO_NOTE)
    options = engine_options(args)
    engines: dict[str, AsyncLLM] = {}
    try:
        for name, source in sources.items():
            log.info("loading %s", name)
            engines[name] = AsyncLLM(source, device=args.device, dtype=args.dtype, **options)
    except BaseException:
        shutdown(engines)
        raise
    return engines, notes


def serve(args: argparse.Namespace, engines: dict[str, AsyncLLM], notes: dict[str, str]) -> None:
    """Serve until Ctrl-C (or SIGTERM)."""
    import uvicorn

    from api import api_key_from_env, create_app

    api_key = args.api_key or api_key_from_env()
    warn_if_exposed(args.host, api_key, share=args.share)
    guards = guard_options(args)
    if args.api_only:
        app = create_app(engines, api_key=api_key, **guards)
    elif args.share:
        return _serve_shared(args, engines, notes, api_key)
    else:
        app = build_app(engines, api_key=api_key, notes=notes, **guards)
    where = "API" if args.api_only else "UI and API"
    log.info("serving the %s on http://%s:%d (Ctrl-C stops)", where, args.host, args.port)
    # A short graceful timeout: open streams (a browser tab's event stream) must not hold up
    # Ctrl-C; the engines abort whatever is still running when they shut down.
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=2)
    uvicorn.Server(config).run()


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


def _serve_shared(
    args: argparse.Namespace, engines: dict[str, AsyncLLM], notes: dict[str, str],
    api_key: str | None,
) -> None:
    """--share needs Gradio's own launcher (it opens the tunnel); the API joins its app."""
    from api import build_router
    from ui import build_demo

    demo = build_demo(engines, notes=notes)
    demo.launch(server_name=args.host, server_port=args.port, share=True,
                prevent_thread_lock=True)
    demo.app.include_router(build_router(engines, api_key=api_key))
    try:
        demo.block_thread()
    finally:
        demo.close()


def shutdown(engines: Mapping[str, AsyncLLM]) -> None:
    for llm in engines.values():
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.allowed_origins:
        from api.guards import check_origins

        try:
            check_origins(args.allowed_origins)
        except ValueError as e:
            print(f"python app.py: error: {e}", file=sys.stderr)
            return 2
        if args.share:
            print("python app.py: error: --allowed-origins cannot be used with --share",
                  file=sys.stderr)
            return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    engines: dict[str, AsyncLLM] = {}
    try:
        engines, notes = load_engines(args)
        serve(args, engines, notes)
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # a bad model or option: the message says what and why
        log.error("%s", e)
        return 2
    finally:
        shutdown(engines)
        log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
