"""Qwen2.5-Omni's thinker through the whole engine, matched against transformers'
Qwen2_5OmniThinkerForConditionalGeneration on the same tiny checkpoint: greedy tokens identical
and top-3 log-probabilities within 1e-3 for audio alone, an image alone, a video without sound, a
video heard with its sound (frames and sound interleaved per 2 s), two heard videos, a video
sampled below one frame a second (chunk cuts that split a temporal patch), chunk budgets that
cut inside the interleaving, an encoder-cache hit on a repeated video and a prefix-cache hit.
The processor's outputs are checked on their own: token layout equal to transformers' (its
replacement rule on the same items), log-mel features and pixel values within 1e-5, positions
equal to `get_rope_index`."""

from __future__ import annotations

import functools
import json
import re
import types

import numpy as np
import pytest
import torch
import transformers

from engine import LLM
from models.qwen_omni.processor import VIDEO_PIXELS
from testing.qwen_omni import items_in_order, reference_inputs
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    user,
)
from tests.hf_references import hf_video_reference
from tests.media_fixtures import VideoSpec, encode_video, tone

N = 8
GREEDY = greedy(N, logprobs=3)
RATE = 16000


def _noise_frame(seed: int, index: int) -> np.ndarray:
    return np.random.default_rng((seed, index)).integers(0, 256, (48, 64, 3), dtype=np.uint8)


@functools.cache
def movie(seconds: int, fps: int = 8, freq: float | None = 660.0, seed: int = 0) -> bytes:
    """An mp4 of noise frames (64x48) and, unless `freq` is None, an AAC tone of `freq` Hz."""
    spec = VideoSpec(frames=seconds * fps, fps=fps, gop=fps, audio_rate=RATE if freq else None,
                     audio_freq=freq or 440.0, pattern=functools.partial(_noise_frame, seed))
    return encode_video(spec)


# name -> (messages, mm_processor_kwargs)
CASES = {
    "audio": (user((tone(880, RATE, 3.3), RATE), "What do you hear?"), {}),
    "image": (user(random_image(60, 90, seed=1), "What is in this image?"), {}),
    "video_silent": (user(movie(4, freq=None), "What happens in this video?"), {}),
    "video_heard": (user(movie(4), "What happens in this video?"), {}),
    "video_seen_only": (user(movie(4), "What happens in this video?"),
                        {"use_audio_in_video": False}),
    "two_videos": (user("Compare", movie(3, seed=2), "with", movie(5, freq=330, seed=3)), {}),
    # Below one frame a second a temporal patch spans more than one 2 s chunk: the reference's
    # cut rule then splits a patch's tokens around a sound run (a span with an is_embed mask).
    "sparse_frames": (user(movie(16, fps=2, seed=4), "Summarize."), {"fps": 0.5}),
}


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory):
    from testing.qwen_omni import build_qwen_omni_model

    return build_qwen_omni_model(tmp_path_factory.mktemp("ckpt") / "qwen_omni")


@pytest.fixture(scope="module")
def hf(omni_path):
    return transformers.Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(
        omni_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(omni_path):
    return LLM(omni_path, max_model_len=4096)


# ---- transformers' inputs for our processed prompt ----------------------------------------------


def reference(hf, llm, name: str):
    messages, options = CASES[name]
    proc, media = process_chat(llm, messages, options)
    return hf_greedy(hf, reference_inputs(proc, media), len(proc.token_ids), N)


@pytest.fixture(scope="module")
def refs(hf, llm):
    return {name: reference(hf, llm, name) for name in CASES}


def reference_ids(llm, name: str, proc, media) -> list[int]:
    """The prompt as transformers' Qwen2_5OmniProcessor expands it: its own replacement
    functions on our items' grids, clip lengths and frame rates (its video processor needs
    torchvision, absent here, so the processor is not built whole)."""
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (
        Qwen2_5OmniProcessor,
        _get_feat_extract_output_lengths,
    )

    tok = llm.tokenizer
    stub = types.SimpleNamespace(
        video_processor=types.SimpleNamespace(merge_size=2), video_token=tok.video_token,
        audio_token=tok.audio_token, audio_bos_token=tok.audio_bos_token,
        audio_eos_token=tok.audio_eos_token)
    stub.get_chunked_index = functools.partial(Qwen2_5OmniProcessor.get_chunked_index, stub)
    replacements = {"image": [], "video": [], "audio": []}
    for modality, features, item in items_in_order(proc, media):
        if modality == "image":
            t, h, w = features[0].data["grid_thw"]
            replacements["image"].append(tok.image_token * (t * h * w // 4))
        elif modality == "audio":
            frames = -(-len(item.samples) // 160)
            replacements["audio"].append(tok.audio_token * int(_get_feat_extract_output_lengths(
                torch.tensor(frames))))
        else:
            patches = [f.data for f in features if f.modality == "video"]
            grid = (len(patches), *patches[0]["grid_thw"][1:])
            if not any(f.modality == "audio" for f in features):
                replacements["video"].append(tok.video_token * (np.prod(grid) // 4))
                continue
            frames = -(-len(item.audio.samples) // 160)
            text = Qwen2_5OmniProcessor.replace_video_with_audio_token(
                stub, {"video_grid_thw": [grid], "video_second_per_grid": [2 / item.sampled_fps]},
                0, {"num_audio_tokens": [int(_get_feat_extract_output_lengths(
                    torch.tensor(frames)))]}, 0, position_id_per_seconds=25, seconds_per_chunk=2.0)
            replacements["video"].append(text)
    queues = {k: iter(v) for k, v in replacements.items()}
    tokens = {tok.image_token: "image", tok.video_token: "video", tok.audio_token: "audio"}
    text = llm.engine.processor.render_chat(CASES[name][0]).text
    pattern = "|".join(re.escape(t) for t in tokens)
    expanded = re.sub(pattern, lambda m: next(queues[tokens[m.group(0)]]), text)
    return tok(expanded, add_special_tokens=False)["input_ids"]


# ---- the processor -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_processor_matches_transformers(llm, hf, name):
    messages, options = CASES[name]
    proc, media = process_chat(llm, messages, options)
    assert proc.token_ids == reference_ids(llm, name, proc, media)
    kwargs = reference_inputs(proc, media)
    # Log-mel features: every window's real frames equal transformers' extractor's.
    for _, features, item in items_in_order(proc, media):
        windows = [f.data["input_features"] for f in features if f.modality == "audio"]
        if not windows:
            continue
        clip = item if features[0].modality == "audio" else item.audio
        mel = transformers.WhisperFeatureExtractor(feature_size=128)(
            [clip.samples], sampling_rate=RATE, padding="max_length", return_attention_mask=True,
            return_tensors="pt")
        frames = int(mel["attention_mask"].sum())
        ours = torch.cat(windows, dim=1)
        assert ours.shape[1] <= frames and frames - ours.shape[1] <= 2  # a pooled-away tail
        torch.testing.assert_close(ours, mel["input_features"][0, :, :ours.shape[1]],
                                   atol=1e-5, rtol=0)
    # Pixels: images through transformers' image processor; video frames at the Omni's own
    # budget (its processor's videos_kwargs) through the same image path, paired into patches.
    settings = json.loads((llm.engine.model_path / "processor_config.json").read_text())
    image_processor = transformers.Qwen2VLImageProcessorPil.from_dict(settings["image_processor"])
    for image in media.get("image", []):
        ref = image_processor(images=[image], return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(kwargs["pixel_values"], ref, atol=1e-5, rtol=0)
    videos = media.get("video", [])
    if videos:
        rows = [int(np.prod(g)) for g in kwargs["video_grid_thw"].tolist()]
        videos = zip(videos, kwargs["pixel_values_videos"].split(rows), strict=True)
    for video, pixels in videos:
        torch.testing.assert_close(pixels, hf_video_reference(video.frames, *VIDEO_PIXELS),
                                   atol=1e-5, rtol=0)
    # Positions: equal to get_rope_index on the same inputs.
    expected, delta = hf.model.get_rope_index(
        kwargs["input_ids"], kwargs.get("image_grid_thw"), kwargs.get("video_grid_thw"),
        kwargs["attention_mask"], kwargs.get("use_audio_in_video", False),
        kwargs["feature_attention_mask"].sum(-1) if "feature_attention_mask" in kwargs else None,
        kwargs.get("video_second_per_grid"))
    assert torch.equal(proc.position_info.window(0, len(proc.token_ids)), expected[:, 0])
    assert proc.position_info.delta == int(delta)


def test_a_heard_video_interleaves_frames_and_sound_per_two_seconds(llm):
    proc, media = process_chat(llm, *CASES["video_heard"])
    parts = [(f.modality, f.part) for f in sorted(proc.mm_features,
                                                  key=lambda f: f.placeholder.offset)]
    assert parts[:6] == [("video", "frames 0-1 s"), ("video", "frames 1-2 s"),
                         ("audio", "sound 0-2 s"), ("video", "frames 2-3 s"),
                         ("video", "frames 3-4 s"), ("audio", "sound 2-4 s")]
    assert len({f.item for f in proc.mm_features}) == 1  # one media item, two encoders
    assert media["video"][0].has_audio_track
    # Frames and sound are cached by their own content: the sound by its samples.
    sound = {f.identifier.split(":")[0] for f in proc.mm_features if f.modality == "audio"}
    frames = {f.identifier.split(":")[0] for f in proc.mm_features if f.modality == "video"}
    assert len(sound) == len(frames) == 1 and sound != frames


def test_a_video_without_sound_is_seen_and_says_so(llm):
    proc, media = process_chat(llm, *CASES["video_silent"])
    assert media["video"][0].has_audio_track is False
    assert all(f.modality == "video" and f.part.endswith("(no sound track)")
               for f in proc.mm_features)
    proc, media = process_chat(llm, *CASES["video_seen_only"])  # not asked for: not decoded
    assert media["video"][0].has_audio_track is None and media["video"][0].audio is None
    assert {f.modality for f in proc.mm_features} == {"video"}


def test_sparse_frames_split_a_patch_around_the_sound(llm):
    proc, _ = process_chat(llm, *CASES["sparse_frames"])
    masked = [f for f in proc.mm_features if f.placeholder.is_embed is not None]
    assert masked and all(f.modality == "video" for f in masked)


# ---- the engine against transformers -------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_each_case_matches_transformers(llm, refs, name):
    messages, options = CASES[name]
    out = llm.chat(messages, GREEDY, mm_processor_kwargs=options)[0]
    assert_matches_reference(out, *refs[name], label=name)
    assert_released(llm)


def test_one_step_runs_each_encoder_once(omni_path, refs):
    llm = LLM(omni_path, max_model_len=4096)
    model = llm.engine.runner.model
    vision, audio = count_calls(model.visual), count_calls(model.audio_tower)
    out = llm.chat(CASES["video_heard"][0], GREEDY)[0]
    assert_matches_reference(out, *refs["video_heard"])
    assert (vision[0], audio[0]) == (1, 1)
    assert llm.stats()["encoder_cache_misses"] == 7  # 4 temporal patches, 3 sound windows


@pytest.mark.parametrize("budget", [7, 53, 160])
def test_chunks_that_cut_inside_the_interleaving(omni_path, refs, budget):
    llm = LLM(omni_path, max_model_len=4096, max_num_batched_tokens=budget)
    for name in ("video_heard", "sparse_frames"):
        messages, options = CASES[name]
        out = llm.chat(messages, GREEDY, mm_processor_kwargs=options)[0]
        assert_matches_reference(out, *refs[name], label=(name, budget))
    assert_released(llm)


def test_encoder_cache_hit_on_a_repeated_video(omni_path, hf):
    llm = LLM(omni_path, max_model_len=4096)
    first = user("Look at this first.", movie(4), "What happens?")
    again = user("And now tell me:", movie(4), "what happens?")
    llm.chat(first, GREEDY)
    out = llm.chat(again, GREEDY)[0]
    assert [p.cache_hit for p in out.multi_modal_placeholders] == [True] * 7
    proc, media = process_chat(llm, again)
    ref = hf_greedy(hf, reference_inputs(proc, media), len(proc.token_ids), N)
    assert_matches_reference(out, *ref)
    assert_released(llm)


def test_prefix_cache_hit_on_a_repeated_prompt(omni_path, refs):
    llm = LLM(omni_path, max_model_len=4096)
    messages = CASES["video_heard"][0]
    llm.chat(messages, GREEDY)
    out = llm.chat(messages, GREEDY)[0]
    assert out.num_cached_tokens >= len(out.prompt_token_ids) - 2 * llm.engine.config.block_size
    assert_matches_reference(out, *refs["video_heard"])
    assert_released(llm)


def test_whole_omni_checkpoint_loads_the_thinker(tmp_path):
    """The Hub's layout: the thinker under `thinker.` beside the talker and token-to-wave
    model, which are skipped; the reference is that checkpoint's own thinker."""
    from testing.qwen_omni import build_qwen_omni_model

    path = build_qwen_omni_model(tmp_path / "omni", layout="omni", seed=3)
    whole = transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, enable_audio_output=False).eval()  # the thinker alone
    llm = LLM(path, max_model_len=4096)
    messages, options = CASES["video_heard"]
    proc, media = process_chat(llm, messages, options)
    ref = hf_greedy(whole.thinker, reference_inputs(proc, media), len(proc.token_ids), N)
    assert_matches_reference(llm.chat(messages, GREEDY)[0], *ref)


# ---- plan, limits and settings -------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_knows_the_prompt_before_processing(llm, name):
    messages, options = CASES[name]
    p = llm.engine.processor
    parsed = p.render_chat(messages, mm_processor_kwargs=options)
    media = p.load_media_sync(parsed)
    ids = llm.tokenizer.encode(parsed.text, add_special_tokens=parsed.add_special_tokens)
    plan = p.mm_processor.plan(ids, media, parsed.mm_kwargs)
    proc = p.process(parsed, media)
    assert plan.num_tokens == len(proc.token_ids)
    assert sorted(plan.item_embeds) == sorted(
        (f.modality, f.placeholder.num_embeds) for f in proc.mm_features)


def test_a_sound_track_longer_than_the_window_is_refused_with_the_limit(llm):
    from models.media_inputs import MediaError

    long = user(movie(31, fps=1), "What happens?")  # the tiny extractor's window is 30 s
    with pytest.raises(MediaError, match=r"video 1: its sound track: duration 31\.\d s exceeds "
                                         r"the audio window of 30 s .*use_audio_in_video=false"):
        llm.chat(long, GREEDY)
    out = llm.chat(long, GREEDY, mm_processor_kwargs={"use_audio_in_video": False})[0]
    assert {p.modality for p in out.multi_modal_placeholders} == {"video"}
    assert_released(llm)


def test_processor_and_config_must_agree_on_the_chunking(omni_path, tmp_path):
    import shutil

    from models.checkpoint import CheckpointError

    path = tmp_path / "omni"
    shutil.copytree(omni_path, path)
    settings = json.loads((path / "processor_config.json").read_text())
    settings["seconds_per_chunk"] = 1.0
    (path / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(CheckpointError, match="seconds_per_chunk=1.0 lays the tokens out, but "
                                              "config.json's seconds_per_chunk=2"):
        LLM(path, max_model_len=4096)
