"""The mixture-of-experts block (models/layers/moe.py) against transformers' own blocks, and the
bookkeeping around it: which layers are sparse, the shape's validation, fused experts tensors
split per expert in both orientations."""

from __future__ import annotations

import pytest
import torch

from models.layers.moe import (
    MoEShape,
    SparseMoE,
    sparse_layers,
    split_fused_experts,
    unfuse_experts,
)


def _reference_block(shared: bool, normalize: bool, dtype: torch.dtype):
    import transformers
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35
    from transformers.models.qwen3_moe import modeling_qwen3_moe as q3

    common = dict(hidden_size=64, num_experts=8, num_experts_per_tok=3,
                  moe_intermediate_size=32, hidden_act="silu")
    if shared:
        cfg = transformers.Qwen3_5MoeTextConfig(**common, shared_expert_intermediate_size=48)
        block = q35.Qwen3_5MoeSparseMoeBlock(cfg)
    else:
        cfg = transformers.Qwen3MoeConfig(**common, norm_topk_prob=normalize)
        block = q3.Qwen3MoeSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return cfg, block.to(dtype).eval()


def _ours(cfg, block, shared: bool, normalize: bool, dtype: torch.dtype) -> SparseMoE:
    shape = MoEShape.from_hf(cfg, normalize)
    ours = SparseMoE(64, shape, "silu").to(dtype).eval()
    tensors = unfuse_experts(iter(block.state_dict().items()), shape, 64)
    params = dict(ours.named_parameters())
    inter = {"experts": 32, "shared_expert": 48}
    with torch.no_grad():
        for name, tensor in tensors:
            parts = name.split(".")
            if parts[-2] in ("gate_proj", "up_proj"):
                rows = inter[parts[0]]
                target = ".".join(parts[:-2] + ["gate_up_proj", "weight"])
                first = 0 if parts[-2] == "gate_proj" else rows
                params[target][first:first + rows].copy_(tensor)
            else:
                params[name].copy_(tensor)
    return ours


@pytest.mark.parametrize(("shared", "normalize"), [(False, False), (False, True), (True, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_matches_transformers(shared, normalize, dtype):
    cfg, block = _reference_block(shared, normalize, dtype)
    ours = _ours(cfg, block, shared, normalize, dtype)
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        ref = block(x)[0]
        got = ours(x[0])
        one = torch.cat([ours(x[0, i:i + 1]) for i in range(5)])  # decode rows one by one
    tol = 3e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    torch.testing.assert_close(one, ref[:5], atol=tol, rtol=tol)


def test_sparse_layers_follow_step_and_dense_layers():
    cfg = type("C", (), {"num_experts": 4, "num_hidden_layers": 6, "decoder_sparse_step": 2,
                         "mlp_only_layers": [3]})()
    assert sparse_layers(cfg) == (1, 5)
    every = type("C", (), {"num_experts": 4, "num_hidden_layers": 3})()
    assert sparse_layers(every) == (0, 1, 2)
    none = type("C", (), {"num_experts": 0, "num_hidden_layers": 3})()
    assert sparse_layers(none) == ()


def test_shape_is_validated():
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        MoEShape(4, 5, 32, True)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        MoEShape(4, 2, 0, True)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        MoEShape(4, 2, 32, True, shared_expert_size=0)


def test_fused_experts_split_in_either_orientation():
    shape = MoEShape(num_experts=3, top_k=2, intermediate_size=5, normalize_top_k=True)
    gate_up = torch.randn(3, 10, 7)
    down = torch.randn(3, 7, 5)
    for g, d in ((gate_up, down), (gate_up.transpose(1, 2), down.transpose(1, 2))):
        split = dict(split_fused_experts("m.layers.0.mlp.experts.gate_up_proj", g, shape, 7))
        split |= dict(split_fused_experts("m.layers.0.mlp.experts.down_proj", d, shape, 7))
        assert sorted(split) == sorted(
            [f"m.layers.0.mlp.experts.{e}.gate_up_proj.weight" for e in range(3)]
            + [f"m.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(3)])
        for e in range(3):
            assert torch.equal(split[f"m.layers.0.mlp.experts.{e}.gate_up_proj.weight"],
                               gate_up[e])
            assert torch.equal(split[f"m.layers.0.mlp.experts.{e}.down_proj.weight"], down[e])
    assert split_fused_experts("m.layers.0.mlp.gate.weight", down, shape, 7) is None
    with pytest.raises(ValueError, match=r"expected \(3, 10, 7\)"):
        split_fused_experts("m.layers.0.mlp.experts.gate_up_proj", torch.randn(3, 9, 7),
                            shape, 7)
