"""models/checkpoint.py: each setting found where transformers 5.24's `from_pretrained` finds
it, unknown settings and unsupported values refused with the file, field and value named, the
schemas' defaults equal to transformers' classes' own, and the LM head tied as transformers
ties it (engine/checkpoint_setup.py, the loader's error)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.checkpoint import (
    CheckpointError,
    CheckpointFiles,
    Found,
    Schema,
    checkpoint_dtype,
    choose_schema,
    read_settings,
)
from tests.hf_references import class_attributes, same_value

SCHEMA = Schema("ToyImageProcessor", {"size": 224, "do_resize": True}, fixed={"do_pad": False},
                inert=frozenset({"harmless"}))


def write(path: Path, name: str, data) -> None:
    (path / name).write_text(data if isinstance(data, str) else json.dumps(data))


def test_a_nested_component_wins_over_the_legacy_file(tmp_path):
    """transformers 5 reads processor_config.json's nested dict first (both are on disk when a
    repo was re-saved without deleting the old file)."""
    write(tmp_path, "processor_config.json", {"image_processor": {"size": 1}, "patch_size": 14})
    write(tmp_path, "preprocessor_config.json", {"size": 2})
    files = CheckpointFiles(tmp_path)
    found = files.component("image_processor")
    assert found.data == {"size": 1} and found.source == "processor_config.json: image_processor"
    assert files.processor_fields().data == {"patch_size": 14}


def test_legacy_files_and_the_video_fallbacks(tmp_path):
    write(tmp_path, "processor_config.json", {"processor_class": "X", "patch_size": 14})
    write(tmp_path, "preprocessor_config.json", {"size": 2})
    files = CheckpointFiles(tmp_path)
    assert files.component("image_processor").source == "preprocessor_config.json"
    # no video file: the video processor reads the image one, as transformers' does
    assert files.component("video_processor").source == "preprocessor_config.json"
    write(tmp_path, "video_preprocessor_config.json", {"size": 3})
    assert CheckpointFiles(tmp_path).component("video_processor").data == {"size": 3}
    assert CheckpointFiles(tmp_path).component("feature_extractor").data == {"size": 2}
    assert CheckpointFiles(tmp_path / "missing").component("image_processor") is None


def test_settings_come_with_their_source_or_the_class_default():
    s = read_settings(Found({"size": 336, "image_processor_type": "ToyImageProcessor"}, "f.json"),
                      SCHEMA)
    assert s["size"] == 336 and s.sources["size"] == "f.json: size" and s.given("size")
    assert s["do_resize"] is True and s.sources["do_resize"] == "default of ToyImageProcessor"
    assert read_settings(None, SCHEMA)["size"] == 224
    assert read_settings(Found({"size": None}, "f.json"), SCHEMA)["size"] == 224


@pytest.mark.parametrize(("data", "message"), [
    ({"crop_to_patches": True}, r"f\.json: unknown setting crop_to_patches=True"),
    ({"do_pad": True}, r"f\.json: do_pad=True is not supported .*do_pad=False only"),
])
def test_unknown_settings_and_unsupported_values_are_refused(data, message):
    with pytest.raises(CheckpointError, match=message):
        read_settings(Found(data, "f.json"), SCHEMA)
    read_settings(Found({"do_pad": False, "harmless": 1, "processor_class": "Y"}, "f.json"), SCHEMA)


def test_the_named_class_picks_the_schema():
    schemas = {"A": SCHEMA, "B": Schema("B", {})}
    assert choose_schema(Found({"image_processor_type": "BFast"}, "f"), schemas, "A").cls == "B"
    assert choose_schema(None, schemas, "A") is SCHEMA
    with pytest.raises(CheckpointError, match="image_processor_type='C' is not one"):
        choose_schema(Found({"image_processor_type": "C"}, "f"), schemas, "A")


def test_the_chat_templates_four_homes_in_order(tmp_path):
    files = lambda: CheckpointFiles(tmp_path)  # noqa: E731 - each read afresh
    assert files().chat_template() == (None, "none")
    write(tmp_path, "tokenizer_config.json", {"chat_template": "T"})
    assert files().chat_template() == ("T", "tokenizer_config.json: chat_template")
    write(tmp_path, "chat_template.jinja", "J")
    assert files().chat_template() == ("J", "chat_template.jinja")
    write(tmp_path, "chat_template.json", {"chat_template": "L"})
    assert files().chat_template() == ("L", "chat_template.json")
    write(tmp_path, "processor_config.json", {"chat_template": "P"})
    assert files().chat_template() == ("P", "processor_config.json: chat_template")


def test_named_templates_in_the_tokenizer_config(tmp_path):
    write(tmp_path, "tokenizer_config.json", {"chat_template": [
        {"name": "tool_use", "template": "U"}, {"name": "default", "template": "D"}]})
    assert CheckpointFiles(tmp_path).chat_template()[0] == "D"


def test_generation_defaults(tmp_path):
    write(tmp_path, "generation_config.json", {"eos_token_id": [5, 7], "temperature": 0.7,
                                               "top_p": 0.8, "top_k": 20, "do_sample": True})
    gen = CheckpointFiles(tmp_path).generation()
    assert gen.eos_token_ids == (5, 7)
    assert gen.sampling == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    write(tmp_path, "generation_config.json", {"eos_token_id": 5, "do_sample": False,
                                               "temperature": 0.7})
    assert CheckpointFiles(tmp_path).generation().sampling == {"temperature": 0.0}
    write(tmp_path, "generation_config.json", {"eos_token_id": "x"})
    with pytest.raises(CheckpointError, match="eos_token_id='x'"):
        CheckpointFiles(tmp_path).generation()


def test_the_dtype_is_the_configs_else_the_weights(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a.weight": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    files = CheckpointFiles(tmp_path)

    class Config:
        dtype = None

    assert checkpoint_dtype(Config(), files)[0] == "bfloat16"
    Config.dtype = torch.float16
    assert checkpoint_dtype(Config(), files) == ("float16", "config.json: dtype (or torch_dtype)")


def test_invalid_json_names_the_file(tmp_path):
    write(tmp_path, "processor_config.json", "{nope")
    with pytest.raises(CheckpointError, match="processor_config.json is not valid JSON"):
        CheckpointFiles(tmp_path).component("image_processor")


# ---- the schemas' defaults are transformers' classes' own ------------------------------------


def _pil_defaults(name: str) -> dict:
    import transformers

    return getattr(transformers, name)().to_dict()


def _image_schemas():
    from models.gemma4.preprocess import IMAGE_PROCESSOR as GEMMA4
    from models.idefics3.preprocess import IMAGE_PROCESSORS as IDEFICS3
    from models.internvl.preprocess import IMAGE_PROCESSORS as INTERNVL
    from models.minicpmv.preprocess import IMAGE_PROCESSORS as MINICPMV
    from models.mistral3.preprocess import IMAGE_PROCESSORS as PIXTRAL
    from models.mllama.preprocess import IMAGE_PROCESSORS as MLLAMA
    from models.processing.clip_image import IMAGE_PROCESSORS as CLIP
    from models.processing.log_mel import FEATURE_EXTRACTOR
    from models.processing.qwen_vision import IMAGE_PROCESSORS as QWEN

    schemas = {**CLIP, **IDEFICS3, **INTERNVL, **MINICPMV, **PIXTRAL, **QWEN, **MLLAMA,
               GEMMA4.cls: GEMMA4}
    pil = {name: f"{name}Pil" for name in schemas}
    return [(schemas[n], pil[n]) for n in sorted(schemas)] + [
        (FEATURE_EXTRACTOR, "WhisperFeatureExtractor")]


@pytest.mark.parametrize(("schema", "cls"), _image_schemas(), ids=lambda v: getattr(v, "cls", v))
def test_image_schema_defaults_are_the_classes(schema, cls):
    theirs = _pil_defaults(cls)
    for key, ours in schema.defaults.items():
        if key in ("min_pixels", "max_pixels"):  # transformers 4's budget names: not set
            assert ours is None
            continue
        assert key in theirs and same_value(ours, theirs[key]), (key, ours, theirs.get(key))
    for key, accepted in schema.fixed.items():
        assert key not in theirs or same_value(accepted, theirs[key]) or accepted is False, key


@pytest.mark.parametrize(("module", "cls"), [
    ("transformers.models.qwen2_vl.video_processing_qwen2_vl", "Qwen2VLVideoProcessor"),
    ("transformers.models.qwen3_vl.video_processing_qwen3_vl", "Qwen3VLVideoProcessor"),
    ("transformers.models.smolvlm.video_processing_smolvlm", "SmolVLMVideoProcessor"),
    ("transformers.models.internvl.video_processing_internvl", "InternVLVideoProcessor"),
    ("transformers.models.minicpmv4_6.video_processing_minicpmv4_6", "MiniCPMV4_6VideoProcessor"),
    ("transformers.models.gemma4.video_processing_gemma4", "Gemma4VideoProcessor"),
])
def test_video_schema_defaults_are_the_classes(module, cls):
    from models.gemma4.preprocess import VIDEO_PROCESSOR as GEMMA4
    from models.idefics3.preprocess import VIDEO_PROCESSORS as SMOLVLM
    from models.internvl.preprocess import VIDEO_PROCESSORS as INTERNVL
    from models.minicpmv.preprocess import VIDEO_PROCESSORS as MINICPMV
    from models.processing.qwen_vision import VIDEO_PROCESSORS as QWEN

    schema = {**QWEN, **SMOLVLM, **INTERNVL, **MINICPMV, GEMMA4.cls: GEMMA4}[cls]
    theirs = class_attributes(module, cls)
    for key, ours in schema.defaults.items():
        if key in theirs:
            assert same_value(ours, theirs[key]), (key, ours, theirs[key])
        else:  # not a class attribute: transformers' base default is None
            assert ours is None or key in ("rescale_factor",), key


@pytest.mark.parametrize(("cls", "schema_module", "name"), [
    ("LlavaProcessor", "models.llava.processor", "PROCESSORS"),
    ("Gemma3Processor", "models.gemma3.processor", "PROCESSOR_SCHEMA"),
    ("Idefics3Processor", "models.idefics3.processor", "PROCESSORS"),
    ("InternVLProcessor", "models.internvl.processor", "PROCESSORS"),
    ("Qwen2AudioProcessor", "models.qwen2_audio.processor", "PROCESSOR_SCHEMA"),
    ("Gemma4Processor", "models.gemma4.preprocess", "PROCESSOR"),
    # Settings of its __init__, which its to_dict() writes in samples instead.
    ("Gemma4AudioFeatureExtractor", "models.gemma4.audio_features", "FEATURE_EXTRACTOR"),
])
def test_processor_field_defaults_are_the_classes(cls, schema_module, name):
    import importlib
    import inspect

    import transformers

    found = getattr(importlib.import_module(schema_module), name)
    schemas = found.values() if isinstance(found, dict) else [found]
    schema = next(s for s in schemas if s.cls == cls)
    params = inspect.signature(getattr(transformers, cls).__init__).parameters
    for key, ours in schema.defaults.items():
        assert params[key].default == ours, key


# ---- the LM head tied as transformers ties it ------------------------------------------------


@pytest.fixture(scope="module")
def gemma_tied(tmp_path_factory):
    """A Gemma 3 checkpoint as the Hub's: the top-level flag ties, the text config's does not,
    and no lm_head.weight is saved."""
    from testing.gemma3 import build_gemma3_model

    path = build_gemma3_model(tmp_path_factory.mktemp("gemma-tied") / "m",
                              tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_a_composite_model_ties_by_its_top_level_flag(gemma_tied):
    import torch
    from safetensors import safe_open

    from engine import LLM, SamplingParams
    from tests.helpers import random_image

    with safe_open(gemma_tied / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    llm = LLM(gemma_tied, max_model_len=512)
    model = llm.engine.runner.model
    assert model.cfg.tie_word_embeddings and model.lm_head.weight is model.embed_tokens.weight
    rows = {(c, k): src for c, k, _, src in llm.engine.checkpoint_settings}
    assert rows["model", "tie_word_embeddings"] == (
        "config.json: tie_word_embeddings of Gemma3Config")
    import transformers

    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma_tied,
                                                                     dtype=torch.float32)
    assert hf.lm_head.weight is hf.get_input_embeddings().weight
    msgs = [{"role": "user", "content": [{"type": "image", "image": random_image(40, 50, 0)},
                                         {"type": "text", "text": "hi"}]}]
    out = llm.chat(msgs, SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_an_untied_head_missing_from_the_checkpoint_names_both_flags(gemma_tied, tmp_path):
    import shutil

    from engine import LLM

    path = tmp_path / "m"
    shutil.copytree(gemma_tied, path)
    config = json.loads((path / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=(
            r"no lm_head.weight .*config.json tie_word_embeddings=False, "
            r"text_config.tie_word_embeddings=False")):
        LLM(path, max_model_len=512)


def test_a_processor_setting_the_model_cannot_honour_is_refused_at_load(tmp_path):
    """LlavaProcessor's own default, num_additional_image_tokens=0, with a CLIP tower and the
    "default" strategy counts one token fewer than the model emits: transformers fails later,
    on the first image; we refuse at load, naming the fields."""
    from engine import LLM
    from testing.llava import build_llava_model

    path = build_llava_model(tmp_path / "m", num_layers=1)
    config = json.loads((path / "processor_config.json").read_text())
    del config["num_additional_image_tokens"]
    (path / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=(
            r"expands a 56-pixel tile to 15 tokens .*num_additional_image_tokens=0.*"
            r"emits 16 features")):
        LLM(path, max_model_len=512)


def test_an_unknown_processor_setting_is_refused_at_load(tmp_path):
    from engine import LLM
    from testing.llava import build_llava_model

    path = build_llava_model(tmp_path / "m", num_layers=1)
    config = json.loads((path / "processor_config.json").read_text())
    config["image_processor"]["crop_to_patches"] = True
    (path / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=(
            r"processor_config.json: image_processor: unknown setting crop_to_patches=True")):
        LLM(path, max_model_len=512)


def test_inspect_reports_without_loading_weights(tmp_path, capsys):
    from engine import inspect
    from testing.llava import build_llava_model

    path = build_llava_model(tmp_path / "m", num_layers=1)
    report = inspect.inspect(path)
    rows = {(c, k): (v, src) for c, k, v, src in report.rows}
    assert rows["processor", "patch_size"] == (14, "processor_config.json: patch_size")
    assert rows["model", "chat template"][1] == "chat_template.jinja"
    assert report.weight_bytes > 0 and report.kv_bytes_per_token == 2 * 1 * 2 * 16 * 4
    # int8 rows of 16 values and a float32 scale
    assert report.kv_int8_bytes_per_token == 2 * 1 * 2 * (16 + 4)
    assert not report.unsupported
    assert inspect.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "supported: the engine can serve" in out
    assert "--kv-cache-dtype int8: 80 B per token (3.20x the tokens" in out
    config = json.loads((path / "processor_config.json").read_text())
    config["image_processor"]["crop_to_patches"] = True
    (path / "processor_config.json").write_text(json.dumps(config))
    assert inspect.main([str(path)]) == 1
    assert "unknown setting crop_to_patches" in capsys.readouterr().out
