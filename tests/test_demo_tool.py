"""The app's demo tool required: in every call format, its grammar bounds the reply (one call,
the one argument the tool names, a city of at most 40 characters), so a random model's
constrained reply ends however it draws, and reads back as the call. A tool schema that leaves
other keys open (JSON Schema's default) lets a reply run on in made-up arguments."""

from __future__ import annotations

import json

import pytest

from engine.grammar import GrammarCompiler
from engine.structured_outputs import StructuredOutputs
from engine.tools import PARSERS
from testing.tiny import qwen_tokenizer
from tests.helpers import walk
from ui.tools import DEMO_TOOL

# the longest reply a walk may take: 40 characters as 6-byte escapes, with the markers and keys
BOUND = 640


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = qwen_tokenizer()  # byte-level BPE, as most demo models'
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], "demo")


def grammar(compiler: GrammarCompiler, name: str, tool: dict) -> StructuredOutputs:
    added = {t.content: i for i, t in compiler.tokenizer.added_tokens_decoder.items()}
    return StructuredOutputs(grammar=PARSERS[name].grammar([tool], False, added.get))


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3", "tagged_list", "bare_keys"])
def test_a_required_demo_call_ends_and_reads_back(compiler, name):
    spec = grammar(compiler, name, DEMO_TOOL)
    for seed in range(3):
        ids = walk(compiler, spec, seed, limit=BOUND)
        text = compiler.tokenizer.decode(ids, skip_special_tokens=False)
        text = text.removesuffix(compiler.tokenizer.eos_token)
        (call,) = PARSERS[name].parse(text, final=True).calls
        assert call.complete and call.name == "get_weather", (name, seed, text)
        arguments = json.loads(call.arguments)
        assert list(arguments) == ["city"] and len(arguments["city"]) <= 40, text


def test_an_open_schema_admits_made_up_arguments(compiler):
    """Why the demo tool closes its arguments: without it, the same grammar takes any key."""
    open_tool = json.loads(json.dumps(DEMO_TOOL))
    del open_tool["function"]["parameters"]["additionalProperties"]
    reply = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","x":[1]}}\n</tool_call>'
    ids = compiler.tokenizer.encode(reply, add_special_tokens=False)
    for tool, admitted in ((open_tool, True), (DEMO_TOOL, False)):
        matcher = compiler.compile(grammar(compiler, "hermes", tool)).matcher()
        assert matcher.consume_tokens(ids) == admitted
