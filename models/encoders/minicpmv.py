"""The MiniCPM-V 4.6 vision tower: SigLIP blocks over NaViT-packed slices of any size, with a
window-attention merger inside the stack and a downsampling MLP after it.

Every slice (a picture's overview or one of its slices) is a segment of the packed sequence:
patch embeddings (a convolution over the packed rows), plus learned positions looked up on a
fixed side x side table at each patch's nearest bucket (its fractional row and column, so any
grid maps onto the table), then the blocks, attention staying inside each slice. After block
`insert_layer_id` (the "16x" mode), each 2 x 2 window of patches attends within itself, is
concatenated and goes through an MLP, plus the window's mean: every side halves. After the last
block and `post_layernorm`, each 2 x 2 block is concatenated, normed and projected by the
merger's MLP into the decoder's width (`merger_times` rounds, the last one into the decoder).

Host-built per step: the position ids and the orders that bring each slice's rows into 2 x 2
windows (both are arange arithmetic on the slices' grids, never read back from the device).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import nn

from models.kernels.linear import EncoderLinear
from models.layers.mlp import ACTIVATIONS
from models.layers.projectors import PatchMerger
from models.layers.transfer import to_device
from models.layers.vit import Segments, ViTAttention, ViTConfig, vit_blocks
from models.loader import Shard


@dataclass(frozen=True)
class MiniCPMVVisionConfig:
    """The tower's and the merger's settings, read once from the composite config."""

    vit: ViTConfig
    patch_size: int
    channels: int
    side: int  # the position table is side x side (image_size // patch_size)
    insert_layer_id: int
    merger_times: int
    out_width: int

    @classmethod
    def from_hf(cls, hf_config) -> MiniCPMVVisionConfig:
        vc = hf_config.vision_config
        for name, value in (("vision_config.window_kernel_size", vc.window_kernel_size),
                            ("merge_kernel_size", hf_config.merge_kernel_size)):
            if tuple(value) != (2, 2):  # transformers' merger MLPs are built 4x wide
                raise NotImplementedError(f"config.json {name}={list(value)}: only [2, 2]")
        depth = vc.num_hidden_layers
        if not 0 <= hf_config.insert_layer_id < depth:
            raise NotImplementedError(
                f"config.json insert_layer_id={hf_config.insert_layer_id}: the window merger "
                f"must follow one of the tower's {depth} blocks")
        if hf_config.merger_times < 1:
            raise NotImplementedError(f"config.json merger_times={hf_config.merger_times}")
        vit = ViTConfig(width=vc.hidden_size, depth=depth, num_heads=vc.num_attention_heads,
                        mlp_hidden=vc.intermediate_size, act=vc.hidden_act, norm="layer",
                        norm_eps=vc.layer_norm_eps)
        return cls(vit, vc.patch_size, vc.num_channels, vc.image_size // vc.patch_size,
                   hf_config.insert_layer_id, hf_config.merger_times,
                   hf_config.text_config.hidden_size)


@dataclass(frozen=True)
class SliceBatch:
    """A step's slices: each one's patch grid (h, w) and whether it is merged inside the tower
    ("16x") or not ("4x")."""

    grids: tuple[tuple[int, int], ...]
    merged: tuple[bool, ...]

    def out_grids(self) -> list[tuple[int, int]]:
        """Each slice's grid after the tower (halved where merged)."""
        return [(h // 2, w // 2) if m else (h, w)
                for (h, w), m in zip(self.grids, self.merged, strict=True)]

    def embeddings(self, merger_times: int) -> list[int]:
        """Each slice's embeddings after the merger."""
        return [h * w // 4**merger_times for h, w in self.out_grids()]


def window_order(h: int, w: int) -> torch.Tensor:
    """Row indices of an h x w grid (row-major) in 2 x 2 window order: windows row-major, and
    inside each window its top row, then its bottom row."""
    idx = torch.arange(h * w).view(h // 2, 2, w // 2, 2).permute(0, 2, 1, 3)
    return idx.reshape(-1)


def bucket_positions(h: int, w: int, side: int) -> torch.Tensor:
    """Position ids [h * w] of an h x w grid on a side x side table: each row (column) at the
    bucket its fraction i / h falls in (float32 arithmetic, as the reference's)."""
    bounds = torch.arange(1 / side, 1.0, 1 / side)
    rows = torch.bucketize(torch.arange(h) / h, bounds, right=True)
    cols = torch.bucketize(torch.arange(w) / w, bounds, right=True)
    return (rows[:, None] * side + cols).reshape(-1)


def _orders(grids: Sequence[tuple[int, int]]) -> torch.Tensor:
    """One gather index bringing every slice's rows (packed in order) into window order."""
    out, offset = [], 0
    for h, w in grids:
        if h % 2 or w % 2:
            raise ValueError(f"a slice of {h} x {w} patches cannot be merged in 2 x 2 windows")
        out.append(window_order(h, w) + offset)
        offset += h * w
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


class WindowMerger(nn.Module):
    """Each 2 x 2 window attends within itself (pre-normed, residual), then its four rows
    concatenated go through norm, MLP (tanh GELU), plus their mean: [4n, w] -> [n, w]."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        w, wide = cfg.width, 4 * cfg.width
        self.layer_norm1 = nn.LayerNorm(w, eps=cfg.norm_eps)
        self.attn = ViTAttention(cfg)
        self.pre_norm = nn.LayerNorm(wide, eps=cfg.norm_eps)
        self.linear_1 = EncoderLinear(wide, 4 * cfg.mlp_hidden)
        self.linear_2 = EncoderLinear(4 * cfg.mlp_hidden, w)
        self.act = ACTIVATIONS["gelu_pytorch_tanh"]  # the reference's, whatever hidden_act says

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [4n, w] in window order -> [n, w]."""
        x = x + self.attn(self.layer_norm1(x), Segments([4] * (x.shape[0] // 4)))
        windows = x.view(-1, 4, x.shape[-1])  # [n, 4, w]
        out = self.linear_2(self.act(self.linear_1(self.pre_norm(windows.flatten(1)))))
        return out + windows.mean(dim=1)


class MiniCPMVVisionTower(nn.Module):
    """NaViT-packed slices -> decoder-width embeddings, every slice of a step in one forward."""

    def __init__(self, cfg: MiniCPMVVisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.vit.width
        self.patch_embedding = nn.Conv2d(cfg.channels, w, cfg.patch_size, cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.side**2, w)
        self.blocks = vit_blocks(cfg.vit)
        self.vit_merger = WindowMerger(cfg.vit)
        self.post_layernorm = nn.LayerNorm(w, eps=cfg.vit.norm_eps)
        outs = [w] * (cfg.merger_times - 1) + [cfg.out_width]
        self.merger = nn.ModuleList(PatchMerger(w, 2, out, rms_norm=False, postshuffle_norm=True)
                                    for out in outs)

    def forward(self, pixels: torch.Tensor, batch: SliceBatch) -> torch.Tensor:
        """pixels [3, patch, N * patch] (the slices' packed rows, concatenated) -> embeddings
        [sum of batch.embeddings, out_width], slice after slice."""
        device = pixels.device
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixels[None].to(weight.dtype))[0, :, 0].t()  # [N, width]
        positions = torch.cat([bucket_positions(h, w, self.cfg.side) for h, w in batch.grids])
        x = x + self.position_embedding(to_device(positions, device))
        lengths = [h * w for h, w in batch.grids]
        seg = Segments.build(lengths, device)
        for i, block in enumerate(self.blocks):
            x = block(x, seg)
            if i == self.cfg.insert_layer_id and any(batch.merged):
                x = self._merge_windows(x, batch, lengths)
                seg = Segments.build([h * w for h, w in batch.out_grids()], device)
        x = self.post_layernorm(x)
        grids = batch.out_grids()
        for merger in self.merger:
            x = merger(x[to_device(_orders(grids), device)])
            grids = [(h // 2, w // 2) for h, w in grids]
        return x

    def _merge_windows(self, x: torch.Tensor, batch: SliceBatch,
                       lengths: list[int]) -> torch.Tensor:
        """The merged slices' rows through the window merger; the others' rows as they are,
        every slice still in its place."""
        device = x.device
        if all(batch.merged):
            return self.vit_merger(x[to_device(_orders(batch.grids), device)])
        starts = list(accumulate(lengths, initial=0))
        merged = [(h, w, starts[i]) for i, ((h, w), m) in
                  enumerate(zip(batch.grids, batch.merged, strict=True)) if m]
        windows = torch.cat([window_order(h, w) + s for h, w, s in merged])
        out = self.vit_merger(x[to_device(windows, device)])  # [sum(h * w) / 4, width]
        # Rebuild slice by slice from x (unmerged) and out (merged), rows of x first.
        order, done = [], 0
        for i, m in enumerate(batch.merged):
            if m:
                n = lengths[i] // 4
                order.append(torch.arange(done, done + n) + x.shape[0])
                done += n
            else:
                order.append(torch.arange(starts[i], starts[i] + lengths[i]))
        return torch.cat([x, out])[to_device(torch.cat(order), device)]


def tower_checkpoint_name(name: str, width: int) -> tuple[str, Shard | None] | None:
    """A name inside the checkpoint's `vision_tower.` -> ours (q, k, v fused into one
    matmul), or None for a tensor not used."""
    if name.endswith("position_ids"):
        return None
    if name.startswith("embeddings."):
        return name[len("embeddings."):], None
    renames = {"layer_norm1": "norm1", "layer_norm2": "norm2", "mlp.fc1": "mlp.fc1",
               "mlp.fc2": "mlp.fc2", "self_attn.out_proj": "attn.proj"}
    qkv = {"self_attn.q_proj": 0, "self_attn.k_proj": 1, "self_attn.v_proj": 2}
    if name.startswith("encoder.layers."):
        layer, rest = name[len("encoder.layers."):].split(".", 1)
        prefix = f"blocks.{layer}."
    elif name.startswith("vit_merger.self_attn."):
        prefix, rest = "vit_merger.", name[len("vit_merger."):]
    else:
        return name, None
    module, param = rest.rsplit(".", 1)
    if module in qkv:
        return prefix + "attn.qkv." + param, Shard(qkv[module] * width, width)
    if module in renames:
        return prefix + renames[module] + "." + param, None
    raise ValueError(f"unexpected vision tower tensor {name}")


def merger_checkpoint_name(name: str) -> str:
    """A name inside the checkpoint's `merger.` (mlp.{i}.pre_norm / linear_1 / linear_2) ->
    ours (merger.{i}.ln_q / mlp.0 / mlp.2)."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "mlp":
        raise ValueError(f"unexpected merger tensor merger.{name}")
    renames = {"pre_norm": "ln_q", "linear_1": "mlp.0", "linear_2": "mlp.2"}
    if parts[2] not in renames:
        raise ValueError(f"unexpected merger tensor merger.{name}")
    return f"merger.{parts[1]}.{renames[parts[2]]}.{parts[3]}"
