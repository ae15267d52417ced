"""Speculative decoding on every kind of decoder the engine serves: output identical to plain
decoding, and every logits row both runs sample after the same tokens identical to the bit
(testing/speculative.py's scripted drafter: drafts right most of the time, wrong every fourth
token), in batches where one request does not speculate.

A hybrid model (Qwen3.5: Gated DeltaNet layers, whose recurrent state a verification steps
token by token and rolls back to its last accepted token) with an image; Qwen3.5's mixture of
experts; Qwen3's mixture of experts; a cross-attention model (Llama 3.2 Vision: verified rows
attend to the image's keys and values as decodes do); a media prompt (Qwen2-VL, an image);
Gemma 4 (per-layer inputs, shared KV, sliding windows) with an image; LoRA adapters chosen per
request. Qwen3.5's MTP layer (random `mtp.*` weights) drafts as its definition says (checked
against the layer assembled from transformers' Qwen3.5 modules) and changes nothing of the
greedy output, on a dense and a mixture-of-experts checkpoint.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from models.kernels import native
from testing.speculative import run_parity
from tests.helpers import greedy, random_image, user

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")

IMAGE = random_image(120, 150, 0)
TEXT = user("Hello there, how are you today?")
COUNT = user("Count: " + " ".join(str(i) for i in range(30)))
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


def _chat(llm, conversations, n: int = 12):
    """A `generate(overrides)` for run_parity; the second conversation never speculates."""
    def run(overrides):
        params = [SamplingParams(**{"max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                                    "logprobs": 2, **overrides,
                                    **({"num_speculative_tokens": 0} if i == 1 else {})})
                  for i in range(len(conversations))]
        return llm.chat(conversations, params)
    return run


def _engine(path, **options) -> LLM:
    return LLM(path, max_model_len=1024, block_size=4, enable_prefix_caching=False,
               **{"speculative": "ngram", **options})


def _assert_parity(llm, conversations):
    parity = run_parity(llm, _chat(llm, conversations))
    parity.assert_identical()
    assert parity.speculative[1].metrics.draft_tokens == 0
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0
    return parity


def _assert_mtp_lossless(llm, conversations, parity) -> None:
    """The engine's own MTP drafter (random weights: poor drafts, asked for at every step, its
    costs held low) leaves the greedy output plain decoding's."""
    llm.engine.speculator.costs.hold(0.08)
    outs = llm.chat(conversations, greedy(12, logprobs=2))
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in parity.plain]
    assert sum(o.metrics.draft_tokens for o in outs) > 0
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def qwen3_5_mtp(tmp_path_factory):
    """A Qwen3.5 (image + text) checkpoint carrying an MTP layer."""
    from testing.qwen3_5 import add_mtp_weights, build_qwen3_5_model

    return add_mtp_weights(build_qwen3_5_model(tmp_path_factory.mktemp("qwen3_5") / "m"))


@pytest.fixture(scope="module")
def qwen3_5_moe_mtp(tmp_path_factory):
    from testing.qwen3_5 import add_mtp_weights, build_qwen3_5_model

    path = build_qwen3_5_model(tmp_path_factory.mktemp("qwen3_5_moe") / "m", experts=MOE)
    return add_mtp_weights(path)


def test_hybrid_with_an_image(qwen3_5_mtp):
    conversations = [user(IMAGE, "Describe the image in detail."), TEXT, COUNT]
    llm = _engine(qwen3_5_mtp, dtype="bfloat16", speculative="mtp")
    _assert_mtp_lossless(llm, conversations, _assert_parity(llm, conversations))


def test_hybrid_mixture_of_experts(qwen3_5_moe_mtp):
    """Qwen3.5-MoE: its MTP layer has experts too."""
    conversations = [COUNT, TEXT, user(IMAGE, "What is this?")]
    llm = _engine(qwen3_5_moe_mtp, speculative="mtp")
    _assert_mtp_lossless(llm, conversations, _assert_parity(llm, conversations))


def test_mixture_of_experts(tmp_path_factory):
    from testing.tiny import build_text_model

    experts = {k: v for k, v in MOE.items() if k != "shared_expert_intermediate_size"}
    path = build_text_model(tmp_path_factory.mktemp("qwen3_moe") / "m", "qwen3_moe",
                            config_overrides={**experts, "head_dim": 16})
    llm = LLM(path, max_model_len=512, block_size=4, enable_prefix_caching=False,
              speculative="ngram")
    _assert_parity(llm, [COUNT, TEXT])


def test_cross_attention(tmp_path_factory):
    from testing.mllama import build_mllama_model

    llm = _engine(build_mllama_model(tmp_path_factory.mktemp("mllama") / "m"))
    _assert_parity(llm, [user("Look at this:", random_image(50, 90, 1), "Describe it."), TEXT,
                         user(random_image(60, 60, 5), "What differs?")])


def test_a_media_prompt(qwen2_vl_path):
    llm = _engine(qwen2_vl_path)
    _assert_parity(llm, [user(IMAGE, "Describe the image in detail."), TEXT])


def test_gemma4(tmp_path_factory):
    from testing.gemma4 import build_gemma4_model

    llm = _engine(build_gemma4_model(tmp_path_factory.mktemp("gemma4") / "m"))
    _assert_parity(llm, [user(IMAGE, "Describe the image in detail."), TEXT])


def test_lora_adapters_per_request(tmp_path_factory):
    """Requests with an adapter and without share the verify steps (the adapters' products
    through our row kernel at a decode's rows)."""
    from testing.lora import llama_with_attention_adapter

    path, folder = llama_with_attention_adapter(tmp_path_factory.mktemp("lora"))
    llm = LLM(path, max_model_len=256, block_size=4, enable_prefix_caching=False,
              speculative="ngram", lora_adapters={"attn": str(folder)})
    prompts = ["The quick brown fox jumps over the lazy dog.", "Describe the image.",
               "Numbers: 0 1 2 3 4 5"]

    def run(overrides):
        return llm.generate(prompts, [
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, lora=lora,
                           **{**overrides, **({"num_speculative_tokens": 0} if i == 1 else {})})
            for i, lora in enumerate(("attn", None, "attn"))])

    parity = run_parity(llm, run)
    parity.assert_identical()


# ---- Qwen3.5's MTP layer ---------------------------------------------------------------------


def test_mtp_drafts_as_defined(tmp_path_factory):
    """After a prompt, the MTP layer's first draft logits and its greedy drafts are those of
    the layer assembled from transformers' Qwen3.5 modules (vLLM's definition: the next
    token's embedding and the target's final hidden state, normed, concatenated, projected,
    one full-attention layer over the positions so far, normed, the target's LM head)."""
    from testing.qwen3_5 import add_mtp_weights, build_qwen3_5_text_model, mtp_reference

    path = add_mtp_weights(build_qwen3_5_text_model(tmp_path_factory.mktemp("q35") / "m"))
    llm = LLM(path, max_model_len=512, block_size=4, speculative="mtp")
    drafter = llm.engine.speculator.drafters["mtp"]
    llm.engine.speculator.costs.hold(0.0)  # as many drafts as allowed
    engine = llm.engine
    prompt = list(range(30, 60))
    req = engine.make_request(engine.processor.process(engine.processor.parse(prompt), {}),
                              greedy(8))
    engine.add_request(req)
    engine.step()  # the prompt, its first token; the MTP layer catches up and drafts
    ours = engine.runner.model.compute_logits(drafter.seqs[req.request_id].hidden[None])[0]
    want, drafts = mtp_reference(path, prompt + req.output_token_ids, drafts=3)
    torch.testing.assert_close(ours, want, atol=2e-4, rtol=1e-4)
    assert list(req.draft_token_ids[:3]) == drafts
