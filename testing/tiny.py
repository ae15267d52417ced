"""Tiny random-weight checkpoints in real Hugging Face format, built locally (no Hub needed).

Used by the tests (as the reference and as our input), the benchmarks (real shapes, random
weights) and the offline demo of `python app.py`. Each checkpoint is a directory with
config.json, safetensors weights, generation_config.json and a tokenizer trained here with the
`tokenizers` library, whose special tokens and chat template match the family's: byte-level
BPE (the tests' default: multi-byte characters split across tokens, as in real checkpoints),
or WordPiece over whole characters for the demo, whose random text then reads as words
instead of byte fragments.

Weights are drawn with a larger scale than the usual 0.02 so that logits are decisive (random
tiny models with the default init give near-ties that flip greedy tokens on 1e-6 noise).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

# A small mixed-language corpus: enough merges for realistic tokens, multi-byte characters
# (accents, CJK, emoji) so that streaming must handle characters split across tokens.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A picture is worth a thousand words.
Describe the image in detail. What is shown in this video? Transcribe the audio clip.
The engine schedules requests, caches keys and values in blocks, and streams tokens.
Images, videos and audio are encoded once and cached by their content hash.
Café, naïve, façade, jalapeño, Straße, smörgåsbord, crème brûlée, déjà vu.
你好，世界。这是一个多模态模型。图像、视频和音频。
こんにちは世界。日本語のテキストです。
Привет, мир! Это тест.
Emoji: 😀 🎉 🚀 🐱 👍 ❤️ — and “quotes”, ‘single’, ellipsis…
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
def main():\n    return {"key": [1, 2, 3]}\n
""".strip()

# The demo's corpus: plain English about what the demo shows, so that the vocabulary is mostly
# whole words.
_WORDS_CORPUS = """
A small red ball rolls across a bright blue table in the morning light.
The picture shows a quiet street with tall trees, parked cars and a yellow bus.
In this video a dog runs through the park, jumps over a bench and chases a ball.
The audio clip has a low tone that rises slowly, then a short pause and a soft voice.
Two children play near the river while their parents talk on the green grass.
The engine reads the image, encodes it once and keeps the result in its cache.
Every request shares the batch with the others, one token at a time.
A green field, a white house and a long road under a cloudy sky.
The camera moves to the left and shows a window, a plant and an old clock.
The speaker describes the weather: cold wind, light rain and a clear evening.
There is a cat sleeping on a warm chair next to the kitchen door.
People walk along the beach as the sun goes down behind the hills.
A man in a black coat opens the gate and waves to his friend.
The music starts quietly, grows louder, and ends with a single bright note.
We can see a boat on the lake, a bridge in the distance and birds flying north.
Her voice is calm and clear; she reads a story about a little fox.
The room is full of books, maps and pictures of distant places.
A train arrives at the station and many people step onto the platform.
Snow covers the mountains, and the air is cold and still.
The chart shows numbers going up, then down, then up again.
What is in this image? Describe the scene in a few words.
What happens in this video? Tell me what you hear in the clip.
Yes, it looks like a sunny day, and everyone seems happy.
You are a helpful assistant: the user asks, the system answers.
""".strip()
# Whole characters only: no token is part of a character, so any sequence of tokens decodes
# to text.
_WORDS_ALPHABET = list(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,!?;:'\"()-"
)

QWEN_SPECIAL = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
    "<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>",
]
LLAMA_SPECIAL = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eot_id|>",
]

def chatml_template(image: str, video: str, audio: str) -> str:
    """ChatML (a default system prompt when the chat has none) with a media part written as
    the given placeholder text."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}"
        f"{{% elif part['type'] == 'video' %}}{video}"
        f"{{% elif part['type'] == 'audio' %}}{audio}"
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# ChatML with the Qwen family's media placeholders (the same layout as Qwen2-VL's template).
QWEN_CHAT_TEMPLATE = chatml_template(
    "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>",
    "<|audio_bos|><|AUDIO|><|audio_eos|>")

LLAMA_CHAT_TEMPLATE = (
    "<|begin_of_text|>{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def train_tokenizer(
    special: list[str], vocab_size: int, chat_template: str, eos: str, kind: str = "bytes"
):
    """A tokenizer trained on a built-in corpus, as a transformers tokenizer: byte-level BPE
    ("bytes", on the mixed-language corpus) or WordPiece over whole characters ("words", on
    the English demo corpus: mostly whole words, decoded with spaces between them; other
    characters become <unk>). The demo's kinds, on the English corpus, are those real
    checkpoints ship: "byte_bpe" (GPT-2's byte-level BPE: Qwen, Llama 3) and "sentencepiece"
    (BPE over metaspace-marked words with byte fallback, as transformers' converters write
    SentencePiece models: Llama 2, Mistral, Gemma)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind == "bytes":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet, corpus, extra = pre_tokenizers.ByteLevel.alphabet(), _CORPUS, {}
    elif kind == "words":
        tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        # Words joined by spaces; a continuation piece that opens a text loses its "##" too.
        tok.decoder = decoders.Sequence([decoders.WordPiece(cleanup=True),
                                         decoders.Replace("##", "")])
        alphabet, corpus, extra = _WORDS_ALPHABET, _WORDS_CORPUS, {"unk_token": "<unk>"}
    elif kind in ("byte_bpe", "sentencepiece"):
        return _demo_tokenizer(kind, special, vocab_size, chat_template, eos)
    else:
        raise ValueError(f"unknown tokenizer kind {kind!r} (bytes, words, byte_bpe, "
                         "sentencepiece)")
    train = trainers.BpeTrainer if kind == "bytes" else trainers.WordPieceTrainer
    trainer = train(
        vocab_size=vocab_size,
        special_tokens=[*special, *extra.values()],
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    tok.train_from_iterator([corpus] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=special[0],
                                   **extra)
    fast.chat_template = chat_template
    return fast


def _demo_tokenizer(kind: str, special: list[str], vocab_size: int, chat_template: str,
                    eos: str):
    """The demo's byte-level BPE or SentencePiece-style BPE (see `train_tokenizer`), trained
    on the English corpus with a larger vocabulary, so that random tokens are mostly words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab_size = max(vocab_size, 900)
    if kind == "byte_bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                      initial_alphabet=alphabet, limit_alphabet=len(alphabet),
                                      show_progress=False)
        tok.train_from_iterator([_WORDS_CORPUS] * 4, trainer)
    else:
        # Trained over metaspace-marked words, then rebuilt with the 256 byte tokens
        # (<0x00> ...) after the special ones, as SentencePiece models hold them.
        base = Tokenizer(models.BPE())
        base.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                      prepend_scheme="first")
        alphabet = sorted(set(_WORDS_CORPUS.replace(" ", "\u2581")) | {"\u2581"})
        trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=special,
                                      initial_alphabet=alphabet, show_progress=False)
        base.train_from_iterator([_WORDS_CORPUS] * 4, trainer)
        model = json.loads(base.to_str())["model"]
        pieces = sorted(model["vocab"], key=model["vocab"].get)
        vocab = [*special, *(f"<0x{b:02X}>" for b in range(256)),
                 *(p for p in pieces if p not in special)]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
                  for m in model["merges"]]
        tok = Tokenizer(models.BPE({p: i for i, p in enumerate(vocab)}, merges,
                                   byte_fallback=True, fuse_unk=True))
        tok.pre_tokenizer = base.pre_tokenizer
        tok.decoder = decoders.Sequence([
            decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
            decoders.Strip(" ", 1, 0)])
        tok.add_special_tokens(special)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=special[0])
    fast.chat_template = chat_template
    return fast


def qwen_tokenizer(vocab_size: int = 600, kind: str = "bytes"):
    return train_tokenizer(QWEN_SPECIAL, vocab_size, QWEN_CHAT_TEMPLATE, "<|im_end|>", kind)


def llama_tokenizer(vocab_size: int = 600):
    return train_tokenizer(LLAMA_SPECIAL, vocab_size, LLAMA_CHAT_TEMPLATE, "<|eot_id|>")


@torch.no_grad()
def randomize(model: torch.nn.Module, std: float = 0.25, seed: int = 0) -> None:
    """Re-draw every parameter: matrices N(0, std), biases N(0, 0.1), norm scales 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        owner = name.split(".")[-2] if "." in name else ""
        if ("norm" in owner or owner.startswith("ln")) and name.endswith("weight"):
            p.copy_(1.0 + 0.1 * noise)
        elif p.dim() >= 2:
            p.copy_(std * noise)
        else:
            p.copy_(0.1 * noise)


def save_checkpoint(model, tokenizer, path: Path, eos_ids: list[int], **save_kwargs) -> Path:
    """save_pretrained the model and tokenizer, plus a generation_config with the EOS ids."""
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    gen = {"eos_token_id": eos_ids, "do_sample": False}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return path


TEXT_FAMILIES = {  # family -> transformers (config class, model class)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def build_text_model(
    path: Path,
    family: str = "qwen2",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    rope_parameters: dict | None = None,
    seed: int = 0,
    std: float = 0.25,
    config_overrides: dict | None = None,
    **save_kwargs,
) -> Path:
    """A tiny text-only checkpoint of one of TEXT_FAMILIES at `path`; `config_overrides` go to
    the config as they are."""
    import transformers

    tokenizer = qwen_tokenizer() if family.startswith("qwen") else llama_tokenizer()
    vocab = vocab_size or len(tokenizer)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=tokenizer.pad_token_id,
    )
    if rope_parameters is not None:
        common["rope_parameters"] = rope_parameters
    common.update(config_overrides or {})
    if family not in TEXT_FAMILIES:
        raise ValueError(f"unknown family {family!r} ({', '.join(TEXT_FAMILIES)})")
    config_name, model_name = TEXT_FAMILIES[family]
    config = getattr(transformers, config_name)(**common)
    cls = getattr(transformers, model_name)
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, std=std, seed=seed)
    return save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id], **save_kwargs)


CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build_qwen2_vl_model(
    path: Path,
    variant: str = "qwen2_vl",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    vision_width: int = 32,
    vision_depth: int = 2,
    max_image_tokens: int = 64,
    seed: int = 0,
    std: float = 0.25,
    tokenizer_kind: str = "bytes",
    tie_word_embeddings: bool | None = None,
    vision_overrides: dict | None = None,
) -> Path:
    """A tiny Qwen2VLForConditionalGeneration ("qwen2_vl") or Qwen2.5-VL ("qwen2_5_vl").

    Its preprocessor config keeps images small (at most `max_image_tokens` embeddings, video
    frames a quarter of that) so that tests and the demo stay fast on a CPU. `tokenizer_kind`
    is the kind of `train_tokenizer`; `vision_overrides` go to the vision config as they are.
    """
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
    )

    tokenizer = qwen_tokenizer(kind=tokenizer_kind)
    special = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_SPECIAL}
    heads = 4
    half = hidden_size // heads // 2
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]  # [2, 3, 3] for 8
    text = dict(
        hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=2, vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 1e6},
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
        pad_token_id=special["<|endoftext|>"],
    )
    ids = dict(
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"],
    )
    if variant == "qwen2_vl":
        vision = dict(depth=vision_depth, embed_dim=vision_width, hidden_size=hidden_size,
                      num_heads=4, mlp_ratio=2)
        config, cls = Qwen2VLConfig(text_config=text, vision_config=vision, **ids), (
            Qwen2VLForConditionalGeneration)
    elif variant == "qwen2_5_vl":
        vision = dict(depth=vision_depth + 1, hidden_size=vision_width, out_hidden_size=hidden_size,
                      intermediate_size=vision_width * 3 // 2, num_heads=4, window_size=56,
                      fullatt_block_indexes=[1], tokens_per_second=2)
        config, cls = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids), (
            Qwen2_5_VLForConditionalGeneration)
    else:
        raise ValueError(f"unknown variant {variant!r} (qwen2_vl, qwen2_5_vl)")
    config.vision_config.update(vision_overrides or {})
    if tie_word_embeddings is not None:  # the flag transformers ties the head by
        config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = cls(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    unit = 28 * 28  # one merged patch
    from transformers import Qwen2VLImageProcessorPil

    from testing.layouts import save_processor

    image = Qwen2VLImageProcessorPil(
        patch_size=14, temporal_patch_size=2, merge_size=2, image_mean=CLIP_MEAN,
        image_std=CLIP_STD, size={"shortest_edge": 4 * unit,
                                  "longest_edge": max_image_tokens * unit})
    video = {"video_processor_type": "Qwen2VLVideoProcessor", "patch_size": 14,
             "temporal_patch_size": 2, "merge_size": 2, "fps": 2.0,
             "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD),
             "size": {"shortest_edge": 4 * unit,
                      "longest_edge": max(4, max_image_tokens // 4) * unit}}
    processor = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor"}[variant]
    save_processor(path, processor, tokenizer, image_processor=image, video_settings=video)
    return path


def build_qwen2_audio_model(
    path: Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    vocab_size: int | None = None,
    audio_width: int = 32,
    audio_layers: int = 2,
    audio_heads: int = 4,
    audio_ffn: int | None = None,
    n_mels: int = 128,
    max_position_embeddings: int = 4096,
    seed: int = 0,
    std: float = 0.25,
    tokenizer_kind: str = "bytes",
    tie_word_embeddings: bool | None = None,
) -> Path:
    """A tiny Qwen2AudioForConditionalGeneration with a Whisper feature-extractor config.

    The encoder keeps Qwen2-Audio's 30 s window (1500 positions); `n_mels` is written both to
    the encoder config and to preprocessor_config.json's feature_size. `tokenizer_kind` is the
    kind of `train_tokenizer`.
    """
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    tokenizer = qwen_tokenizer(kind=tokenizer_kind)
    text = dict(
        hidden_size=hidden_size, intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, vocab_size=vocab_size or len(tokenizer),
        max_position_embeddings=max_position_embeddings, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    )
    audio = dict(
        d_model=audio_width, encoder_layers=audio_layers, encoder_attention_heads=audio_heads,
        encoder_ffn_dim=audio_ffn or 2 * audio_width, num_mel_bins=n_mels,
        max_source_positions=1500,
    )
    config = Qwen2AudioConfig(audio_config=audio, text_config=text,
                              audio_token_index=tokenizer.convert_tokens_to_ids("<|AUDIO|>"))
    if tie_word_embeddings is not None:  # its head sits in a causal LM of text_config
        config.text_config.tie_word_embeddings = tie_word_embeddings
    torch.manual_seed(seed)
    model = Qwen2AudioForConditionalGeneration(config)
    randomize(model, std=std, seed=seed)
    path = save_checkpoint(model, tokenizer, Path(path), [tokenizer.eos_token_id])
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    Qwen2AudioProcessor(
        feature_extractor=WhisperFeatureExtractor(feature_size=n_mels, return_attention_mask=True),
        tokenizer=tokenizer, chat_template=tokenizer.chat_template,
    ).save_pretrained(path)
    return path
