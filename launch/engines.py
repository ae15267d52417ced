"""The engines `python app.py` serves: those the command line names (else the offline demo's),
started here, a refusal of one of several noted instead of stopping the others; the models of
Ollama's and LM Studio's stores, listed for the picker and started when chosen; or, with
--backend, the models of a remote server. Shut down together."""

from __future__ import annotations

import argparse
import functools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from launch.options import engine_options, given_models, model_sources

if TYPE_CHECKING:  # torch waits until an engine is started (and never comes with --backend)
    from engine.interface import ChatEngine
    from engine.load_progress import ProgressListener
    from ui.lineup import Loader, Refused

log = logging.getLogger("mmserve")

ENGINE_EXTRA_HINT = (
    "the in-process engine needs torch and transformers: pip install 'mmserve[engine]' "
    "(or point the app at a server with --backend URL)"
)
REFUSED = "not started: "  # a refused model's note begins so


def load_engines(args: argparse.Namespace) -> tuple[dict[str, ChatEngine], dict[str, str]]:
    """The engines to serve and, for demo models, the note that says whether their weights are
    random or real. A model of several that refuses the options (a ValueError: the demo's
    Gemma 4 with a small --max-num-batched-tokens) does not stop the others: it is left out of
    the engines and its note says why (`refused_models`); only when none starts is the first
    refusal raised."""
    if args.backend:
        return connect_backend(args), {}
    try:
        from engine import AsyncLLM
    except ModuleNotFoundError as e:
        raise SystemExit(f"{ENGINE_EXTRA_HINT} ({e})") from e
    from ui.demo import demo_lineup

    sources = model_sources(args)
    notes = {}
    if not sources:
        sources, notes = demo_lineup()
    options = engine_options(args)
    if args.mmproj:
        options["mmproj"] = args.mmproj
    engines: dict[str, ChatEngine] = {}
    refusals: dict[str, ValueError] = {}
    try:
        for name, source in sources.items():
            log.info("loading %s", name)
            try:
                engines[name] = AsyncLLM(source, device=args.device, dtype=args.dtype,
                                         **options)
            except ValueError as e:
                if len(sources) == 1:
                    raise
                log.warning("%s is not served: %s", name, e)
                refusals[name] = e
    except BaseException:
        shutdown(engines)
        raise
    if not engines and refusals:
        raise next(iter(refusals.values()))
    notes.update({name: f"{REFUSED}{e}" for name, e in refusals.items()})
    return engines, notes


def refused_models(engines: Mapping[str, ChatEngine], notes: Mapping[str, str]
                   ) -> dict[str, Refused]:
    """The models `load_engines` could not start, for the picker: each says why when chosen."""
    from ui.lineup import Refused

    return {name: Refused(note.removeprefix(REFUSED)) for name, note in notes.items()
            if name not in engines and note.startswith(REFUSED)}


def stored_models(args: argparse.Namespace, engines: dict[str, ChatEngine]
                  ) -> dict[str, Loader]:
    """The models of Ollama's and LM Studio's stores not already in `engines`, each with the
    function that loads it (with the command line's engine options, telling the picker of each
    start-up stage) when the picker chooses it and adds it to `engines` (whose engines the app
    shuts down)."""
    if args.backend or args.no_model_stores or args.api_only:
        return {}
    from engine import AsyncLLM
    from engine.model_stores import discover

    options = engine_options(args)

    def load(name: str, progress: ProgressListener) -> ChatEngine:
        engines[name] = AsyncLLM(name, device=args.device, dtype=args.dtype,
                                 load_progress=progress, **options)
        return engines[name]

    found = [m.name for m in discover() if m.name not in engines]
    if found:
        log.info("found on this machine (listed, loaded when chosen): %s", ", ".join(found))
    return {name: functools.partial(load, name) for name in found}


def connect_backend(args: argparse.Namespace) -> dict[str, ChatEngine]:
    """A remote engine for each model of the --backend server (or each --model, else $MODEL,
    of its models)."""
    from engine.remote import RemoteConfig, connect

    config = RemoteConfig(
        args.backend, api_key=args.backend_key, timeout_s=args.backend_timeout,
        max_body_bytes=int(args.backend_max_body_mb * 2**20),
        return_token_ids=not args.backend_no_token_ids,
    )
    log.info("connecting to %s", config.base_url)
    engines: dict[str, ChatEngine] = dict(connect(config, given_models(args)))
    log.info("models of %s: %s", config.base_url, ", ".join(engines))
    return engines


def is_local(engines: Mapping[str, ChatEngine]) -> bool:
    """Whether the engines run in this process (the app then also serves them on /v1)."""
    return all(llm.info.backend is None for llm in engines.values())


def shutdown(engines: Mapping[str, ChatEngine]) -> None:
    """Shut down every engine (a remote one closes its connection)."""
    for llm in engines.values():
        llm.shutdown()
