"""The gated delta rule of Gated DeltaNet linear attention, in PyTorch ops: the causal depthwise
convolution in front of it, the chunked form for prefill pieces and the one-step recurrence for
decodes. The state of one sequence is [Hv, dk, dv] float32; at each token t, with decay
exp(g_t) <= 1 and learning rate beta_t:

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T        (the delta rule: write the correction)
    o_t = S^T q_t

The chunked form computes the same thing `chunk` tokens at a time (the UT transform of the
DeltaNet paper: a triangular solve per chunk, then one state update per chunk), as transformers'
`torch_chunk_gated_delta_rule` does; the recurrence is its `torch_recurrent_gated_delta_rule`,
in the same order of operations. Decode states live in a pool indexed by slot
(`recurrent_step`); the CPU takes our own in-place kernel where it measured faster
(models.layers.gated_deltanet chooses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.kernels import native
from models.layers.activations import rowwise


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (the reference's l2norm)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, ...]:
    """q, k [T, Hk, dk] in the model dtype -> float32 [T, Hv, dk], L2-normalized, q scaled by
    dk^-0.5; each key head serves Hv / Hk consecutive value heads."""
    repeat = num_v_heads // q.shape[1]
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    return q * q.shape[-1] ** -0.5, k


def chunked_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None, chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's tokens in chunks of `chunk`.

    q, k [T, Hv, dk] (from `prepare_qk`), v [T, Hv, dv], g, beta [T, Hv], all float32; `state`
    [Hv, dk, dv] float32 before the first token (None: zeros). -> (o [T, Hv, dv] float32, the
    state after the last token [Hv, dk, dv])."""
    length = q.shape[0]
    pad = -length % chunk
    # [Hv, T + pad, d], zero-padded at the end: a padded token has k = v = beta = 0 and g = 0,
    # so it leaves the state as it is.
    q, k, v = (F.pad(x.transpose(0, 1), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1), (0, pad)) for x in (g, beta))
    heads, dk, dv = q.shape[0], q.shape[-1], v.shape[-1]
    n = (length + pad) // chunk
    k_beta = (k * beta[..., None]).view(heads, n, chunk, dk)
    v_beta = (v * beta[..., None]).view(heads, n, chunk, dv)
    q, k = q.view(heads, n, chunk, dk), k.view(heads, n, chunk, dk)
    decay = g.view(heads, n, chunk).cumsum(dim=-1)  # log of the decay since the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower-triangular after the mask
    intra = (q @ k.transpose(-1, -2)) * pairwise
    values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                          unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    s = torch.zeros(heads, dk, dv, dtype=torch.float32, device=q.device) if state is None \
        else state.float()
    out = values.new_empty(heads, n, chunk, dv)
    for i in range(n):
        correction = values[:, i] - reads[:, i] @ s
        out[:, i] = q[:, i] @ s + intra[:, i] @ correction
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ correction
    return out.view(heads, -1, dv)[:, :length].transpose(0, 1), s


RECURRENCES = ("torch", "native")


def recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    states: torch.Tensor, slots: torch.Tensor, kernel: str = "torch",
) -> torch.Tensor:
    """One token of each of B sequences; their states are rows `slots` [B] of the pool
    `states` [S, Hv, dk, dv] float32, updated there. q, k [B, Hv, dk] (from `prepare_qk`), v
    [B, Hv, dv], g, beta [B, Hv] float32 -> o [B, Hv, dv] float32.

    `kernel` "torch": gathers the states, updates them, scatters them back (PyTorch ops, any
    device); "native": our CPU kernel, which updates them where they are
    (models.kernels.native; models.layers.delta_rule_choice picks by measurement)."""
    if kernel == "native":
        return native.load().delta_rule_step(q, k, v, g, beta, states, slots)
    s = states.index_select(0, slots) * rowwise("exp", g)[..., None, None]
    memory = (s * k[..., None]).sum(dim=-2)
    delta = (v - memory) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    states.index_copy_(0, slots, s)
    return (s * q[..., None]).sum(dim=-2)


def causal_conv(x: torch.Tensor, history: torch.Tensor | None, weight: torch.Tensor,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The depthwise causal convolution of one sequence's piece, SiLU after it.

    x [T, C] (the piece's projected inputs), `history` [C, K - 1] (the K - 1 inputs before the
    piece, oldest first; None: zeros, the start of the sequence), weight [C, 1, K] (a depthwise
    Conv1d's) -> (out [T, C] in x's dtype, the inputs [C, K - 1 + T] the piece saw, history
    first: any later history is a window of it)."""
    width = weight.shape[-1]
    if history is None:
        history = x.new_zeros(x.shape[1], width - 1)
    seen = torch.cat([history.to(x.dtype), x.t()], dim=1)  # [C, K - 1 + T]
    out = F.conv1d(seen[None].to(weight.dtype), weight, groups=weight.shape[0])
    return F.silu(out[0]).t().to(x.dtype), seen


def conv_step(x: torch.Tensor, histories: torch.Tensor, slots: torch.Tensor,
              weight: torch.Tensor) -> torch.Tensor:
    """One input of each of B sequences through the convolution: x [B, C]; their histories are
    rows `slots` of the pool `histories` [S, C, K - 1], shifted by one there -> out [B, C]."""
    seen = torch.cat([histories.index_select(0, slots), x[..., None].to(histories.dtype)], dim=2)
    histories.index_copy_(0, slots, seen[..., 1:])
    out = F.conv1d(seen.to(weight.dtype), weight, groups=weight.shape[0])
    return rowwise("silu", out[..., 0]).to(x.dtype)
