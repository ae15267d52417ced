"""A GGUF file's tokenizer kept on disk after the first start (engine/tokenizer_cache.py): the
second start reads back the tokenizer the first built (the same ids, text, special tokens and
chat template), a changed file misses, an unreadable entry is rebuilt, and "0" turns it off."""

from __future__ import annotations

import os

import pytest

from engine import tokenizer_cache
from engine.gguf_setup import GGUFSetup


@pytest.fixture
def gguf_file(qwen2_path, tmp_path):
    from testing.gguf import write_gguf

    return write_gguf(qwen2_path, tmp_path / "tiny.gguf")


def _same(a, b) -> None:
    text = "héllo <|im_end|> 你好 x"
    assert type(a) is type(b)
    assert a(text)["input_ids"] == b(text)["input_ids"]
    assert a.decode(a(text)["input_ids"]) == b.decode(b(text)["input_ids"])
    assert (a.eos_token_id, a.bos_token_id, a.all_special_tokens) == (
        b.eos_token_id, b.bos_token_id, b.all_special_tokens)
    messages = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        b.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_the_second_start_reads_the_first_ones_tokenizer(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_cache.CACHE_ENV, str(tmp_path / "cache"))
    built = GGUFSetup.load(gguf_file).tokenizer
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and entries[0].suffix == ".pickle"
    monkeypatch.setattr(tokenizer_cache.pickle, "load", _counting(tokenizer_cache.pickle.load))
    read_back = GGUFSetup.load(gguf_file).tokenizer
    assert tokenizer_cache.pickle.load.calls == 1
    _same(built, read_back)
    # a changed file is another entry
    stat = gguf_file.stat()
    os.utime(gguf_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    GGUFSetup.load(gguf_file)
    assert tokenizer_cache.pickle.load.calls == 1 and len(list((tmp_path / "cache").iterdir())) == 2
    # an unreadable entry is rebuilt and replaced
    entry = tokenizer_cache.entry_path(gguf_file, type(built))
    entry.write_bytes(b"not a pickle")
    _same(built, GGUFSetup.load(gguf_file).tokenizer)
    _same(built, GGUFSetup.load(gguf_file).tokenizer)
    assert tokenizer_cache.pickle.load.calls == 3  # the broken one and the rebuilt one


def test_turned_off(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_cache.CACHE_ENV, "0")
    assert tokenizer_cache.entry_path(gguf_file, object) is None
    GGUFSetup.load(gguf_file)
    assert not list(tmp_path.glob("**/*.pickle"))


def _counting(load):
    def counted(*args, **kwargs):
        counted.calls += 1
        return load(*args, **kwargs)

    counted.calls = 0
    return counted


def test_a_tokenizer_that_does_not_pickle_is_only_not_kept(gguf_file, tmp_path, monkeypatch):
    monkeypatch.setenv(tokenizer_cache.CACHE_ENV, str(tmp_path / "cache"))

    def refuse(*args, **kwargs):
        raise TypeError("cannot pickle this")

    monkeypatch.setattr(tokenizer_cache.pickle, "dump", refuse)
    assert GGUFSetup.load(gguf_file).tokenizer is not None
    assert not list((tmp_path / "cache").iterdir())  # no entry, no staging file left
