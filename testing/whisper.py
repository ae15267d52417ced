"""Tiny random-weight Whisper checkpoints (WhisperForConditionalGeneration), laid out as the
Hub's: a byte-level BPE vocabulary followed by Whisper's special tokens in Whisper's order
(`<|endoftext|>`, `<|startoftranscript|>`, the languages, `<|translate|>`, `<|transcribe|>`,
`<|startoflm|>`, `<|startofprev|>`, `<|nocaptions|>`, `<|notimestamps|>`, then the timestamps
`<|0.00|>` ... `<|30.00|>`), a generation_config.json with the fields transformers' Whisper
generate reads, and WhisperFeatureExtractor's preprocessor_config.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from testing.tiny import _CORPUS, randomize

LANGUAGES = ("en", "de", "fr")  # a multilingual checkpoint's, in Whisper's order
TASKS = ("translate", "transcribe")
TIMESTAMPS = tuple(f"<|{i * 0.02:.2f}|>" for i in range(1501))


def whisper_special(multilingual: bool = True) -> list[str]:
    """Whisper's special tokens in its order (an English-only model has no language or task
    tokens' predecessors past <|endoftext|>'s neighbours, as the Hub's .en vocabularies)."""
    langs = [f"<|{lang}|>" for lang in LANGUAGES] if multilingual else []
    return ["<|endoftext|>", "<|startoftranscript|>", *langs, "<|translate|>", "<|transcribe|>",
            "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>",
            *TIMESTAMPS]


def whisper_tokenizer(vocab_size: int = 300, multilingual: bool = True):
    """Byte-level BPE trained on the built-in corpus, Whisper's special tokens after it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet,
                                  limit_alphabet=len(alphabet), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    fast.add_special_tokens({"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>",
                             "pad_token": "<|endoftext|>", "unk_token": "<|endoftext|>"})
    fast.add_tokens(whisper_special(multilingual)[1:], special_tokens=True)
    return fast


def generation_config(tok, multilingual: bool) -> dict:
    """The fields of a Hub Whisper generation_config.json that generate reads."""
    ids = tok.convert_tokens_to_ids
    eot = ids("<|endoftext|>")
    config = {
        "decoder_start_token_id": ids("<|startoftranscript|>"),
        "eos_token_id": eot, "pad_token_id": eot, "bos_token_id": eot,
        "no_timestamps_token_id": ids("<|notimestamps|>"),
        "prev_sot_token_id": ids("<|startofprev|>"),
        "is_multilingual": multilingual,
        "max_initial_timestamp_index": 50, "max_length": 448,
        "return_timestamps": False,
        # What the Hub's checkpoints suppress always and at the first sampled token.
        "suppress_tokens": [ids("<|startoflm|>"), ids("<|nocaptions|>")],
        "begin_suppress_tokens": [ids(" ") if ids(" ") != tok.unk_token_id else eot, eot],
    }
    if multilingual:
        config["lang_to_id"] = {f"<|{lang}|>": ids(f"<|{lang}|>") for lang in LANGUAGES}
        config["task_to_id"] = {task: ids(f"<|{task}|>") for task in TASKS}
    return config


def build_whisper_model(
    path: Path,
    *,
    multilingual: bool = True,
    d_model: int = 64,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    heads: int = 4,
    n_mels: int = 80,
    seed: int = 0,
    std: float = 0.25,
    tie_word_embeddings: bool = True,
    alignment_heads: list[tuple[int, int]] | None = None,
) -> Path:
    """A tiny WhisperForConditionalGeneration saved by transformers, with its tokenizer,
    generation config (with `alignment_heads`, the (decoder layer, head) pairs word timestamps
    read, when given) and feature extractor."""
    from transformers import (
        WhisperConfig,
        WhisperFeatureExtractor,
        WhisperForConditionalGeneration,
    )

    tok = whisper_tokenizer(multilingual=multilingual)
    gen = generation_config(tok, multilingual)
    if alignment_heads is not None:
        gen["alignment_heads"] = [list(pair) for pair in alignment_heads]
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=n_mels, d_model=d_model,
        encoder_layers=encoder_layers, decoder_layers=decoder_layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads,
        encoder_ffn_dim=2 * d_model, decoder_ffn_dim=2 * d_model,
        max_source_positions=1500, max_target_positions=448,
        decoder_start_token_id=gen["decoder_start_token_id"], eos_token_id=gen["eos_token_id"],
        pad_token_id=gen["pad_token_id"], bos_token_id=gen["bos_token_id"],
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(path)
    return path
