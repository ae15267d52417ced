"""Every registered family against the declared seams (models/interfaces.py)."""

from __future__ import annotations

import inspect

import pytest

from models.interfaces import LanguageModel, MultimodalProcessor
from models.layer_interfaces import ForwardMetadata, KVCacheLayer
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
        assert engine.runner.model.cfg.num_layers == len(engine.runner.attention_layers())
        assert all(isinstance(a, KVCacheLayer) for a in engine.runner.attention_layers())
        proc = engine.processor.mm_processor
        assert proc is None or isinstance(proc, MultimodalProcessor)


def test_the_step_metadata_satisfies_the_forward_protocol():
    import torch

    from models.layers.attention_metadata import build_metadata

    meta = build_metadata([0, 3], [3, 1], [[1], [2]], 4, torch.device("cpu"))
    assert isinstance(meta, ForwardMetadata)
    assert (meta.states, meta.cross, meta.adapters) == (None, None, None)


def test_unknown_architecture_names_the_supported_ones():
    class Config:
        architectures = ["NoSuchModel"]

    with pytest.raises(ValueError, match="unsupported architecture.*Qwen2ForCausalLM"):
        resolve(Config())


def _plan_cases(tmp_path):
    """(checkpoint, messages) per family whose processor plans: images of odd sizes, a video."""
    import numpy as np
    from PIL import Image

    from testing.gemma3 import build_gemma3_model
    from testing.llava import build_llava_model
    from testing.mistral3 import build_mistral3_model
    from testing.qwen3_vl import build_qwen3_vl_model

    rng = np.random.default_rng(0)

    def image(h, w):
        return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))

    video = rng.integers(0, 256, (5, 40, 90, 3), dtype=np.uint8)
    parts = [{"type": "text", "text": "look"}, {"type": "image", "image": image(70, 130)},
             {"type": "image", "image": image(150, 40)}]
    with_video = [*parts, {"type": "video", "video": video}]
    pan = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 20}
    return [
        (build_llava_model(tmp_path / "next", next_=True), parts),
        (build_gemma3_model(tmp_path / "gemma", pan_and_scan=pan), parts),
        (build_qwen3_vl_model(tmp_path / "qwen3"), with_video),
        (build_mistral3_model(tmp_path / "mistral3"), parts),
    ]


def test_plans_agree_with_processing(tmp_path):
    """What a processor plans from sizes alone is what processing then produces."""
    from engine import LLM

    for path, parts in _plan_cases(tmp_path):
        engine = LLM(path, max_model_len=2048).engine
        p = engine.processor
        parsed = p.render_chat([{"role": "user", "content": parts}])
        media = p.load_media_sync(parsed)
        ids = engine.tokenizer.encode(
            p.mm_processor.expand_text(parsed.text, media, {}), add_special_tokens=False)
        plan = p.mm_processor.plan(ids, media, {})
        out = p.process(parsed, media)
        assert plan.num_tokens == len(out.token_ids), path.name
        assert plan.item_embeds == [(f.modality, f.placeholder.num_embeds)
                                    for f in out.mm_features], path.name
