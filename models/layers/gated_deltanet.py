"""Gated DeltaNet, the linear-attention token mixer of hybrid decoders (Qwen3.5, Qwen3-Next):
one fused input projection (q, k, v before the convolution; the output gate z; the learning
rate b; the decay input a), a depthwise causal convolution of width K with SiLU over q/k/v, the
gated delta rule (models/layers/delta_rule.py) with one state [Hv, dk, dv] per sequence, an
RMSNorm of each head's output gated by SiLU(z), and the output projection.

Its per-sequence state lives in pools the model runner allocates and binds (`bind_state`): the
convolution's last K - 1 inputs [S, C, K - 1] in the model dtype and the recurrent state
[S, Hv, dk, dv] in float32, S slots; and the same for prefix-cache snapshots. Which slot and
snapshot each chunk uses comes with the step (models/layers/state_metadata.py).

Draft tokens being verified (speculative decoding) step the one-token forms token by token, as
decodes of those tokens would; their slots are backed up first (`bind_backups`: a pool of S
more states, bound where the engine speculates), and `keep_verified` leaves each slot holding
the state after its last accepted token: the backup replayed through the accepted tokens'
recorded inputs with the same kernels, so the state is the one decoding them would have left.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.kernels.linear import Linear
from models.layers import delta_rule
from models.layers.activations import rowwise
from models.layers.state_metadata import StateMetadata

# Tokens per chunk of the chunked form (the reference's).
CHUNK = 64


@dataclass(frozen=True)
class LinearAttentionShape:
    """The linear-attention layers' shape, read from the text config's `linear_*` fields."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads={self.num_v_heads} is not a multiple of "
                             f"linear_num_key_heads={self.num_k_heads}")
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be >= 2, got {self.conv_kernel}")

    @classmethod
    def from_hf(cls, cfg) -> LinearAttentionShape:
        return cls(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                   cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                   cfg.linear_conv_kernel_dim)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One sequence's (convolution history, recurrent state) shapes."""
        return ((self.conv_dim, self.conv_kernel - 1),
                (self.num_v_heads, self.k_head_dim, self.v_head_dim))

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state in one layer (history in `dtype`, state in float32)."""
        conv, rec = self.state_shapes()
        return (conv[0] * conv[1] * torch.finfo(dtype).bits // 8
                + rec[0] * rec[1] * rec[2] * 4)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each head's output (weight w), times SiLU of the gate z, rounded where the
    reference rounds: normalize in float32, scale in the input dtype, gate in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * rowwise("silu", gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """x [T, H] of the step's flat batch -> [T, H], reading and writing the chunks' states."""

    def __init__(self, hidden_size: int, shape: LinearAttentionShape, eps: float) -> None:
        super().__init__()
        self.shape = shape
        s = shape
        self.splits = [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]
        self.in_proj = Linear(hidden_size, sum(self.splits), bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, 1, s.conv_kernel))  # depthwise
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.v_head_dim, eps)
        self.out_proj = Linear(s.value_dim, hidden_size, bias=False)
        # Bound by the model runner: [S, C, K - 1] (model dtype) and [S, Hv, dk, dv] (float32)
        # for the slots, and the same for the snapshots.
        self.conv_states = torch.empty(0)
        self.recurrent_states = torch.empty(0)
        self.conv_snapshots = torch.empty(0)
        self.recurrent_snapshots = torch.empty(0)
        # How decodes step the recurrence: one of delta_rule.RECURRENCES (set at start-up).
        self.recurrence = "torch"
        # Verifications of drafts: the slots' states before the step, by slot ([S, ...] each,
        # bound where the engine speculates), and the last step's inputs of each verification.
        self.conv_backups = torch.empty(0)
        self.recurrent_backups = torch.empty(0)
        self._verified: list[tuple] = []

    def bind_state(self, conv_states: torch.Tensor, recurrent_states: torch.Tensor,
                   conv_snapshots: torch.Tensor, recurrent_snapshots: torch.Tensor) -> None:
        self.conv_states, self.recurrent_states = conv_states, recurrent_states
        self.conv_snapshots, self.recurrent_snapshots = conv_snapshots, recurrent_snapshots

    def bind_backups(self, conv_backups: torch.Tensor, recurrent_backups: torch.Tensor) -> None:
        """Pools shaped as the slots', where verifications back their slots' states up."""
        self.conv_backups, self.recurrent_backups = conv_backups, recurrent_backups

    def forward(self, x: torch.Tensor, meta: StateMetadata) -> torch.Tensor:
        s = self.shape
        t = x.shape[0]
        mixed, z, b, a = self.in_proj(x).split(self.splits, dim=-1)
        self._start_slots(meta)
        self._verified = []
        if meta.verify:
            if self.recurrent_backups.numel() == 0:
                raise RuntimeError("a verification of drafts needs the state backups bound")
            slots = meta.verify_slots
            self.conv_backups.index_copy_(0, slots, self.conv_states.index_select(0, slots))
            self.recurrent_backups.index_copy_(0, slots,
                                               self.recurrent_states.index_select(0, slots))
        conv = torch.empty_like(mixed)
        histories = []  # per piece: the convolution inputs it saw ([C, K - 1 + n])
        for piece in meta.pieces:
            out, seen = delta_rule.causal_conv(mixed[piece.rows],
                                               self.conv_states[piece.slot], self.conv_weight)
            conv[piece.rows] = out
            self.conv_states[piece.slot].copy_(seen[:, -(s.conv_kernel - 1):])
            histories.append(seen)
        for rows, slots in meta.steps:  # decodes, and verified drafts token by token
            conv.index_copy_(0, rows, delta_rule.conv_step(
                mixed.index_select(0, rows), self.conv_states, slots, self.conv_weight))
        q, k, v = conv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q, k = delta_rule.prepare_qk(q.view(t, s.num_k_heads, s.k_head_dim),
                                     k.view(t, s.num_k_heads, s.k_head_dim), s.num_v_heads)
        v = v.reshape(t, s.num_v_heads, s.v_head_dim).float()
        beta = rowwise("sigmoid", b).float()
        g = -self.A_log.float().exp() * rowwise("softplus", a.float() + self.dt_bias)

        core = x.new_empty(t, s.num_v_heads, s.v_head_dim)
        for piece, seen in zip(meta.pieces, histories, strict=True):
            core[piece.rows] = self._run_piece(piece, seen, q, k, v, g, beta).to(x.dtype)
        for rows, slots in meta.steps:
            out = delta_rule.recurrent_step(
                q.index_select(0, rows), k.index_select(0, rows), v.index_select(0, rows),
                g.index_select(0, rows), beta.index_select(0, rows), self.recurrent_states,
                slots, self.recurrence)
            core.index_copy_(0, rows, out.to(x.dtype))
        for piece in meta.verify:  # what keep_verified replays
            r = piece.rows
            self._verified.append((piece.slot, mixed[r], q[r], k[r], v[r], g[r], beta[r]))
        core = self.norm(core, z.reshape(t, s.num_v_heads, s.v_head_dim))
        return self.out_proj(core.view(t, s.value_dim))

    def keep_verified(self, kept: list[int]) -> None:
        """After a step that verified drafts: for each verification of the step (in order),
        the number of its tokens accepted as computed (its last token and the accepted
        drafts); its slot gets the state after them. A slot that kept every token holds it
        already; the others restart from their backup and replay the kept tokens' recorded
        inputs through the same one-token kernels."""
        width = self.shape.conv_kernel - 1
        for (slot, mixed, q, k, v, g, beta), keep in zip(self._verified, kept, strict=True):
            if keep == mixed.shape[0]:
                continue
            seen = torch.cat([self.conv_backups[slot], mixed[:keep].t().to(
                self.conv_backups.dtype)], dim=1)
            self.conv_states[slot].copy_(seen[:, -width:])
            self.recurrent_states[slot].copy_(self.recurrent_backups[slot])
            index = torch.tensor([slot], dtype=torch.int64, device=mixed.device)
            for i in range(keep):
                step = slice(i, i + 1)
                delta_rule.recurrent_step(q[step], k[step], v[step], g[step], beta[step],
                                          self.recurrent_states, index, self.recurrence)
        self._verified = []

    def _start_slots(self, meta: StateMetadata) -> None:
        """Zero the slots of sequences that start this step; copy restored snapshots in."""
        for slot in meta.resets:
            self.conv_states[slot].zero_()
            self.recurrent_states[slot].zero_()
        for slot, snapshot in meta.restores:
            self.conv_states[slot].copy_(self.conv_snapshots[snapshot])
            self.recurrent_states[slot].copy_(self.recurrent_snapshots[snapshot])

    def _run_piece(self, piece, seen, q, k, v, g, beta) -> torch.Tensor:
        """One multi-token chunk through the chunked form, cut where snapshots are saved ->
        its outputs [n, Hv, dv] float32; its final state back into its slot.

        `seen` [C, K - 1 + n]: the convolution inputs of the chunk, its history first, so the
        history at `cut` tokens into the chunk is seen[:, cut : cut + K - 1]."""
        lo, n = piece.rows.start, piece.rows.stop - piece.rows.start
        width = self.shape.conv_kernel - 1
        saves = dict(zip(piece.cuts, piece.saves, strict=True))
        state = self.recurrent_states[piece.slot]
        outs, begin = [], 0
        for end in sorted({*piece.cuts, n}):
            rows = slice(lo + begin, lo + end)
            out, state = delta_rule.chunked_delta_rule(q[rows], k[rows], v[rows], g[rows],
                                                       beta[rows], state, CHUNK)
            outs.append(out)
            if end in saves:
                self.recurrent_snapshots[saves[end]].copy_(state)
                self.conv_snapshots[saves[end]].copy_(seen[:, end : end + width])
            begin = end
        self.recurrent_states[piece.slot].copy_(state)
        return torch.cat(outs) if len(outs) > 1 else outs[0]
