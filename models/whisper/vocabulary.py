"""A CTranslate2 Whisper folder's vocabulary (`vocabulary.txt`: one token a line, in id order;
or `vocabulary.json`: a list) as a transformers tokenizer that decodes ids to text and refuses
to encode text.

Whisper's tokens are byte-level BPE strings (each byte written as one printable character, as
GPT-2's byte-level alphabet does), so the vocabulary alone turns ids back into bytes and text.
Encoding text needs the BPE merges too, which tokenizer.json holds and the vocabulary does not:
encoding is refused with a ValueError naming the file (a transcription's initial `prompt` is
the one text a Whisper request encodes; windows' prompts are ids). The `<|...|>` entries are
special tokens, as in Whisper's own tokenizer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from models.checkpoint import CheckpointError

VOCABULARY_FILES = ("vocabulary.json", "vocabulary.txt")
SPECIAL = re.compile(r"<\|[^|]*\|>")


def read_vocabulary(file: Path) -> list[str]:
    """The tokens in id order."""
    if file.suffix == ".json":
        tokens = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise CheckpointError(f"{file}: not a JSON list of token strings")
    else:
        tokens = file.read_text(encoding="utf-8").split("\n")
        if tokens and tokens[-1] == "":
            tokens.pop()  # the final newline
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{file}: a token appears twice")
    return tokens


def vocabulary_tokenizer(file: Path):
    """A decode-only transformers tokenizer over the vocabulary in `file`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = read_vocabulary(Path(file))
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in tokens if SPECIAL.fullmatch(t)])
    if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(f"{file}: its special tokens did not keep their ids")

    class VocabularyTokenizer(PreTrainedTokenizerFast):
        """Decodes ids; encoding text raises (no BPE merges)."""

        source = f"{Path(file).name} (decode only: no BPE merges)"

        def _encode_plus(self, *args, **kwargs):
            raise ValueError(
                f"{file}: this Whisper folder has a vocabulary but no tokenizer.json, so text "
                "cannot be encoded (encoding needs the BPE merges); a transcription's `prompt` "
                "needs them: add the model's tokenizer.json beside model.bin, or send no prompt")

        def tokenize(self, *args, **kwargs):
            return self._encode_plus()

    return VocabularyTokenizer(tokenizer_object=backend)
