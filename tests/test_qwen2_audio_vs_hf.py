"""Audio through the whole engine on Qwen2-Audio, matched against transformers: placeholder
expansion equal to its processor's, greedy tokens identical and logits within tolerance for one
clip, two clips, text-only batch mates, chunked prefill across a span, encoder-cache hits, long
clips split into 30 s windows; clips decoded from real files reach the model; bad audio is
refused and the engine keeps serving."""

from __future__ import annotations

import base64

import av
import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor

from engine import LLM
from engine.media import MediaError, load_audio_sync
from models.encoders.whisper import encoder_lengths
from tests.helpers import (
    assert_released,
    assert_top_logprobs,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    user,
)
from tests.media_fixtures import VideoSpec, encode_av_audio, encode_soundfile, encode_video, tone

N = 10
GREEDY = greedy(N)
RATE = 16000
WINDOW = 30 * RATE


def noise(seconds: float, seed: int, rate: int = RATE) -> np.ndarray:
    return (0.3 * np.random.default_rng(seed).standard_normal(round(rate * seconds))).astype(
        np.float32)


CASES = {
    "one_clip": user((tone(440, RATE, 3.0), RATE), "Transcribe the audio clip."),
    "two_clips": user("Compare", (noise(1.3, 1), RATE), "with", (tone(880, 22050, 7.77), 22050)),
    "text_only": user("Hello there, how are you today?"),
}


def processed(llm: LLM, messages):
    """Our processed prompt, with the decoded clips the reference needs."""
    proc, media = process_chat(llm, messages)
    proc.clips = media.get("audio", [])
    return proc


def hf_inputs(proc) -> dict:
    """transformers' inputs: WhisperFeatureExtractor's features of every 30 s window (our split)
    and our expanded token ids."""
    ids = torch.tensor([proc.token_ids])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    windows = [c.samples[i : i + WINDOW] for c in proc.clips for i in range(0, len(c.samples),
                                                                             WINDOW)]
    if windows:
        extractor = WhisperFeatureExtractor(feature_size=128, sampling_rate=RATE, hop_length=160,
                                            chunk_length=30, n_fft=400)
        mel = extractor(windows, sampling_rate=RATE, return_attention_mask=True,
                        padding="max_length", return_tensors="pt")
        kwargs.update(input_features=mel["input_features"],
                      feature_attention_mask=mel["attention_mask"])
    return kwargs


def hf_tokens(hf, proc, n: int = N) -> list[int]:
    """transformers' greedy tokens (hf_greedy) for the prompt the engine processed."""
    return hf_greedy(hf, hf_inputs(proc), len(proc.token_ids), n)[0]


@pytest.fixture(scope="module")
def llm(qwen2_audio_path):
    return LLM(qwen2_audio_path, max_model_len=2048)


@pytest.fixture(scope="module")
def refs(llm, hf_audio_model):
    return {name: hf_tokens(hf_audio_model, processed(llm, msgs)) for name, msgs in CASES.items()}


def test_placeholders_match_the_transformers_processor(llm):
    from transformers import Qwen2AudioProcessor

    hf = Qwen2AudioProcessor(WhisperFeatureExtractor(feature_size=128), llm.tokenizer)
    for name, msgs in CASES.items():
        parsed = llm.engine.processor.render_chat(msgs)
        proc = processed(llm, msgs)
        audio = [c.samples for c in proc.clips] or None
        ref = hf(text=parsed.text, audio=audio, sampling_rate=RATE)["input_ids"][0]
        assert proc.token_ids == list(ref), name


def test_encoder_budget_below_one_window_is_refused_at_start_up(qwen2_audio_path):
    with pytest.raises(ValueError, match="raise encoder_cache_size to at least 750"):
        LLM(qwen2_audio_path, max_model_len=2048, encoder_cache_size=700)


def test_each_case_alone_matches(llm, refs):
    for name, msgs in CASES.items():
        assert llm.chat(msgs, GREEDY)[0].outputs[0].token_ids == refs[name], name
    assert_released(llm)


def test_batch_with_text_only_mates_is_one_encoder_forward(qwen2_audio_path, refs):
    llm = LLM(qwen2_audio_path, max_model_len=2048)
    calls = count_calls(llm.engine.runner.model.audio_tower)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert {n: o.outputs[0].token_ids for n, o in zip(CASES, outs, strict=True)} == refs
    assert calls == [1]  # three clips of two requests, padded to the longest
    assert_released(llm)


def test_span_split_across_prefill_chunks(qwen2_audio_path, refs):
    llm = LLM(qwen2_audio_path, max_model_len=2048, max_num_batched_tokens=16)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert {n: o.outputs[0].token_ids for n, o in zip(CASES, outs, strict=True)} == refs
    assert len(outs[0].metrics.prefill_chunks) > 5
    assert_released(llm)


def test_prefill_and_decode_logits_match(qwen2_audio_path, hf_audio_model):
    llm = LLM(qwen2_audio_path, max_model_len=2048, max_num_batched_tokens=32)
    msgs = CASES["two_clips"]
    params = greedy(3, logprobs=5)
    out = llm.chat(msgs, params)[0].outputs[0]
    proc = processed(llm, msgs)
    kwargs = hf_inputs(proc)
    ids = torch.tensor([proc.token_ids + out.token_ids[:-1]])
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        ref = hf_audio_model(**kwargs).logits[0, len(proc.token_ids) - 1 :].log_softmax(-1)
    assert_top_logprobs(out.logprobs, ref, k=5)


def test_encoder_padded_to_the_longest_clip_equals_the_full_window(llm, hf_audio_model):
    """Our batch pads to the longest clip of the step; the reference pads every clip to 30 s."""
    from transformers.masking_utils import create_bidirectional_mask

    proc = processed(llm, CASES["two_clips"])
    ours = llm.engine.runner.model.encode([("audio", f.data) for f in proc.mm_features])
    mel = hf_inputs(proc)
    tower = hf_audio_model.model.audio_tower
    lengths = [encoder_lengths(int(n)) for n in mel["feature_attention_mask"].sum(-1)]
    valid = torch.arange(1500)[None, :] < torch.tensor([n for n, _ in lengths])[:, None]
    mask = create_bidirectional_mask(config=tower.config, inputs_embeds=torch.zeros(2, 1500, 1),
                                     attention_mask=valid.long())
    with torch.no_grad():
        states = tower(mel["input_features"], attention_mask=mask).last_hidden_state
        ref = hf_audio_model.model.multi_modal_projector(states)
    for i, (_, size) in enumerate(lengths):
        torch.testing.assert_close(ours[i], ref[i, :size], atol=1e-5, rtol=1e-5)


def test_encoder_cache_hit_skips_the_encoder(qwen2_audio_path, hf_audio_model):
    llm = LLM(qwen2_audio_path, max_model_len=2048, enable_prefix_caching=False)
    calls = count_calls(llm.engine.runner.model.audio_tower)
    clip = (tone(660, RATE, 2.5), RATE)
    first = llm.chat(user(clip, "Transcribe the audio clip."), GREEDY)[0]
    assert calls == [1] and first.multi_modal_placeholders[0].cache_hit is False
    msgs = user(clip, "What is shown in this video?")
    second = llm.chat(msgs, GREEDY)[0]
    assert calls == [1], "the encoder ran again for a cached clip"
    assert second.multi_modal_placeholders[0].cache_hit is True
    assert second.metrics.encoder_cache_hits == 1 and second.metrics.encoder_calls == 0
    assert second.outputs[0].token_ids == hf_tokens(hf_audio_model, processed(llm, msgs))
    assert llm.engine.processor.mm_processor.cache.hits >= 1  # the mel features were reused
    assert_released(llm)


def test_long_clip_splits_into_30_second_windows(llm, hf_audio_model):
    """35 s recorded at 8 kHz: a full 30 s window (750 embeddings) and a 5 s one (125)."""
    msgs = user((tone(300, 8000, 35.0), 8000), "Transcribe the audio clip.")
    out = llm.chat(msgs, GREEDY)[0]
    spans = out.multi_modal_placeholders
    assert [s.length for s in spans] == [750, 125]
    assert spans[0].identifier != spans[1].identifier
    tokens = llm.tokenizer.convert_tokens_to_ids(["<|audio_eos|>", "<|audio_bos|>"])
    assert out.prompt_token_ids[spans[0].offset + 750 : spans[1].offset] == tokens
    assert out.prompt_token_ids[spans[1].offset + 125] == tokens[0]
    assert out.outputs[0].token_ids == hf_tokens(hf_audio_model, processed(llm, msgs))
    assert_released(llm)


def test_a_tail_too_short_to_encode_is_padded_with_silence(llm):
    proc = processed(llm, user((noise(30.005, 2), RATE), "hi"))  # 80 samples past 30 s
    assert [f.placeholder.length for f in proc.mm_features] == [750, 1]


def test_clips_over_the_maximum_duration_are_refused(llm):
    msgs = user((tone(300, 8000, 35.0), 8000), "hi")
    with pytest.raises(MediaError, match=r"audio 1: duration 35.0 s exceeds the limit of 20 s "
                       r"\(mm_processor_kwargs max_audio_duration_s\)"):
        llm.chat(msgs, GREEDY, mm_processor_kwargs={"max_audio_duration_s": 20})
    with pytest.raises(MediaError, match=r"MediaLimits.max_audio_duration_s"):
        llm.chat(user((np.zeros(1000 * 601, np.float32), 1000), "hi"), GREEDY)
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs max_pixels"):
        llm.chat(msgs, GREEDY, mm_processor_kwargs={"max_pixels": 5})
    assert llm.chat(CASES["one_clip"], GREEDY)[0].outputs[0].finish_reason == "length"
    assert_released(llm)


def _data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def _encoded(name: str) -> bytes:
    """2 s of a tone in several containers, codecs, source rates and channel layouts."""
    if name == "wav_8k_mono":
        return encode_soundfile(tone(500, 8000, 2.0), 8000, "WAV", "PCM_16")
    if name == "flac_44k_stereo":
        return encode_soundfile(tone(700, 44100, 2.0, 2), 44100, "FLAC")
    if name == "mp3_48k_stereo":
        if "libmp3lame" not in av.codecs_available:
            pytest.skip("this FFmpeg build has no mp3 encoder")
        return encode_av_audio(tone(900, 48000, 2.0, 2), 48000, "mp3", "libmp3lame")
    return encode_video(VideoSpec(audio_rate=44100))  # AAC stereo track of a 2 s H.264 video


@pytest.mark.parametrize(("name", "part"), [
    ("wav_8k_mono", lambda data: {"type": "input_audio", "input_audio": {
        "data": base64.b64encode(data).decode(), "format": "wav"}}),
    ("flac_44k_stereo", lambda data: {"type": "audio_url", "audio_url": {
        "url": _data_url(data, "audio/flac")}}),
    ("mp3_48k_stereo", lambda data: {"type": "audio_url", "audio_url": _data_url(
        data, "audio/mpeg")}),
    ("video_track_44k_stereo", lambda data: {"type": "audio", "audio": _data_url(
        data, "video/mp4")}),
])
def test_decoded_files_reach_the_model(llm, name, part):
    data = _encoded(name)
    out = llm.chat(user(part(data), "Transcribe the audio clip."), GREEDY)[0]
    assert out.outputs[0].finish_reason == "length"
    resampled = load_audio_sync(data)  # 16 kHz mono, as the processor received it
    (span,) = out.multi_modal_placeholders
    assert span.length == encoder_lengths(-(-len(resampled.samples) // 160))[1]
    assert span.length == pytest.approx(2.0 * 25, abs=3)  # 25 embeddings per second
    assert_released(llm)


def test_bad_audio_is_refused_and_the_engine_keeps_serving(llm):
    empty = encode_soundfile(np.zeros(0, np.float32), RATE, "WAV")
    corrupt = b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(range(200))
    for source, message in ((empty, "contains no samples"), (corrupt, "could not decode")):
        with pytest.raises(MediaError, match=message):
            llm.chat(user({"type": "audio", "audio": _data_url(source, "audio/wav")}), GREEDY)
    with pytest.raises(MediaError, match="exceeds the limit"):
        llm.chat(user((np.zeros(1000 * 700, np.int16), 1000)), GREEDY)
    assert llm.chat(CASES["one_clip"], GREEDY)[0].outputs[0].finish_reason == "length"
    assert_released(llm)
