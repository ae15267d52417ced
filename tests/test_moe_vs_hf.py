"""Mixture-of-experts decoders through the whole engine, against transformers on tiny random
checkpoints with more experts than the top k: Qwen3-MoE (text; a dense layer among the sparse
ones, `mlp_only_layers`), Qwen3-VL-MoE (its dense family's tower and DeepStack) and Qwen3.5-MoE
(hybrid layers, a gated shared expert in every layer), each in both of its checkpoint layouts:
Qwen3-MoE and Qwen3.5-MoE per expert (what transformers writes) and fused
(`save_original_format=False`, transformers 5's in-memory layout); Qwen3-VL-MoE fused as
transformers 5 writes it and transposed as transformers 4 wrote it (its Hub checkpoints).

Greedy tokens identical and top log-probabilities within tolerance for text and an image,
batches whose tokens route to different experts, chunk budgets that cut prompts at odd places,
and prefix-cache hits; int8 / int4 quantize the experts but never the router.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from models.kernels.quantization import QuantizedLinear
from models.layers.moe import SparseMoE
from testing.layouts import transpose_fused_experts
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    greedy,
    hf_greedy,
    process_chat,
    qwen_vl_reference,
    random_image,
    user,
)

N = 6
GREEDY = greedy(N, logprobs=3)
# 8 experts, 2 per token; expert sizes that no layout's transpose leaves square (hidden 64).
EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 96}
CHECKPOINTS = {
    "qwen3_moe": {},
    "qwen3_moe_fused": {"save_original_format": False},
    "qwen3_vl_moe": {},
    "qwen3_vl_moe_transposed": {},
    "qwen3_5_moe": {},
    "qwen3_5_moe_fused": {"save_original_format": False},
}
IMAGE = random_image(120, 150, 0)
CASES = {
    "text": user("Hello there, how are you today?"),
    "long_text": user("Count: " + " ".join(str(i) for i in range(30))),
    "one_image": user(IMAGE, "Describe the image in detail."),
}


def build(root, name: str):
    family = name.removesuffix("_fused").removesuffix("_transposed")
    save = CHECKPOINTS[name]
    if family == "qwen3_moe":
        from testing.tiny import build_text_model

        return build_text_model(root / "m", "qwen3_moe", num_layers=3, config_overrides={
            **EXPERTS, "norm_topk_prob": True, "mlp_only_layers": [1], "head_dim": 16}, **save)
    if family == "qwen3_vl_moe":
        from testing.qwen3_vl import build_qwen3_vl_model

        path = build_qwen3_vl_model(root / "m", experts={**EXPERTS, "mlp_only_layers": [1]},
                                    **save)
        return transpose_fused_experts(path) if name.endswith("_transposed") else path
    from testing.qwen3_5 import build_qwen3_5_model

    return build_qwen3_5_model(root / "m", experts={**EXPERTS,
                                                    "shared_expert_intermediate_size": 64},
                               **save)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
    return request.param, build(tmp_path_factory.mktemp(request.param), request.param)


def cases(name: str) -> dict:
    text_only = name.startswith("qwen3_moe")
    return {c: m for c, m in CASES.items() if not (text_only and c == "one_image")}


def references(hf, llm, name: str) -> dict:
    out = {}
    for case, messages in cases(name).items():
        if not name.startswith("qwen3_moe"):
            out[case] = qwen_vl_reference(hf, llm, messages, N)
            continue
        proc, _ = process_chat(llm, messages)
        out[case] = hf_greedy(hf, {"input_ids": torch.tensor([proc.token_ids])},
                              len(proc.token_ids), N)
    return out


@pytest.fixture(scope="module")
def refs(checkpoint, hf_models):
    name, path = checkpoint
    return references(hf_models(path), LLM(path, max_model_len=1024), name)


def record_routes(llm) -> list[torch.Tensor]:
    """Every sparse block's routed experts per call, [T, k] each."""
    seen: list[torch.Tensor] = []
    for module in llm.engine.runner.model.modules():
        if isinstance(module, SparseMoE):
            routed = module.routed

            def spy(x, weights, experts, routed=routed):
                seen.append(experts.clone())
                return routed(x, weights, experts)

            module.routed = spy
    return seen


def test_sparse_layers_as_the_config_places_them(checkpoint):
    name, path = checkpoint
    llm = LLM(path, max_model_len=1024)
    layers = llm.engine.runner.model.layers
    sparse = [isinstance(layer.mlp, SparseMoE) for layer in layers]
    if name.startswith("qwen3_5_moe"):
        assert all(sparse)
        assert all(layer.mlp.shared_expert is not None for layer in layers)
    else:
        assert sparse == [True, False, True]  # mlp_only_layers=[1]
    assert not llm.engine.runner.native_decode  # the one-call decode does not take experts


def test_each_case_matches_transformers(checkpoint, refs):
    name, path = checkpoint
    llm = LLM(path, max_model_len=1024)
    for case, messages in cases(name).items():
        assert_matches_reference(llm.chat(messages, GREEDY)[0], *refs[case], f"{name}/{case}")
    assert_released(llm)


def test_batch_routes_tokens_to_different_experts_in_chunks(checkpoint, refs):
    name, path = checkpoint
    llm = LLM(path, max_model_len=1024, max_num_batched_tokens=7, max_num_seqs=4,
              enable_prefix_caching=False)
    routes = record_routes(llm)
    chosen = cases(name)
    outs = llm.chat(list(chosen.values()), GREEDY)
    for out, case in zip(outs, chosen, strict=True):
        assert_matches_reference(out, *refs[case], f"{name}/{case}")
    # Steps of several rows whose tokens reached different experts were exercised.
    assert any(r.shape[0] > 1 and len(set(r.flatten().tolist())) > r.shape[1] for r in routes)
    assert_released(llm)


def test_prefix_hit_matches_transformers(checkpoint, refs):
    name, path = checkpoint
    llm = LLM(path, max_model_len=1024, block_size=4)
    case = "text" if name.startswith("qwen3_moe") else "one_image"
    llm.chat(CASES[case], GREEDY)
    again = llm.chat(CASES[case], GREEDY)[0]
    assert again.num_cached_tokens >= 8
    assert_matches_reference(again, *refs[case], f"{name}/{case} hit")
    assert_released(llm)


@pytest.fixture(scope="module")
def shared_expert_path(tmp_path_factory):
    return build(tmp_path_factory.mktemp("qwen3_5_moe_q"), "qwen3_5_moe")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_experts_keep_the_router_exact(mode, shared_expert_path):
    """Quantizing replaces every expert's linears (int4 where the pack takes the shape, int8
    where not) and leaves the router and the shared expert's gate in the model dtype, planned
    like any linear; int8 keeps the dense model's greedy token."""
    path = shared_expert_path
    dense = LLM(path, max_model_len=512)
    quant = LLM(path, max_model_len=512, quantization=mode, quantization_group_size=32)
    for module in quant.engine.runner.model.modules():
        if isinstance(module, SparseMoE):
            assert all(isinstance(e.gate_up_proj, QuantizedLinear)
                       and isinstance(e.down_proj, QuantizedLinear) for e in module.experts)
            assert module.gate.weight.dtype == torch.float32
            assert not isinstance(module.shared_expert_gate, QuantizedLinear)
            assert not isinstance(module.gate, QuantizedLinear) and module.gate.kernels
    params = greedy(1, logprobs=5)
    a = dense.chat(CASES["text"], params)[0].outputs[0].logprobs[0]
    b = quant.chat(CASES["text"], params)[0].outputs[0].logprobs[0]
    assert all(v == v and v > -1e9 for v in b.values())  # finite
    if mode == "int8":  # this tiny random model is too sensitive for int4's error to keep it
        assert max(a, key=a.get) == max(b, key=b.get)

