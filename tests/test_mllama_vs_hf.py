"""Llama 3.2 Vision (Mllama) through the whole engine, against transformers on a tiny random
MllamaForConditionalGeneration (5 decoder layers, 2 of them cross-attention; 28-pixel tiles of
17 positions, up to 4 per image; the image token past the LM head's vocabulary, as Meta's).

The reference's inputs come from transformers' own MllamaProcessor (token ids, tiles, aspect
ratio ids and mask, the cross-attention mask). Rows that attend to no image (the text before the
first one) follow Meta's model, as the engine does: transformers 5.24 lets their attention
spread over every tile and zeroes only their MLP, so the reference runs with
testing.mllama.zero_text_rows, which multiplies its cross-attention outputs by the row mask
transformers already computes (a test below shows the difference matters). Greedy tokens
identical and top-3 log-probabilities within 1e-3 for one image after text, two images apart,
two images together, text only, a second question about an image and a different image after
the same text; then batches mixing them under budgets that cut anywhere, preemption and resume
in a small KV pool, a cross-attention state pool smaller than the traffic, state-cache and
prefix-cache hits, and a soak of aborts and failures that must leave nothing held.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM
from engine.llm_engine import LLMEngine
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
LOGPROBS = greedy(N, logprobs=3)
PICTURE, OTHER = random_image(50, 90, 1), random_image(70, 40, 4)
CASES = {
    "one_image": user("Look at this:", PICTURE, "Describe it."),
    "two_images": user("Compare", random_image(30, 30, 2), "with", random_image(40, 120, 3),
                       "please."),
    "together": user(random_image(60, 60, 5), OTHER, "What differs?"),
    "text_only": user("Hello there, how are you today?"),
    "same_image": user("Look at this:", PICTURE, "What colour is it?"),
    "other_image": user("Look at this:", OTHER, "Describe it."),
}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    from testing.mllama import build_mllama_model

    return build_mllama_model(tmp_path_factory.mktemp("mllama") / "m")


@pytest.fixture(scope="module")
def hf(path, hf_models):
    from testing.mllama import zero_text_rows

    model = hf_models(path)
    zero_text_rows(model)
    return model


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, max_model_len=256)


def hf_inputs(path, llm, messages) -> tuple[dict, list[int]]:
    """transformers' processor inputs for the engine's rendered prompt, and our prompt ids."""
    import transformers

    proc, media = process_chat(llm, messages)
    text = llm.engine.processor.render_chat(messages).text
    processor = transformers.AutoProcessor.from_pretrained(path)
    images = [media["image"]] if media.get("image") else None
    inputs = dict(processor(text=[text], images=images, return_tensors="pt",
                            add_special_tokens=False))
    return inputs, proc.token_ids


@pytest.fixture(scope="module")
def refs(path, llm, hf):
    out = {}
    for case, messages in CASES.items():
        inputs, ids = hf_inputs(path, llm, messages)
        assert inputs["input_ids"][0].tolist() == ids, case
        out[case] = hf_greedy(hf, inputs, len(ids), N)
    return out


def test_prompt_tiles_and_cross_rows_equal_transformers_processor(path, llm):
    """Ids, every tile's pixels (padding tiles included), aspect ratio ids, and which rows see
    which image (transformers' cross_attention_mask), for tilings of 1 to 4 tiles and images
    apart and together; a text prompt gets transformers' BOS handling."""
    import transformers

    for case in ("one_image", "two_images", "together"):
        inputs, _ = hf_inputs(path, llm, CASES[case])
        proc, _ = process_chat(llm, CASES[case])
        pixels = torch.stack([f.data["pixel_values"] for f in proc.mm_features])
        torch.testing.assert_close(pixels, inputs["pixel_values"][0], atol=1e-6, rtol=0)
        assert [f.data["aspect_ratio_id"] for f in proc.mm_features] == \
            inputs["aspect_ratio_ids"][0].tolist()
        mask = inputs["cross_attention_mask"][0]  # [S, images, tiles]
        for i, f in enumerate(proc.mm_features):
            rows = mask[:, i, 0].nonzero().flatten().tolist()
            end = len(proc.token_ids) if f.cross.end is None else f.cross.end
            assert rows == list(range(f.cross.start, end)), (case, i)
            assert mask[f.cross.start, i].sum() == f.data["num_tiles"]
            assert f.cross.num_keys == f.data["num_tiles"] * 17
        if case == "together":  # the first image's rows reach to the end with the second's
            assert [f.cross.end for f in proc.mm_features] == [None, None]
    processor = transformers.AutoProcessor.from_pretrained(path)
    tokenizer = llm.engine.tokenizer
    prompt = "<|image|>Describe it."
    want = processor(text=[prompt], images=[[PICTURE]], return_tensors="pt")["input_ids"][0]
    parsed = llm.engine.processor.parse({"prompt": prompt, "multi_modal_data": {
        "image": [PICTURE]}})
    got = llm.engine.processor.process(parsed, {"image": [PICTURE]}).token_ids
    assert got == want.tolist() and got.count(tokenizer.bos_token_id) == 2


def test_rows_before_the_first_image_follow_meta_not_transformers_as_is(path, hf, llm):
    """With the hooks removed, transformers' rows before the image attend to its tiles: other
    logits. The engine matches the hooked reference (next test), so the difference is real."""
    from testing.mllama import zero_text_rows

    inputs, _ = hf_inputs(path, llm, CASES["one_image"])
    with torch.no_grad():
        meta = hf(**inputs).logits
    fresh = type(hf).from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        as_is = fresh(**inputs).logits
        handles = zero_text_rows(fresh)
        assert torch.equal(fresh(**inputs).logits, meta)
    for h in handles:
        h.remove()
    assert (meta[0, -1] - as_is[0, -1]).abs().max() > 1e-2


def test_each_case_matches_transformers(llm, refs):
    layers = [layer.cross_attn.q_proj for layer in llm.engine.runner.model.cross_attention_layers()]
    calls = count_calls(layers[0])
    for case, messages in CASES.items():
        before = calls[0]
        out = llm.chat(messages, LOGPROBS)[0]
        assert_matches_reference(out, *refs[case], case)
        if case == "text_only":  # the cross-attention layers are skipped, as in transformers
            assert calls[0] == before
    assert_released(llm)


def test_a_mixed_batch_under_a_budget_that_cuts_anywhere(path, refs):
    """Every case at once: chunks start and end inside images' attending rows, on image tokens,
    and decodes of some requests share steps with others' prefill chunks."""
    llm = LLM(path, max_model_len=256, max_num_batched_tokens=5, max_num_seqs=8)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert_released(llm)


def test_preemption_and_a_small_state_pool(path, refs):
    """A KV pool of 18 4-token blocks for six requests of ~30 tokens: running requests are
    preempted (their cross-attention states released) and resume (looked up again, encoded
    again where evicted); a state pool of two 4-tile images makes requests wait for room."""
    llm = LLM(path, max_model_len=64, block_size=4, kv_cache_bytes=18 * 3072,
              cross_attention_cache_bytes=2 * 68 * 512, max_num_batched_tokens=32,
              max_num_seqs=6)
    tower = count_calls(llm.engine.runner.model.vision_model)
    outs = llm.chat(list(CASES.values()), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [refs[c][0] for c in CASES]
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert tower[0] > 1
    assert_released(llm)


def test_state_cache_and_prefix_cache_hits(path, refs):
    llm = LLM(path, max_model_len=256, enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.vision_model)
    llm.chat(CASES["one_image"], GREEDY)
    again = llm.chat(CASES["same_image"], GREEDY)[0]  # another question: the states are cached
    assert again.outputs[0].token_ids == refs["same_image"][0]
    assert tower[0] == 1 and again.multi_modal_placeholders[0].cache_hit
    both = llm.chat([CASES["one_image"], CASES["same_image"]], GREEDY)  # one entry for both
    assert [o.outputs[0].token_ids for o in both] == [refs["one_image"][0],
                                                      refs["same_image"][0]]
    assert tower[0] == 1 and llm.stats()["encoder_cache_entries"] == 1
    assert_released(llm)

    llm = LLM(path, max_model_len=256, block_size=4)
    first = llm.chat(CASES["one_image"], GREEDY)[0]
    image_at = first.multi_modal_placeholders[0].offset
    again = llm.chat(CASES["one_image"], GREEDY)[0]  # blocks after the image reused
    assert again.num_cached_tokens > image_at + 4
    assert again.outputs[0].token_ids == refs["one_image"][0]
    # Same text, another image: nothing from the image on is reused (the text before it is, up
    # to its last token: a tail copied out of the image's block).
    other = llm.chat(CASES["other_image"], GREEDY)[0]
    assert other.num_cached_tokens == image_at
    assert other.outputs[0].token_ids == refs["other_image"][0]
    assert_released(llm)


def test_startup_refuses_a_state_pool_below_the_largest_image(path):
    with pytest.raises(ValueError, match="68 key positions.*cross_attention_cache_bytes.*34816"):
        LLM(path, max_model_len=256, cross_attention_cache_bytes=67 * 512)


def test_soak_with_aborts_failures_and_preemption_leaves_nothing_held(path, monkeypatch):
    """Random traffic (a few images, repeated), aborts mid-prefill and mid-decode, a failing
    tower, a KV pool that preempts and a state pool that evicts: after every step the
    bookkeeping is consistent, and at the end no KV block or cross-attention state is held."""
    rng, flaky = random.Random(0), random.Random(1)
    engine = LLMEngine(path, max_model_len=64, block_size=4, kv_cache_bytes=16 * 3072,
                       cross_attention_cache_bytes=3 * 68 * 512, max_num_batched_tokens=24,
                       max_num_seqs=4)
    processor, tower = engine.processor, engine.runner.model.vision_model
    images = [random_image(30 + 20 * s, 60, s) for s in range(4)]
    failures = {"encoder": 0, "abort": 0}
    tower_forward = tower.forward

    def flaky_tower(*args, **kwargs):
        if flaky.random() < 0.2:
            failures["encoder"] += 1
            raise RuntimeError("tower broke")
        return tower_forward(*args, **kwargs)

    monkeypatch.setattr(tower, "forward", flaky_tower)
    params = greedy(8)
    made = []
    for i in range(40):
        if rng.random() < 0.8:
            parts = [rng.choice(["Hi.", "Describe it.", "Why?"])]
            for _ in range(rng.choice([0, 1, 1, 2])):
                parts.insert(rng.randrange(len(parts) + 1), rng.choice(images))
            parsed = processor.render_chat(user(*parts))
            processed = processor.process(parsed, processor.load_media_sync(parsed))
            made.append(engine.make_request(processed, params, f"r{i}"))
            engine.add_request(made[-1])
        live = engine.scheduler.running + list(engine.scheduler.waiting)
        if live and rng.random() < 0.15:
            failures["abort"] += 1
            engine.abort_request(rng.choice(live).request_id)
        engine.step()
        engine.check_integrity()
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    stats = engine.stats()
    assert stats["kv_blocks_used"] == 0 and stats["encoder_cache_referenced"] == 0
    preempted = sum(r.metrics.num_preemptions for r in made)
    assert all(failures.values()) and preempted, (failures, preempted)


def test_tower_states_and_cross_layers_have_no_host_sync(llm):
    from engine.cross_states import cross_items
    from engine.scheduler import ScheduledChunk
    from models.layers.attention_metadata import build_metadata
    from models.layers.cross_metadata import build_cross_metadata
    from tests.model_fixtures import SyncRecorder

    runner = llm.engine.runner
    proc, _ = process_chat(llm, CASES["two_images"])
    with torch.inference_mode(), SyncRecorder() as rec:
        states = runner.model.encode([(f.modality, f.data) for f in proc.mm_features])
    assert rec.seen == [] and [s.shape[-2] for s in states] == [
        f.cross.num_keys for f in proc.mm_features]
    outputs = {f.identifier: s for f, s in zip(proc.mm_features, states, strict=True)}
    req = llm.engine.make_request(proc, GREEDY)
    n = len(proc.token_ids)
    chunk = ScheduledChunk(req, 0, n)
    meta = build_metadata([0], [n], [list(range(-(-n // 16)))], 16, torch.device("cpu"))
    meta.cross = build_cross_metadata([0], [n], cross_items([chunk], outputs),
                                      torch.device("cpu"))
    with torch.inference_mode(), SyncRecorder() as rec:
        runner.model(torch.tensor(proc.token_ids), torch.arange(n), meta)
    llm.engine.block_manager.reset_prefix_cache()  # the blocks written above hold no prefix
    assert rec.seen == []


def test_inspect_states_the_cross_attention_memory(path):
    from engine import inspect

    report = inspect.inspect(path)
    assert not report.unsupported
    # 2 layers x (key + value) x 2 heads x 16 x 4 bytes; the largest image: 4 tiles x 17
    assert (report.cross_bytes_per_key, report.cross_largest_item) == (512, 68)
    assert report.kv_bytes_per_token == 3 * 2 * 2 * 16 * 4  # the 3 self-attention layers
    assert "34.00 KiB for the largest image (68 key positions)" in inspect.render(report)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu_and_never_synchronizes(path):
    """The mixed batch under a cutting budget gives the CPU's tokens on CUDA; the tower, the
    states and a forward through the cross-attention layers run under CUDA's sync debug mode
    (any synchronizing call is an error)."""
    from engine.cross_states import cross_items
    from engine.scheduler import ScheduledChunk
    from models.layers.attention_metadata import build_metadata
    from models.layers.cross_metadata import build_cross_metadata

    options = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=5, max_num_seqs=8)
    cpu = LLM(path, device="cpu", **options)
    gpu = LLM(path, device="cuda", **options)
    messages = list(CASES.values())
    want = [o.outputs[0].token_ids for o in cpu.chat(messages, GREEDY)]
    assert [o.outputs[0].token_ids for o in gpu.chat(messages, GREEDY)] == want
    assert_released(gpu)
    bf16 = LLM(path, device="cuda", dtype="bfloat16", max_model_len=256)
    assert all(len(o.outputs[0].token_ids) == N for o in bf16.chat(messages, GREEDY))

    runner, device = gpu.engine.runner, torch.device("cuda")
    proc, _ = process_chat(gpu, CASES["two_images"])
    req = gpu.engine.make_request(proc, GREEDY)
    n = len(proc.token_ids)
    meta = build_metadata([0], [n], [list(range(-(-n // 16)))], 16, device)
    ids = torch.tensor(proc.token_ids, device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            states = runner.model.encode([(f.modality, f.data) for f in proc.mm_features])
            outputs = {f.identifier: s for f, s in zip(proc.mm_features, states, strict=True)}
            meta.cross = build_cross_metadata(
                [0], [n], cross_items([ScheduledChunk(req, 0, n)], outputs), device)
            runner.model(ids, torch.arange(n, device=device), meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    gpu.engine.block_manager.reset_prefix_cache()
