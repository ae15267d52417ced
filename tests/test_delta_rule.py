"""The gated delta rule and its convolution (models/layers/delta_rule.py) against transformers'
reference functions: the chunked form at lengths around the chunk size, from a given state, cut
anywhere and resumed; the one-step recurrence over a pool of slots; the convolution with its
history carried across pieces and one step at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as ref

from models.kernels import native
from models.layers import delta_rule

HK, HV, DK, DV = 2, 4, 16, 8


def inputs(length: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(length, HV, DV, generator=gen)
    g = -F.softplus(torch.randn(length, HV, generator=gen))  # log decays <= 0
    beta = torch.rand(length, HV, generator=gen)
    state = torch.randn(HV, DK, DV, generator=gen) * 0.1
    return q, k, v, g, beta, state


def reference(q, k, v, g, beta, state):
    out, final = ref.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[0], final[0]


def ours(q, k, v, g, beta, state, chunk=64):
    qn, kn = delta_rule.prepare_qk(q, k, HV)
    return delta_rule.chunked_delta_rule(qn, kn, v, g, beta, state, chunk)


@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 150])
def test_chunked_form_matches_transformers(length):
    q, k, v, g, beta, state = inputs(length)
    out, final = ours(q, k, v, g, beta, state)
    want, want_final = reference(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_final, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cut", [1, 3, 40, 99])
def test_a_sequence_cut_anywhere_resumes_from_its_state(cut):
    q, k, v, g, beta, state = inputs(100, seed=1)
    whole, final = ours(q, k, v, g, beta, state)
    first, mid = ours(q[:cut], k[:cut], v[:cut], g[:cut], beta[:cut], state, chunk=16)
    second, end = ours(q[cut:], k[cut:], v[cut:], g[cut:], beta[cut:], mid, chunk=16)
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, final, atol=1e-5, rtol=1e-5)


def test_the_recurrence_updates_its_slots_in_the_pool():
    pool = torch.randn(5, HV, DK, DV) * 0.1
    before = pool.clone()
    slots = torch.tensor([3, 0])
    q, k, v, g, beta, _ = inputs(2, seed=2)
    qn, kn = delta_rule.prepare_qk(q, k, HV)
    out = delta_rule.recurrent_step(qn, kn, v, g, beta, pool, slots)
    for row, slot in enumerate(slots.tolist()):
        want, want_state = ref.torch_recurrent_gated_delta_rule(
            q[row][None, None], k[row][None, None], v[row][None, None], g[row][None, None],
            beta[row][None, None], initial_state=before[slot][None], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[row], want[0, 0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(pool[slot], want_state[0], atol=1e-6, rtol=1e-6)
    for slot in (1, 2, 4):
        assert torch.equal(pool[slot], before[slot])


@pytest.mark.skipif(native.load() is None, reason="our kernels are not built here")
def test_our_kernel_steps_the_recurrence_in_place():
    pool = torch.randn(6, HV, DK, DV) * 0.1
    slots = torch.tensor([5, 2, 0])
    q, k, v, g, beta, _ = inputs(3, seed=4)
    qn, kn = delta_rule.prepare_qk(q, k, HV)
    theirs = pool.clone()
    want = delta_rule.recurrent_step(qn, kn, v, g, beta, theirs, slots, "torch")
    before = pool.data_ptr()
    got = delta_rule.recurrent_step(qn, kn, v, g, beta, pool, slots, "native")
    assert pool.data_ptr() == before
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(pool, theirs, atol=1e-6, rtol=1e-5)


def test_the_convolution_carries_its_history():
    gen = torch.Generator().manual_seed(3)
    channels, width, length = 6, 4, 11
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, 1, width, generator=gen)
    want = ref.causal_conv1d_fn(x.t()[None], weight[:, 0], activation="silu")[0].t()
    whole, _ = delta_rule.causal_conv(x, None, weight)
    torch.testing.assert_close(whole, want)
    first, seen = delta_rule.causal_conv(x[:2], None, weight)  # shorter than the window
    rest, _ = delta_rule.causal_conv(x[2:7], seen[:, -(width - 1):], weight)
    pool = torch.zeros(3, channels, width - 1)
    _, seen = delta_rule.causal_conv(x[:7], None, weight)
    pool[1] = seen[:, -(width - 1):]
    steps = [delta_rule.conv_step(x[t][None], pool, torch.tensor([1]), weight)[0]
             for t in range(7, length)]
    torch.testing.assert_close(torch.cat([first, rest, torch.stack(steps)]), want)
    assert not pool[0].any() and not pool[2].any()
