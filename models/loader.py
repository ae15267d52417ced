"""Load a Hugging Face safetensors checkpoint (single file or sharded) into one of our modules.

The module is built on the meta device (no memory, no random init), materialised empty on the
target device, then every parameter is filled from the checkpoint through the model's explicit
name map. A parameter (or row range of a fused parameter) that nothing fills is an error, as is
a checkpoint tensor whose shape does not match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.checkpoint import weight_files


@dataclass(frozen=True)
class Shard:
    """Rows [start, start + size) of a fused parameter (e.g. k_proj inside qkv_proj)."""

    start: int
    size: int


WeightMap = Callable[[str], "tuple[str, Shard | None] | None"]


class MissingWeights(ValueError):
    """Parameters the checkpoint does not fill (`missing`, our names)."""

    def __init__(self, missing: list[str]) -> None:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        super().__init__(f"checkpoint does not provide {len(missing)} parameter(s): {shown}")
        self.missing = missing


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sharded (with index) or single."""
    found = weight_files(path)
    if not found:
        raise FileNotFoundError(
            f"no safetensors weights in {path} (expected model.safetensors or "
            "model.safetensors.index.json; .bin checkpoints are not supported)"
        )
    return found


def iter_checkpoint(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@torch.no_grad()
def load_weights(
    module: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], mapping: WeightMap
) -> None:
    """Copy checkpoint tensors into `module` (dtype converted); fail on gaps or mismatches."""
    params = dict(module.named_parameters())
    filled: dict[str, int] = {name: 0 for name in params}
    for name, tensor in weights:
        target = mapping(name)
        if target is None:
            continue
        ours, shard = target
        param = params.get(ours)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} maps to unknown parameter {ours}")
        dest = param if shard is None else param.narrow(0, shard.start, shard.size)
        if dest.shape != tensor.shape:
            raise ValueError(
                f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)} for {ours}"
            )
        dest.copy_(tensor)
        filled[ours] += dest.numel()
    missing = [n for n, p in params.items() if filled[n] != p.numel()]
    if missing:
        raise MissingWeights(missing)


def build_on_meta(factory: Callable[[], nn.Module], device: torch.device, dtype: torch.dtype):
    """Construct with `factory` on the meta device, then allocate (uninitialised) on `device`.

    Buffers created with an explicit device inside the factory (rotary tables) stay as built.
    Moving off the meta device makes new Parameter objects, which unties shared weights, so the
    module's `tie_weights()` (if any) runs again afterwards.
    """
    with torch.device("meta"):
        module = factory()
    module = module.to(dtype=dtype).to_empty(device=device)
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    return module
