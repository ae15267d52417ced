"""Whisper through the whole engine, matched against transformers' WhisperForConditionalGeneration
on a tiny random checkpoint: log-mel features equal to WhisperFeatureExtractor's, greedy tokens
identical to its generate for two clips batched (one encoder call), logits within tolerance at
prefill and decode, a repeated clip served from the encoder cache, the decoder prompt as
generate writes it, the generation config's token rules (suppression, the timestamp rules) as
generate applies them, and clips Whisper cannot take refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.transcription import split_segments
from models.checkpoint import GENERATION_CONFIG
from models.media_inputs import AudioClip, MediaError
from models.whisper.prompt import WhisperTokens, decoder_prompt
from tests.helpers import assert_released, assert_top_logprobs, count_calls

N = 8
RATE = 16000
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.3 * rng.standard_normal(round(RATE * seconds))).astype(np.float32)


CLIPS = {"short": noise(2.5, 1), "long": noise(29.0, 2)}


@pytest.fixture(scope="module")
def whisper_path(tmp_path_factory):
    from testing.whisper import build_whisper_model

    return build_whisper_model(tmp_path_factory.mktemp("ckpt") / "whisper")


@pytest.fixture(scope="module")
def hf(whisper_path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(whisper_path,
                                                           dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(whisper_path):
    return LLM(whisper_path, max_model_len=448)


@pytest.fixture(scope="module")
def tokens(llm):
    return WhisperTokens.from_generation_config(llm.engine.setup.files.json(GENERATION_CONFIG))


def features(whisper_path, clip: np.ndarray) -> torch.Tensor:
    from transformers import WhisperFeatureExtractor

    extractor = WhisperFeatureExtractor.from_pretrained(whisper_path)
    return extractor([clip], sampling_rate=RATE, return_tensors="pt").input_features


def hf_greedy(hf, whisper_path, clip: np.ndarray, prompt: list[int]) -> list[int]:
    """transformers' generate from our decoder prompt, with no suppression (the plain model)."""
    with torch.no_grad():
        out = hf.generate(features(whisper_path, clip), decoder_input_ids=torch.tensor([prompt]),
                          max_new_tokens=N, do_sample=False, suppress_tokens=None,
                          begin_suppress_tokens=None, eos_token_id=-1, pad_token_id=0)
    return out[0, :N].tolist()


def hf_timestamped(hf, whisper_path, clip: np.ndarray, k: int) -> tuple[list[int], list]:
    """transformers' generate with timestamps: the raw tokens it generated (the unfinished
    tail included) and the segments it cut them into (start, end, tokens). (It then goes on
    from the last complete segment, as its long-form loop does: those calls are left out.)"""
    with torch.no_grad():
        out = hf.generate(features(whisper_path, clip), language="en", task="transcribe",
                          return_timestamps=True, max_new_tokens=k, return_segments=True,
                          return_dict_in_generate=True)
    first = out["segments"][0][0]["result"]
    segments = [s for s in out["segments"][0] if s["result"] is first]
    return first["sequences"].tolist(), [
        (float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in segments]


def request(prompt: list[int], clip: np.ndarray) -> dict:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"audio": [(clip, RATE)]}}


def test_decoder_prompt_is_what_generate_forces(tokens, llm):
    ids = llm.tokenizer.convert_tokens_to_ids
    assert decoder_prompt(tokens, "de", "translate") == ids(
        ["<|startoftranscript|>", "<|de|>", "<|translate|>", "<|notimestamps|>"])
    assert decoder_prompt(tokens, "en", timestamps=True) == ids(
        ["<|startoftranscript|>", "<|en|>", "<|transcribe|>"])
    assert tokens.timestamp_begin == ids("<|0.00|>")
    with pytest.raises(ValueError, match="language 'xx' is not one of the model's"):
        decoder_prompt(tokens, "xx")


def test_features_match_the_feature_extractor(llm, whisper_path):
    proc = llm.engine.processor.mm_processor
    for clip in CLIPS.values():
        ours = proc._features(AudioClip(clip, RATE), "", None)["input_features"]
        torch.testing.assert_close(ours, features(whisper_path, clip)[0], atol=2e-5, rtol=0)


def test_a_long_clips_windows_are_slices_of_its_whole_features(llm, whisper_path, hf, tokens):
    """A clip past one window (41 s): each window's features are transformers' long-form
    segment input (the whole clip's features, unpadded, sliced from the window's frame and
    zero-padded past the clip's end), and its greedy tokens, through the request
    engine.transcription sends, those of transformers' generate on that input."""
    from dataclasses import asdict

    import torch.nn.functional as F
    from transformers import WhisperFeatureExtractor

    from engine.transcription import FRAME, WindowAudio, _request
    from models.processing.hashing import hash_audio

    clip = noise(41.0, 3)
    whole = WhisperFeatureExtractor.from_pretrained(whisper_path)(
        [clip], sampling_rate=RATE, return_tensors="pt", truncation=False,
        padding="longest").input_features
    assert whole.shape[-1] == len(clip) // FRAME
    proc = llm.engine.processor.mm_processor
    digest = hash_audio(AudioClip(clip, RATE), model_id=proc.model_id,
                        processor_kwargs=asdict(proc.mel))
    segments = {}
    for first in (0, 1234, 3000):  # 3000: the second window, 1,100 frames then zeros
        part = whole[:, :, first:first + 3000]
        segments[first] = F.pad(part, (0, 3000 - part.shape[-1]))
        ours = proc._features(AudioClip(clip, RATE), digest, first)["input_features"]
        torch.testing.assert_close(ours, segments[first][0], atol=2e-5, rtol=0)
    prompt = decoder_prompt(tokens, "en")
    audio = WindowAudio.of(clip, 3000 * FRAME)
    assert audio.first_frame == 3000 and len(audio.samples) == len(clip)
    ours = llm.generate([_request(prompt, audio)], GREEDY)[0].outputs[0].token_ids
    theirs = list(prompt)  # the plain model's greedy tokens: its forward's argmax, each step
    with torch.no_grad():
        states = hf.model.encoder(segments[3000]).last_hidden_state
        for _ in range(N):
            logits = hf(encoder_outputs=(states,), decoder_input_ids=torch.tensor([theirs]))
            theirs.append(int(logits.logits[0, -1].argmax()))
    assert list(ours) == theirs[len(prompt):]
    with pytest.raises(MediaError, match="clip_window=4100 is past the clip's last 10 ms frame"):
        proc.process(prompt, {"audio": [AudioClip(clip, RATE)]}, {"clip_window": 4100})


def test_two_clips_batched_match_generate_in_one_encoder_call(llm, whisper_path, hf, tokens):
    calls = count_calls(llm.engine.runner.model.encoder)
    prompts = {"short": decoder_prompt(tokens, "en"),
               "long": decoder_prompt(tokens, "fr", timestamps=True)}
    outs = llm.generate([request(prompts[k], CLIPS[k]) for k in CLIPS], GREEDY)
    assert calls == [1]
    for name, out in zip(CLIPS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, whisper_path, CLIPS[name],
                                                     prompts[name]), name
    assert_released(llm)


@pytest.mark.parametrize("timestamps", [True, False])
def test_token_rules_match_generate(llm, whisper_path, hf, tokens, timestamps):
    """The generation config's suppression and, with timestamps, the timestamp rules (pairs,
    not decreasing, the first one bounded, forced by their summed probability): greedy tokens
    identical to generate's for two clips batched."""
    k = 24
    prompt = decoder_prompt(tokens, "en", timestamps=timestamps)
    params = SamplingParams(max_tokens=k, temperature=0, ignore_eos=True,
                            token_rules=tokens.rules(timestamps), skip_special_tokens=False)
    outs = llm.generate([request(prompt, clip) for clip in CLIPS.values()], params)
    for clip, out in zip(CLIPS.values(), outs, strict=True):
        ours = out.outputs[0].token_ids
        if timestamps:
            raw, segments = hf_timestamped(hf, whisper_path, clip, k)
            assert raw[:len(prompt)] == prompt
            assert ours == raw[len(prompt):]
            # its segments as transformers cuts them (a short clip: the 3000-frame window)
            cuts, _ = split_segments(ours, tokens.timestamp_begin, 0.0, 3000)
            assert [(round(c.start, 6), round(c.end, 6), c.tokens) for c in cuts] == [
                (round(a, 6), round(b, 6), t) for a, b, t in segments]
            assert len(cuts) > 1
            stamps = [t for t in ours if t >= tokens.timestamp_begin]
            assert ours[0] - tokens.timestamp_begin <= tokens.max_initial_timestamp_index
            assert stamps == sorted(stamps) and len(stamps) > 2
            assert ours != hf_greedy(hf, whisper_path, clip, prompt)[:k]  # the rules bind
        else:
            with torch.no_grad():
                ref = hf.generate(features(whisper_path, clip), language="en",
                                  task="transcribe", max_new_tokens=k)
            assert ours == ref[0, :k].tolist()  # (generated tokens only, as hf_greedy's)
    assert_released(llm)


def test_prefill_and_decode_logits_match(llm, hf, whisper_path, tokens):
    prompt = decoder_prompt(tokens, "en", previous=llm.tokenizer.encode("hello there"))
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=5)
    out = llm.generate(request(prompt, CLIPS["short"]), params)[0].outputs[0]
    ids = torch.tensor([prompt + out.token_ids[:-1]])
    with torch.no_grad():
        logits = hf(input_features=features(whisper_path, CLIPS["short"]),
                    decoder_input_ids=ids).logits[0, len(prompt) - 1:]
    assert_top_logprobs(out.logprobs, logits.log_softmax(-1), k=5)
    assert_released(llm)


def test_a_repeated_clip_hits_the_encoder_cache(llm, tokens):
    clip = noise(4.0, 5)
    calls = count_calls(llm.engine.runner.model.encoder)
    first = llm.generate(request(decoder_prompt(tokens, "en"), clip), GREEDY)[0]
    second = llm.generate(request(decoder_prompt(tokens, "de"), clip), GREEDY)[0]
    assert calls == [1]
    assert first.multi_modal_placeholders[0].cache_hit is False
    assert second.multi_modal_placeholders[0].cache_hit is True
    assert second.metrics.encoder_cache_hits == 1
    assert_released(llm)


def test_clips_whisper_cannot_take_are_refused(llm, tokens):
    prompt = decoder_prompt(tokens, "en")
    with pytest.raises(MediaError, match="exceeds one Whisper window of 30 s"):
        llm.generate(request(prompt, noise(31.0, 3)), GREEDY)
    with pytest.raises(ValueError, match="exactly one audio clip, got 2"):
        llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {
            "audio": [(CLIPS["short"], RATE)] * 2}}, GREEDY)
    assert llm.generate(request(prompt, CLIPS["short"]), GREEDY)[0].outputs[0].token_ids
    assert_released(llm)


@pytest.mark.parametrize("precision", ["float32", "float16", "int8"])
def test_ctranslate2_folders_read_by_our_reader(whisper_path, llm, tokens, tmp_path, precision):
    """The checkpoint written as CTranslate2's converter writes it: float32 gives the
    checkpoint's tokens and logits, float16 its tokens, int8 runs as our int8 linears within a
    stated distance of transformers on the file's dequantized values. The float32 folder holds
    vocabulary.txt and no tokenizer.json: ids decode to the same text (special tokens skipped
    or not), and encoding text (a transcription's prompt) is refused naming the file."""
    from models.whisper.ctranslate2 import MODEL_FILE, CT2File, Int8Weight, ct2_tensors
    from testing.ctranslate2 import write_ctranslate2_whisper

    folder = write_ctranslate2_whisper(whisper_path, tmp_path / precision, precision,
                                       vocabulary_only=precision == "float32")
    ours = LLM(folder, max_model_len=448, dtype="float32")
    prompt = decoder_prompt(tokens, "en")
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, logprobs=3)
    out = ours.generate(request(prompt, CLIPS["short"]), params)[0].outputs[0]
    want = llm.generate(request(prompt, CLIPS["short"]), params)[0].outputs[0]
    if precision == "float32":
        assert not (folder / "tokenizer.json").exists()
        assert out.token_ids == want.token_ids
        ids = list(range(len(llm.tokenizer)))
        for skip in (True, False):
            assert ours.tokenizer.decode(ids, skip_special_tokens=skip) == llm.tokenizer.decode(
                ids, skip_special_tokens=skip)
        with pytest.raises(ValueError, match="vocabulary.txt: .*no tokenizer.json, so text "
                           "cannot be encoded"):
            ours.tokenizer.encode(" hello")
        for a, b in zip(out.logprobs, want.logprobs, strict=True):
            assert list(a) == list(b)
            torch.testing.assert_close(torch.tensor([*a.values()]), torch.tensor([*b.values()]),
                                       atol=1e-5, rtol=0)
        from engine.inspect import inspect

        report = inspect(folder, "float32")  # read without loading the weights
        assert not report.unsupported and report.max_model_len == 448
        assert report.cross_largest_item == 1500
        assert report.weight_bytes == 4 * sum(p.numel() for n, p in ours.engine.runner.model
                                              .named_parameters() if "lm_head" not in n)
    elif precision == "float16":
        assert out.token_ids == want.token_ids
    else:
        # every linear: 2 encoder layers x 6 (q, k, v, out, fc1, fc2), 2 decoder layers x 10
        assert ours.engine.runner.quantized_formats() == {"int8": 2 * 6 + 2 * 10}
        from transformers import WhisperForConditionalGeneration

        hf = WhisperForConditionalGeneration(ours.engine.setup.hf_config).eval()
        hf.load_state_dict({n: t.q.float() / t.scale[:, None] if isinstance(t, Int8Weight) else t
                            for n, t in ct2_tensors(CT2File(folder / MODEL_FILE), torch.float32)},
                           strict=False)
        hf.tie_weights()
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        with torch.no_grad():
            ref = hf(input_features=features(whisper_path, CLIPS["short"]),
                     decoder_input_ids=ids).logits[0, len(prompt) - 1:].log_softmax(-1)
        # Our int8 linears keep the file's values; their scales round to bfloat16 (2^-9).
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            assert abs(entry[token] - ref[step, token].item()) < 0.05, step
    assert_released(ours)


def test_an_untied_head_reads_proj_out(tmp_path):
    from transformers import WhisperForConditionalGeneration

    from testing.whisper import build_whisper_model

    path = build_whisper_model(tmp_path / "untied", multilingual=False, decoder_layers=1,
                               encoder_layers=1, tie_word_embeddings=False)
    ours = LLM(path, max_model_len=448)
    english = WhisperTokens.from_generation_config(
        ours.engine.setup.files.json(GENERATION_CONFIG))
    assert not english.multilingual and not ours.engine.setup.tie_word_embeddings
    prompt = decoder_prompt(english, "en")
    assert prompt == [english.start, english.no_timestamps]
    hf = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=3)
    out = ours.generate(request(prompt, CLIPS["short"]), params)[0].outputs[0]
    ids = torch.tensor([prompt + out.token_ids[:-1]])  # teacher-forced: every step's logits
    with torch.no_grad():
        logits = hf(input_features=features(path, CLIPS["short"]),
                    decoder_input_ids=ids).logits[0, len(prompt) - 1:]
    assert_top_logprobs(out.logprobs, logits.log_softmax(-1), k=3)
