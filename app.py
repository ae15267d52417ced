"""Command line: `python app.py [--model ...]` loads the engines and serves the Gradio UI at / and
the OpenAI-compatible API at /v1 on one server (`--api-only`: the API alone). With no model
it serves the offline demo lineup. With `--backend URL` (or $MMSERVE_BACKEND) the UI drives the
models of an OpenAI-compatible server instead (vLLM, SGLang, mmserve): nothing is loaded here
and torch is never imported. Run `python app.py --help` for the options.

The entry point only: its parts, one job each, are in launch/ (the options, the engines, the
dictation engine, the web app, serving)."""

from __future__ import annotations

import logging
import sys

from launch.dictation import load_dictation
from launch.engines import load_engines, shutdown
from launch.options import parse_args
from launch.serve import serve

log = logging.getLogger("mmserve")


def main(argv: list[str] | None = None) -> int:
    """Run the app with `argv` (sys.argv's by default) until Ctrl-C; the exit status."""
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
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request to a server
    engines = {}
    dictation = None
    try:
        engines, notes = load_engines(args)
        dictation = load_dictation(args)
        serve(args, engines, notes, dictation)
    except KeyboardInterrupt:
        pass
    except ValueError as e:  # a bad model or option: the message says what and why
        log.error("%s", e)
        return 2
    except RuntimeError as e:
        from engine.interface import EngineError

        if not isinstance(e, EngineError):
            raise
        log.error("%s", e)  # a server that cannot be reached or refuses the key
        return 2
    finally:
        shutdown(engines)
        if dictation is not None:
            dictation.llm.shutdown()
        log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
