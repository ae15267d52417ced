"""A GGUF file's blocks in the layouts our kernels run (models.kernels.ggml_blocks.repack: each
type in groups of 8 channels), repacked at load or read back from a store that
kept an earlier start's (engine/weight_cache.py keeps them on disk, mapped at the next start:
no repacking, and no fresh memory to fault in, zero and fill).

Each repacked weight is known by a key naming the file's tensors it was made of (stable across
starts of the same file); what the store hands back is used only where it is the layout and
shape this build would make itself (a store written by a build with another vector path, or
for another shape, is repacked anew and rewritten).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from models.kernels.ggml_blocks import (
    KERNEL_TYPES,
    BlockEmbedding,
    BlockPart,
    repacked_as,
    row_bytes,
)
from models.mapped_files import MappedFile, keep


class RepackStore(Protocol):
    """Repacked blocks kept between starts, by key."""

    def get(self, key: str) -> tuple[str, torch.Tensor] | None:
        """(layout, blocks [N, row bytes] uint8) kept under `key`, or None."""
        ...

    def put(self, key: str, kernel_type: str, blocks: torch.Tensor) -> None:
        """Keep `blocks` (in layout `kernel_type`) under `key` at the next `save`."""
        ...

    def save(self) -> bool:
        """Write what was put since it was read (nothing when nothing was): whether the
        store now holds it, to be read back by `get`."""
        ...

    def mappings(self) -> list[MappedFile]:
        """The files the blocks `get` hands out view."""
        ...


class Repacker:
    """Makes the block modules of a file's weights, each in the layout our decode kernel runs
    its type in where there is one: read back from `store` (when given and it holds the
    weight), else repacked here and put in the store; `finish` saves the new ones and points
    their modules at the store's copies, so that this start runs what the next one will."""

    def __init__(self, store: RepackStore | None) -> None:
        self.store = store
        self._made: list[tuple[nn.Module, str]] = []  # (module holding `blocks`, its key)

    def part(self, key: str, type_name: str, blocks: torch.Tensor,
             in_features: int) -> BlockPart:
        """One part of a block linear: `blocks` [N, row bytes] as the file holds them."""
        kept = self._kept(key, type_name, blocks.shape[0], in_features)
        if kept is not None:
            return BlockPart(kept[1], type_name, in_features, kernel_type=kept[0])
        part = BlockPart(blocks, type_name, in_features, repack_blocks=True)
        self._put(part, key, part.kernel_type != type_name)
        return part

    def embedding(self, key: str, blocks: torch.Tensor, type_name: str, embedding_dim: int,
                  dtype: torch.dtype, repack_blocks: bool) -> BlockEmbedding:
        """A token table in its blocks (repacked where `repack_blocks`: a head is tied to
        it)."""
        kept = (self._kept(key, type_name, blocks.shape[0], embedding_dim)
                if repack_blocks else None)
        if kept is not None:
            return BlockEmbedding(kept[1], type_name, embedding_dim, dtype,
                                  kernel_type=kept[0])
        table = BlockEmbedding(blocks, type_name, embedding_dim, dtype, repack_blocks)
        self._put(table, key, table.kernel_type != type_name)
        return table

    def finish(self, model: nn.Module) -> None:
        """Save what was repacked here in the store and point its modules at the store's
        copies (the copies made here are let go), `model` keeping the store's files. Before a
        head is tied to a table (`BlockEmbedding.tied_head` shares the blocks it holds then)."""
        if self.store is None:
            return
        if self._made and self.store.save():
            for module, key in self._made:
                kept = self.store.get(key)
                if kept is not None and tuple(kept[1].shape) == tuple(module.blocks.shape):
                    module.blocks = kept[1]
        self._made.clear()
        keep(model, self.store.mappings())

    def _kept(self, key: str, type_name: str, n: int,
              in_features: int) -> tuple[str, torch.Tensor] | None:
        """The store's blocks for `key` where they are what `repack` would make here."""
        target = repacked_as(type_name, n, in_features)
        kept = None if self.store is None or target is None else self.store.get(key)
        if kept is None or kept[0] != target or tuple(kept[1].shape) != (
                n, row_bytes(KERNEL_TYPES[target], in_features)):
            return None
        return kept

    def _put(self, module: BlockPart | BlockEmbedding, key: str, repacked: bool) -> None:
        if repacked and self.store is not None:
            self.store.put(key, module.kernel_type, module.blocks)
            self._made.append((module, key))

