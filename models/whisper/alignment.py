"""The attention probabilities of chosen cross-attention heads (Whisper's alignment heads) over
a window's tokens: one teacher-forced pass of the decoder in plain torch, for word timestamps.

The engine decodes a window with its paged KV cache and never materializes attention
probabilities; once the window's tokens are decided, this pass runs the decoder over the
prompt and the generated tokens at once (causal self-attention among them, cross-attention
over the window's cached keys and values, [L, 2, H, n, D] as `encode` returns them) and keeps
softmax(q k^T / sqrt(D)) of the asked (layer, head) pairs, as transformers' eager attention
returns them with `output_attentions`. Layers past the deepest asked one are not run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from models.layers.activations import TORCH


def alignment_probabilities(model: Any, input_ids: torch.Tensor, states: torch.Tensor,
                            heads: Sequence[tuple[int, int]]) -> torch.Tensor:
    """input_ids [T] (positions 0..T-1), states [L, 2, H, n, D] -> [len(heads), T, n] float32:
    each (layer, head)'s attention probabilities over the n encoder positions."""
    layers = model.decoder.layers
    num_heads = layers[0].encoder_attn.num_heads
    for layer, head in heads:
        if not (0 <= layer < len(layers) and 0 <= head < num_heads):
            raise ValueError(f"alignment head ({layer}, {head}) is outside the decoder's "
                             f"{len(layers)} layers x {num_heads} heads")
    if not heads:
        raise ValueError("no alignment heads given")
    n = input_ids.shape[0]
    if n > model.decoder.embed_positions.num_embeddings:
        raise ValueError(f"{n} tokens exceed the decoder's "
                         f"{model.decoder.embed_positions.num_embeddings} positions")
    positions = torch.arange(n, device=input_ids.device)
    h = model.decoder.embed_tokens(input_ids) + model.decoder.embed_positions(positions)
    wanted: dict[int, list[int]] = {}
    for layer, head in heads:
        wanted.setdefault(layer, []).append(head)
    kept: dict[tuple[int, int], torch.Tensor] = {}
    for index, layer in enumerate(layers[: max(wanted) + 1]):
        attn = layer.self_attn
        x = layer.self_attn_layer_norm(h)
        q, k, v = (attn.heads(p(x)).transpose(0, 1) for p in (attn.q_proj, attn.k_proj,
                                                                attn.v_proj))  # [H, T, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale)
        h = h + attn.out_proj(out.transpose(0, 1).reshape(n, -1))
        cross = layer.encoder_attn
        x = layer.encoder_attn_layer_norm(h)
        q = cross.heads(cross.q_proj(x)).transpose(0, 1)  # [H, T, D]
        keys, values = states[index, 0].to(q.dtype), states[index, 1].to(q.dtype)  # [H, n, D]
        probs = ((q.float() @ keys.float().transpose(1, 2)) * cross.scale).softmax(-1)
        for head in wanted.get(index, ()):
            kept[index, head] = probs[head]
        if index == max(wanted):
            break
        out = (probs.to(values.dtype) @ values).transpose(0, 1).reshape(n, -1)
        h = h + cross.out_proj(out)
        h = h + layer.fc2(TORCH[layer.act](layer.fc1(layer.final_layer_norm(h))))
    return torch.stack([kept[pair] for pair in heads])
