"""Every registered family against the declared seams (models/interfaces.py)."""

from __future__ import annotations

import inspect

import pytest

from models.interfaces import LanguageModel, MultimodalProcessor
from models.registry import registered, resolve


def _members(protocol) -> set[str]:
    names = {n for n in vars(protocol) if not n.startswith("_")}
    return names | set(getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("arch", sorted(registered()))
def test_model_class_declares_every_member(arch):
    spec = registered()[arch]
    missing = {n for n in _members(LanguageModel) - {"cfg"} if not hasattr(spec.model, n)}
    assert not missing, f"{spec.model.__name__} lacks {sorted(missing)}"
    assert spec.model.position_rows in (1, 3)


@pytest.mark.parametrize("arch", sorted(registered()))
def test_processor_declares_every_member(arch):
    spec = registered()[arch]
    if spec.processor is None:
        return
    missing = {n for n in _members(MultimodalProcessor) if not hasattr(spec.processor, n)}
    assert not missing, f"{spec.processor.__name__} lacks {sorted(missing)}"
    assert list(inspect.signature(spec.processor).parameters) == ["ctx"]


def test_built_models_and_processors_satisfy_the_protocols(qwen2_path, qwen2_vl_path,
                                                           qwen2_audio_path):
    from engine import LLM

    for path in (qwen2_path, qwen2_vl_path, qwen2_audio_path):
        engine = LLM(path, max_model_len=128).engine
        assert isinstance(engine.runner.model, LanguageModel)
        assert engine.runner.model.cfg.num_layers == len(engine.runner.model.attention_layers())
        proc = engine.processor.mm_processor
        assert proc is None or isinstance(proc, MultimodalProcessor)


def test_unknown_architecture_names_the_supported_ones():
    class Config:
        architectures = ["NoSuchModel"]

    with pytest.raises(ValueError, match="unsupported architecture.*Qwen2ForCausalLM"):
        resolve(Config())
