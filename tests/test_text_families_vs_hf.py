"""Decoder features against transformers on text-only families: Qwen3 (qk-norm) and Gemma 3
(a 5:1 local/global pattern with a window shorter than the prompt, (1 + w) sandwich norms,
qk-norm, scaled embeddings, separate rope bases, `query_pre_attn_scalar`).

Logits at every position for a prefill in one piece and in chunks followed by decodes, and
greedy tokens with and without prefix-cache hits, in float32.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from models.layers.attention_metadata import build_metadata
from tests.helpers import greedy
from tests.model_fixtures import GEMMA3_1B_SHAPE

ATOL = 3e-4


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text"])
def family(request, tmp_path_factory):
    from testing.tiny import build_text_model

    root = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3":
        path = build_text_model(root / "m", "qwen3", num_layers=2,
                                config_overrides={"head_dim": 24})
    else:
        path = build_text_model(root / "m", "gemma3_text", num_layers=6, num_heads=4,
                                num_kv_heads=1, tie_word_embeddings=True,
                                config_overrides=GEMMA3_1B_SHAPE)
    return request.param, path


def _logits(model, ids, pieces, blocks, block_size):
    out = []
    for start, end in pieces:
        meta = build_metadata([start], [end - start], [blocks], block_size, torch.device("cpu"),
                              windows=model.attention_windows())
        with torch.inference_mode():
            hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end), meta)
            out.append(model.compute_logits(hidden))
    return torch.cat(out)


def test_logits_match_transformers(family, hf_models):
    name, path = family
    hf = hf_models(path)
    llm = LLM(path, dtype="float32", max_model_len=256, block_size=4)
    model = llm.engine.runner.model
    if name == "gemma3_text":
        windows = [a.layout.sliding_window for a in model.attention_layers()]
        assert windows == [6] * 5 + [None]
        assert len(model.rotaries) == 2  # local and global rope bases
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, llm.engine.runner.vocab_size, (30,), generator=gen).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    blocks = [5, 0, 7, 2, 9, 1, 3, 8]
    whole = _logits(model, ids, [(0, 30)], blocks, 4)
    torch.testing.assert_close(whole, ref, atol=ATOL, rtol=0)
    pieces = [(0, 9), (9, 23)] + [(p, p + 1) for p in range(23, 30)]
    torch.testing.assert_close(_logits(model, ids, pieces, blocks, 4), ref, atol=ATOL, rtol=0)


def test_greedy_matches_transformers_with_chunks_and_prefix_hits(family, hf_models):
    _, path = family
    hf = hf_models(path)
    prompt = list(range(4, 40))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    params = greedy(10)
    llm = LLM(path, max_model_len=256, max_num_batched_tokens=16, block_size=8)
    first = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert first.outputs[0].token_ids == ref
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == ref
