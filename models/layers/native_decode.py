"""A decoder's decode steps through all of its layers in one native call (`mm_decode_layers`
of models/kernels/cpu/decode_layers.c), on the CPU.

At a decode's few rows, calling a layer's dozen small operations one by one from Python costs
about as much as the smaller ones compute. The native call runs the same kernels the modules
would run at those rows (models.kernels.native), in their order and with their roundings, so its
result is theirs to the bit; it only replaces the calls. It therefore takes a step only where
the modules would run exactly those kernels:

- the layers have the shape the kernel implements (pre-norm residual, optionally with norms
  of the attention's and the MLP's outputs too (sandwich norms: Gemma 3), a gated MLP with
  SiLU or GELU, attention without soft-capping, over all keys or a sliding window per layer;
  optional q / k norms and biases; a KV cache in the model dtype or int8
  (models/layers/kv_quant.py, quantized as the modules do); every layer of one shape, with
  keys and values of its own, no per-layer inputs or output scalars), with the fused decode
  ops on, which `unsupported` checks once when the runner prepares the model;
- every linear's planned formulation (models.kernels.linear_choice) for the step's row count
  is ours ("native"): where PyTorch's measured faster for some layer, the modules run; a
  linear held in a GGUF file's blocks (models.kernels.ggml_blocks.BlockLinear) is taken at
  the row counts its module runs the blocks' matrix-vector kernel at (FEW_ROWS at most);
- the step decodes only (one token per request), attended by our paged kernel
  (models.layers.decode_attention_choice chose it), at most models.kernels.native.FUSED_ROWS
  tokens, with no per-layer media residuals and no request using a LoRA adapter (the
  adapters' updates are added by the modules' linears: models/layers/lora.py).

`MMSERVE_NATIVE_DECODE=0` keeps the modules (for A/B runs: bench/decode_ab.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from models.kernels import native
from models.kernels.choice import BUCKET_LAST_ROWS, BUCKETS, bucket_index
from models.kernels.ggml_blocks import FEW_ROWS, BlockLinear
from models.kernels.linear import Linear
from models.kernels.native_interface import DecoderDesc, LayerDesc, LinearDesc
from models.kernels.native_linear import linear_desc
from models.kernels.quantization import QuantizedLinear
from models.layers.attention_metadata import AttentionMetadata
from models.layers.decoder_attention import Attention
from models.layers.decoder_config import DecoderConfig
from models.layers.decoder_layer import DecoderLayer
from models.layers.mlp import GatedMLP
from models.layers.norm import RMSNorm

log = logging.getLogger(__name__)

DISABLE_ENV = "MMSERVE_NATIVE_DECODE"  # "0": decode steps through the modules
# the MLP activations (transformers' names) the call computes as the modules do at a decode's
# rows (mm_silu_mul; mm_activation's kinds, as models/layers/activations.py's `rowwise`)
ACTIVATIONS = {name: native.ACTIVATIONS[kind] for name, kind in (
    ("silu", "silu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu", "gelu"))}


class DecoderStack(Protocol):
    """What the call reads of a decoder (models.layers.decoder.Decoder): its shape, its layers
    (whose forwards it replaces) and the dtype and device of its weights."""

    cfg: DecoderConfig
    embed_tokens: torch.nn.Embedding
    layers: Sequence[DecoderLayer]


def unsupported(model: DecoderStack) -> str | None:
    """Why the native decode call cannot run this model's layers, or None if it can."""
    dtype = model.embed_tokens.weight.dtype
    if model.embed_tokens.weight.device.type != "cpu" or dtype not in native.DTYPES:
        return "it runs float32 or bfloat16 models on the CPU"
    norms: list[RMSNorm] = []
    for i, layer in enumerate(model.layers):
        if layer.is_linear:
            return "linear-attention (Gated DeltaNet) layers are not implemented"
        if layer.mixer != "attention":
            return f"{layer.mixer} layers are not implemented"
        if model.cfg.is_sparse(i):
            return "mixture-of-experts layers are not implemented"
        attn, mlp = layer.self_attn, layer.mlp
        # The kernel implements these classes' forwards; a family overriding one is not served.
        if (type(layer).forward is not DecoderLayer.forward
                or type(layer).feed_forward is not DecoderLayer.feed_forward
                or type(attn).forward is not Attention.forward
                or type(mlp).forward is not GatedMLP.forward):
            return f"layer {i} runs a forward of its own"
        if attn.output_gate or attn.rotary_dim != attn.head_dim:
            return "attention output gates and partial rotary embeddings are not implemented"
        cfg = model.cfg
        if (attn.num_kv_heads, attn.head_dim) != (cfg.num_kv_heads, cfg.head_dim) or (
                mlp.intermediate != cfg.intermediate_size):
            return "layers of different shapes are not implemented"
        if attn.kv_source is not None or attn.values_are_keys or attn.v_norm:
            return ("layers sharing keys and values, values that are the keys and value norms "
                    "are not implemented")
        if layer.per_layer_input is not None or layer.scaled:
            return "per-layer inputs and layer output scalars are not implemented"
        if mlp.activation not in ACTIVATIONS or not mlp.fused_decode:
            return f"the MLP activation {mlp.activation} is not implemented"
        if attn.layout.softcap is not None:
            return "attention soft-capping is not implemented"
        # [2, Hkv, blocks, block_size, D] (or int8 rows [.., D + 4]) once the runner binds it
        cache = attn.kv_cache
        if cache.dim() != 5 or not cache.is_contiguous() or cache.dtype not in (dtype,
                                                                               torch.int8):
            return "the KV cache is not bound"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if layer.sandwich:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        if attn.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if isinstance(linear, BlockLinear):
                if linear.bias is not None and (linear.bias.dtype != dtype
                                                or not linear.bias.is_contiguous()):
                    return "a block linear's bias is not in the model dtype"
                continue  # its parts' blocks are contiguous (BlockPart)
            if not isinstance(linear, Linear | QuantizedLinear):
                return f"layer {i} has a linear of an unknown kind"
            weights = [linear.qweight, linear.scales] if linear.is_quantized else [linear.weight]
            if linear.bias is not None:
                weights.append(linear.bias)
            if not all(w.is_contiguous() for w in weights):
                return "a weight is not contiguous"
            if not linear.is_quantized and linear.weight.dtype != dtype:
                return "a weight is not in the model dtype"
    if any(not n.fused_decode or n.weight.dtype != dtype for n in norms):
        return "a norm does not take the fused decode path"
    if len({(n.eps, n.norm_mode(dtype)) for n in norms}) > 1:
        return "the norms differ in epsilon or convention"
    if len({layer.self_attn.scale for layer in model.layers}) > 1:
        return "the layers' attention scales differ"
    if len({layer.mlp.activation for layer in model.layers}) > 1:
        return "the layers' MLP activations differ"
    if all(layer.self_attn.layout.sliding_window is not None for layer in model.layers):
        # the windowed layers read the full view's block table (_decode_tables), which a
        # step's metadata holds only where some layer sees every key
        return "sliding windows on every layer are not implemented"
    return None


class NativeDecode:
    """The decode-step call for one model, with its layers' weights and caches described once.
    `run` returns None for a step it does not take (then the modules run it)."""

    def __init__(self, model: DecoderStack, kernels: native.NativeKernels) -> None:
        self.dtype = model.embed_tokens.weight.dtype
        self._call = kernels.decode_layers  # bound by models.kernels.native_interface
        cfg, first = model.cfg, model.layers[0]
        cache = first.self_attn.kv_cache  # [2, Hkv, blocks, block_size, D or D + 4 (int8)]
        norm = first.input_layernorm
        mode = native.NORM_MODES[norm.norm_mode(self.dtype)]
        self.desc = DecoderDesc(
            dtype=native.DTYPES[self.dtype], norm_mode=mode, eps=norm.eps,
            scale=first.self_attn.scale, hidden=cfg.hidden_size, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            act=ACTIVATIONS[first.mlp.activation],
            intermediate=cfg.intermediate_size, num_blocks=cache.shape[2],
            block_size=cache.shape[3], kv_int8=int(cache.dtype == torch.int8))
        # Pointers to the weights and KV caches as they are now: the runner binds the caches
        # once, before it prepares the model (a model re-bound must be prepared again).
        # block linears' later parts, read through the layers' chains
        self._parts: list[LinearDesc] = []
        self.layers = (LayerDesc * len(model.layers))(
            *(_layer_desc(layer, self._parts) for layer in model.layers))
        # Per row-count bucket: whether every linear's plan there is our kernel (a block
        # linear's: its matrix-vector kernel, up to FEW_ROWS rows).
        linears = [m for layer in model.layers for m in layer.modules()
                   if isinstance(m, Linear | QuantizedLinear)]
        blocks = any(isinstance(m, BlockLinear) for layer in model.layers
                     for m in layer.modules())
        self.buckets = tuple(
            all(m.kernels is not None and m.kernels[b] == "native" for m in linears)
            and not (blocks and (b >= len(BUCKET_LAST_ROWS) or BUCKET_LAST_ROWS[b] > FEW_ROWS))
            for b in range(len(BUCKETS)))

    @classmethod
    def build(cls, model: DecoderStack) -> NativeDecode | None:
        """The call for this model, or None (logged) where it cannot run its layers."""
        kernels = native.load()
        if os.environ.get(DISABLE_ENV, "1") == "0":
            reason = f"disabled by {DISABLE_ENV}=0"
        elif kernels is None:
            reason = f"no native kernels ({native.status().detail})"
        else:
            reason = unsupported(model)
        if reason is not None:
            log.info("decode steps run through the modules: %s", reason)
            return None
        decode = cls(model, kernels)
        served = [b for b, ok in zip(BUCKETS, decode.buckets, strict=True) if ok]
        if not served:
            log.info("decode steps run through the modules: at no row count are all linears "
                     "planned to run our kernels")
            return None
        log.info("decode steps of %s rows run the layers in one native call", ", ".join(served))
        return decode

    def run(self, h: torch.Tensor, rotary: list[tuple[torch.Tensor, torch.Tensor]],
            meta: AttentionMetadata) -> torch.Tensor | None:
        """h [m, H] entering the first layer -> the states leaving the last, or None when this
        step is not one the call takes. rotary: (cos, sin) [m, 1, D / 2] per rope table."""
        m = h.shape[0]
        if (meta.adapters is not None or h.dim() != 2 or m > native.FUSED_ROWS
                or h.dtype != self.dtype
                or h.device.type != "cpu" or not self.buckets[bucket_index(m)]):
            return None
        tables = _decode_tables(meta, m)
        half = self.desc.head_dim // 2
        if tables is None or any(
                t.dtype != self.dtype or t.shape != (m, 1, half) or not t.is_contiguous()
                for pair in rotary for t in pair):
            return None
        table, key0, context = tables
        cos = (ctypes.c_void_p * len(rotary))(*(c.data_ptr() for c, _ in rotary))
        sin = (ctypes.c_void_p * len(rotary))(*(s.data_ptr() for _, s in rotary))
        out = h.clone()
        self.desc.threads = torch.get_num_threads()
        status = self._call(ctypes.byref(self.desc), self.layers, len(self.layers),
                            out.data_ptr(), m, cos, sin, meta.slot_mapping.data_ptr(),
                            table.data_ptr(), table.shape[1], key0.data_ptr(),
                            context.data_ptr())
        if status:
            if status == 1:
                raise MemoryError("native decode step: out of memory for its intermediates")
            raise RuntimeError(f"native decode step: a kernel refused its shapes ({status})")
        return out


def _layer_desc(layer: DecoderLayer, keep: list[LinearDesc]) -> LayerDesc:
    attn, mlp = layer.self_attn, layer.mlp
    # with sandwich norms the norm before the MLP is pre_feedforward_layernorm, and
    # post_attention_layernorm norms the attention's output
    before_mlp = layer.pre_feedforward_layernorm if layer.sandwich else (
        layer.post_attention_layernorm)
    return LayerDesc(
        qkv=linear_desc(attn.qkv_proj, keep), o=linear_desc(attn.o_proj, keep),
        gate_up=linear_desc(mlp.gate_up_proj, keep), down=linear_desc(mlp.down_proj, keep),
        input_norm=layer.input_layernorm.weight.data_ptr(),
        post_norm=before_mlp.weight.data_ptr(),
        q_norm=attn.q_norm.weight.data_ptr() if attn.qk_norm else None,
        k_norm=attn.k_norm.weight.data_ptr() if attn.qk_norm else None,
        kv_cache=attn.kv_cache.data_ptr(), rope=layer.rope_index,
        attn_out_norm=(layer.post_attention_layernorm.weight.data_ptr() if layer.sandwich
                       else None),
        mlp_out_norm=(layer.post_feedforward_layernorm.weight.data_ptr() if layer.sandwich
                      else None),
        window=attn.layout.sliding_window or 0)


def _decode_tables(meta: AttentionMetadata,
                   m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(block table [m, width], key0 [m], context [m]) in token order, when the step is
    decodes only attended by our paged kernel; else None."""
    if meta.decode_kernel != "native" or meta.varlen is not None or meta.num_tokens != m:
        return None
    views = []
    for group in meta.groups:
        view = group.views.get(None)
        if group.q_len != 1 or view is None or view.context is None:
            return None
        views.append(view)
    if len(views) == 1 and m == 1:
        return views[0].block_table, views[0].key0, views[0].context
    width = max(v.block_table.shape[1] for v in views)
    table = torch.zeros(m, width, dtype=torch.int64)  # padding points at block 0, never read
    key0 = torch.zeros(m, dtype=torch.int64)
    context = torch.zeros(m, dtype=torch.int64)
    for group, view in zip(meta.groups, views, strict=True):
        table[group.rows, : view.block_table.shape[1]] = view.block_table
        key0[group.rows] = view.key0
        context[group.rows] = view.context
    return table, key0, context
