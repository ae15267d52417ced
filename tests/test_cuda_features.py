"""Speculative decoding and GGUF files on CUDA: the same code as on the CPU.

Speculation: greedy output identical to plain decoding with n-gram lookup, a draft model and
Qwen3.5's MTP layer (a hybrid), and every logits row both runs sample after the same tokens
compared to the bit (the linears whose rows the library sums by the row count run few rows
padded to one shape: models/kernels/row_invariance.py), also at a real model's widths, with
LoRA adapters (their products padded alike), a mixture of experts and a media prompt. A
GGUF file (its blocks dequantized on CUDA, and said so): the tokens of the CPU engine
reading the same file dequantized. Skipped without a GPU. (The int8 KV cache on CUDA:
tests/test_kv_quant.py's engine test, its "cuda" case.)
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from testing.speculative import run_parity
from tests.helpers import greedy, random_image, user

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
PROMPTS = [[5, 9, 200, 17, 3, 5, 9, 200, 17], list(range(40, 61)) * 2, [7, 7, 7]]


def _tokens(outputs) -> list[list[int]]:
    return [c.token_ids for o in outputs for c in o.outputs]


@pytest.fixture(scope="module")
def wide_qwen2(tmp_path_factory):
    """Two layers at Qwen2.5-1.5B's widths: the GEMMs a real model's decode runs."""
    from testing.tiny import build_text_model

    return build_text_model(tmp_path_factory.mktemp("wide") / "qwen2", "qwen2",
                            hidden_size=1536, num_heads=12, num_kv_heads=2,
                            intermediate_size=8960, std=0.02)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("checkpoint", ["qwen2_path", "wide_qwen2"])
def test_verified_rows_equal_plain_decoding(request, checkpoint, dtype):
    """A batch in which two requests speculate (scripted drafts, some wrong) and one does not."""
    llm = LLM(request.getfixturevalue(checkpoint), device=DEVICE, dtype=dtype,
              speculative="ngram", max_model_len=256, block_size=4, enable_prefix_caching=False)

    def run(overrides):
        return llm.generate(PROMPTS, [
            greedy(24, logprobs=2, **{**overrides, **({"num_speculative_tokens": 0} if i == 1
                                                      else {})})
            for i in range(len(PROMPTS))])

    parity = run_parity(llm, run)
    parity.assert_identical()
    assert parity.speculative[1].metrics.draft_tokens == 0
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_ngram_and_draft_models_are_lossless(qwen2_path, tmp_path_factory):
    """n-gram lookup, a small draft model and the target as its own draft (every draft
    accepted): the tokens of plain decoding on the same device."""
    from testing.tiny import build_text_model

    small = build_text_model(tmp_path_factory.mktemp("draft") / "qwen2", "qwen2",
                             hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, seed=5)
    options = dict(device=DEVICE, dtype="float32", max_model_len=256, block_size=4)
    want = _tokens(LLM(qwen2_path, **options).generate(PROMPTS, greedy(24)))
    for method in ("ngram", f"draft:{small}", f"draft:{qwen2_path}"):
        llm = LLM(qwen2_path, speculative=method, **options)
        llm.engine.speculator.costs.hold(0.08)  # drafts by acceptance, not this GPU's timing
        outs = llm.generate(PROMPTS, greedy(24))
        assert _tokens(outs) == want, method
        assert sum(o.metrics.draft_tokens for o in outs) > 0, method
        if method == f"draft:{qwen2_path}":
            for o in outs:
                assert o.metrics.draft_tokens == o.metrics.accepted_tokens > 15
        llm.engine.check_integrity()
        assert llm.engine.block_manager.num_used_blocks == 0


def test_hybrid_with_its_mtp_layer(tmp_path_factory):
    """Qwen3.5 (Gated DeltaNet state rolled back to the last accepted token): scripted drafts
    to the bit, then its own MTP layer's drafts (with an image on the CPU:
    tests/test_speculative_families.py)."""
    from testing.qwen3_5 import add_mtp_weights, build_qwen3_5_model

    path = add_mtp_weights(build_qwen3_5_model(tmp_path_factory.mktemp("qwen3_5") / "m"))
    llm = LLM(path, device=DEVICE, dtype="float32", max_model_len=1024, block_size=4,
              enable_prefix_caching=False, speculative="mtp")
    chats = [user("Describe a tree in detail, then a house."),
             user("Hello there, how are you today?"),
             user("Count: " + " ".join(str(i) for i in range(30)))]

    def run(overrides):
        return llm.chat(chats, [greedy(12, logprobs=2, **{
            **overrides, **({"num_speculative_tokens": 0} if i == 1 else {})})
            for i in range(len(chats))])

    parity = run_parity(llm, run)
    parity.assert_identical()
    llm.engine.speculator.costs.hold(0.08)
    outs = llm.chat(chats, greedy(12, logprobs=2))
    assert _tokens(outs) == _tokens(parity.plain)
    assert sum(o.metrics.draft_tokens for o in outs) > 0
    llm.engine.check_integrity()


def _lora_engine(root, dtype: str):
    """A Llama with an attention adapter: requests with and without it share the steps."""
    from testing.lora import llama_with_attention_adapter

    path, folder = llama_with_attention_adapter(root)
    return LLM(path, device=DEVICE, dtype=dtype, max_model_len=256, block_size=4,
               enable_prefix_caching=False, speculative="ngram",
               lora_adapters={"attn": str(folder)})


def _moe_engine(root, dtype: str):
    """Qwen3-MoE: every expert runs on every token off the CPU (models/layers/moe.py)."""
    from testing.tiny import build_text_model

    path = build_text_model(root / "qwen3_moe", "qwen3_moe", config_overrides={
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "head_dim": 16})
    return LLM(path, device=DEVICE, dtype=dtype, max_model_len=512, block_size=4,
               enable_prefix_caching=False, speculative="ngram")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_and_experts_rows_equal_plain_decoding(tmp_path_factory, dtype):
    """LoRA products (padded off the CPU: models/layers/lora.py) and a mixture's experts:
    every logits row both runs sample after the same tokens, to the bit."""
    root = tmp_path_factory.mktemp("lora_moe")
    prompts = ["The quick brown fox jumps over the lazy dog.", "Describe the image.",
               "Numbers: 0 1 2 3 4 5"]
    for llm, adapters in ((_lora_engine(root, dtype), ("attn", None, "attn")),
                          (_moe_engine(root, dtype), (None, None, None))):
        def run(overrides, llm=llm, adapters=adapters):
            return llm.generate(prompts, [
                greedy(16, logprobs=2, lora=lora, **{
                    **overrides, **({"num_speculative_tokens": 0} if i == 1 else {})})
                for i, lora in enumerate(adapters)])

        parity = run_parity(llm, run)
        parity.assert_identical()
        llm.engine.check_integrity()
        assert llm.engine.block_manager.num_used_blocks == 0


def test_a_media_prompt_rows_equal_plain_decoding(qwen2_vl_path):
    """Qwen2-VL with an image (mRoPE positions, the encoder's rows spliced in) beside a text
    request that does not speculate."""
    llm = LLM(qwen2_vl_path, device=DEVICE, dtype="float32", max_model_len=1024, block_size=4,
              enable_prefix_caching=False, speculative="ngram")
    chats = [user(random_image(120, 150, 0), "Describe the image in detail."),
             user("Hello there, how are you today?")]

    def run(overrides):
        return llm.chat(chats, [greedy(12, logprobs=2, **{
            **overrides, **({"num_speculative_tokens": 0} if i == 1 else {})})
            for i in range(len(chats))])

    parity = run_parity(llm, run)
    parity.assert_identical()
    llm.engine.check_integrity()


def test_gguf_file_dequantized_on_cuda(qwen2_path, tmp_path):
    """Its blocks run as stored only by our CPU kernels: on CUDA they are dequantized, and the
    start-up line says why; the tokens are the CPU engine's on the file dequantized."""
    from testing.gguf import write_gguf

    path = write_gguf(qwen2_path, tmp_path / "qwen2.gguf")
    prompts = [[5, 17, 99, 3] * k for k in (1, 5, 11)]
    cpu = LLM(path, device="cpu", dtype="float32", dequantize_gguf=True, max_model_len=256)
    gpu = LLM(path, device=DEVICE, dtype="float32", max_model_len=256,
              max_num_batched_tokens=16)
    assert _tokens(gpu.generate(prompts, greedy(16))) == _tokens(cpu.generate(prompts,
                                                                               greedy(16)))
    assert "the model runs on cuda" in gpu.engine.runner.gguf_summary
