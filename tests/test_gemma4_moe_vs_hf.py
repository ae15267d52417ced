"""Gemma 4's mixture of experts (26B-A4B's shape) against transformers, on one tiny random
Gemma4ForConditionalGeneration: every layer's routed experts (4, top 2) beside its dense MLP,
global layers whose values are their keys (attention_k_eq_v) with their own head size and KV
head count, causal image spans (use_bidirectional_attention unset), a vision tower.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    user,
)

N = 6
GREEDY = greedy(N)
CASES = {
    "text": user("The quick brown fox jumps over the lazy dog. Describe it in detail."),
    "image": user(random_image(64, 70, 0), "Describe the image in detail."),
    "two_images": user("Compare", random_image(50, 60, 1), "with", random_image(80, 40, 2)),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from testing.gemma4 import build_gemma4_model

    return build_gemma4_model(tmp_path_factory.mktemp("gemma4_moe") / "m", experts=True,
                              audio=False, use_bidirectional_attention=None)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=1024)


@pytest.fixture(scope="module")
def refs(path, llm):
    import transformers

    from testing.gemma4 import hf_inputs

    hf = transformers.Gemma4ForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32).eval()
    out = {}
    for case, msgs in CASES.items():
        proc, _ = process_chat(llm, msgs)
        out[case] = hf_greedy(hf, hf_inputs(hf.config, proc), len(proc.token_ids), N)
    return out


def test_shapes_and_causal_spans(llm):
    from models.gemma4.experts import ExpertsLayer

    model = llm.engine.runner.model
    assert all(isinstance(layer, ExpertsLayer) for layer in model.layers)
    shapes = model.cfg.layer_shapes
    assert [(s.num_kv_heads, s.head_dim, s.values_are_keys) for s in shapes[1:3]] == [
        (2, 16, False), (1, 32, True)]
    assert model.per_layer_inputs is None and not model.shares_kv
    proc, _ = process_chat(llm, CASES["image"])
    assert not proc.mm_features[0].placeholder.bidirectional
    assert llm.engine.processor.mm_processor.max_bidirectional_span() == 0


def test_each_case_matches_transformers(llm, refs):
    params = greedy(N, logprobs=3)
    for case, msgs in CASES.items():
        assert_matches_reference(llm.chat(msgs, params)[0], *refs[case], case)
    assert_released(llm)


def test_chunked_batch_and_active_experts_only(path, refs):
    """12 tokens a step, every case in one batch; a decode row runs only its routed experts
    (top 2 of 4), each once."""
    llm = LLM(path, max_model_len=1024, max_num_batched_tokens=12, max_num_seqs=4)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert_released(llm)
    layer = llm.engine.runner.model.layers[0]
    calls = [count_calls(e) for e in layer.experts.experts]
    h = torch.randn(1, llm.engine.runner.model.cfg.hidden_size)
    with torch.inference_mode():
        weights, experts = layer.router(h)
        layer.experts.routed(h, weights, experts)
    assert [c[0] for c in calls] == [int(e in experts[0].tolist()) for e in range(4)]
    assert sum(c[0] for c in calls) == 2


def test_quantized_while_loading(path):
    """int8: the experts' and layers' linears quantized as they stream in, the router kept in
    the model dtype, and greedy decoding still runs end to end."""
    llm = LLM(path, max_model_len=256, quantization="int8")
    layer = llm.engine.runner.model.layers[0]
    assert all(e.gate_up_proj.is_quantized and e.down_proj.is_quantized
               for e in layer.experts.experts)
    assert not layer.router.proj.is_quantized and layer.mlp.gate_up_proj.is_quantized
    out = llm.chat(CASES["text"], GREEDY)[0]
    assert len(out.outputs[0].token_ids) == N
    assert_released(llm)
