"""The offline demo's checkpoints: a tiny builder's checkpoint with the tokenizer its family
ships (the builder's `tokenizer_kind`) and its family's chat template, written for mmserve in
testing/templates/*.jinja (tools, and thinking where the family thinks), installed wherever
the checkpoint keeps a template so that transformers and mmserve both read it.

Each demo model's tokenizer and template:

| demo model | tokenizer | template |
| --- | --- | --- |
| demo-qwen2-vl | byte-level BPE | qwen2_vl.jinja: ChatML, Hermes tool calls |
| demo-llava-next | SentencePiece-style BPE, byte fallback (*) | Mistral's [INST], [TOOL_CALLS] |
| demo-qwen2-audio | byte-level BPE | qwen2_audio.jinja: ChatML, Hermes tool calls |
| demo-qwen2.5-omni | byte-level BPE | qwen2_5_omni.jinja: ChatML, Hermes tool calls |
| demo-internvl | byte-level BPE | internvl.jinja: ChatML, Hermes tool calls |
| demo-llama3.2-vision | byte-level BPE | llama3_2_vision.jinja: JSON tool calls |
| demo-phi4-multimodal | byte-level BPE (**) | phi4_multimodal.jinja: <|tool_call|> list |
| demo-minicpm-v-4.6 | byte-level BPE | minicpm_v.jinja: ChatML, Hermes tool calls, thinking |
| demo-gemma4 | SentencePiece-style BPE, byte fallback | gemma4.jinja: <|tool_call>, thinking |

(*) LLaVA-NeXT's Mistral checkpoints are Mistral-7B-Instruct based; the demo's tokenizer
holds Mistral v0.3's control tokens ([INST], [AVAILABLE_TOOLS], [TOOL_CALLS], ...) and its
template is Mistral's with tools (testing/chat_formats.py's, an image part as `<image>`).
(**) Phi-4-mini and Phi-4-multimodal ship GPT-2 style byte-level BPE (o200k), not Phi-3's
SentencePiece, so the demo keeps byte-level BPE; it holds Phi-4's tool tokens (<|tool|>,
<|tool_call|>, <|tool_response|>, ...). Gemma 4's tool, string-delimiter and thought-channel
tokens are special, as its tokenizer holds them (testing/chat_formats.py lists each set).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

TEMPLATES = Path(__file__).with_name("templates")


def build_demo_checkpoint(path: Path, builder: str, template: str | None = None,
                          **kwargs: Any) -> Path:
    """Build `builder` ("module:function" of the testing package) at `path` with `kwargs`,
    then install the template `template`: a file of testing/templates, or "module:function"
    of the testing package that returns it (None: the builder's)."""
    path = Path(_named(builder)(path, **kwargs))
    if template is not None:
        text = _named(template)() if ":" in template else (TEMPLATES / template).read_text()
        install_chat_template(path, text)
    return path


def _named(name: str):
    module, attr = name.split(":")
    return getattr(importlib.import_module(module), attr)


def install_chat_template(path: Path, template: str) -> None:
    """Write `template` everywhere the checkpoint at `path` keeps one (processor_config.json,
    chat_template.json, chat_template.jinja, tokenizer_config.json), chat_template.jinja when
    it keeps none."""
    path = Path(path)
    written = False
    for name in ("processor_config.json", "chat_template.json", "tokenizer_config.json"):
        file = path / name
        data = json.loads(file.read_text()) if file.exists() else None
        if isinstance(data, dict) and "chat_template" in data:
            file.write_text(json.dumps({**data, "chat_template": template}, indent=2) + "\n")
            written = True
    jinja = path / "chat_template.jinja"
    if jinja.exists() or not written:
        jinja.write_text(template)
