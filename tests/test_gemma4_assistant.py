"""Gemma 4's assistant drafter (`Gemma4AssistantForCausalLM`, `speculative="draft:PATH"`)
against transformers, on a tiny random text-only Gemma 4 target (sliding and global layers with
their own head sizes, a 12-token window, per-layer inputs, the last two layers reading others'
keys) and a tiny random assistant (a sliding and a global layer reading the target's):

- its drafts after a prompt longer than the window, and after rounds of verification, are
  transformers' assistant's over the target's shared keys and values and final hidden state
  (its multi-token candidate generator's loop over the tokens so far), with the LM head and
  with ordered embeddings (centroids);
- greedy output is plain decoding's, in float32 and in bfloat16 with int8 weights over an int8
  KV cache (the assistant reads the target's quantized keys in place), in a batch
  where one request does not speculate; sampling at temperature > 0 runs through the drafter's
  own distribution and releases every block;
- an assistant that does not fit the target is refused, naming why;
- on the multimodal target (Gemma4ForConditionalGeneration), an image prompt's greedy output is
  plain decoding's.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from models.gemma4.assistant import AssistantError
from tests.helpers import greedy

PROMPT = list(range(30, 60))  # longer than the 12-token window


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    from testing.gemma4 import build_gemma4_assistant, build_gemma4_model

    root = tmp_path_factory.mktemp("gemma4_assistant")
    target = build_gemma4_model(root / "target", text_only=True)
    return {"target": target, "plain": build_gemma4_assistant(root / "plain", target),
            "ordered": build_gemma4_assistant(root / "ordered", target, ordered=True)}


def _engine(paths, kind: str, **options) -> LLM:
    return LLM(paths["target"], max_model_len=512, block_size=4,
               speculative=f"draft:{paths[kind]}", **options)


@pytest.mark.parametrize("kind", ["plain", "ordered"])
def test_drafts_as_defined(paths, kind):
    """The first draft's logits and every greedy draft, after the prompt and after rounds of
    verification, are transformers' on the same tokens."""
    import transformers

    from testing.gemma4 import assistant_reference

    target = transformers.Gemma4ForCausalLM.from_pretrained(
        paths["target"], dtype=torch.float32).eval()
    assistant = transformers.Gemma4AssistantForCausalLM.from_pretrained(
        paths[kind], dtype=torch.float32).eval()
    llm = _engine(paths, kind)
    llm.engine.speculator.costs.hold(0.0)  # as many drafts as allowed, every step
    engine = llm.engine
    drafter = engine.speculator.drafters["draft"]
    req = engine.make_request(engine.processor.process(engine.processor.parse(PROMPT), {}),
                              greedy(16))
    engine.add_request(req)
    rounds = 0
    while not req.finished and rounds < 4:
        engine.step()  # the prompt (or a verification); the drafter drafts for the next
        if req.finished:
            break
        drafts = list(req.draft_token_ids)
        assert drafts, "the assistant drafts at every step"
        want_logits, want = assistant_reference(target, assistant, req.all_token_ids,
                                                len(drafts))
        assert drafts == want
        if rounds == 0:
            meta, positions = drafter.queries([req])
            last = torch.tensor([req.all_token_ids[-1]])
            hidden = drafter.seqs[req.request_id].hidden[None]
            with torch.inference_mode():
                ours, _ = drafter.model.draft(engine.runner.model.embed(last), hidden,
                                              positions, meta)
            torch.testing.assert_close(ours[0], want_logits[0], atol=1e-4, rtol=1e-4)
        rounds += 1
    assert rounds >= 2 and req.metrics.verify_steps >= 1
    for _ in range(40):
        if not engine.has_unfinished():
            break
        engine.step()
    assert engine.block_manager.num_used_blocks == 0


def _conversations():
    return [PROMPT, list(range(100, 140)), [5, 6, 7, 8, 9, 10] * 5]


@pytest.mark.parametrize("options", [
    {}, {"dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8"}],
    ids=["float32", "bfloat16-int8-int8kv"])
def test_greedy_output_is_plain_decodings(paths, options):
    """Random weights draft poorly: asked for at every step (costs held low), the drafts are
    verified and the greedy output stays plain decoding's; a request that does not speculate
    shares the steps."""
    plain = LLM(paths["target"], max_model_len=512, block_size=4, **options)
    llm = _engine(paths, "ordered", **options)
    llm.engine.speculator.costs.hold(0.05)
    prompts = [{"prompt_token_ids": p} for p in _conversations()]
    want = plain.generate(prompts, greedy(12))
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                             **({"num_speculative_tokens": 0} if i == 1 else {}))
              for i in range(len(prompts))]
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert got[0].metrics.draft_tokens > 0 and got[1].metrics.draft_tokens == 0
    llm.engine.check_integrity()
    assert llm.engine.block_manager.num_used_blocks == 0


def test_sampling_draws_from_the_assistant(paths):
    """At temperature > 0 the drafts are draws from the assistant's distribution, verified by
    speculative sampling's rule; a seeded request gives the same text twice."""
    llm = _engine(paths, "plain")
    llm.engine.speculator.costs.hold(0.05)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    again = llm.generate([{"prompt_token_ids": PROMPT}], params)[0]
    assert first.metrics.draft_tokens > 0
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert llm.engine.block_manager.num_used_blocks == 0


def test_an_assistant_for_another_target_is_refused(paths, tmp_path):
    from testing.gemma4 import build_gemma4_model
    from testing.tiny import build_text_model

    qwen = build_text_model(tmp_path / "qwen2", "qwen2")
    with pytest.raises(AssistantError, match="drafts for a Gemma 4 target"):
        LLM(qwen, max_model_len=256, speculative=f"draft:{paths['plain']}")
    wider = build_gemma4_model(tmp_path / "wide", text_only=True, hidden_size=96)
    with pytest.raises(AssistantError, match="backbone_hidden_size=64; this target's "
                                             "hidden_size is 96"):
        LLM(wider, max_model_len=256, speculative=f"draft:{paths['plain']}")
    import shutil

    from safetensors.torch import load_file, save_file

    unordered = shutil.copytree(paths["ordered"], tmp_path / "unordered")
    tensors = load_file(unordered / "model.safetensors")
    del tensors["masked_embedding.token_ordering"]
    save_file(tensors, unordered / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(AssistantError, match="token_ordering is missing or not a permutation"):
        LLM(paths["target"], max_model_len=256, speculative=f"draft:{unordered}")


def test_an_image_prompt_on_the_multimodal_target(tmp_path):
    """The same drafter for Gemma4ForConditionalGeneration (its text config read from the
    composite one): an image prompt's greedy output is plain decoding's."""
    from testing.gemma4 import build_gemma4_assistant, build_gemma4_model
    from tests.helpers import random_image, user

    target = build_gemma4_model(tmp_path / "target", audio=False)
    assistant = build_gemma4_assistant(tmp_path / "assistant", target, ordered=True)
    conversations = [user(random_image(64, 70, 0), "Describe the image in detail."),
                     user("The quick brown fox jumps over the lazy dog.")]
    plain = LLM(target, max_model_len=512, block_size=4).chat(conversations, greedy(12))
    llm = LLM(target, max_model_len=512, block_size=4, speculative=f"draft:{assistant}")
    llm.engine.speculator.costs.hold(0.05)
    got = llm.chat(conversations, greedy(12))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics.draft_tokens for o in got) > 0
    assert llm.engine.block_manager.num_used_blocks == 0
