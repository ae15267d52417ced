"""Word timestamps for Whisper: the alignment heads' cross-attention from our teacher-forced pass
equal to transformers' eager attention, the token times equal to transformers'
`_extract_token_timestamps` on them (tiny random checkpoint, a short and a nearly full window)
and to its `generate(..., return_token_timestamps=True)` on a full window,
the dynamic time warping equal to transformers' loop, tokens grouped into words as
transformers' Whisper tokenizer groups them (literal token strings: spaces, punctuation, a
character split across tokens, a language without spaces), and a checkpoint without alignment
heads refused by name."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.transcription import alignment_heads, cut_words, split_segments
from models.checkpoint import GENERATION_CONFIG
from models.whisper.prompt import WhisperTokens, decoder_prompt
from models.whisper.timing import dynamic_time_warping, token_times
from models.whisper.words import group_words

RATE = 16000
HEADS = [(0, 1), (1, 0), (1, 3)]


def noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(round(RATE * seconds))).astype(np.float32)


@pytest.fixture(scope="module")
def whisper_path(tmp_path_factory):
    from testing.whisper import build_whisper_model

    return build_whisper_model(tmp_path_factory.mktemp("ckpt") / "whisper", alignment_heads=HEADS)


@pytest.fixture(scope="module")
def llm(whisper_path):
    return LLM(whisper_path, max_model_len=448)


def test_token_times_match_transformers(llm, whisper_path):
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration
    from transformers.generation.utils import GenerateEncoderDecoderOutput

    hf = WhisperForConditionalGeneration.from_pretrained(
        whisper_path, dtype=torch.float32, attn_implementation="eager").eval()
    extractor = WhisperFeatureExtractor.from_pretrained(whisper_path)
    ids = WhisperTokens.from_generation_config(llm.engine.setup.files.json(GENERATION_CONFIG))
    assert ids.alignment_heads == tuple(HEADS)
    prompt = decoder_prompt(ids, "en", timestamps=True)
    params = SamplingParams(max_tokens=30, temperature=0, token_rules=ids.rules(True),
                            skip_special_tokens=False)
    for clip in (noise(2.5, 1), noise(29.0, 2)):
        request = {"prompt_token_ids": prompt, "multi_modal_data": {"audio": [(clip, RATE)]}}
        generated = llm.generate(request, params)[0].outputs[0].token_ids
        rows = prompt + generated[:-1]
        ours = llm.cross_attention_weights({**request, "prompt_token_ids": rows},
                                           ids.alignment_heads)
        features = extractor([clip], sampling_rate=RATE, return_tensors="pt").input_features
        with torch.no_grad():
            out = hf(input_features=features, decoder_input_ids=torch.tensor([rows]),
                     output_attentions=True)
        want = torch.stack([out.cross_attentions[layer][0, head] for layer, head in HEADS])
        np.testing.assert_allclose(ours, want.numpy(), atol=1e-5, rtol=0)
        frames = -(-len(clip) // 160)  # the attention mask's frames: the crop transformers makes
        outputs = GenerateEncoderDecoderOutput(sequences=torch.tensor([prompt + generated]),
                                               cross_attentions=(out.cross_attentions,))
        ref = hf._extract_token_timestamps(outputs, HEADS, num_frames=frames,
                                           num_input_ids=len(prompt))[0, len(prompt):]
        times = token_times(ours, len(prompt), frames, hf.config.median_filter_width)
        assert len(set(times.tolist())) > 2  # the path moves: a test that could fail
        np.testing.assert_allclose(times, ref.double().numpy(), atol=1e-6, rtol=0)
        assert times.max() <= len(clip) / RATE
        # words: times within the window, in order, their text the segments' text
        tokens = generated[:-1] if generated[-1] == ids.end else generated
        cuts, _ = split_segments(tokens, ids.timestamp_begin, 0.0, frames)
        first, words = 0, []
        for cut in cuts:
            words += cut_words(cut, first, times, ids, llm.tokenizer.decode, "en", 0.0, 30.0)
            first += len(cut.tokens)
        assert words and all(w.start <= w.end for w in words)
        assert [w.start for w in words] == sorted(w.start for w in words)
        assert "".join(w.word for w in words) == "".join(
            llm.tokenizer.decode([t for t in c.tokens if t < ids.end]) for c in cuts)


    # transformers' public generate on a full window (its short-form loop runs a second call
    # past a short clip's audio and returns that one's times: docs/speech.md)
    clip = noise(30.0, 5)
    features = extractor([clip], sampling_rate=RATE, return_tensors="pt").input_features
    with torch.no_grad():
        out = hf.generate(features, language="en", task="transcribe", return_timestamps=True,
                          max_new_tokens=20, return_token_timestamps=True,
                          return_dict_in_generate=True, return_segments=True)
    result = out["segments"][0][0]["result"]
    request = {"prompt_token_ids": prompt, "multi_modal_data": {"audio": [(clip, RATE)]}}
    generated = llm.generate(request, SamplingParams(
        max_tokens=20, temperature=0, token_rules=ids.rules(True)))[0].outputs[0].token_ids
    assert result["sequences"].tolist() == prompt + generated
    weights = llm.cross_attention_weights({**request, "prompt_token_ids": prompt + generated[:-1]},
                                          ids.alignment_heads)
    np.testing.assert_allclose(token_times(weights, len(prompt), 3000),
                               result["token_timestamps"][len(prompt):].double().numpy(),
                               atol=1e-6, rtol=0)


def test_dynamic_time_warping_matches_transformers():
    from transformers.models.whisper.generation_whisper import _dynamic_time_warping

    rng = np.random.default_rng(0)
    for shape in ((1, 5), (6, 40), (12, 13)):
        matrix = rng.integers(0, 3, shape).astype(np.float64)  # ties: the order of preference
        for a, b in zip(dynamic_time_warping(matrix), _dynamic_time_warping(matrix),
                        strict=True):
            np.testing.assert_array_equal(a, b)


class LiteralTokenizer:
    """Tokens as literal byte strings (decoded as UTF-8, broken characters as U+FFFD), with the
    interface transformers' word grouping calls."""

    eos_token_id = 1000

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def decode(self, tokens, decode_with_timestamps: bool = False) -> str:
        return b"".join(self.pieces[t] for t in tokens).decode("utf-8", errors="replace")


@pytest.mark.parametrize(("pieces", "language", "name", "words"), [
    ([b" Hello", b",", b" wor", b"ld", b"!", b" \"", b"Hi", b"\"", b" (", b"ok", b")"], "en",
     "english", [" Hello,", " world!", " \"Hi\"", " (ok)"]),
    ([b" caf", b"\xc3", b"\xa9", b" -", b" 5", b"0", b"%", b"."], "fr", "french",
     [" caf\u00e9", " - 50", "%."]),
    ([b"\xe4\xbd", b"\xa0", b"\xe5\xa5\xbd", b"\xe3\x80\x82", b"\xe4\xb8\x96"], "zh", "chinese",
     ["\u4f60", "\u597d\u3002", "\u4e16"]),
])
def test_words_grouped_as_transformers_groups_them(pieces, language, name, words):
    from transformers.models.whisper.tokenization_whisper import _combine_tokens_into_words

    tok = LiteralTokenizer(pieces)
    tokens = list(range(len(pieces)))
    ours = group_words(tokens, tok.decode, language)
    want, _, indices = _combine_tokens_into_words(tok, tokens, name)
    assert [w.text for w in ours] == want == words
    assert [w.indices for w in ours] == indices


def test_a_checkpoint_without_alignment_heads_is_refused_by_name():
    llm = SimpleNamespace(engine=SimpleNamespace(model_id="tiny"))
    ids = WhisperTokens(start=1, end=0, no_timestamps=2, multilingual=False)
    with pytest.raises(ValueError, match="model tiny has no alignment_heads"):
        alignment_heads(llm, ids)
