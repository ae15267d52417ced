"""Chat templates that render tools, tool calls, tool results and thinking the way the real
families' templates do, and tiny checkpoints that carry them (for the API's tool-call and
reasoning tests and the demo).

Written from how the Hub's templates behave (what they put where), not copied:
- qwen3: Hermes tools in the system turn (`<tools>` JSON lines, `<tool_call>` blocks), tool
  results as `<tool_response>` in a user turn; `enable_thinking: false` closes an empty
  `<think>` block in the generation prompt, else the model opens its own.
- qwen3_5: the same, but the generation prompt opens `<think>` (the model thinks by default);
  its media placeholders are Qwen-VL's.
- mistral: Mistral Small 3.1's control tokens: `[AVAILABLE_TOOLS]` before the last user turn,
  `[TOOL_CALLS]` + a JSON list, `[TOOL_RESULTS]` with the call's id.
- llama3: Llama 3.2's JSON calls: the tools and the calling instructions in the first user
  turn, a call as `{"name": ..., "parameters": ...}`, results in `ipython` turns.
- gemma3: the pythonic prompt of Google's Gemma 3 function-calling guide (and vLLM's example
  template): the tools in the first user turn, calls as `[name(key=value)]`, results in a user
  turn as a `tool_output` block.
"""

from __future__ import annotations

import re
from pathlib import Path


def _jinja(text: str) -> str:
    """A template written with every newline meant as output: transformers renders with
    trim_blocks (the first newline after a block tag is dropped), so such a newline becomes an
    expression; no whitespace control is used."""
    return re.sub(r"%\}\n", "%}{{ '\\n' }}", text.replace("{%-", "{%").replace("-%}", "%}"))


# A message's content: a string, or parts whose media become the family's placeholder.
_CONTENT = (
    "{%- macro content(message, image, video='') -%}"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- elif message.content -%}{%- for part in message.content -%}"
    "{%- if part.type == 'text' -%}{{ part.text }}"
    "{%- elif part.type == 'image' -%}{{ image }}"
    "{%- elif part.type == 'video' -%}{{ video }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
)

_HERMES_TOOLS = (
    "{%- if tools -%}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ content(messages[0], image) }}\n\n{% endif -%}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' -%}"
    "<|im_start|>system\n{{ content(messages[0], image) }}<|im_end|>\n{%- endif -%}"
)

_HERMES_TURNS = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "<|im_start|>{{ message.role }}\n{{ content(message, image) }}<|im_end|>\n"
    "{%- elif message.role == 'assistant' -%}<|im_start|>assistant\n"
    "{%- if message.content %}{{ content(message, image) }}{% endif -%}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if loop.first and message.content %}\n{% elif not loop.first %}\n{% endif -%}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": '
    "{{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}<|im_start|>user{% endif -%}"
    "\n<tool_response>\n{{ content(message, image) }}\n</tool_response>"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}<|im_end|>\n{% endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def qwen3_template(image: str = "", video: str = "", think_by_default: bool = False) -> str:
    """Qwen3's behaviour (`think_by_default`: Qwen3.5's generation prompt; `image` and
    `video`: the placeholders of a media part)."""
    opened = "<think>\n" if think_by_default else ""
    return _jinja(
        _CONTENT + f"{{%- set image = {image!r} -%}}{{%- set video = {video!r} -%}}"
        + _HERMES_TOOLS + _HERMES_TURNS
        + "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
        "{%- if enable_thinking is defined and enable_thinking is false -%}"
        "<think>\n\n</think>\n\n"
        f"{{%- else %}}{opened}{{%- endif -%}}{{%- endif -%}}"
    )


def mistral_template(image: str = "[IMG]") -> str:
    """Mistral's template with its tools (`image`: the placeholder of an image part; Mistral
    Small 3.1's `[IMG]`, LLaVA-NeXT's `<image>`)."""
    return _jinja(
        _CONTENT + f"{{%- set image = {image!r} -%}}"
        "{{ bos_token }}"
        "{%- set turns = messages[1:] if messages[0].role == 'system' else messages -%}"
        "{%- if messages[0].role == 'system' -%}"
        "[SYSTEM_PROMPT]{{ content(messages[0], image) }}[/SYSTEM_PROMPT]{%- endif -%}"
        "{%- set ns = namespace(last_user=-1) -%}"
        "{%- for message in turns -%}{%- if message.role == 'user' -%}"
        "{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}"
        "{%- for message in turns -%}"
        "{%- if message.role == 'user' -%}"
        "{%- if tools and loop.index0 == ns.last_user -%}"
        "[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif -%}"
        "[INST]{{ content(message, image) }}[/INST]"
        "{%- elif message.role == 'assistant' -%}"
        "{%- if message.tool_calls -%}[TOOL_CALLS]["
        "{%- for call in message.tool_calls -%}"
        '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}'
        ', "id": "{{ call.id }}"}{% if not loop.last %}, {% endif -%}'
        "{%- endfor -%}]{{ eos_token }}"
        "{%- else -%}{{ content(message, image) }}{{ eos_token }}{%- endif -%}"
        "{%- elif message.role == 'tool' -%}"
        '[TOOL_RESULTS]{"content": {{ content(message, image) | tojson }}, '
        '"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
        "{%- endif -%}"
        "{%- endfor -%}"
    )


MISTRAL_TEMPLATE = mistral_template()
# Mistral v0.3's control tokens (special), the [IMG] placeholder aside.
MISTRAL_CONTROL = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                   "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
# Phi-4-mini's and Phi-4-multimodal's tool tokens (special): declarations, calls, results.
PHI4_TOOL_TOKENS = ("<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>",
                    "<|tool_response|>")
# Gemma 4's tool and thinking tokens (special, as its tokenizer holds them): declarations,
# calls, responses, the string delimiter, the thought channel and the thinking switch.
GEMMA4_TOOL_TOKENS = ("<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>", "<|tool_response>",
                      "<tool_response|>", '<|"|>', "<|channel>", "<channel|>", "<|think|>")

LLAMA3_TEMPLATE = _jinja(
    _CONTENT + "{%- set image = '<|image|>' -%}"
    "{{ bos_token }}"
    "{%- set has_system = messages[0].role == 'system' -%}"
    "{%- set system = content(messages[0], image) if has_system else '' -%}"
    "{%- set turns = messages[1:] if has_system else messages -%}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{%- if tools or builtin_tools is defined %}Environment: ipython\n{% endif -%}"
    "Cutting Knowledge Date: December 2023\n\n{{ system }}<|eot_id|>"
    "{%- set ns = namespace(tools_told=false) -%}"
    "{%- for message in turns -%}"
    "{%- if message.role == 'user' -%}"
    "<|start_header_id|>user<|end_header_id|>\n\n"
    "{%- if tools and not ns.tools_told -%}{%- set ns.tools_told = true -%}"
    "Given the following functions, please respond with a JSON for a function call with its "
    "proper arguments that best answers the given prompt.\n\nRespond in the format "
    '{"name": function name, "parameters": dictionary of argument name and its value}. '
    "Do not use variables.\n\n"
    "{%- for tool in tools %}{{ tool | tojson(indent=4) }}\n\n{% endfor -%}{%- endif -%}"
    "{{ content(message, image) }}<|eot_id|>"
    "{%- elif message.role == 'assistant' -%}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- if message.tool_calls -%}{%- for call in message.tool_calls -%}"
    "{%- if builtin_tools is defined and call.function.name in builtin_tools -%}"
    "<|python_tag|>{{ call.function.name }}.call({{ call.function.arguments | tojson }})"
    "<|eom_id|>{%- else -%}"
    '{"name": "{{ call.function.name }}", "parameters": '
    "{{ call.function.arguments | tojson }}}<|eot_id|>{%- endif -%}{%- endfor -%}"
    "{%- else -%}{{ content(message, image) }}<|eot_id|>{%- endif -%}"
    "{%- elif message.role in ('tool', 'ipython') -%}"
    "<|start_header_id|>ipython<|end_header_id|>\n\n{{ content(message, image) }}<|eot_id|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- endif -%}"
)

GEMMA3_TEMPLATE = _jinja(
    _CONTENT + "{%- set image = '<start_of_image>' -%}"
    "{{ bos_token }}"
    "{%- set has_system = messages[0].role == 'system' -%}"
    "{%- set turns = messages[1:] if has_system else messages -%}"
    "{%- set ns = namespace(prefix=content(messages[0], image) + '\n\n' if has_system "
    "else '') -%}"
    "{%- if tools -%}{%- set ns.prefix = ns.prefix + 'Tools (functions) are available. If you "
    "decide to invoke one or more of the tools, you must respond with a python list of the "
    "function calls.\nExample Format: [func_name1(params_name1=params_value1, "
    "params_name2=params_value2...), func_name2(params)]\nDo not use variables. DO NOT USE "
    "MARKDOWN SYNTAX. You SHOULD NOT include any other text in the response if you call a "
    "function.\n' + (tools | tojson) + '\n\n' -%}{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message.role == 'user' -%}<start_of_turn>user\n"
    "{%- if loop.first %}{{ ns.prefix }}{% endif %}{{ content(message, image) }}<end_of_turn>\n"
    "{%- elif message.role == 'assistant' -%}<start_of_turn>model\n"
    "{%- if message.tool_calls -%}["
    "{%- for call in message.tool_calls -%}{{ call.function.name }}("
    "{%- for key, value in call.function.arguments.items() -%}"
    "{{ key }}={{ value | tojson }}{% if not loop.last %}, {% endif -%}{%- endfor -%})"
    "{%- if not loop.last %}, {% endif -%}{%- endfor -%}]"
    "{%- else -%}{{ content(message, image) }}{%- endif -%}<end_of_turn>\n"
    "{%- elif message.role == 'tool' -%}<start_of_turn>user\n```tool_output\n"
    "{{ content(message, image) }}\n```<end_of_turn>\n"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)

# family -> (transformers text family, special tokens, eos, template, added plain tokens)
FORMATS = {
    "qwen3": ("qwen3", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>",
                        "<|fim_middle|>", "<|fim_suffix|>"], "<|im_end|>",
              qwen3_template(), ["<think>", "</think>", "<tool_call>", "</tool_call>"]),
    "mistral": ("mistral", ["<unk>", "<s>", "</s>", *MISTRAL_CONTROL, "[IMG]"],
                "</s>", MISTRAL_TEMPLATE, []),
    "llama3": ("llama", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                         "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                         "<|image|>"], "<|eot_id|>", LLAMA3_TEMPLATE, []),
    "gemma3": ("gemma3_text", ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>",
                               "<start_of_image>"], "<end_of_turn>", GEMMA3_TEMPLATE, []),
}

QWEN3_5_PLAIN_TOKENS = FORMATS["qwen3"][4]


def chat_tokenizer(family: str):
    """The family's tokenizer: trained locally, its special tokens, template and plain added
    tokens (Qwen's `<think>` and `<tool_call>` are ordinary text tokens, not special)."""
    from testing.tiny import train_tokenizer

    _, special, eos, template, plain = FORMATS[family]
    tok = train_tokenizer(special, 600, template, eos)
    if plain:
        tok.add_tokens(plain)
    bos = {"mistral": "<s>", "llama3": "<|begin_of_text|>", "gemma3": "<bos>"}.get(family)
    if bos:
        tok.bos_token = bos
    return tok


def build_chat_model(path: Path, family: str, seed: int = 0) -> Path:
    """A tiny text checkpoint of `family` (a key of FORMATS) with its chat format."""
    import transformers

    from testing.tiny import TEXT_FAMILIES, randomize, save_checkpoint

    text_family = FORMATS[family][0]
    tokenizer = chat_tokenizer(family)
    config_name, model_name = TEXT_FAMILIES[text_family]
    extra = {"head_dim": 16} if text_family in ("qwen3", "gemma3_text") else {}
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id, **extra)
    import torch

    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    randomize(model, seed=seed)
    eos = [tokenizer.eos_token_id]
    if family == "llama3":
        eos.append(tokenizer.convert_tokens_to_ids("<|eom_id|>"))
    return save_checkpoint(model, tokenizer, Path(path), eos)


def build_qwen3_5_chat_model(path: Path) -> Path:
    """A tiny Qwen3.5 (image and video input, hybrid decoder) whose template thinks by
    default and renders Hermes tools."""
    from testing.qwen3_5 import build_qwen3_5_model
    from testing.tiny import QWEN_SPECIAL, train_tokenizer

    template = qwen3_template("<|vision_start|><|image_pad|><|vision_end|>",
                              "<|vision_start|><|video_pad|><|vision_end|>",
                              think_by_default=True)
    tokenizer = train_tokenizer(QWEN_SPECIAL, 600, template, "<|im_end|>")
    tokenizer.add_tokens(QWEN3_5_PLAIN_TOKENS)
    return build_qwen3_5_model(Path(path), tokenizer=tokenizer)


def llava_next_mistral_template() -> str:
    """LLaVA-NeXT's Mistral-based checkpoints: Mistral's [INST] turns and tools, an image part
    as `<image>`."""
    return mistral_template("<image>")
