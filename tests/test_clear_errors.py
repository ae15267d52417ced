"""Bad input answered clearly, over real HTTP: a media part of a modality the model does not
take is a 400 naming the modality and the model (never the 500 of a template that cannot
render it), a malformed content part is refused for its own problem at its index, and a
checkpoint stored quantized is refused at load by its method and format."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from api import create_app
from engine import AsyncLLM
from engine.checkpoint_setup import CheckpointSetup
from models.checkpoint import CheckpointError
from tests.api_fixtures import running_server

MODEL = "text-only"
# SmolLM2's way: the content concatenated into the prompt (a list of parts cannot be).
CONCATENATING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PNG = "data:image/png;base64,iVBORw0KGgo="


@pytest.fixture(scope="module")
def text_only_path(qwen2_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "concatenating"
    shutil.copytree(qwen2_path, path)
    (path / "chat_template.jinja").write_text(CONCATENATING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def engine(text_only_path):
    llm = AsyncLLM(text_only_path, max_model_len=256)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def base_url(engine):
    with running_server(create_app({MODEL: engine})) as url:
        yield url


def chat(base_url: str, content) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2,
            "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30)


@pytest.mark.parametrize(("part", "modality"), [
    ({"type": "image_url", "image_url": {"url": PNG}}, "image"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "video", "video": "clip.mp4"}, "video"),
])
def test_media_the_model_does_not_take_is_a_400_naming_it(base_url, part, modality):
    response = chat(base_url, [{"type": "text", "text": "What is this?"}, part])
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith(f"messages.0.content.1: model {MODEL!r} does not accept "
                              f"{modality} inputs (it takes text)"), message


def test_the_engine_refuses_media_before_the_template_renders(engine):
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": PNG}]}]
    with pytest.raises(ValueError, match="does not accept image inputs"):
        engine.processor.render_chat(messages)


@pytest.mark.parametrize(("content", "where", "fragments"), [
    ([{"type": "text", "text": "hi"}, {"type": "picture", "picture": "x"}],
     "messages.0.content.1", ["Input tag 'picture'", "'image_url'"]),
    ([{"text": "hi"}], "messages.0.content.0", ["string 'type'"]),
    ([{"type": "image_url", "image_url": {"url": 3}}],
     "messages.0.content.0.image_url.image_url.url", ["valid string"]),
    ([{"type": "image_url", "image_url": 7}],
     "messages.0.content.0.image_url.image_url", ["'url'", "URL as a string"]),
    (5, "messages.0.content", ["a string or a list of content parts"]),
], ids=["unknown-type", "no-type", "url-not-a-string", "image-url-a-number", "content-number"])
def test_a_malformed_part_is_refused_for_its_problem(base_url, content, where, fragments):
    response = chat(base_url, content)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages"
    assert error["message"].startswith(f"invalid request: {where}: "), error["message"]
    assert ".str" not in error["message"] and "<" not in error["message"]
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


QUANTIZED = {
    "awq": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
             "zero_point": True}, ["'awq'", "bits=4", "version='gemm'"]),
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
             ["'gptq'", "bits=4", "group_size=128"]),
    "compressed-tensors": ({"quant_method": "compressed-tensors", "format": "pack-quantized",
                            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                                "num_bits": 4, "type": "int", "group_size": 128}}}},
                           ["'compressed-tensors'", "format='pack-quantized'",
                            "group_0: weights int4"]),
    "fp8": ({"quant_method": "fp8", "activation_scheme": "dynamic",
             "weight_block_size": [128, 128]}, ["'fp8'", "weight_block_size=[128, 128]"]),
}


@pytest.mark.parametrize("method", list(QUANTIZED))
def test_a_quantized_checkpoint_is_refused_at_load_by_name(qwen2_path, tmp_path, method):
    quant, fragments = QUANTIZED[method]
    path = tmp_path / method
    shutil.copytree(qwen2_path, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(CheckpointError) as info:
        CheckpointSetup.load(path)
    message = str(info.value)
    assert message.startswith("config.json: quantization_config quant_method="), message
    assert "unquantized" in message
    for fragment in fragments:
        assert fragment in message, message
