"""LoRA adapters chosen per request, applied beside the decoder's linears in one batched step.

An adapter (models/adapters.py reads one) adds (x A^T) B^T to some linears' outputs, on the
rows it targets (a part of a fused linear updates its own rows). The base linears are left as
they are: their planned kernels and quantization run unchanged, and each adapted linear gets a
forward hook that adds the updates of the adapters this step's tokens use.

A step may hold requests with different adapters or none. `AdapterBatch`, built on the host by
the runner (`build_adapter_batch`) and carried in the step's metadata, lists for each adapter
used in the step the rows of the flat token batch that use it (None: every row). An adapted
linear then adds, per adapter: one gather of its rows, x A^T for all the parts it adapts at
once, and per part (q, k, v of a fused qkv_proj) a small GEMM and an indexed add into its rows
of the output: grouped by adapter (a few per step), never by token. Rows without an adapter
keep the base output. Nothing reads a device value: the rows are index tensors made on the
host, the loop runs over host lists.

A speculating engine needs a verified row's update to round as a decode row's does: on the CPU
the products at a decode's rows go through our matrix-vector kernel (each row by itself); off
it, `pad_rows` set (by the runner) runs the products of fewer rows padded to that many, one
shape and so one library kernel (as models/kernels/row_invariance.py does for the linears).

Adapters apply to the linears of attention and dense MLP blocks, whose inputs are the step's
token rows in order; other targets (embeddings, the LM head, routed experts) are refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from models.adapters import LoraAdapter, read_adapter
from models.kernels import native
from models.layers.transfer import to_device

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterBatch:
    """Which rows of a step's flat token batch use which adapter: (slot, rows [R] int64 on the
    device, or None for every row) per adapter the step uses (slot 0, no adapter, is left
    out)."""

    groups: tuple[tuple[int, torch.Tensor | None], ...]


def build_adapter_batch(slots: Sequence[int], counts: Sequence[int],
                        device: torch.device) -> AdapterBatch | None:
    """Per chunk of the step, its request's adapter slot (0: none) and its token count -> the
    step's AdapterBatch, or None when no chunk uses an adapter. Host-side."""
    rows: dict[int, list[int]] = {}
    offset = 0
    for slot, n in zip(slots, counts, strict=True):
        if slot:
            rows.setdefault(slot, []).extend(range(offset, offset + n))
        offset += n
    if not rows:
        return None
    if len(rows) == 1 and len(next(iter(rows.values()))) == offset:
        return AdapterBatch(((next(iter(rows)), None),))
    return AdapterBatch(tuple(
        (slot, to_device(torch.tensor(r, dtype=torch.int64), device))
        for slot, r in rows.items()))


@dataclass(frozen=True)
class _Update:
    """One adapter's update of one linear: x A^T for all its parts at once, then part by part
    (rank columns [lo, hi) of x A^T) times B into output rows [first, first + rows)."""

    a: torch.Tensor  # [sum of ranks, in]
    parts: tuple[tuple[int, int, int, torch.Tensor], ...]  # (lo, hi, first, B [rows, r])


class AdapterSet:
    """The adapters loaded for a model, in slots 1.. (0: none), and the hooks on its linears.

    `step` is the AdapterBatch of the forward in progress (set by the decoder from the step's
    metadata before its layers run); a hook with no batch, or whose linear none of the step's
    adapters updates, adds nothing."""

    def __init__(self, model: nn.Module, adapters: Sequence[LoraAdapter],
                 device: torch.device, dtype: torch.dtype) -> None:
        self.names = tuple(a.name for a in adapters)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"adapter names repeat: {self.names}")
        self.adapters = tuple(adapters)
        self.step: AdapterBatch | None = None
        self.pad_rows: int | None = None  # off the CPU: fewer rows run padded to this many
        allowed = adaptable_linears(model)
        updates: dict[str, dict[int, _Update]] = {}
        for slot, adapter in enumerate(adapters, start=1):
            by_module: dict[str, list] = {}
            for part in adapter.parts:
                by_module.setdefault(part.module, []).append(part)
            for module, parts in by_module.items():
                linear = allowed.get(module)
                if linear is None:
                    raise ValueError(
                        f"adapter {adapter.name!r} ({adapter.path}) targets {module}, which is "
                        "not a linear of an attention or dense MLP block (LoRA is applied to "
                        "those only)")
                updates.setdefault(module, {})[slot] = _update(adapter, linear, parts,
                                                               device, dtype)
        self.nbytes = sum(u.a.nbytes + sum(p[3].nbytes for p in u.parts)
                          for per in updates.values() for u in per.values())
        for module, per_slot in updates.items():
            allowed[module].register_forward_hook(self._hook(per_slot))

    def slot(self, name: str | None) -> int:
        """The slot of adapter `name` (0 for None)."""
        return 0 if name is None else self.names.index(name) + 1

    def _hook(self, per_slot: dict[int, _Update]):
        def add_updates(module: nn.Module, inputs: tuple, out: torch.Tensor):
            batch = self.step
            if batch is None:
                return None
            x = inputs[0]
            for slot, rows in batch.groups:
                update = per_slot.get(slot)
                if update is None:
                    continue
                xs = x if rows is None else x.index_select(0, rows)
                count = xs.shape[0]
                if self.pad_rows is not None and count < self.pad_rows:
                    xs = F.pad(xs, (0, 0, 0, self.pad_rows - count))
                xa = _product(xs, update.a)  # [R, sum of ranks] (R: padded, if it is)
                for lo, hi, first, b in update.parts:
                    delta = _product(xa[:, lo:hi], b)[:count]  # [count, rows]
                    target = out.narrow(-1, first, b.shape[0])
                    if rows is None:
                        target.add_(delta)
                    else:
                        target.index_add_(0, rows, delta)
            return out  # the base kernel's fresh output, updated in place
        return add_updates


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x weight^T; at a decode step's rows on the CPU through our matrix-vector kernel, which
    computes each row by itself (a verification's rows then equal decodes of their tokens: a
    GEMM's rounding may depend on its row count)."""
    ours = native.for_small_ops(x) if x.dim() == 2 else None
    if ours is None or not ours.supports_linear(x.dtype, weight.dtype):
        return x @ weight.t()
    return ours.linear(x, weight)


def _update(adapter: LoraAdapter, linear: nn.Module, parts: list, device: torch.device,
            dtype: torch.dtype) -> _Update:
    cols, lo, a = [], 0, []
    for p in parts:
        rows, rank = p.b.shape
        if p.a.shape[1] != linear.in_features or p.first + rows > linear.out_features:
            raise ValueError(
                f"adapter {adapter.name!r}: {p.module} update of shape A {tuple(p.a.shape)}, "
                f"B {tuple(p.b.shape)} at row {p.first} does not fit the linear "
                f"[{linear.out_features}, {linear.in_features}]")
        a.append(p.a)
        cols.append((lo, lo + rank, p.first, p.b.to(device=device, dtype=dtype).contiguous()))
        lo += rank
    return _Update(torch.cat(a).to(device=device, dtype=dtype).contiguous(), tuple(cols))


def attach_adapters(model: nn.Module, path: Path, configured: Sequence[tuple[str, str]],
                    device: torch.device, dtype: torch.dtype
                    ) -> tuple[AdapterSet | None, dict[str, str]]:
    """Read and attach the adapters requests may choose: those the checkpoint at `path` ships
    for its modalities (`model.modality_adapters()`, folders inside it; a missing one is logged
    and its modality computes with the base model) and the `configured` (name, folder) pairs.
    Sets `model.adapters`. -> (the set or None, {modality: adapter name} of the defaults)."""
    wanted: list[tuple[str, Path]] = []
    defaults: dict[str, str] = {}
    for name, modality, folder in model.modality_adapters():
        if (path / folder).is_dir():
            wanted.append((name, path / folder))
            defaults.setdefault(modality, name)
        else:
            log.warning("the checkpoint has no %s/ adapter folder: %s requests compute with "
                        "the base model", folder, modality)
    wanted += [(name, Path(folder)) for name, folder in configured]
    if not wanted:
        return None, defaults
    weight_map = model.checkpoint_map()
    adapters = [read_adapter(name, folder, weight_map) for name, folder in wanted]
    model.adapters = AdapterSet(model, adapters, device, dtype)
    for adapter in adapters:
        log.info("LoRA adapter %r from %s: %s", adapter.name, adapter.path, adapter.describe())
    return model.adapters, defaults


# The linears an adapter may update, by block: attention's and a dense gated MLP's (a mixture
# of experts block has none of these as its own children).
ADAPTABLE = {"self_attn": ("qkv_proj", "o_proj"), "mlp": ("gate_up_proj", "down_proj")}


def adaptable_linears(model: nn.Module) -> dict[str, nn.Module]:
    """Our names of the linears an adapter may update (ADAPTABLE in each decoder layer):
    those whose input rows are the step's tokens in order."""
    found = {}
    for index, layer in enumerate(getattr(model, "layers", ())):
        for kind, names in ADAPTABLE.items():
            block = getattr(layer, kind, None)
            for name in names:
                child = getattr(block, name, None) if block is not None else None
                if isinstance(child, nn.Module) and hasattr(child, "in_features"):
                    found[f"layers.{index}.{kind}.{name}"] = child
    return found
