"""Qwen3.5 through the whole engine, against transformers on tiny random checkpoints: a
Qwen3_5ForConditionalGeneration (two Gated DeltaNet layers, a gated full-attention layer with
partial interleaved mRoPE, another DeltaNet layer; Qwen3-VL's tower without DeepStack) and a
text-only Qwen3_5ForCausalLM.

Greedy tokens identical and top log-probabilities within tolerance for text, one image, a video,
a batch of different lengths, chunk budgets that cut prompts at odd positions (inside the
convolution's first window, inside an image span), prefix-cache hits on a shared system prompt
and on a repeated image (the recurrent state restored from a snapshot together with the KV
blocks), and an abort mid-prefill followed by a request that reuses the state slot.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.llm_engine import LLMEngine
from models.layer_interfaces import KVCacheLayer, RecurrentStateLayer
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    assert_rope_index_positions,
    greedy,
    hf_greedy,
    qwen_vl_reference,
    random_image,
    random_video,
    user,
)

N = 6
GREEDY = greedy(N, logprobs=3)
IMAGE = random_image(120, 150, 0)
SYSTEM = {"role": "system", "content": "You are a careful assistant who answers briefly, "
          "names what is in front of it, and says so when it does not know the answer."}

CASES = {
    "text": user("Hello there, how are you today?"),
    "one_image": user(IMAGE, "Describe the image in detail."),
    "video": user(random_video(6, 64, 96, 3), "What is shown in this video?"),
    "long_text": user("Count: " + " ".join(str(i) for i in range(40))),
    "system_a": [SYSTEM, *user("What is the capital of France?")],
    "system_b": [SYSTEM, *user("Name three colours.")],
    "image_again": user(IMAGE, "What colours dominate?"),
}


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    from testing.qwen3_5 import build_qwen3_5_model

    return build_qwen3_5_model(tmp_path_factory.mktemp("qwen3_5") / "m")


@pytest.fixture(scope="module")
def text_path(tmp_path_factory):
    from testing.qwen3_5 import build_qwen3_5_text_model

    return build_qwen3_5_text_model(tmp_path_factory.mktemp("qwen3_5_text") / "m")


@pytest.fixture(scope="module")
def refs(vl_path, hf_models):
    llm = LLM(vl_path, max_model_len=2048)
    hf = hf_models(vl_path)
    return {case: qwen_vl_reference(hf, llm, msgs, N) for case, msgs in CASES.items()}


def test_positions_match_get_rope_index(vl_path, hf_models):
    llm = LLM(vl_path, max_model_len=2048)
    hf = hf_models(vl_path)
    for case in ("one_image", "video"):
        assert_rope_index_positions(llm, hf, CASES[case], case)


def test_each_case_matches_transformers(vl_path, refs):
    llm = LLM(vl_path, max_model_len=2048, enable_prefix_caching=False)
    for case, messages in CASES.items():
        assert_matches_reference(llm.chat(messages, GREEDY)[0], *refs[case], case)
    assert_released(llm)
    stats = llm.stats()
    assert stats["state_slots_used"] == 0 and stats["state_snapshots_total"] == 0


def test_a_batch_of_different_lengths(vl_path, refs):
    llm = LLM(vl_path, max_model_len=2048, max_num_seqs=8, enable_prefix_caching=False)
    cases = ["text", "one_image", "long_text", "video"]
    outs = llm.chat([CASES[c] for c in cases], GREEDY)
    for case, out in zip(cases, outs, strict=True):
        assert_matches_reference(out, *refs[case], case)
    assert_released(llm)


@pytest.mark.parametrize("budget", [2, 3, 7, 10])
def test_chunk_budgets_that_cut_anywhere(vl_path, refs, budget):
    """Budgets of 2 and 3 end chunks inside the convolution's first window (width 4); 7 and 10
    end them inside the image's span, and at different offsets into every block."""
    llm = LLM(vl_path, max_model_len=2048, max_num_batched_tokens=budget, max_num_seqs=4,
              enable_prefix_caching=False)
    cases = ["text", "one_image"]
    outs = llm.chat([CASES[c] for c in cases], GREEDY)
    for case, out in zip(cases, outs, strict=True):
        assert_matches_reference(out, *refs[case], f"{case} @ {budget}")
    assert any(p.length > budget for o in outs for p in o.multi_modal_placeholders)
    assert_released(llm)


def test_prefix_hits_restore_the_state(vl_path, refs):
    llm = LLM(vl_path, max_model_len=2048, block_size=4)
    for first, second in (("system_a", "system_b"), ("one_image", "image_again")):
        hits = llm.stats()["state_snapshot_hits"]
        assert_matches_reference(llm.chat(CASES[first], GREEDY)[0], *refs[first], first)
        out = llm.chat(CASES[second], GREEDY)[0]
        assert_matches_reference(out, *refs[second], second)
        assert out.num_cached_tokens > 0, second
        assert llm.stats()["state_snapshot_hits"] == hits + 1
    # The image's request skipped past the image: its encoder did not run again either.
    assert out.num_cached_tokens >= out.multi_modal_placeholders[0].offset
    assert_released(llm)
    assert llm.stats()["state_slots_used"] == 0
    # The engine panel shows the state cache beside the KV cache.
    from ui import panels

    html = panels.engine_html(llm.stats())
    assert "State slots</b>: 0 / " in html and "2 hits restored" in html


def test_a_hit_without_its_state_would_be_wrong(vl_path, refs, monkeypatch):
    """With the snapshot's restore skipped (the KV blocks alone, the slot keeping whatever it
    held), the hit's output moves: the parity above exercises the restored state."""
    from models.layers.gated_deltanet import GatedDeltaNet

    start_slots = GatedDeltaNet._start_slots

    def without_restores(self, meta):
        meta.restores = []
        start_slots(self, meta)

    llm = LLM(vl_path, max_model_len=2048, block_size=4)
    llm.chat(CASES["system_a"], GREEDY)
    monkeypatch.setattr(GatedDeltaNet, "_start_slots", without_restores)
    out = llm.chat(CASES["system_b"], GREEDY)[0]
    assert out.num_cached_tokens > 0
    tokens, logprobs = refs["system_b"]
    first = out.outputs[0].logprobs[0]
    moved = max(abs(v - logprobs[0, t].item()) for t, v in first.items())
    assert out.outputs[0].token_ids != tokens or moved > 0.01


def test_text_model_matches_transformers_whole_and_in_chunks(text_path, hf_models):
    hf = hf_models(text_path)
    llm = LLM(text_path, max_model_len=512)
    # its layers are what the engine binds (models/layer_interfaces.py)
    states = llm.engine.runner.state_layers()
    assert states and all(isinstance(layer, RecurrentStateLayer) for layer in states)
    assert all(isinstance(a, KVCacheLayer) for a in llm.engine.runner.attention_layers())
    prompt = llm.engine.tokenizer.encode("Once upon a time, in a land far away, there lived")
    ids = torch.tensor([prompt])
    want = hf_greedy(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     len(prompt), N)
    assert_matches_reference(llm.generate([prompt], GREEDY)[0], *want, "whole")
    chunked = LLM(text_path, max_model_len=512, max_num_batched_tokens=5)
    assert_matches_reference(chunked.generate([prompt], GREEDY)[0], *want, "chunked")
    again = chunked.generate([prompt], GREEDY)[0]  # the whole prompt's last block: a hit
    assert again.num_cached_tokens > 0
    assert_matches_reference(again, *want, "prefix hit")


def test_an_abort_mid_prefill_frees_the_slot_for_the_next_request(text_path, hf_models):
    hf = hf_models(text_path)
    engine = LLMEngine(text_path, max_model_len=512, max_num_batched_tokens=4, max_num_seqs=1,
                       enable_prefix_caching=False)
    tok = engine.tokenizer
    long = tok.encode("A long prompt that takes several steps to prefill, and is aborted.")
    engine.add_request(engine.make_request(_processed(long), GREEDY, "long"))
    engine.step()
    engine.step()
    assert engine.stats()["state_slots_used"] == 1
    engine.abort_request("long")
    assert engine.stats()["state_slots_used"] == 0
    short = tok.encode("Then a short one.")
    engine.add_request(engine.make_request(_processed(short), GREEDY, "short"))
    out = None
    while engine.has_unfinished():
        for o in engine.step():
            out = o
    ids = torch.tensor([short])
    want = hf_greedy(hf, {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
                     len(short), N)
    assert_matches_reference(out, *want, "after abort")
    engine.check_integrity()


def _processed(ids: list[int]):
    from models.interfaces import ProcessedPrompt

    return ProcessedPrompt(None, list(ids))


def test_soak_with_aborts_and_failures_leaves_no_state_held(vl_path, monkeypatch):
    """Random traffic on the real engine: prompts sharing prefixes (hits), images, chunked
    prefills, aborts mid-prefill and mid-decode, a failed encoder item and a failed decoder
    step; after every step the bookkeeping is consistent, and at the end nothing is held."""
    import random

    rng = random.Random(0)
    engine = LLMEngine(vl_path, max_model_len=2048, block_size=4, max_num_batched_tokens=24,
                       max_num_seqs=3, state_snapshot_bytes=1 << 20)
    processor, tower = engine.processor, engine.runner.model.visual
    images = [random_image(64, 64, s) for s in range(6)]
    failures = {"encoder": 0, "decoder": 0}
    forward, tower_forward = engine.runner.model.forward, tower.forward

    def flaky_forward(*args, **kwargs):
        if rng.random() < 0.03:
            failures["decoder"] += 1
            raise RuntimeError("decoder broke")
        return forward(*args, **kwargs)

    def flaky_tower(*args, **kwargs):
        if rng.random() < 0.25:
            failures["encoder"] += 1
            raise RuntimeError("tower broke")
        return tower_forward(*args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", flaky_forward)
    monkeypatch.setattr(tower, "forward", flaky_tower)
    params = greedy(4)
    for i in range(60):
        if rng.random() < 0.5:
            content = [{"type": "text", "text": rng.choice(["Hi.", "Describe it.", "Why?"])}]
            if rng.random() < 0.4:
                content.insert(0, {"type": "image", "image": rng.choice(images)})
            parsed = processor.render_chat([SYSTEM, {"role": "user", "content": content}])
            processed = processor.process(parsed, processor.load_media_sync(parsed))
            engine.add_request(engine.make_request(processed, params, f"r{i}"))
        live = engine.scheduler.running + list(engine.scheduler.waiting)
        if live and rng.random() < 0.15:
            engine.abort_request(rng.choice(live).request_id)
        engine.step()
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    stats = engine.stats()
    assert stats["state_slots_used"] == 0 and stats["kv_blocks_used"] == 0
    assert stats["encoder_cache_referenced"] == 0
    assert stats["state_snapshot_hits"] > 0 and all(failures.values()), (stats, failures)
