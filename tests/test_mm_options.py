"""Per-request processor options (mm_processor_kwargs): every option of the Qwen-VL and
Qwen2-Audio processors refused just outside each edge of its range and accepted on the edge,
with a ValueError naming the option, the value and the range; and prompts too large for the
engine refused from the items' sizes, before any pixel is resized or normalized."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from models.processing import qwen_items  # where the Qwen-VL processor prepares pixels
from models.processing.options import OptionRange, check_mm_kwargs
from tests.helpers import assert_released
from tests.media_fixtures import VideoSpec, encode_video

# 256 embeddings of 28x28 pixels: the largest item, and the pixel cap of the options.
EMBEDS = 256
CAP = EMBEDS * 28 * 28
ONE = SamplingParams(max_tokens=1, temperature=0)


@pytest.fixture(scope="module")
def vl(qwen2_vl_path):
    return LLM(qwen2_vl_path, max_model_len=1024, encoder_cache_size=EMBEDS,
               max_num_encoder_input_tokens=EMBEDS)


@pytest.fixture(scope="module")
def audio(qwen2_audio_path):
    return LLM(qwen2_audio_path, max_model_len=2048)


def chat(part) -> list[dict]:
    kind = "image" if isinstance(part, Image.Image) else "video"  # frames or encoded bytes
    return [{"role": "user", "content": [{"type": kind, kind: part},
                                         {"type": "text", "text": "What is it?"}]}]


def picture(height: int = 56, width: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(7).integers(0, 256, (height, width, 3), np.uint8))


def clip(frames: int = 4) -> np.ndarray:
    return np.random.default_rng(8).integers(0, 256, (frames, 56, 56, 3), np.uint8)


def run(llm: LLM, messages, **mm_kwargs):
    """Process (decode, check, expand) a chat the way generation does; the processed prompt."""
    processor = llm.engine.processor
    parsed = processor.render_chat(messages, mm_processor_kwargs=mm_kwargs)
    return processor.process(parsed, processor.load_media_sync(parsed))


def embeds(processed) -> list[int]:
    return [f.placeholder.num_embeds for f in processed.mm_features]


# Qwen-VL ------------------------------------------------------------------------------------


@pytest.mark.parametrize("option", ["min_pixels", "max_pixels"])
@pytest.mark.parametrize("value", [783, CAP + 1, 0, -1, 10**12, 2.0e5, "50176", True, None])
def test_pixel_budgets_outside_their_range(vl, option: str, value) -> None:
    with pytest.raises(ValueError) as info:
        run(vl, chat(picture()), **{option: value})
    assert str(info.value).startswith(
        f"mm_processor_kwargs {option}={value!r} is not an integer in [784, {CAP}] (pixels per "
        "image or video frame: at least one 28x28 patch, at most 256 of them, "
        "min(encoder_cache_size, max_num_encoder_input_tokens))"
    )


def test_pixel_budgets_on_the_edges(vl) -> None:
    # One merged patch: the smallest item there is.
    assert embeds(run(vl, chat(picture()), min_pixels=784, max_pixels=784)) == [1]
    # The cap: an upscaled item exactly as large as the encoder budget allows.
    assert embeds(run(vl, chat(picture()), min_pixels=CAP, max_pixels=CAP)) == [EMBEDS]
    assert 196 < embeds(run(vl, chat(picture(1000, 1000)), max_pixels=CAP))[0] <= EMBEDS
    assert embeds(run(vl, chat(clip()), max_pixels=784)) == [1, 1]
    assert vl.chat(chat(picture()), ONE, mm_processor_kwargs={"min_pixels": CAP})[0].outputs
    assert_released(vl)


def test_min_pixels_above_max_pixels(vl) -> None:
    with pytest.raises(ValueError, match="min_pixels=1568 must not exceed max_pixels=784"):
        run(vl, chat(picture()), min_pixels=1568, max_pixels=784)


@pytest.mark.parametrize("value", [0, -1.0, 240.001, math.inf, math.nan, "2", False])
def test_fps_outside_its_range(vl, value) -> None:
    with pytest.raises(ValueError) as info:
        run(vl, chat(clip()), fps=value)
    assert f"mm_processor_kwargs fps={value!r} is not a number in (0, 240]" in str(info.value)


def test_fps_on_the_edges(vl) -> None:
    # An encoded 2 s video of 20 frames: 240 fps keeps all 20 (10 temporal patches); a rate
    # just above 0 keeps one frame (one patch).
    mp4 = encode_video(VideoSpec(frames=20, fps=10, width=56, height=56))
    assert len(embeds(run(vl, chat(mp4), fps=240))) == 10
    assert len(embeds(run(vl, chat(mp4), fps=1e-9))) == 1


@pytest.mark.parametrize(("value", "fragment"), [
    (0, "mm_processor_kwargs max_frames=0 is not an integer >= 1"),
    (2.5, "mm_processor_kwargs max_frames=2.5 is not an integer >= 1"),
    (769, "video 1: max_frames=769 must be an integer between 1 and 768 "
          "(MediaLimits.max_video_frames)"),
    (10**9, "video 1: max_frames=1000000000 must be an integer between 1 and 768"),
])
def test_max_frames_outside_its_range(vl, value, fragment: str) -> None:
    with pytest.raises(ValueError) as info:
        run(vl, chat(clip()), max_frames=value)
    assert fragment in str(info.value)


def test_max_frames_on_the_edges(vl) -> None:
    frames = clip(8)
    assert len(embeds(run(vl, chat(frames), fps=100, max_frames=1))) == 1
    assert len(embeds(run(vl, chat(frames), fps=100, max_frames=768))) == 4


def test_unknown_options_and_wrong_container(vl) -> None:
    with pytest.raises(ValueError, match="unknown mm_processor_kwargs size .Qwen-VL accepts "
                       "min_pixels, max_pixels, fps, max_frames."):
        run(vl, chat(picture()), size=5)
    with pytest.raises(ValueError, match="mm_processor_kwargs must be a dict"):
        vl.generate({"prompt": "hi", "mm_processor_kwargs": [("fps", 2)]}, ONE)


def test_oversized_prompts_are_refused_before_pixels_are_prepared(vl, monkeypatch) -> None:
    def never(*args, **kwargs):
        raise AssertionError("pixels were prepared for a prompt that is refused")

    monkeypatch.setattr(qwen_items, "preprocess_image", never)
    monkeypatch.setattr(qwen_items, "preprocess_video", never)
    # Five images of 256 embeddings each: 1280 tokens, past max_model_len.
    five = [{"role": "user", "content": [{"type": "image", "image": picture()}] * 5}]
    with pytest.raises(ValueError, match=r"the prompt has 1\d\d\d tokens, but max_model_len is "
                       "1024"):
        run(vl, five, min_pixels=CAP)
    # 768 frames, each upscaled to the cap: 384 x 256 embeddings (the whole processed video
    # would be 9 GB of float32 patches).
    with pytest.raises(ValueError, match=r"the prompt has 983\d\d tokens, but max_model_len"):
        run(vl, chat(clip(768)), min_pixels=CAP, fps=240)


# Qwen2-Audio ----------------------------------------------------------------------------------


def speech(seconds: float) -> tuple[np.ndarray, int]:
    return np.zeros(round(16000 * seconds), np.float32), 16000


def audio_chat(seconds: float) -> list[dict]:
    return [{"role": "user", "content": [{"type": "audio", "audio": speech(seconds)},
                                         {"type": "text", "text": "What is it?"}]}]


@pytest.mark.parametrize("value", [0, -5, 600.001, math.inf, "30", None])
def test_max_audio_duration_outside_its_range(audio, value) -> None:
    with pytest.raises(ValueError) as info:
        run(audio, audio_chat(1.0), max_audio_duration_s=value)
    assert str(info.value).startswith(
        f"mm_processor_kwargs max_audio_duration_s={value!r} is not a number in (0, 600] "
        "(seconds per clip; it can only lower the default)"
    )


def test_max_audio_duration_on_the_edges(audio) -> None:
    assert embeds(run(audio, audio_chat(1.0), max_audio_duration_s=600)) == [25]
    assert embeds(run(audio, audio_chat(1.0), max_audio_duration_s=1.0)) == [25]
    with pytest.raises(ValueError, match="audio 1: duration 1.0 s exceeds the limit of 1e-06 s"):
        run(audio, audio_chat(1.0), max_audio_duration_s=1e-6)


# The range type itself --------------------------------------------------------------------------


def test_option_range_descriptions_and_types() -> None:
    assert OptionRange(1, 5, integer=True).describe() == "an integer in [1, 5]"
    assert OptionRange(0, 2.5, low_open=True).describe() == "a number in (0, 2.5]"
    assert OptionRange(1, integer=True).describe() == "an integer >= 1"
    assert OptionRange(1, 5, integer=True).check("n", np.int64(3)) == 3
    assert OptionRange(0, 5).check("x", np.float32(2.5)) == 2.5
    with pytest.raises(ValueError, match="high 1 is below low 2"):
        OptionRange(2, 1)
    assert check_mm_kwargs({"a": 1}, ("a", "b"), "Family") == {"a": 1}
