"""Loads a GGUF file's weights into one of our modules: every tensor checked against the model
before anything is allocated, the linears held in the file's own ggml blocks where our kernels
run that block type (models.kernels.ggml_blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K;
no float copy, the float16 scales as stored), every other tensor dequantized into the model dtype
one at a time and handed to models.loader (which quantizes it as it fills, when the user asked
for int8 / int4).

Blocks run as stored are read-only views of the file's mapping (models/mapped_files.py: no copy;
the model keeps the mapping), but for a llama file's q and k, whose rows llama.cpp permuted
(reordered here, so copied). Parts of one fused linear that lie back to back in the file in one
block type are one view; others stay parts of their own (never joined by a copy). Parts our
kernels run in another layout are repacked, or read back from an earlier start's
(models/gguf/repacks.py).

A linear runs as stored (by default, on the CPU) when every checkpoint tensor it is made of (q, k
and v for our fused qkv_proj; gate and up) is of a block type our kernels run; its parts may
differ in type (a Q4_K_M file's v is often Q6_K beside Q4_K q and k): each part keeps its own.
Otherwise all its parts are dequantized. The token embedding table of such a type stays in its
blocks too (models.kernels.ggml_blocks.BlockEmbedding: the rows a step looks up dequantized as
ggml does, into the model dtype), and a head tied to it is a BlockLinear on the same bytes.
Dequantized, with the reason recorded per tensor (the start-up line and `python -m
engine.inspect` count them): norms and other non-linear tensors, block types without a kernel
here (IQ types, Q2_K, Q3_K: their grids are codebooks or 2-3 bit packings our kernels do not
read), and everything when `dequantize_gguf`, a device other than the CPU, or a quantization is
asked (then the embedding table too, looked up in the model dtype). With int4 / int8 asked,
Q4_0 / Q4_1 linears become our int4 at group 32 and Q8_0 ones our int8 at group 32 straight from
their blocks (each block's float16 scale rounded to bfloat16); the rest is dequantized and
requantized as it loads.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from models.gguf.config import read_config
from models.gguf.mmproj import projector_weights
from models.gguf.reader import GGUFError, GGUFFile, TensorInfo
from models.gguf.repacks import Repacker, RepackStore
from models.gguf.tensors import (
    BLOCK,
    STORED_INT4,
    Rearrange,
    hf_name,
    read_dense,
    read_int4,
    read_int8,
    readable,
)
from models.kernels.ggml_blocks import BlockLinear, held_bytes, takes
from models.kernels.int_formats import int4_supported, pack_int4
from models.kernels.linear import Linear
from models.kernels.quantization import QuantizedLinear, QuantizeOnLoad
from models.loader import (
    LoadObserver,
    Shard,
    StageCounter,
    StageProgress,
    build_on_meta,
    counted,
    load_weights,
    on_meta,
)
from models.mapped_files import enabled as mapping_enabled
from models.mapped_files import keep

log = logging.getLogger(__name__)

Part = tuple[TensorInfo, Shard | None]


class GGUFWeights:
    """A GGUF file's tensors for one model: which linears run as stored, and the rest."""

    def __init__(self, path: Path, hf_config: Any, dequantize_all: bool,
                 stored_q8: bool = False, as_blocks: bool = False,
                 why_dense: str = "") -> None:
        self.file = GGUFFile(path)
        self.family = read_config(self.file).family
        text = hf_config.get_text_config()
        self.rearrange = Rearrange(self.family, text.num_attention_heads,
                                   text.num_key_value_heads)
        self.dequantize_all = dequantize_all
        self.stored_q8 = stored_q8 and not dequantize_all
        # Linears in the file's blocks (the default), else only Q4_0 / Q4_1 / Q8_0 as our ints.
        self.as_blocks = as_blocks and not dequantize_all
        self.why_dense = why_dense  # why no linear runs in its blocks, when none may
        self.blocks: dict[str, list[Part]] = {}  # our weight name -> its parts, in blocks
        self.stored: dict[str, list[Part]] = {}  # our weight name -> its parts, as stored
        self.int8: dict[str, list[Part]] = {}  # our weight name -> its Q8_0 parts
        self.dense: list[tuple[str, TensorInfo]] = []  # (checkpoint name, tensor)
        # The token embedding table in its blocks: (our weight name, tensor), the tied heads.
        self.embedding: tuple[str, TensorInfo] | None = None
        self.tied_heads: list[str] = []  # modules whose weight is the table (our names)
        self.reasons: dict[str, str] = {}  # a dense tensor's name -> why it was dequantized

    def plan(self, model: nn.Module, mapping: Callable, elsewhere: Collection[str] = ()) -> None:
        """Check every tensor against `model` (on the meta device) and decide which linears
        run as stored. Raises GGUFError naming the tensor for one the model has no place
        for, a shape that contradicts the config, or a parameter no tensor fills (but for
        `elsewhere`: those a projector file fills)."""
        params = dict(model.named_parameters())
        parts: dict[str, list[Part]] = {}
        name = self.file.path.name
        for info in self.file.tensors:
            if not readable(info.ggml_type):
                raise GGUFError(f"{name}: tensor {info.name} is of type {info.type_name}, "
                                "which mmserve does not read (gguf-py has no dequantizer for "
                                "it)")
            checkpoint = hf_name(info.name, self.family)
            target = None if checkpoint is None else mapping(checkpoint)
            if checkpoint is None or (target is None and checkpoint.startswith("model.")):
                raise GGUFError(f"{name}: tensor {info.name} ({info.type_name} "
                                f"{list(info.shape)}) is not a tensor of a {self.family} model "
                                "mmserve reads")
            if target is None:  # an output.weight the tied head does not read
                continue
            ours, shard = target
            param = params.get(ours)
            expected = None if param is None else tuple(
                param.shape if shard is None else (shard.size, *param.shape[1:]))
            if expected != info.shape:
                raise GGUFError(f"{name}: tensor {info.name} has shape {list(info.shape)}, but "
                                f"the config in the metadata makes {ours} "
                                f"{list(expected) if expected else 'no parameter'}")
            parts.setdefault(ours, []).append((info, shard))
        missing = [p for p, param in params.items() if p not in elsewhere
                   and sum((s.size if s else param.shape[0]) for _, s in parts.get(p, []))
                   != param.shape[0]]
        if missing:
            raise GGUFError(f"{name}: no tensors for {', '.join(missing[:6])}"
                            f"{' ...' if len(missing) > 6 else ''} (the metadata's config "
                            "describes more than the file holds)")
        modules = dict(model.named_modules())
        linears = {f"{n}.weight" for n, m in modules.items() if isinstance(m, Linear)}
        tables = {f"{n}.weight" for n, m in modules.items() if isinstance(m, nn.Embedding)}
        for ours, found in parts.items():
            n, k = params[ours].shape if params[ours].dim() == 2 else (0, 0)
            types = {info.ggml_type for info, _ in found}
            if self.as_blocks and ours in linears and all(
                    takes(info.type_name, k) for info, _ in found):
                self.blocks[ours] = found
            elif (self.as_blocks and ours in tables and found[0][0].name == "token_embd.weight"
                  and len(found) == 1 and found[0][1] is None
                  and takes(found[0][0].type_name, k)):
                self.embedding = (ours, found[0][0])
                self.tied_heads = [name for name, m in modules.items() if isinstance(m, Linear)
                                   and m.weight is params[ours]]
            elif (not self.as_blocks and not self.dequantize_all and ours in linears
                  and types <= set(STORED_INT4) and int4_supported(n, k, BLOCK)):
                self.stored[ours] = found
            elif (self.stored_q8 and ours in linears and k % BLOCK == 0
                  and types == {GGMLQuantizationType.Q8_0}):
                self.int8[ours] = found
            else:
                self.dense += [(hf_name(info.name, self.family), info) for info, _ in found]
                for info, _ in found:
                    self.reasons[info.name] = self._reason(info, found, ours in linears, k)
        self.dense.sort(key=lambda item: item[1].offset)  # file order

    def _reason(self, info: TensorInfo, found: list[Part], linear: bool, k: int) -> str:
        """Why tensor `info` (a part of a weight made of `found`) is dequantized."""
        if info.type_name in ("F32", "F16", "BF16"):
            return "values (read in the model dtype)"
        if not linear:
            return ("the token embedding table (looked up in the model dtype)"
                    if info.name.startswith("token_embd") else "not a linear's weight")
        if not self.as_blocks:
            return self.why_dense
        if not takes(info.type_name, k):
            return (f"no kernel for {info.type_name} (IQ types, Q2_K and Q3_K are dequantized)"
                    if info.type_name not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
                    else f"rows of {k} are not whole {info.type_name} blocks")
        other = next(i.type_name for i, _ in found if not takes(i.type_name, k))
        return f"shares a linear with a {other} tensor, which is dequantized"

    def defer(self, model: nn.Module) -> list[str]:
        """build_on_meta's `defer`: the weights of the linears placed here (not streamed)."""
        return [*self.blocks, *self.stored, *self.int8,
                *([self.embedding[0]] if self.embedding else [])]

    def _blocks(self, info: TensorInfo) -> tuple[torch.Tensor, bool]:
        """A tensor's blocks [rows, row bytes] in transformers' row order: a view of the file's
        mapping where the rows stay in the file's order (and mapping is on), else a copy read
        from the file. -> (blocks, whether a view)."""
        if mapping_enabled() and not self.rearrange.moves(info.name):
            return self.file.view(info), True
        rows = np.ascontiguousarray(self.rearrange.rows(info.name, self.file.read(info)))
        return torch.from_numpy(rows), False

    @torch.no_grad()
    def place_stored(self, model: nn.Module, dtype: torch.dtype,
                     progress: StageProgress | None = None,
                     repacks: RepackStore | None = None) -> None:
        """Replace each linear that runs as stored by a BlockLinear holding its blocks, or a
        QuantizedLinear at group 32 made from them, int4 or int8 (its bias, if any, is left for
        the loader to fill); the embedding table in its blocks by a BlockEmbedding, and each
        head tied to it by a BlockLinear on the same bytes. The blocks our kernels run in
        another layout are repacked, or read back from `repacks` (and kept there when made
        here: models/gguf/repacks.py). The model keeps the file's mapping its blocks view.
        `progress` hears of each linear (and the table) placed."""
        total = (len(self.blocks) + len(self.stored) + len(self.int8)
                 + (self.embedding is not None))
        if not total:
            return
        stage = ("placing the file's blocks" if not (self.stored or self.int8)
                 else "repacking the file's blocks as our int4 / int8")
        placed = StageCounter(stage, total, progress)
        repacker = Repacker(repacks)
        views = False
        for weight, found in self.blocks.items():
            owner, attr, linear = _linear(model, weight)
            n, k = linear.out_features, linear.in_features
            parts = sorted(((_rows(shard, n).start, info) for info, shard in found),
                           key=lambda part: part[0])
            # (type, blocks, the file offset past them when a view, the tensors' names): a
            # part joins the one before when of its type and back to back in the file (one
            # view over both), or when both are copies.
            blocks: list[tuple[str, torch.Tensor, int | None, str]] = []
            for _, info in parts:
                rows, view = self._blocks(info)
                views |= view
                last = blocks[-1] if blocks else None
                if last is not None and last[0] == info.type_name and view and (
                        last[2] == info.offset):
                    start = info.offset - last[1].nbytes
                    joined = self.file.mapping().view(start, last[1].nbytes + info.nbytes)
                    blocks[-1] = (info.type_name, joined.view(-1, rows.shape[1]),
                                  info.offset + info.nbytes, f"{last[3]}+{info.name}")
                elif last is not None and last[0] == info.type_name and not view and (
                        last[2] is None):
                    blocks[-1] = (info.type_name, torch.cat([last[1], rows]), None,
                                  f"{last[3]}+{info.name}")
                else:
                    blocks.append((info.type_name, rows,
                                   info.offset + info.nbytes if view else None, info.name))
            bias = None if linear.bias is None else torch.empty(n, dtype=dtype)
            setattr(owner, attr, BlockLinear(
                [repacker.part(key, t, b, k) for t, b, _, key in blocks], k, bias))
            placed.step()
        if self.embedding is not None:
            weight, info = self.embedding
            owner, attr, table = _linear(model, weight)
            rows, view = self._blocks(info)
            views |= view
            # a table a head is tied to is held in the head's kernel layout, which its
            # lookups read too
            embedding = repacker.embedding(info.name, rows, info.type_name,
                                           table.embedding_dim, dtype, bool(self.tied_heads))
            setattr(owner, attr, embedding)
        repacker.finish(model)  # before the heads are tied: they share the table's blocks
        if self.embedding is not None:
            for head in self.tied_heads:
                owner, attr, _ = _linear(model, f"{head}.weight")
                setattr(owner, attr, embedding.tied_head())
            placed.step()
        if views:
            keep(model, [self.file.mapping()])
        for weight, found in self.stored.items():
            owner, attr, linear = _linear(model, weight)
            n, k = linear.out_features, linear.in_features
            q = torch.empty(n, k, dtype=torch.uint8)
            sz = torch.empty(k // BLOCK, n, 2, dtype=torch.bfloat16)
            for info, shard in found:
                rows = _rows(shard, n)
                q[rows], values = read_int4(self.file, info, self.rearrange)
                sz[:, rows] = values.transpose(0, 1)
            bias = None if linear.bias is None else torch.empty(n, dtype=dtype)
            setattr(owner, attr, QuantizedLinear.from_int4(pack_int4(q), sz, bias, BLOCK))
            placed.step()
        for weight, found in self.int8.items():
            owner, attr, linear = _linear(model, weight)
            n, k = linear.out_features, linear.in_features
            q = torch.empty(n, k, dtype=torch.int8)
            scales = torch.empty(n, k // BLOCK, dtype=torch.bfloat16)
            for info, shard in found:
                rows = _rows(shard, n)
                q[rows], scales[rows] = read_int8(self.file, info, self.rearrange)
            bias = None if linear.bias is None else torch.empty(n, dtype=dtype)
            setattr(owner, attr, QuantizedLinear.from_int8(q, scales, bias, BLOCK))
            placed.step()

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor in `dtype`) of every tensor not placed as stored."""
        for checkpoint, info in self.dense:
            yield checkpoint, read_dense(self.file, info, self.rearrange, dtype)

    def type_counts(self) -> dict[str, dict[str, int]]:
        """Tensors per block type: {"as stored": {type: count}, "dequantized (<why>)": ...}."""
        table: dict[str, Counter] = {}
        for found in self.blocks.values():
            table.setdefault("as stored", Counter()).update(i.type_name for i, _ in found)
        if self.embedding is not None:
            table.setdefault("as stored", Counter())[self.embedding[1].type_name] += 1
        for found in [*self.stored.values(), *self.int8.values()]:
            table.setdefault("as our int4 / int8 (scales rounded to bfloat16)", Counter()).update(
                i.type_name for i, _ in found)
        for _, info in self.dense:
            why = self.reasons.get(info.name, "")
            table.setdefault(f"dequantized ({why})", Counter())[info.type_name] += 1
        return {key: dict(counts.most_common()) for key, counts in table.items()}

    def resident_bytes(self, dtype: torch.dtype) -> int:
        """The weights' bytes as loaded (without a requested quantization): blocks as in the
        file (or as repacked for our decode kernel: models.kernels.ggml_blocks.held_bytes), our
        int4 / int8 with their scales, the rest at `dtype`."""
        def held(info: TensorInfo) -> int:  # its rows of shape[-1] values, as held
            return held_bytes(info.type_name, info.numel // info.shape[-1], info.shape[-1])

        blocks = sum(held(info) for found in self.blocks.values() for info, _ in found)
        if self.embedding is not None:
            info = self.embedding[1]
            blocks += held(info) if self.tied_heads else info.nbytes
        stored = sum(info.numel for parts in self.stored.values() for info, _ in parts)
        int8 = sum(info.numel for parts in self.int8.values() for info, _ in parts)
        dense = sum(info.numel for _, info in self.dense)
        scales = stored // BLOCK * 4 + int8 // BLOCK * 2
        return blocks + stored // 2 + int8 + scales + dense * dtype.itemsize

    def summary(self) -> str:
        """One line: the tensors per block type, as stored and dequantized (with why)."""
        parts = []
        for key, counts in self.type_counts().items():
            listed = ", ".join(f"{n} {t}" for t, n in counts.items())
            parts.append(f"{key}: {listed}")
        if self.blocks:
            parts.append(f"{len(self.blocks)} linears in their blocks")
        if self.embedding is not None:
            parts.append("the embedding table in its blocks" + (
                " (the head tied to it too)" if self.tied_heads else ""))
        return "; ".join(parts)


def _linear(model: nn.Module, weight: str) -> tuple[nn.Module, str, nn.Module]:
    owner_name, _, attr = weight.removesuffix(".weight").rpartition(".")
    owner = model.get_submodule(owner_name)
    return owner, attr, getattr(owner, attr)


def _rows(shard: Shard | None, n: int) -> slice:
    return slice(0, n) if shard is None else slice(shard.start, shard.start + shard.size)


def load_gguf(path: Path, hf_config: Any, factory: Callable[[], nn.Module], device: torch.device,
              dtype: torch.dtype, observer: LoadObserver | None,
              defer: Callable[[nn.Module], list[str]] | None, dequantize_all: bool,
              mmproj: Path | None = None, progress: StageProgress | None = None,
              stage: str = "reading weights",
              repacks: RepackStore | None = None) -> tuple[nn.Module, str]:
    """Build the model with `factory` and fill it from the GGUF file at `path` (see the module
    docstring), and its tower and projector from the projector file `mmproj`, if any
    (models/gguf/mmproj.py); `observer` and `defer` as for models.loader (weights quantized as
    they load). Blocks run as stored only on the CPU (our int kernels); Q8_0 ones when no
    quantization or int8 is asked. `progress` hears of the linears placed in their blocks and
    of each tensor read (under `stage`); `repacks` keeps the blocks repacked for our
    kernels between starts (models/gguf/repacks.py). -> (model, what ran as stored)."""
    int8_asked = isinstance(observer, QuantizeOnLoad) and observer.mode == "int8"
    why = ("dequantize_gguf asked" if dequantize_all else f"the model runs on {device.type}"
           if device.type != "cpu" else f"{observer.mode} asked: requantized"
           if isinstance(observer, QuantizeOnLoad) else "")
    weights = GGUFWeights(path, hf_config, dequantize_all or device.type != "cpu",
                          stored_q8=observer is None or int8_asked,
                          as_blocks=observer is None, why_dense=why)
    projector, names = None, _same_name
    with on_meta():
        probe = factory()
    mapping = probe.checkpoint_map()
    if mmproj is not None:
        projector = projector_weights(mmproj)
        names = projector.text_name
    weights.plan(probe, lambda name: mapping(names(name)),
                 projector.plan(probe, mapping) if projector else ())
    del probe

    def defer_all(model: nn.Module) -> list[str]:
        return sorted({*weights.defer(model), *(defer(model) if defer else [])})

    model = build_on_meta(factory, device, dtype,
                          defer=defer_all if (weights.blocks or weights.stored or weights.int8
                                              or weights.embedding or defer) else None)
    weights.place_stored(model, dtype, progress, repacks)
    tensors = ((names(name), tensor) for name, tensor in weights.tensors(dtype))
    if projector is not None:
        tensors = itertools.chain(tensors, projector.tensors(dtype))
    total = len(weights.dense) + (0 if projector is None else len(projector.targets))
    tensors = counted(tensors, stage, total, progress)
    load_weights(model, tensors, model.checkpoint_map(), observer)
    summary = weights.summary() + ("" if projector is None else f"; {projector.summary()}")
    log.info("%s: %s", path.name, summary)
    return model, summary


def _same_name(name: str) -> str:
    return name
