"""Phi-4-multimodal's image embedding: a SigLIP tower over dynamic-HD crops, 2 x 2 pooling, the
crops laid out with their separators, and a two-layer projection.

Every crop of a step goes through the tower in one batch: patch embeddings, the position of each
patch (a crop's real patches spread over the whole position table, padding at 0:
models/phi4mm/preprocess.py computes them), then the blocks up to `feature_layer`, attending
only to the crop's real patches (a key mask; padding patches still produce outputs, which the
pooling may average in). The hidden state is average-pooled 2 x 2 into pooled_side^2 vectors
per crop. Per image (models/phi4mm/preprocess.py), in this order:

    the crops' pooled grid cut to its useful rows and columns, a learned separator
    (`sub_img_feature_extensor`) after each row; one `global_img_feature_extensor`; the global
    view's pooled grid with a separator after each row

then up-projection, GELU and down-projection into the decoder's width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.encoders.clip import ClipVisionConfig, ClipVisionTower
from models.kernels.linear import EncoderLinear
from models.layers.transfer import to_device
from models.layers.vit import Segments


class ImageEmbedding(nn.Module):
    """The checkpoint's `model.embed_tokens_extend.image_embed.` (tower: `img_processor.`)."""

    def __init__(self, vision_config, hidden_size: int) -> None:
        super().__init__()
        cfg = ClipVisionConfig.from_hf(vision_config)
        self.img_processor = ClipVisionTower(cfg)
        self.layer = self.img_processor.resolve_layers([vision_config.feature_layer])[0]
        if self.layer == 0:
            raise NotImplementedError("vision_config.feature_layer must name a block's output, "
                                      "not the embeddings")
        self.side = cfg.image_size // cfg.patch_size
        if self.side % 2:
            raise NotImplementedError(f"{self.side} patches per crop side: the odd-side "
                                      "reflection padding before pooling is not implemented")
        width = cfg.vit.width
        self.global_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, width))
        self.sub_img_feature_extensor = nn.Parameter(torch.zeros(1, 1, 1, width))
        self.img_projection_up = EncoderLinear(width, hidden_size)
        self.img_projection_down = EncoderLinear(hidden_size, hidden_size)

    def forward(self, items: list[dict]) -> list[torch.Tensor]:
        """Images' processed inputs (pixel_values, patch_mask, position_ids, grid, useful) ->
        embeddings [tokens, hidden] each, all crops in one tower forward."""
        tower = self.img_processor
        weight = tower.patch_embedding.weight
        device, dtype = weight.device, weight.dtype
        pixels = to_device(torch.cat([d["pixel_values"] for d in items]), device).to(dtype)
        positions = to_device(torch.cat([d["position_ids"] for d in items]), device)
        keys = to_device(torch.cat([d["patch_mask"] for d in items]).flatten(1), device)
        crops, patches = positions.shape
        x = tower.patch_embedding(pixels).flatten(2).transpose(1, 2)  # [C, P, width]
        x = (x + tower.position_embedding(positions)).reshape(crops * patches, -1)
        seg = Segments([patches] * crops, mask=keys[:, None, None, :])
        for block in tower.blocks[: self.layer]:
            x = block(x, seg)
        side, half = self.side, self.side // 2
        grid = x.view(crops, side, side, -1).permute(0, 3, 1, 2)
        pooled = F.avg_pool2d(grid, 2).permute(0, 2, 3, 1)  # [C, half, half, width]
        out, first = [], 0
        for d in items:
            (rows, cols), (useful_rows, useful_cols) = d["grid"], d["useful"]
            glob, subs = pooled[first], pooled[first + 1 : first + 1 + rows * cols]
            first += 1 + rows * cols
            subs = subs.reshape(rows, cols, half, half, -1).transpose(1, 2).reshape(
                rows * half, cols * half, -1)[:useful_rows, :useful_cols]
            out.append(torch.cat([self._with_separators(subs),
                                  self.global_img_feature_extensor[0],
                                  self._with_separators(glob)]))
        sizes = [len(o) for o in out]
        embeds = self.img_projection_down(F.gelu(self.img_projection_up(torch.cat(out))))
        return list(embeds.split(sizes))

    def _with_separators(self, grid: torch.Tensor) -> torch.Tensor:
        """[rows, cols, width] -> [rows * (cols + 1), width], a separator closing each row."""
        sep = self.sub_img_feature_extensor[0].expand(grid.shape[0], 1, -1)
        return torch.cat([grid, sep], dim=1).flatten(0, 1)

    def checkpoint_name(self, name: str):
        """A name inside the checkpoint's `image_embed.` -> ours (None: not used)."""
        if name.startswith("img_processor."):
            target = self.img_processor.checkpoint_name(name[len("img_processor."):])
            return None if target is None else ("img_processor." + target[0], target[1])
        return name, None
