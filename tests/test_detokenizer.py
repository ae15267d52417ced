"""Incremental detokenization: multi-byte characters split over byte-level BPE tokens."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer

TEXT = "Café naïve — 你好，世界。こんにちは 😀🎉 “quotes” Straße ❤️ done"


@pytest.fixture(scope="module")
def tokenizer(qwen2_path):
    return AutoTokenizer.from_pretrained(qwen2_path)


def test_deltas_join_to_the_text_and_never_hold_a_broken_character(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT) // 3  # multi-byte characters are split over several tokens
    detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=True)
    deltas = []
    for token in ids:
        detok.add(token)
        deltas.append(detok.delta(finished=False))
    deltas.append(detok.delta(finished=True))
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_stop_string_is_cut_and_held_back_while_streaming(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, ("こんにちは",), skip_special_tokens=True)
    streamed = ""
    for token in ids:
        hit = detok.add(token)
        streamed += detok.delta(finished=hit is not None)
        assert not streamed.endswith("こん")  # a prefix of the stop string is held back
        if hit:
            break
    assert hit == "こんにちは"
    assert streamed == TEXT[: TEXT.index("こんにちは")]


def test_special_tokens_are_skipped_or_kept(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False)
    for skip, want in ((True, "hi"), (False, "hi<|im_end|>")):
        detok = IncrementalDetokenizer(tokenizer, (), skip_special_tokens=skip)
        for token in ids:
            detok.add(token)
        assert detok.delta(finished=True) == want
