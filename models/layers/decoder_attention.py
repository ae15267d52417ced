"""The self-attention of one decoder layer over the paged cache (`Attention`): q/k/v fused
into one matmul, RoPE on the first `rotary_dim` dimensions of each head, RMSNorm over each
head's q and k (`qk_norm`), values normalized (`v_norm`), an output gate, and layers that read
another layer's keys and values (`kv_source`), another model's (`external_kv`: Gemma 4's
assistant) or whose values are their keys. Its options are the layer's `DecoderConfig`
(models/layers/decoder_config.py); the attention itself is models/layers/attention.py.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from models.kernels.linear import Linear
from models.layers.activations import rowwise
from models.layers.attention import LayerAttention, paged_attention
from models.layers.attention_metadata import AttentionMetadata
from models.layers.decoder_config import DecoderConfig
from models.layers.norm import RMSNorm, rms_norm_unscaled
from models.layers.rotary import apply_rotary


class Attention(nn.Module):
    """GQA attention of one layer over the paged cache. A layer with a `kv_source` has only its
    query projection: it reads the keys and values that layer stored (in the cache, and for this
    step's own tokens in `meta.shared_kv`) and stores none."""

    def __init__(self, cfg: DecoderConfig, layout: LayerAttention, index: int = 0) -> None:
        super().__init__()
        shape = cfg.shape(index)
        self.index = index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads, shape.num_kv_heads, shape.head_dim,
        )
        self.q_size = cfg.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = cfg.attn_scale or self.head_dim**-0.5
        self.layout = layout
        self.rotary_dim = cfg.rotary_dim or self.head_dim
        self.output_gate = cfg.attn_output_gate
        self.kv_source = shape.kv_source  # None: keys and values of its own
        self.external_kv = shape.external_kv
        # Whether the layer computes (and stores) keys and values of its own.
        self.own_kv = self.kv_source is None and not self.external_kv
        self.values_are_keys = shape.values_are_keys
        # q_proj's rows: per head, its query then (with the output gate) its gate.
        self.q_rows = 2 * self.q_size if self.output_gate else self.q_size
        self.kv_rows = (0 if not self.own_kv
                        else self.kv_size * (1 if self.values_are_keys else 2))
        self.qkv_proj = Linear(cfg.hidden_size, self.q_rows + self.kv_rows, cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            head_norm = functools.partial(RMSNorm, self.head_dim, cfg.rms_norm_eps,
                                          cfg.norm_unit_offset, fused_decode=True,
                                          float32_scale=cfg.norm_float32_scale)
            self.q_norm = head_norm()
            if self.own_kv:
                self.k_norm = head_norm()
        self.qk_norm = cfg.qk_norm
        self.v_norm = cfg.v_norm
        self.eps = cfg.rms_norm_eps
        # Whether a later layer reads this layer's keys and values (kept for the step).
        self.shares_kv = cfg.is_kv_source(index)
        # Bound by the model runner (a layer with a kv_source gets its source's cache).
        self.kv_cache = torch.empty(0)

    def forward(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        if not self.own_kv or self.values_are_keys:
            return self._forward_shaped(x, cos, sin, meta)
        t = x.shape[0]
        gate = None
        if self.output_gate:
            qg, k, v = self.qkv_proj(x).split([self.q_rows, self.kv_size, self.kv_size], dim=-1)
            q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            qk = torch.cat([q, k.view(t, self.num_kv_heads, self.head_dim)], dim=1)
        else:
            qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
            qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            # Contiguous heads: at a decode step's rows the norms then run our fused kernel,
            # which normalises each head alone whatever the row count, as the one-call decode
            # does (a verification's rows then equal decodes of their tokens to the bit).
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q.contiguous()), self.k_norm(k.contiguous())], dim=1)
        # q and k are adjacent in the fused projection: rotate both heads at once.
        qk = self._rotate(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.v_norm:
            v = rms_norm_unscaled(v, self.eps)
        out = self._attend(q, k, v, meta)
        if gate is not None:
            out = out * rowwise("sigmoid", gate.reshape(t, self.q_size))
        return self.o_proj(out)

    def _rotate(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        r = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def _forward_shaped(self, x, cos, sin, meta: AttentionMetadata) -> torch.Tensor:
        """A layer that reads another's (or another model's) keys and values, or whose values
        are its keys (no output gate in any)."""
        t = x.shape[0]
        proj = self.qkv_proj(x)
        q = proj[:, : self.q_size].view(t, self.num_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q.contiguous())  # contiguous: see forward
        q = self._rotate(q, cos, sin)
        if self.external_kv:  # every row a decode: the keys are read from the cache alone
            return self.o_proj(paged_attention(q, None, None, self.kv_cache, meta, self.scale,
                                               self.layout, store=False))
        if self.kv_source is not None:
            k, v = meta.shared_kv[self.kv_source]
            return self.o_proj(paged_attention(q, k, v, self.kv_cache, meta, self.scale,
                                               self.layout, store=False))
        raw = proj[:, self.q_size :].contiguous().view(t, self.num_kv_heads, self.head_dim)
        k = self._rotate(self.k_norm(raw) if self.qk_norm else raw, cos, sin)
        v = rms_norm_unscaled(raw, self.eps) if self.v_norm else raw
        return self.o_proj(self._attend(q, k, v, meta))

    def _attend(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        if self.shares_kv:  # a later layer reads this step's keys and values
            meta.shared_kv[self.index] = (k, v)
        return paged_attention(q, k, v, self.kv_cache, meta, self.scale, self.layout)
