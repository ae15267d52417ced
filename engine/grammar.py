"""Grammars for structured output, with llguidance: a StructuredOutputs constraint compiled
once per distinct constraint (LRU), and per request a matcher that says which tokens may come
next (a bitmask the sampler applies) and advances as tokens are accepted.

llguidance was chosen over xgrammar by measurement (`python -m bench.grammar`): it compiles a
realistic schema in milliseconds where xgrammar, which precomputes masks at compile time, takes
seconds, for a per-token mask cost well under a decode step's either way.

A request's matcher lives on the host and is advanced there as the engine accepts its tokens
(as vLLM does); the sampler only reads the bitmask it fills. `GrammarState.release` drops the
matcher (finish, abort, failure, preemption); the next mask rebuilds it from the compiled
grammar by replaying the request's output tokens, so a preempted request resumes where it was.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
import llguidance.hf
import torch

from engine.structured_outputs import StructuredOutputs
from engine.token_table import TokenTable, TokenTableError, read_token_table

CACHE_SIZE = 64  # compiled grammars kept (distinct schemas, regexes, tool sets)


class GrammarError(ValueError):
    """A constraint the compiler refuses; the message says why (a 400 over HTTP)."""


class GrammarCompiler:
    """Compiles constraints for one tokenizer. Thread-safe: prompts are processed in worker
    threads. The tokenizer's token table is built on first use (about a second for a large
    vocabulary), so that models never asked for structured output never pay for it."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int],
                 model: str = "this model") -> None:
        self.tokenizer = tokenizer
        self.model = model  # named in errors
        # Where the token table came from once built: "definition" (llguidance read the
        # tokenizer's) or "decoded" (engine.token_table).
        self.table_source: str | None = None
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.eos_token_ids = [t for t in eos_token_ids if t < self.vocab_size]
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()

    @property
    def mask_words(self) -> int:
        """int32 words of one bitmask row."""
        return (self.vocab_size + 31) // 32

    def literal(self, text: str) -> str:
        """`text` in a Lark rule: by id where it is one added token of the tokenizer
        (llguidance treats every added token as special, which a quoted string does not
        match), else quoted."""
        added = {t.content: i for i, t in self.tokenizer.added_tokens_decoder.items()}
        return f"<[{added[text]}]>" if text in added else json.dumps(text)

    def state(self, spec: StructuredOutputs | None,
              closes_thinking: str | None = None) -> GrammarState | None:
        """A new request's place in its constraint's grammar (None: unconstrained).
        `closes_thinking`: the end marker of a thinking block the prompt opened; the
        constrained reply writes it first (and no reasoning)."""
        if spec is None:
            return None
        prefix = "" if closes_thinking is None else f'{self.literal(closes_thinking)} "\\n\\n"'
        return self.compile(spec, prefix).new_state()

    def compile(self, spec: StructuredOutputs, prefix: str = "") -> CompiledGrammar:
        """The constraint's grammar, after `prefix` (a Lark expression; a thinking model's
        prompt that opened the thinking block: the reply closes it first); GrammarError
        naming the problem if it is refused."""
        key = (spec.kind, getattr(spec, spec.kind), spec.whitespace_flexible, prefix)
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return CompiledGrammar(template, self.mask_words)
            tokenizer = self._llg_tokenizer()
        try:
            template = llguidance.LLMatcher(tokenizer, _grammar_text(spec, prefix), log_level=0)
        except (ValueError, TypeError, RuntimeError) as e:  # malformed input, said by name
            raise GrammarError(f"the {_describe(spec)} cannot be compiled: {e}") from None
        if template.is_error():
            raise GrammarError(f"the {_describe(spec)} cannot be compiled: "
                               f"{template.get_error()}")
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return CompiledGrammar(template, self.mask_words)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the tokenizer: read from its definition where llguidance
        knows the decoder, else from the token table it decodes (engine.token_table)."""
        if self._ll_tokenizer is None:
            try:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size,
                    eos_token=self.eos_token_ids or None)
                self.table_source = "definition"
            except (ValueError, TypeError, RuntimeError):  # e.g. a decoder it cannot read
                self._ll_tokenizer = self._decoded_tokenizer()
                self.table_source = "decoded"
        return self._ll_tokenizer

    def _decoded_tokenizer(self) -> llguidance.LLTokenizer:
        try:
            table = read_token_table(self.tokenizer, self.vocab_size)
        except TokenTableError as e:
            raise GrammarError(f"structured output is not available for {self.model}: its "
                               f"tokenizer's tokens cannot be mapped to bytes ({e})") from None
        encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
        wrapper = _TableTokenizer(table, table.encoder(encode), self.eos_token_ids,
                                  getattr(self.tokenizer, "bos_token_id", None))
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(wrapper),
                                      n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_ids or None)


class _TableTokenizer:
    """What llguidance's TokenizerWrapper reads: the token table, EOS / BOS and special ids,
    and an encoding of a text into tokens whose table bytes spell it (called with str)."""

    def __init__(self, table: TokenTable, encode: Callable[[str], list[int]],
                 eos_token_ids: Sequence[int], bos_token_id: int | None) -> None:
        self.tokens = list(table.tokens)
        self.special_token_ids = list(table.special_ids)
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.bos_token_id = bos_token_id
        self._encode = encode

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("takes text")  # TokenizerWrapper then passes str
        return self._encode(text)


class CompiledGrammar:
    """A compiled constraint: a matcher in its start state, copied for each request."""

    def __init__(self, template: llguidance.LLMatcher, mask_words: int) -> None:
        self._template = template
        self.mask_words = mask_words  # int32 words of a bitmask row

    def new_state(self) -> GrammarState:
        return GrammarState(self)

    def matcher(self) -> llguidance.LLMatcher:
        return self._template.deep_copy()


class GrammarState:
    """One request's position in its grammar. `fill` writes the allowed next tokens into a
    bitmask row; `accept` advances by a sampled token. The matcher is made on first use and
    dropped by `release`; a later use replays `output_token_ids` into a fresh one."""

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._matcher: llguidance.LLMatcher | None = None
        self.error: str | None = None

    @property
    def held(self) -> bool:
        """Whether a live matcher is held (released ones cost nothing)."""
        return self._matcher is not None

    def fill(self, row: torch.Tensor, output_token_ids: Sequence[int],
             ahead: Sequence[int] = ()) -> None:
        """Write the tokens allowed next into `row` ([W] int32, contiguous, on the CPU); with
        `ahead` (draft tokens being verified), the tokens allowed after them: the matcher
        advances through them and back. A draft the grammar refuses stops the advance there
        (that draft is rejected by the mask of its own row, so the rows after it go unused)."""
        matcher = self._live(output_token_ids)
        consumed = matcher.try_consume_tokens(list(ahead)) if ahead else 0
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        if consumed:
            matcher.rollback(consumed)

    def accept(self, token: int, output_token_ids: Sequence[int]) -> bool:
        """Advance by `token` (already appended to `output_token_ids`). Returns whether the
        grammar is complete (nothing may follow); sets `error` if the token was refused."""
        if self._matcher is None:  # released since the mask was made: replay, then advance
            self._live(output_token_ids[:-1])
        if not self._matcher.consume_token(token):
            self.error = f"the grammar refused token {token}: {self._matcher.get_error()}"
            return False
        return self._matcher.is_stopped()

    def release(self) -> None:
        self._matcher = None

    def _live(self, output_token_ids: Sequence[int]) -> llguidance.LLMatcher:
        if self._matcher is None:
            matcher = self.grammar.matcher()
            if output_token_ids and not matcher.consume_tokens(list(output_token_ids)):
                raise RuntimeError(f"replaying the output into its grammar failed: "
                                   f"{matcher.get_error()}")
            self._matcher = matcher
        return self._matcher


def _grammar_text(spec: StructuredOutputs, prefix: str = "") -> str:
    options = {"whitespace_flexible": spec.whitespace_flexible}
    kind = spec.kind
    if kind in ("json", "json_object"):
        text = llguidance.LLMatcher.grammar_from_json_schema(spec.schema, defaults=options)
    elif kind == "regex":
        text = llguidance.LLMatcher.grammar_from_regex(spec.regex)
    elif kind == "choice":
        text = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
    else:
        text = llguidance.LLMatcher.grammar_from_lark(spec.grammar)
    if not prefix:
        return text
    # llguidance's grammar list: a Lark start rule that writes the prefix, then the
    # constraint's own grammar, referenced by name.
    inner = (json.loads(text) if text.lstrip().startswith("{")
             else {"grammars": [{"lark_grammar": text}]})["grammars"][0]
    outer = {"lark_grammar": f"start: {prefix} @constraint"}
    return json.dumps({"grammars": [outer, {**inner, "name": "constraint"}]})


def _describe(spec: StructuredOutputs) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[spec.kind]
