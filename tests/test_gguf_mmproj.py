"""Multimodal GGUF pairs, a text GGUF and its projector file (`mmproj`), written by llama.cpp's own
converter (`convert_hf_to_gguf.py` and `--mmproj`, from llama-cpp-python's source package: no
llama.cpp build) from tiny checkpoints, against the same checkpoints loaded from safetensors:
with an image or a sound in the prompt, greedy tokens identical and log-probabilities within
float32 rounding, for Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Gemma 3, Qwen2-Audio, Mistral 3 and
Qwen2.5-Omni (image and sound); the config and processor settings each with the metadata key
they came from (the inspector on a pair); a Q8_0 projector; the Ollama store and an LM Studio
folder laid out in a temporary HOME, the app's picker of them; broken projectors (another type,
another family, a key or a tensor missing or unknown, a truncated file) refused by name before
any weight loads.

The checkpoints' weights are on float16's grid (the converter writes a few tensors as F16
whatever it is asked: Whisper's convolutions, Gemma 3's projection), and their settings are
those a projector file cannot say otherwise than the transformers classes' defaults (Qwen2.5-VL's
112-px attention windows, Gemma 3's query scale): the files then hold the checkpoints exactly.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import wave
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from engine import LLM, SamplingParams
from engine.checkpoint_setup import CheckpointSetup
from engine.hub import resolve_files
from models.gguf.reader import GGUFError, GGUFFile

MAX_LEN = 256
STEPS = 4


def _qwen2_vl(path: Path) -> Path:
    from testing.tiny import build_qwen2_vl_model

    # The converter names the merger's layers by block number: a tower of three blocks or more.
    return build_qwen2_vl_model(path, "qwen2_vl", vision_depth=3)


def _qwen2_5_vl(path: Path) -> Path:
    from testing.tiny import build_qwen2_vl_model

    return build_qwen2_vl_model(path, "qwen2_5_vl", vision_overrides={
        "window_size": 112, "tokens_per_second": 4})


def _qwen3_vl(path: Path) -> Path:
    from testing.qwen3_vl import build_qwen3_vl_model

    return build_qwen3_vl_model(path)


def _gemma3(path: Path) -> Path:
    from testing.gemma3 import build_gemma3_model

    return build_gemma3_model(path, vision_use_head=False,
                              text_overrides={"query_pre_attn_scalar": 256})


def _qwen2_audio(path: Path) -> Path:
    from testing.tiny import build_qwen2_audio_model

    return build_qwen2_audio_model(path, audio_layers=3)


def _mistral3(path: Path) -> Path:
    from testing.mistral3 import build_mistral3_model

    return build_mistral3_model(path, vision_depth=3)


def _qwen2_5_omni(path: Path) -> Path:
    from testing.qwen_omni import build_qwen_omni_model

    path = build_qwen_omni_model(path, layout="omni", audio_layers=3, vision_window=112)
    # The whole model under the Hub's architecture name (the one the converter knows).
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen2_5OmniModel"]
    (path / "config.json").write_text(json.dumps(config))
    return path


# family -> (the tiny checkpoint's builder, the media its prompts carry)
FAMILIES = {"qwen2_vl": (_qwen2_vl, ("image",)), "qwen2_5_vl": (_qwen2_5_vl, ("image",)),
            "qwen3_vl": (_qwen3_vl, ("image",)), "gemma3": (_gemma3, ("image",)),
            "qwen2_audio": (_qwen2_audio, ("audio",)), "mistral3": (_mistral3, ("image",)),
            "qwen2_5_omni": (_qwen2_5_omni, ("image", "audio"))}
MODALITIES = {"qwen2_audio": ("audio",), "gemma3": ("image",), "mistral3": ("image",),
              "qwen2_5_omni": ("image", "video", "audio")}


@pytest.fixture(scope="module", autouse=True)
def no_kernel_timing():
    """These tests are about weights, not kernel choice: linears take the baseline formulation
    untimed (models/kernels/linear_policy.py; every formulation computes the same product)."""
    from models.kernels.linear_policy import PLAN_SECONDS_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(PLAN_SECONDS_ENV, "0")
        yield


def _converter() -> Path:
    from testing.llama_convert import converter_source

    try:
        return converter_source()
    except (subprocess.CalledProcessError, OSError) as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"llama.cpp's converter could not be fetched from the package index "
                    f"(llama-cpp-python's source package): {e}")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[Path, Path, Path]]:
    """family -> (checkpoint, text GGUF, projector GGUF), in a folder each as LM Studio keeps
    them."""
    from testing.llama_convert import convert_many, round_to_half

    source = _converter()
    root = tmp_path_factory.mktemp("mmproj")
    out, jobs = {}, []
    for family, (build, _) in FAMILIES.items():
        checkpoint = round_to_half(build(root / family))
        folder = root / f"{family}-gguf"
        folder.mkdir()
        text, projector = folder / f"{family}-F32.gguf", folder / f"mmproj-{family}-F32.gguf"
        jobs += [(checkpoint, text, "f32", False), (checkpoint, projector, "f32", True)]
        out[family] = (checkpoint, text, projector)
    # A projector quantized by the converter (`--outtype q8_0`), beside nothing.
    checkpoint, text, _ = out["qwen2_5_vl"]
    (root / "q8").mkdir()
    q8 = root / "q8" / "mmproj-qwen2_5_vl-Q8_0.gguf"
    jobs.append((checkpoint, q8, "q8_0", True))
    out["qwen2_5_vl q8_0"] = (checkpoint, text, q8)
    convert_many(jobs, source)
    return out


def _image() -> bytes:
    rng = np.random.default_rng(7)
    small = Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    small.resize((112, 112), Image.BICUBIC).save(buffer, format="PNG")
    return buffer.getvalue()


def _sound() -> bytes:
    t = np.arange(2 * 16000) / 16000
    samples = (0.3 * np.sin(2 * np.pi * (220 + 200 * t) * t) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


def _chat(kind: str) -> list[dict]:
    media = _image() if kind == "image" else _sound()
    return [{"role": "user", "content": [{"type": kind, kind: media},
                                         {"type": "text", "text": "Describe it."}]}]


def _run(model, kind: str, **kwargs):
    llm = LLM(model, dtype="float32", max_model_len=MAX_LEN, **kwargs)
    params = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5)
    out = llm.chat(_chat(kind), params)[0]
    return llm, out


@pytest.fixture(scope="module")
def runs(pairs):
    """(family, media) -> (the safetensors run, the GGUF pair's run, its LLM), computed once
    each."""
    cache = {}

    def get(family: str, kind: str | None = None):
        kind = kind or FAMILIES[family][1][0]
        if (family, kind) not in cache:
            checkpoint, text, projector = pairs[family]
            _, reference = _run(checkpoint, kind)
            llm, ours = _run(text, kind, mmproj=projector)
            cache[family, kind] = (reference, ours, llm)
        return cache[family, kind]

    return get


@pytest.mark.parametrize(("family", "kind"), [(f, k) for f, (_, kinds) in FAMILIES.items()
                                              for k in kinds])
def test_pair_computes_as_its_checkpoint(runs, family, kind):
    reference, ours, llm = runs(family, kind)
    assert llm.engine.processor.modalities == MODALITIES.get(family, ("image", "video"))
    assert ours.prompt_token_ids == reference.prompt_token_ids
    assert [(p.offset, p.length) for p in ours.multi_modal_placeholders] == [
        (p.offset, p.length) for p in reference.multi_modal_placeholders]
    assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
    for mine, theirs in zip(ours.outputs[0].logprobs, reference.outputs[0].logprobs,
                            strict=True):
        assert list(mine) == list(theirs)
        np.testing.assert_allclose(list(mine.values()), list(theirs.values()), atol=2e-4)


def test_a_q8_0_projector_is_dequantized_as_gguf_py_does(pairs):
    import torch

    from testing.gguf import dequantized

    _, text, q8 = pairs["qwen2_5_vl q8_0"]
    counts = GGUFFile(q8).type_counts()
    assert counts.get("Q8_0", 0) > 10, counts
    llm, out = _run(text, "image", mmproj=q8)
    visual = llm.engine.runner.model.visual
    torch.testing.assert_close(visual.merger.mlp[0].weight, dequantized(q8, "mm.0.weight"),
                               rtol=0, atol=0)
    qkv = torch.cat([dequantized(q8, f"v.blk.1.attn_{p}.weight") for p in "qkv"])
    torch.testing.assert_close(visual.blocks[1].attn.qkv.weight, qkv, rtol=0, atol=0)
    assert "Q8_0" in llm.engine.runner.gguf_summary
    assert len(out.outputs[0].token_ids) == STEPS


def test_the_text_file_alone_is_its_base_family(pairs):
    """A qwen3vl text file without its projector: Qwen3 (mRoPE over equal position rows is
    plain RoPE), its text prompt computed as the checkpoint computes it."""
    checkpoint, text, _ = pairs["qwen3_vl"]
    setup = CheckpointSetup.load(text)
    assert setup.architecture == "Qwen3ForCausalLM"
    assert setup.hf_config.head_dim == 16  # qwen3vl.attention.key_length
    params = SamplingParams(max_tokens=STEPS, temperature=0, logprobs=5)
    chat = [{"role": "user", "content": "Describe the engine."}]
    ours = LLM(text, dtype="float32", max_model_len=MAX_LEN).chat(chat, params)[0]
    reference = LLM(checkpoint, dtype="float32", max_model_len=MAX_LEN).chat(chat, params)[0]
    assert ours.outputs[0].token_ids == reference.outputs[0].token_ids


def test_settings_name_the_metadata_they_came_from(pairs):
    _, text, projector = pairs["qwen2_5_vl"]
    setup = CheckpointSetup.load(text, projector)
    assert setup.architecture == "Qwen2_5_VLForConditionalGeneration"
    rows = {key: (value, source) for key, value, source in setup.rows()}
    name = projector.name
    assert rows["config.vision_config.depth"] == (3, f"{name}: clip.vision.block_count")
    assert rows["config.vision_config.fullatt_block_indexes"][0] == [1]
    assert "clip.vision.n_wa_pattern" in rows["config.vision_config.fullatt_block_indexes"][1]
    assert rows["config.vision_config.window_size"] == (
        112, "not in the file: default of Qwen2_5_VLVisionConfig")
    assert rows["config.image_token_id"][1] == (
        f"{text.name}: tokenizer.ggml.tokens (<|image_pad|>)")
    assert "rope.dimension_sections" in rows["config.text_config.rope_parameters"][1]
    assert rows["config.text_config.rope_parameters"][0]["mrope_section"] == [2, 3, 3]
    image = setup.files.component("image_processor")
    assert image.origins["image_mean"] == f"{name}: clip.vision.image_mean"
    assert setup.files.json("preprocessor_config.json") is None  # nothing from the folder


def test_the_inspector_on_a_pair_and_a_folder(pairs, capsys):
    """`python -m engine.inspect TEXT --mmproj PROJECTOR`, and the folder holding both (its
    main, in this process)."""
    from engine.inspect import main

    _, text, projector = pairs["gemma3"]
    for argv in ([str(text), "--mmproj", str(projector)], [str(text.parent)]):
        assert main(argv) == 0
        shown = capsys.readouterr().out
        assert "Gemma3ForConditionalGeneration" in shown
        assert f"gemma3 ({projector.name})" in shown
        assert f"{projector.name}: clip.vision.image_size" in shown
        assert "image_processor.image_mean" in shown
        assert "processor.image_seq_length" in shown
        assert "supported: the engine can serve this checkpoint" in shown
    assert main([str(text), "--mmproj", str(pairs["qwen2_audio"][2])]) == 1
    assert "a projector of another family" in capsys.readouterr().out


def test_a_folder_finds_its_projector_by_name(pairs, tmp_path):
    _, text, projector = pairs["qwen2_audio"]
    files = resolve_files(text.parent)
    assert (files.path, files.mmproj) == (text, projector)
    assert resolve_files(text).mmproj is None  # a file alone is the text model
    folder = tmp_path / "two"
    folder.mkdir()
    for copy in ("mmproj-a.gguf", "mmproj-b.gguf"):
        shutil.copy(projector, folder / copy)
    shutil.copy(text, folder / text.name)
    with pytest.raises(ValueError, match="2 projector files"):
        resolve_files(folder)


# ---- the stores ------------------------------------------------------------------------------


def _blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _ollama_store(root: Path, name: str, tag: str, layers: dict[str, bytes]) -> Path:
    """An Ollama store holding one model: its blobs and manifest, as `ollama pull` lays
    them out."""
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    manifest = root / "manifests" / "registry.ollama.ai" / "library" / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    config = _blob(root, b"{}")
    manifest.write_text(json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", **config},
        "layers": [{"mediaType": f"application/vnd.ollama.image.{kind}", **_blob(root, data)}
                   for kind, data in layers.items()]}))
    return manifest


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_an_ollama_model_opens_from_its_store(pairs, runs, tmp_path, monkeypatch):
    from engine.model_stores import discover

    _, text, projector = pairs["qwen2_5_vl"]
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    store = tmp_path / ".ollama" / "models"
    _ollama_store(store, "tiny-vl", "3b", {
        "model": text.read_bytes(), "projector": projector.read_bytes(),
        "template": b"{{ .Prompt }}", "license": b"Apache-2.0",
        "params": json.dumps({"stop": ["<|im_end|>"], "temperature": 0.1,
                              "repeat_penalty": 1.05, "num_ctx": 4096}).encode()})
    before = _snapshot(store)
    setup = CheckpointSetup.load(*_files("ollama:tiny-vl:3b"))
    assert setup.architecture == "Qwen2_5_VLForConditionalGeneration"
    assert setup.sampling_defaults == {"stop": ("<|im_end|>",), "temperature": 0.1,
                                       "repetition_penalty": 1.05}
    notes = [value for key, value, _ in setup.rows() if key == "store note"]
    assert any("num_ctx" in n for n in notes) and any("Go syntax" in n for n in notes)
    reference, _, _ = runs("qwen2_5_vl")
    _, ours = _run("ollama:tiny-vl:3b", "image")
    assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
    assert [m.name for m in discover()] == ["ollama:tiny-vl:3b"]
    assert _snapshot(store) == before  # nothing written into the store


def _files(model: str):
    files = resolve_files(model)
    return files.path, files.mmproj, files.stored


def test_ollama_names_and_refusals(pairs, tmp_path, monkeypatch):
    from engine.model_stores import StoreError, ollama_model
    from testing.gguf import rewrite_gguf

    _, text, projector = pairs["qwen2_5_vl"]
    monkeypatch.setenv("OLLAMA_MODELS", str(tmp_path / "store"))
    store = tmp_path / "store"
    _ollama_store(store, "tiny", "latest", {"model": text.read_bytes()})
    assert ollama_model("tiny").model.parent == store / "blobs"  # tag latest by default
    assert ollama_model("tiny").mmproj is None
    with pytest.raises(StoreError, match="no manifest"):
        ollama_model("tiny:7b")
    with pytest.raises(StoreError, match="not an Ollama model name"):
        ollama_model("../tiny")
    # A model whose file holds its own tower in Ollama's layout.
    own = rewrite_gguf(text, tmp_path / "own.gguf",
                       set_keys={"qwen2vl.vision.block_count": 3})
    _ollama_store(store, "own", "latest", {"model": own.read_bytes()})
    with pytest.raises(StoreError, match=r"Ollama's layout \(qwen2vl.vision.block_count\)"):
        ollama_model("own")
    _ollama_store(store, "lora", "latest", {"model": text.read_bytes(),
                                            "adapter": projector.read_bytes()})
    with pytest.raises(StoreError, match="LoRA adapter"):
        ollama_model("lora")
    manifest = _ollama_store(store, "gone", "latest", {"model": text.read_bytes()})
    layers = json.loads(manifest.read_text())
    layers["layers"][0]["digest"] = "sha256:" + "0" * 64
    manifest.write_text(json.dumps(layers))
    with pytest.raises(StoreError, match="is missing"):
        ollama_model("gone")


def test_an_lmstudio_folder_opens_with_its_projector(pairs, tmp_path, monkeypatch):
    from engine.model_stores import StoreError, discover

    _, text, projector = pairs["gemma3"]
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    folder = tmp_path / ".lmstudio" / "models" / "tiny-org" / "gemma-3-tiny-GGUF"
    folder.mkdir(parents=True)
    shutil.copy(text, folder / "gemma-3-tiny-F32.gguf")
    shutil.copy(projector, folder / "mmproj-gemma-3-tiny-F32.gguf")
    before = _snapshot(tmp_path / ".lmstudio")
    files = resolve_files("lmstudio:tiny-org/gemma-3-tiny-GGUF")
    assert files.mmproj == folder / "mmproj-gemma-3-tiny-F32.gguf"
    setup = CheckpointSetup.load(files.path, files.mmproj, files.stored)
    assert setup.architecture == "Gemma3ForConditionalGeneration"
    assert [m.name for m in discover()] == ["lmstudio:tiny-org/gemma-3-tiny-GGUF"]
    shutil.copy(text, folder / "gemma-3-tiny-F16.gguf")
    with pytest.raises(StoreError, match="2 model files"):
        resolve_files("lmstudio:tiny-org/gemma-3-tiny-GGUF")
    named = resolve_files("lmstudio:tiny-org/gemma-3-tiny-GGUF/gemma-3-tiny-F16.gguf")
    assert named.path.name == "gemma-3-tiny-F16.gguf" and named.mmproj is not None
    assert len(discover()) == 2
    (folder / "gemma-3-tiny-F16.gguf").unlink()
    assert _snapshot(tmp_path / ".lmstudio") == before


# ---- refusals ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken(pairs, tmp_path_factory):
    from testing.gguf import rewrite_gguf

    _, text, projector = pairs["qwen2_5_vl"]
    root = tmp_path_factory.mktemp("broken")
    truncated = root / "truncated.gguf"
    data = projector.read_bytes()
    truncated.write_bytes(data[: len(data) - 4096])
    return {
        "type": rewrite_gguf(projector, root / "type.gguf",
                             set_keys={"clip.projector_type": "llama4"}),
        "key": rewrite_gguf(projector, root / "key.gguf",
                            set_keys={"clip.vision.wa_layer_indexes": [0, 2]}),
        "value": rewrite_gguf(projector, root / "value.gguf", set_keys={"clip.use_silu": False}),
        "missing key": rewrite_gguf(projector, root / "missing-key.gguf",
                                    drop_keys=("clip.vision.n_wa_pattern",)),
        "missing tensor": rewrite_gguf(projector, root / "missing.gguf",
                                       drop_tensors=("v.blk.1.attn_k.weight",)),
        "unknown tensor": rewrite_gguf(projector, root / "unknown.gguf",
                                       rename_tensors={"v.post_ln.weight": "v.post_norm.weight"}),
        "truncated": truncated,
        "other family": pairs["gemma3"][2],
        "width": rewrite_gguf(projector, root / "width.gguf",
                              set_keys={"clip.vision.projection_dim": 128}),
    }


@pytest.mark.parametrize(("kind", "message"), [
    ("type", r"clip.projector_type='llama4' is not a projector type mmserve reads"),
    ("key", r"metadata clip.vision.wa_layer_indexes=\[0, 2\] is not read for a "
            r"qwen2.5vl_merger projector"),
    ("value", r"clip.use_silu=False, but Qwen2.5-VL's tower activation"),
    ("missing key", r"metadata has no clip.vision.n_wa_pattern"),
    ("truncated", r"truncated"),
    ("other family", r"gemma3 projector, whose text model is a GGUF of architecture gemma3"),
    ("width", r"clip.vision.projection_dim=128, but .* embeddings are 64 wide"),
])
def test_broken_projectors_are_refused_at_setup(pairs, broken, kind, message):
    _, text, _ = pairs["qwen2_5_vl"]
    with pytest.raises(GGUFError, match=message):
        CheckpointSetup.load(text, broken[kind])


@pytest.mark.parametrize(("kind", "message"), [
    ("missing tensor", r"visual.blocks.1.attn.qkv.weight is made of 3 tensors and the file "
                       r"holds 2 of them: missing tensor"),
    ("unknown tensor", r"tensor v.post_norm.weight \(F32 \[32\]\) is not a tensor of a "
                       r"qwen2.5vl_merger projector"),
])
def test_broken_projectors_are_refused_before_loading(pairs, broken, kind, message):
    _, text, _ = pairs["qwen2_5_vl"]
    with pytest.raises(GGUFError, match=message):
        LLM(text, mmproj=broken[kind], dtype="float32", max_model_len=MAX_LEN)


def test_a_projector_is_not_a_model_and_a_model_not_a_projector(pairs):
    _, text, projector = pairs["qwen2_vl"]
    with pytest.raises(GGUFError, match="a projector \\(mmproj\\) file"):
        CheckpointSetup.load(projector)
    with pytest.raises(GGUFError, match="not a projector \\(mmproj\\) file"):
        CheckpointSetup.load(text, text)
    checkpoint = pairs["qwen2_vl"][0]
    with pytest.raises(ValueError, match="is not one"):
        resolve_files(checkpoint, projector)


# ---- the app ---------------------------------------------------------------------------------


def test_the_app_takes_a_pair_and_lists_the_stores(pairs, tmp_path, monkeypatch):
    from launch.engines import stored_models
    from launch.options import model_sources, parse_args

    _, text, projector = pairs["qwen2_audio"]
    args = parse_args(["--model", str(text), "--mmproj", str(projector)])
    assert args.mmproj == str(projector)
    with pytest.raises(SystemExit):
        parse_args(["--model", str(text), "--model", "x", "--mmproj", str(projector)])
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("OLLAMA_MODELS", raising=False)
    folder = tmp_path / ".lmstudio" / "models" / "org" / "audio-GGUF"
    folder.mkdir(parents=True)
    for file in (text, projector):
        shutil.copy(file, folder / file.name)
    engines: dict = {}
    found = stored_models(parse_args([]), engines)
    assert list(found) == ["lmstudio:org/audio-GGUF"] and engines == {}  # nothing loaded
    assert stored_models(parse_args(["--no-model-stores"]), engines) == {}
    assert model_sources(parse_args(["--model", "ollama:qwen2.5vl:7b"])) == {
        "ollama:qwen2.5vl:7b": "ollama:qwen2.5vl:7b"}


def test_the_picker_loads_a_model_once_when_chosen():
    """ui.lineup with stand-in engines: listed as loadable, loaded once however many choose it
    at once, a failed load said to every chooser and tried again at the next choice."""
    import asyncio
    import threading

    from ui.lineup import NOT_LOADED, Lineup

    calls, gate = [], threading.Event()

    def load(progress):
        calls.append(1)
        gate.wait(5)
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return "engine"

    lineup = Lineup({"here": "loaded"}, {"here": load, "store:m": load})
    assert lineup.choices() == [("here", "here"), ("store:m" + NOT_LOADED, "store:m")]

    async def choose_twice():
        first = asyncio.ensure_future(lineup.load("store:m"))
        second = asyncio.ensure_future(lineup.load("store:m"))
        await asyncio.sleep(0.05)
        gate.set()
        return await asyncio.gather(first, second, return_exceptions=True)

    failed = asyncio.run(choose_twice())
    assert [str(e) for e in failed] == ["out of memory"] * 2 and len(calls) == 1
    assert not lineup.loaded("store:m")
    assert asyncio.run(lineup.load("store:m")) == "engine" and len(calls) == 2
    assert lineup.loaded("store:m") and lineup.engines["store:m"] == "engine"
    with pytest.raises(KeyError):
        asyncio.run(lineup.load("elsewhere"))


def test_the_ui_picker_offers_a_store_model_and_loads_it_when_chosen():
    import asyncio

    import gradio as gr

    from engine.interface import EngineInfo
    from engine.media.limits import MediaLimits
    from ui import build_demo
    from ui.lineup import NOT_LOADED

    class Standin:  # a ChatEngine's face, for the picker
        def __init__(self, name: str) -> None:
            self.info = EngineInfo(name, ("audio",), 512, MediaLimits(), 4)

        def stats(self) -> dict:
            return {}

    loads = []
    demo = build_demo({"served": Standin("served")}, examples=[],
                      available={"lmstudio:org/m": lambda _: loads.append(1) or Standin("m")})
    (picker,) = [b for b in demo.blocks.values() if isinstance(b, gr.Dropdown)]
    assert ("lmstudio:org/m" + NOT_LOADED, "lmstudio:org/m") in picker.choices
    assert loads == []  # nothing loaded until chosen
    (choose,) = [f.fn for f in demo.fns.values() if f.name == "choose"]

    async def chosen():
        return [line async for line in choose("lmstudio:org/m")]

    lines = asyncio.run(chosen())
    assert lines[0].startswith("Loading **lmstudio:org/m**") and "audio" in lines[-1]
    assert loads == [1]
    assert asyncio.run(chosen()) == [lines[-1]] and loads == [1]  # loaded once
