"""Engine construction and input validation: every bad value gets an error that names it."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import LLM, EngineConfig, SamplingParams


@pytest.mark.parametrize(
    "options, words",
    [
        ({"block_size": 3}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs must be in [1, 4096]"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len must be in [2,"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"kv_cache_bytes": 1.5}, "kv_cache_bytes"),
        ({"max_num_sequences": 4}, "unknown engine option(s) max_num_sequences"),
    ],
)
def test_invalid_options_name_the_option_and_range(options, words):
    with pytest.raises(ValueError) as err:
        EngineConfig.from_options(**options)
    assert words in str(err.value)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        EngineConfig().block_size = 32  # type: ignore[misc]


def test_missing_local_path_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nope" / "x" / "y"))
    with pytest.raises(ValueError, match="no config.json"):
        LLM(tmp_path)


def test_unreachable_hub_suggests_a_local_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="pass its local directory instead"):
        LLM("some-org/some-model-that-is-not-cached")


def test_kv_cache_smaller_than_one_sequence_is_refused(qwen2_path):
    with pytest.raises(ValueError, match="fewer than max_model_len=256; raise kv_cache_bytes"):
        LLM(qwen2_path, max_model_len=256, kv_cache_bytes=4096)


def test_max_model_len_beyond_the_model_is_refused(qwen2_path):
    with pytest.raises(ValueError, match="exceeds the model's context length"):
        LLM(qwen2_path, max_model_len=100_000)


@pytest.fixture(scope="module")
def llm(qwen2_path):
    return LLM(qwen2_path, max_model_len=64)


def test_prompt_too_long_names_both_numbers(llm):
    with pytest.raises(ValueError, match="the prompt has 70 tokens, but max_model_len is 64"):
        llm.generate([list(range(1, 71))])
    assert llm.stats()["requests_waiting"] == 0  # nothing was queued


def test_out_of_vocab_token_ids_are_refused(llm):
    with pytest.raises(ValueError, match=r"integers in \[0, "):
        llm.generate([[1, 2, 10**6]])


def test_empty_prompt_is_refused(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("")


def test_media_for_a_text_model_is_refused(llm):
    with pytest.raises(ValueError, match="does not accept image inputs"):
        llm.generate({"prompt": "hi", "multi_modal_data": {"image": ["x.png"]}})
    with pytest.raises(ValueError, match="does not accept audio inputs"):
        llm.chat([{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}])


def test_chat_renders_the_template(llm):
    messages = [{"role": "user", "content": "Hello!"}]
    params = SamplingParams(max_tokens=5, temperature=0)
    out = llm.chat(messages, params)[0]
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and text.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(text, add_special_tokens=False)
    again = llm.generate({"prompt": text, "add_special_tokens": False}, params)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids


def test_unknown_content_part_is_refused(llm):
    with pytest.raises(ValueError, match="unsupported content part type 'file'"):
        llm.chat([{"role": "user", "content": [{"type": "file", "file": "x"}]}])


def test_checkpoint_missing_a_tensor_names_it(qwen2_path, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(qwen2_path, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up_proj\.weight"):
        LLM(broken)


def test_checkpoint_with_wrong_shape_names_it(qwen2_path, tmp_path):
    broken = tmp_path / "shape"
    shutil.copytree(qwen2_path, broken)
    config = json.loads((broken / "config.json").read_text())
    config["intermediate_size"] = 96
    (broken / "config.json").write_text(json.dumps(config))
    shape = r"mlp\.\w+_proj\.weight has shape \((128, 64|64, 128)\), expected"
    with pytest.raises(ValueError, match=shape):
        LLM(broken)


def test_unsupported_architecture_lists_the_supported(qwen2_path, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(qwen2_path, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture.*Qwen2ForCausalLM"):
        LLM(other)


def test_a_request_that_can_never_run_fails_instead_of_hanging(qwen2_path):
    """Defence in depth: if validation ever lets through a request an idle engine cannot
    schedule, it finishes with an error and the engine keeps serving."""
    from engine.sampling_params import SamplingParams as SP

    llm = LLM(qwen2_path, max_model_len=64)
    engine = llm.engine
    processed = engine.processor.process(engine.processor.parse([1, 2, 3]), {})
    stuck = engine.make_request(processed, SP(max_tokens=4), "stuck")
    engine.add_request(stuck)
    engine.block_manager.free.clear()  # simulate an impossible allocation
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert "raise kv_cache_bytes" in outs[0].error
    assert not engine.has_unfinished()

