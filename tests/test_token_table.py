"""Structured output for tokenizers whose decoder the compiler cannot read (WordPiece, and a
SentencePiece-style Unigram without byte fallback): the token table is read from the tokenizer
(engine.token_table), and every reply the grammar lets through decodes to JSON that fits the
schema; a tokenizer whose tokens map to no text is refused in our words, naming the model."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from engine.grammar import GrammarCompiler, GrammarError
from engine.structured_outputs import StructuredOutputs
from engine.token_table import SPECIAL_MARK, read_token_table
from tests.helpers import walk

CHARS = string.ascii_letters + string.digits + string.punctuation
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 2}},
    "required": ["name", "count", "tags"], "additionalProperties": False}


def wordpiece() -> PreTrainedTokenizerFast:
    """BERT's model, pre-tokenizer and decoder (words joined by spaces), every character also
    as a continuation piece, and the decoder's `##` dropped at the start of a text too."""
    words = ["the", "name", "count", "red", "blue", "##ing", "fox"]
    vocab = ["[UNK]", "[SEP]", *CHARS, *("##" + c for c in CHARS), *words]
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.Sequence([decoders.WordPiece(cleanup=True),
                                     decoders.Replace("##", "")])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[SEP]", unk_token="[UNK]")


def unigram() -> PreTrainedTokenizerFast:
    """SentencePiece's Unigram with its metaspace (T5's and ALBERT's kind): no byte fallback."""
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                      unk_token="<unk>", initial_alphabet=list(CHARS),
                                      show_progress=False)
    corpus = 'the red fox and the blue fox {"name": "fox", "count": 12} ' + " ".join(CHARS)
    tok.train_from_iterator([corpus] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")


@pytest.mark.parametrize("make", [wordpiece, unigram])
def test_a_tokenizer_the_compiler_cannot_read_gets_structured_output(make):
    tokenizer = make()
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id], "model 'x'")
    for seed in range(4):
        ids = walk(compiler, StructuredOutputs(json=SCHEMA), seed)
        reply = json.loads(tokenizer.decode(ids, skip_special_tokens=True))
        assert set(reply) == {"name", "count", "tags"} and isinstance(reply["count"], int)
        assert len(reply["name"]) <= 6 and set(reply["tags"]) <= {"red", "blue"}
    assert compiler.table_source == "decoded"  # llguidance could not read this decoder
    ids = walk(compiler, StructuredOutputs(choice=("red fox", "the blue")), 0)
    assert tokenizer.decode(ids, skip_special_tokens=True) in ("red fox", "the blue")


def test_the_table_holds_each_token_as_decoded_in_text():
    tokenizer = wordpiece()
    table = read_token_table(tokenizer, len(tokenizer) + 3)
    vocab = tokenizer.get_vocab()
    assert table.tokens[vocab["fox"]] == b" fox" and table.tokens[vocab["##ing"]] == b"ing"
    assert table.tokens[vocab["[SEP]"]] == SPECIAL_MARK + b"[SEP]"
    assert table.tokens[-3:] == (b"", b"", b"")  # ids past the tokenizer's: never written


class Opaque:
    """A tokenizer whose tokens decode to nothing (no text to constrain)."""

    added_tokens_decoder: dict = {}
    eos_token_id = 0

    def __len__(self) -> int:
        return 8

    def decode(self, ids, skip_special_tokens=False) -> str:
        return ""

    def batch_decode(self, batch, skip_special_tokens=False) -> list[str]:
        return ["" for _ in batch]

    def convert_ids_to_tokens(self, ids) -> list[str]:
        return [f"t{i}" for i in ids]


def test_an_unmappable_tokenizer_is_refused_naming_the_model():
    compiler = GrammarCompiler(Opaque(), 8, [0], "model 'opaque'")
    with pytest.raises(GrammarError) as info:
        compiler.state(StructuredOutputs(json_object=True))
    assert str(info.value) == (
        "structured output is not available for model 'opaque': its tokenizer's tokens "
        "cannot be mapped to bytes (no token decodes to plain text that the next token's "
        "text follows)")
