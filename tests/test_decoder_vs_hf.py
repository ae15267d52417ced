"""Our decoder over the paged KV cache against transformers: logits at every position, float32.

The model is driven directly (no scheduler) so each test picks the exact chunking: a prefill in
one piece, in chunks that read earlier chunks from the cache, one token at a time (decode), and
several sequences in one flat batch.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from tests.helpers import run_chunks

ATOL = 2e-4


def _reference_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(params=["qwen2", "llama"])
def case(request, qwen2_path, llama_path, hf_models):
    path = qwen2_path if request.param == "qwen2" else llama_path
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=512)
    vocab = llm.engine.runner.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (70, 33, 5)]
    return llm.engine.runner.model, hf_models(path), prompts


def test_prefill_in_one_piece(case):
    model, hf, prompts = case
    ids = prompts[0]
    (ours,) = run_chunks(model, [(ids, 0, len(ids), list(range(8)))])
    torch.testing.assert_close(ours, _reference_logits(hf, ids), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode(case):
    model, hf, prompts = case
    ids = prompts[0]
    blocks = [7, 3, 11, 0, 5]  # deliberately non-contiguous
    ref = _reference_logits(hf, ids)
    got = []
    for start, end in [(0, 20), (20, 37), (37, 64)] + [(p, p + 1) for p in range(64, 70)]:
        got += run_chunks(model, [(ids, start, end, blocks)])
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def test_mixed_batch_of_prefill_chunks_and_decodes(case):
    model, hf, prompts = case
    a, b, c = prompts
    refs = [_reference_logits(hf, p) for p in prompts]
    blocks = {0: [1, 2, 3, 4, 5], 1: [6, 7, 8], 2: [9]}
    run_chunks(model, [(a, 0, 40, blocks[0])])  # a: first chunk alone
    run_chunks(model, [(b, 0, 32, blocks[1])])  # b: all but its last token
    # One flat batch: a's second chunk, b's last token (decode-like), c's whole prompt.
    out_a, out_b, out_c = run_chunks(
        model, [(a, 40, 70, blocks[0]), (b, 32, 33, blocks[1]), (c, 0, 5, blocks[2])]
    )
    torch.testing.assert_close(out_a, refs[0][40:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_b, refs[1][32:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out_c, refs[2], atol=ATOL, rtol=0)


def test_bfloat16_tracks_float32(qwen2_path, hf_models):
    """bfloat16 is not bit-comparable; its logits must stay close to the float32 reference."""
    llm = LLM(qwen2_path, device="cpu", dtype="bfloat16", max_model_len=256)
    ids = list(range(3, 40))
    (ours,) = run_chunks(llm.engine.runner.model, [(ids, 0, len(ids), [0, 1, 2])])
    ref = _reference_logits(hf_models(qwen2_path), ids)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.25 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8
