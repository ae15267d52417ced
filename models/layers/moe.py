"""The mixture-of-experts feed-forward block (`moe`): a softmax top-k router, the experts' gated
MLPs and, where the config has one, a shared expert scaled by a sigmoid gate.

Each expert is a GatedMLP of its own (gate and up fused), so quantization, the start-up plan of
linear kernels and our decode kernels treat the experts' linears as any other: a token reads
only its routed experts' weights. On the CPU tokens are grouped by expert, and each active expert
runs one GEMM over its tokens (at a decode's rows, one matrix-vector product per routed expert);
the formulation for that row count is the one the plan timed for the experts' shape group (at
a decode's rows, where all are ours, in one native call: models.kernels.native_experts). On an
accelerator, where grouping would read the counts back to the host, every expert runs over every
token with zero weight where not routed (correct, not fast: no grouped GEMM is built).

The router and the shared expert's gate stay in the model dtype (linears built
`quantizable=False`): rounding their weights would change which experts a token reaches.

Checkpoints store experts either per expert (`experts.{e}.gate_proj.weight`, what transformers
writes) or fused (`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I],
transformers 5's in-memory layout, or transposed [E, H, 2I] / [E, I, H], the Hub's Qwen3-VL-MoE
layout): `split_fused_experts` turns a fused tensor into per-expert views, transposing only
where the shape is not already the expected one (as transformers decides).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from models.kernels.linear import Linear, run_kernel
from models.kernels.native_experts import NativeExperts
from models.layers.activations import rowwise
from models.layers.mlp import GatedMLP


@dataclass(frozen=True)
class MoEShape:
    """The experts of a sparse block, read from a text config (`num_experts`,
    `num_experts_per_tok`, `moe_intermediate_size`, `shared_expert_intermediate_size`).
    `normalize_top_k`: the routed weights are renormalised to sum to 1 (`norm_topk_prob`, or
    always, as the family's reference router does)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    shared_expert_size: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in "
                             f"[1, num_experts={self.num_experts}]")
        if self.intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size={self.intermediate_size} must be positive")
        if self.shared_expert_size is not None and self.shared_expert_size <= 0:
            raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_size} "
                             "must be positive")

    @classmethod
    def from_hf(cls, cfg, normalize_top_k: bool) -> MoEShape:
        return cls(cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
                   normalize_top_k, getattr(cfg, "shared_expert_intermediate_size", None))


def sparse_layers(cfg) -> tuple[int, ...]:
    """The layers whose feed-forward block is sparse: every `decoder_sparse_step`-th layer not
    in `mlp_only_layers`, where the config has those fields (Qwen3-MoE, Qwen3-VL-MoE), else
    every layer (Qwen3.5-MoE)."""
    step = getattr(cfg, "decoder_sparse_step", None) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    if cfg.num_experts <= 0:
        return ()
    return tuple(i for i in range(cfg.num_hidden_layers)
                 if i not in dense and (i + 1) % step == 0)


class Router(Linear):
    """The experts' logits (a linear kept in the model dtype, planned like any other), softmax
    over them in float32, the top k, optionally renormalised; the weights are returned in the
    input's dtype, as the reference rounds them."""

    def __init__(self, hidden: int, shape: MoEShape) -> None:
        super().__init__(hidden, shape.num_experts, bias=False, quantizable=False)
        self.top_k, self.normalize = shape.top_k, shape.normalize_top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, experts [T, k] int64)."""
        logits = run_kernel(self, x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), experts


class RoutedExperts(nn.Module):
    """The experts' gated MLPs and their weighted sum over each token's routed experts
    (`routed`), for a router of the caller's (SparseMoE's, or a family's own)."""

    def __init__(self, hidden: int, shape: MoEShape, act: str) -> None:
        super().__init__()
        self.shape = shape
        self.experts = nn.ModuleList(
            GatedMLP(hidden, shape.intermediate_size, act=act, fused_decode=True)
            for _ in range(shape.num_experts))
        self.native: NativeExperts | None = None  # set by prepare_decode

    def prepare_decode(self, dtype: torch.dtype | None = None) -> bool:
        """Once the linears are placed and planned, on the CPU: run the routed experts of the
        decode steps it can take in one native call (models.kernels.native_experts), in
        `dtype` (the model's; SparseMoE's router has it)."""
        dtype = dtype or self.gate.weight.dtype
        self.native = NativeExperts.build(
            [(e.gate_up_proj, e.down_proj) for e in self.experts], dtype,
            all(e.fused_silu for e in self.experts))
        return self.native is not None

    def routed(self, x: torch.Tensor, weights: torch.Tensor,
               experts: torch.Tensor) -> torch.Tensor:
        """The weighted sum of each token's routed experts, accumulated expert by expert in
        increasing index (the reference's order, so rounding in bfloat16 matches). On the CPU
        each active expert runs once over its own tokens; elsewhere every expert runs over
        every token (see `_every_expert`)."""
        if x.device.type != "cpu":
            return self._every_expert(x, weights, experts)
        out = None if self.native is None else self.native.run(x, weights, experts)
        return self._grouped_on_host(x, weights, experts) if out is None else out

    def _grouped_on_host(self, x: torch.Tensor, weights: torch.Tensor,
                         experts: torch.Tensor) -> torch.Tensor:
        """Token-expert pairs sorted by expert (stable: a token's pairs keep their order); each
        active expert runs once over its rows. The per-expert counts are read on the host,
        which on the CPU is a read of memory, not a device sync: CPU tensors only."""
        k = experts.shape[1]
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.shape.num_experts).tolist()
        rows = order // k  # the token of each sorted pair
        scale = weights.reshape(-1)[order, None]
        out = torch.zeros_like(x)
        single = x.shape[0] == 1  # a lone decode row: every pair reads row 0
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            token_rows = rows[start:end]
            y = self.experts[expert](x if single else x[token_rows])
            out.index_add_(0, token_rows, y * scale[start:end])
            start = end
        return out

    def _every_expert(self, x: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor) -> torch.Tensor:
        """Accelerators: every expert over every token, scaled by the token's weight for it
        (zero where the token is not routed there), so that nothing is read back to the host
        inside the forward; num_experts / top_k times the routed FLOPs. A grouped GEMM that
        takes the per-expert offsets on the device is not built."""
        dense = torch.zeros(x.shape[0], self.shape.num_experts, dtype=weights.dtype,
                            device=x.device).scatter_(1, experts, weights)  # [T, E]
        out = torch.zeros_like(x)
        for expert, mlp in enumerate(self.experts):
            out = out + mlp(x) * dense[:, expert, None]
        return out


class SparseMoE(RoutedExperts):
    """Router, experts and the optional gated shared expert; x [T, H] -> [T, H]."""

    def __init__(self, hidden: int, shape: MoEShape, act: str) -> None:
        super().__init__(hidden, shape, act)
        self.gate = Router(hidden, shape)
        self.shared_expert: GatedMLP | None = None
        if shape.shared_expert_size is not None:
            self.shared_expert = GatedMLP(hidden, shape.shared_expert_size, act=act,
                                          fused_decode=True)
            self.shared_expert_gate = Linear(hidden, 1, bias=False, quantizable=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.gate(x)
        out = self.routed(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            out = out + rowwise("sigmoid", self.shared_expert_gate(x)) * shared
        return out


FUSED_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def split_fused_experts(name: str, tensor: torch.Tensor, shape: MoEShape,
                        hidden: int) -> Iterator[tuple[str, torch.Tensor]] | None:
    """A fused experts tensor as per-expert views named after our modules
    (`...experts.{e}.gate_up_proj.weight`, `...experts.{e}.down_proj.weight`), or None for any
    other tensor. [E, 2I, H] / [E, H, I] are read as stored; the transposed [E, H, 2I] /
    [E, I, H] are transposed (a shape equal to the expected one is never transposed)."""
    if name.endswith(FUSED_EXPERTS[0]):
        expected, ours = (shape.num_experts, 2 * shape.intermediate_size, hidden), "gate_up_proj"
    elif name.endswith(FUSED_EXPERTS[1]):
        expected, ours = (shape.num_experts, hidden, shape.intermediate_size), "down_proj"
    else:
        return None
    if tuple(tensor.shape) != expected:
        tensor = tensor.transpose(1, 2)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.transpose(1, 2).shape)}"
                         f", expected {expected} or its transpose in the last two dimensions")
    base = name[: -len(ours) - 1]  # "...experts"
    return ((f"{base}.{e}.{ours}.weight", tensor[e]) for e in range(shape.num_experts))


def unfuse_experts(tensors: Iterator[tuple[str, torch.Tensor]], shape: MoEShape,
                   hidden: int) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's (name, tensor) pairs with every fused experts tensor split per expert
    (split_fused_experts); the rest pass through."""
    for name, tensor in tensors:
        split = split_fused_experts(name, tensor, shape, hidden)
        if split is None:
            yield name, tensor
        else:
            yield from split
