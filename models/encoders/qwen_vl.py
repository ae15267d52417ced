"""The Qwen2-VL and Qwen2.5-VL vision towers, batched over every item of a step.

Patches of all items (images and videos, from any requests) are concatenated into one sequence;
attention never crosses an item's frame: each frame is a segment (Qwen2-VL), and Qwen2.5-VL's
windowed layers use smaller segments (windows of merged patches, after reordering the patches
window by window). The blocks are the shared ViT blocks (models/layers/vit.py) with 2-D rotary
angles; segments are padded into a batch on the host, so the forward is one SDPA call per layer with
a key-padding mask, no host sync and no Python loop per item. The merger fuses each 2x2 block of
patches into one LLM embedding; `VisionBatch.sizes` splits the output back per item."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.projectors import PatchMerger
from models.layers.transfer import to_device
from models.layers.vit import Segments, ViTConfig, vit_blocks


@dataclass
class VisionBatch:
    """Everything the tower needs for one step, built on the host from the items' grids."""

    pixel_values: torch.Tensor  # [N, C * tps * ps * ps]
    positions: torch.Tensor  # [N, 2] int64 (row, column) of each patch, block-major
    frames: Segments  # one segment per frame: full attention
    windows: Segments | None  # Qwen2.5-VL windowed attention (in window order)
    window_order: torch.Tensor | None  # [N / merge^2] merged-patch permutation into windows
    window_restore: torch.Tensor | None  # its inverse
    sizes: list[int]  # merged embeddings per item
    grids: list[tuple[int, int, int]]  # (t, h, w) in patches per item


@dataclass(frozen=True)
class VisionConfig:
    """Shape of either tower, read once from the checkpoint's vision_config."""

    width: int
    depth: int
    num_heads: int
    out_dim: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    in_channels: int
    hidden_act: str
    mlp_hidden: int
    norm: str  # "rms" (Qwen2.5-VL) or "layer" (Qwen2-VL)
    gated_mlp: bool  # Qwen2.5-VL
    window_size: int | None
    full_attention_layers: tuple[int, ...]
    rope_theta: float
    patch_bias: bool = False  # Qwen3-VL
    position_grid: int = 0  # side of a learned position table resampled per grid (Qwen3-VL)
    deepstack_layers: tuple[int, ...] = ()  # blocks whose outputs feed DeepStack mergers

    @classmethod
    def from_hf(cls, vc) -> VisionConfig:
        """Read a Qwen2-VL, Qwen2.5-VL (Qwen2.5-Omni's too), Qwen3-VL or Qwen3.5 vision config
        (the MoE variants' towers are their dense family's)."""
        rope_theta = float((getattr(vc, "rope_parameters", None) or {}).get("rope_theta", 1e4))
        common = dict(depth=vc.depth, num_heads=vc.num_heads, patch_size=vc.patch_size,
                      temporal_patch_size=vc.temporal_patch_size,
                      merge_size=vc.spatial_merge_size, in_channels=vc.in_channels,
                      hidden_act=vc.hidden_act, rope_theta=rope_theta)
        if vc.model_type in ("qwen2_vl", "qwen2_vl_vision"):
            return cls(width=vc.embed_dim, out_dim=vc.hidden_size,
                       mlp_hidden=int(vc.embed_dim * vc.mlp_ratio), norm="layer",
                       gated_mlp=False, window_size=None, full_attention_layers=(), **common)
        if vc.model_type in ("qwen2_5_vl", "qwen2_5_vl_vision", "qwen2_5_omni_vision_encoder"):
            return cls(width=vc.hidden_size, out_dim=vc.out_hidden_size,
                       mlp_hidden=vc.intermediate_size, norm="rms", gated_mlp=True,
                       window_size=vc.window_size,
                       full_attention_layers=tuple(vc.fullatt_block_indexes), **common)
        if vc.model_type in ("qwen3_vl", "qwen3_vl_vision", "qwen3_5", "qwen3_5_vision",
                             "qwen3_vl_moe", "qwen3_vl_moe_vision", "qwen3_5_moe",
                             "qwen3_5_moe_vision"):
            side = math.isqrt(vc.num_position_embeddings)
            # Qwen3.5's tower is Qwen3-VL's without the DeepStack mergers.
            deepstack = () if vc.model_type.startswith("qwen3_5") else tuple(
                vc.deepstack_visual_indexes)
            return cls(width=vc.hidden_size, out_dim=vc.out_hidden_size,
                       mlp_hidden=vc.intermediate_size, norm="layer", gated_mlp=False,
                       window_size=None, full_attention_layers=(), patch_bias=True,
                       position_grid=side, deepstack_layers=deepstack, **common)
        raise NotImplementedError(f"vision tower {vc.model_type!r} is not supported")


def build_vision_batch(
    pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]], cfg: VisionConfig,
    device: torch.device, dtype: torch.dtype,
) -> VisionBatch:
    """Concatenate items and derive positions, frame segments and (2.5) window segments."""
    m = cfg.merge_size
    positions, frame_lengths, sizes = [], [], []
    order, window_lengths = [], []
    merged_offset = 0
    for t, h, w in grids:
        # Patch (row, col) in block-major order: each m x m block is contiguous.
        rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m)
        cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m)
        block = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], 1)
        positions.append(block.repeat(t, 1))
        frame_lengths += [h * w] * t
        sizes.append(t * h * w // (m * m))
        if cfg.window_size is not None:
            idx, lens = _window_order(t, h // m, w // m, cfg.window_size // m // cfg.patch_size)
            order.append(idx + merged_offset)
            window_lengths += [n * m * m for n in lens]
        merged_offset += t * h * w // (m * m)
    window_order = window_restore = windows = None
    if cfg.window_size is not None:
        perm = torch.cat(order)
        window_order = to_device(perm, device)
        window_restore = to_device(torch.argsort(perm), device)
        windows = Segments.build(window_lengths, device)
    pixels = torch.cat(pixel_values).to(dtype)
    return VisionBatch(
        pixel_values=pixels if device.type == "cpu" else to_device(pixels, device),
        positions=to_device(torch.cat(positions), device),
        frames=Segments.build(frame_lengths, device),
        windows=windows,
        window_order=window_order,
        window_restore=window_restore,
        sizes=sizes,
        grids=[tuple(g) for g in grids],
    )


def _window_order(t: int, gh: int, gw: int, win: int) -> tuple[torch.Tensor, list[int]]:
    """Merged-patch indices of a [t, gh, gw] grid listed window by window (win x win windows,
    the last ones cut at the edge), and the number of merged patches in each window."""
    index = torch.arange(t * gh * gw).view(t, gh, gw)
    order, lengths = [], []
    for f in range(t):
        for r in range(0, gh, win):
            for c in range(0, gw, win):
                window = index[f, r : r + win, c : c + win].flatten()
                order.append(window)
                lengths.append(window.numel())
    return torch.cat(order), lengths


class VisionTower(nn.Module):
    """Patch embedding (a Conv3d with stride == kernel, applied as one matmul), 2-D rotary,
    blocks, merger."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c, t, p = cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Module()
        self.patch_embed.proj.weight = nn.Parameter(torch.empty(cfg.width, c, t, p, p))
        if cfg.patch_bias:
            self.patch_embed.proj.bias = nn.Parameter(torch.empty(cfg.width))
        if cfg.position_grid:
            self.pos_embed = nn.Embedding(cfg.position_grid**2, cfg.width)
        self.blocks = vit_blocks(ViTConfig(
            width=cfg.width, depth=cfg.depth, num_heads=cfg.num_heads, mlp_hidden=cfg.mlp_hidden,
            act=cfg.hidden_act, norm=cfg.norm, norm_eps=1e-6, gated_mlp=cfg.gated_mlp,
            rotary=True,
        ))
        self.merger = PatchMerger(cfg.width, cfg.merge_size, cfg.out_dim, cfg.norm == "rms")
        # DeepStack: the outputs of some blocks, merged by their own mergers (normed after the
        # merge), become residuals for the decoder's first layers.
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg.width, cfg.merge_size, cfg.out_dim, False, postshuffle_norm=True)
            for _ in cfg.deepstack_layers
        )
        head_dim = cfg.width // cfg.num_heads
        quarter = head_dim // 2  # rows and columns each rotate half of the head dim
        steps = torch.arange(0, quarter, 2, dtype=torch.int64, device="cpu").float()
        self.inv_freq = 1.0 / cfg.rope_theta ** (steps / quarter)  # [head_dim / 4], not a param

    def forward(self, batch: VisionBatch) -> torch.Tensor:
        """-> merged embeddings [sum(sizes), out_dim], items in input order; with DeepStack
        layers [1 + K, sum(sizes), out_dim]: the embeddings, then the K residuals."""
        weight = self.patch_embed.proj.weight
        x = batch.pixel_values @ weight.view(weight.shape[0], -1).t()  # [N, width]
        if self.cfg.patch_bias:
            x = x + self.patch_embed.proj.bias
        if self.cfg.position_grid:
            x = x + self._learned_positions(batch.grids, x.dtype)
        freqs = batch.positions[..., None].float() * self.inv_freq.to(x.device)  # [N, 2, D/4]
        freqs = freqs.flatten(1)[:, None]  # [N, 1, D/2]: row angles, then column angles
        cos, sin = freqs.cos(), freqs.sin()
        if batch.window_order is not None:
            x, cos, sin = (self._by_window(t, batch.window_order) for t in (x, cos, sin))
        deepstack = []
        for i, block in enumerate(self.blocks):
            windowed = batch.windows is not None and i not in self.cfg.full_attention_layers
            x = block(x, batch.windows if windowed else batch.frames, (cos, sin))
            if i in self.cfg.deepstack_layers:
                merger = self.deepstack_merger_list[self.cfg.deepstack_layers.index(i)]
                deepstack.append(merger(x))
        merged = self.merger(x)
        if batch.window_restore is not None:
            merged = merged[batch.window_restore]
        return torch.stack([merged, *deepstack]) if deepstack else merged

    def _learned_positions(self, grids: list[tuple[int, int, int]], dtype) -> torch.Tensor:
        """The learned square table resampled (bilinear, corners aligned) to each item's
        [h, w] grid, in the patches' block-major order, repeated over t: [N, width]."""
        side, m = self.cfg.position_grid, self.cfg.merge_size
        table = self.pos_embed.weight.float().view(side, side, -1).permute(2, 0, 1)[None]
        pieces = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
            grid = grid.view(-1, h // m, m, w // m, m).permute(1, 3, 2, 4, 0).reshape(h * w, -1)
            pieces.append(grid.repeat(t, 1))
        return torch.cat(pieces).to(dtype)

    def _by_window(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        unit = self.cfg.merge_size**2
        return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)
