"""Gemma 4's decoder options, read from its text config (Gemma4TextConfig) as transformers 5.24
reads them, and the text-only model (Gemma4ForCausalLM).

Per layer: sliding-window or global attention (`layer_types`), each with its own rope setting
(default on sliding layers, proportional RoPE on global ones); global layers may have another
head size and KV head count (the Hub's configs write `global_head_dim` and
`num_global_key_value_heads`, transformers 5.24 saves `per_layer_config`: the config class turns
both into per-layer values, read here through `per_layer_config[i]`) and, with
`attention_k_eq_v`, no value projection. The last `num_kv_shared_layers` layers compute no keys
or values: each reads those of the last earlier layer of its type (the store / reuse modes
transformers derives, `kv_sharing_modes`), and with `use_double_wide_mlp` has an MLP twice as
wide. With `use_bidirectional_attention="vision"` the sliding-window layers attend each image's
(and video frame's) tokens both ways, the global layers causally. Norms scale by their weight
in float32, values are RMS-normed without a scale, attention
is unscaled (q and k are normed), every layer's output is scaled by its `layer_scalar`, and with
`hidden_size_per_layer_input` every layer takes a per-layer input
(models/layers/per_layer_inputs.py). With `enable_moe_block` (26B-A4B) every layer has routed
experts beside its dense MLP (models/gemma4/experts.py). Gemma 4's assistant drafter
(models/gemma4/assistant.py) is a decoder of these options whose every layer reads its
target's keys and values (`target_kv`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from models.gemma4.experts import ExpertsLayer, moe_shape
from models.layers.attention import LayerAttention
from models.layers.decoder import Decoder
from models.layers.decoder_config import DecoderConfig, LayerShape
from models.layers.moe import unfuse_experts
from models.layers.per_layer_inputs import PerLayerInputShape

SLIDING = "sliding_attention"


def store_layers(text) -> dict[str, int]:
    """Per layer type, the layer whose keys and values the config marks "store" (the last
    layer of that type computing its own): what KV sharing and the assistant drafter read."""
    types = list(text.layer_types)
    return {types[i]: i for i, m in enumerate(text.kv_sharing_modes) if m == "store"}


def kv_sources(text) -> list[int | None]:
    """Per layer, the layer whose keys and values it reads (None: its own), from the config's
    `kv_sharing_modes`: a "reuse" layer reads the "store" layer of its type."""
    modes = list(text.kv_sharing_modes)
    types = list(text.layer_types)
    if all(m == "reuse" for m in modes):
        raise NotImplementedError(
            "every layer of this model reads another model's keys and values "
            f"(num_kv_shared_layers={text.num_kv_shared_layers} of {text.num_hidden_layers}): "
            "a speculative-decoding drafter is not served on its own")
    store = store_layers(text)
    return [store[types[i]] if m == "reuse" else None for i, m in enumerate(modes)]


def decoder_config(text, tie_word_embeddings: bool, target_kv: bool = False) -> DecoderConfig:
    """The decoder options of a Gemma4TextConfig (see the module docstring). `target_kv`: every
    layer reads the keys and values of its target's layer of its type (Gemma 4's assistant
    drafter, models/gemma4/assistant.py), whose config marks every layer "reuse"."""
    if text.use_bidirectional_attention == "all":
        raise NotImplementedError(
            "use_bidirectional_attention='all' (every token attending both ways: an encoder, "
            "not a generator) is not supported")
    types = list(text.layer_types)
    layers = [text.per_layer_config[i] for i in range(text.num_hidden_layers)]
    sources = [None] * len(layers) if target_kv else kv_sources(text)
    shapes = tuple(
        LayerShape(layer.num_key_value_heads, layer.head_dim,
                   values_are_keys=bool(text.attention_k_eq_v) and kind != SLIDING,
                   kv_source=source, external_kv=target_kv)
        for layer, kind, source in zip(layers, types, sources, strict=True))
    wide = 2 if text.use_double_wide_mlp else 1
    mlp_sizes = tuple(layer.intermediate_size * (wide if source is not None else 1)
                      for layer, source in zip(layers, sources, strict=True))
    # Read the options every layer shares from one layer's view of the config (a sliding layer
    # where there is one): the global config's per-layer fields are ambiguous by design.
    base = layers[types.index(SLIDING) if SLIDING in types else 0]
    per_layer = None
    if text.hidden_size_per_layer_input:
        per_layer = PerLayerInputShape(text.vocab_size_per_layer_input,
                                       text.hidden_size_per_layer_input)
    # Media spans are attended both ways on the sliding-window layers only (with
    # use_bidirectional_attention="vision"); the global layers stay causal.
    both_ways = text.use_bidirectional_attention == "vision"
    # The assistant's sliding layers read one key more than the target's: its reference
    # attends every key within distance sliding_window of the query, inclusive.
    window = text.sliding_window + 1 if target_kv else text.sliding_window
    layouts = tuple(LayerAttention(window if kind == SLIDING else None, None,
                                   bidirectional=both_ways and kind == SLIDING)
                    for kind in types)
    return DecoderConfig.from_hf(
        base, tie_word_embeddings=tie_word_embeddings, layer_shapes=shapes,
        layer_attention=layouts,
        layer_mlp_sizes=mlp_sizes, qk_norm=True, v_norm=True, sandwich_norms=True,
        norm_float32_scale=True, embed_scale=math.sqrt(text.hidden_size), attn_scale=1.0,
        layer_scalar=True, per_layer_inputs=per_layer,
    )


class Gemma4Decoder(Decoder):
    """The Gemma 4 decoder: with `enable_moe_block`, every layer's feed-forward block is the
    dense MLP beside routed experts (models/gemma4/experts.py)."""

    def __init__(self, text, tie_word_embeddings: bool, max_positions: int,
                 device: torch.device, target_kv: bool = False) -> None:
        self.expert_shape = moe_shape(text) if text.enable_moe_block else None
        super().__init__(decoder_config(text, tie_word_embeddings, target_kv), max_positions,
                         device)

    def make_layer(self, cfg: DecoderConfig, layout, rope_index: int, index: int):
        if self.expert_shape is None:
            return super().make_layer(cfg, layout, rope_index, index)
        return ExpertsLayer(cfg, layout, rope_index, index, self.expert_shape)

    def checkpoint_tensors(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The fused experts tensors ([E, 2I, H], [E, H, I]) as one view per expert."""
        if self.expert_shape is None:
            return tensors
        return unfuse_experts(tensors, self.expert_shape, self.cfg.hidden_size)

    def weight_map(self, prefix: str = "model.", lm_head: str = "lm_head.") -> Callable:
        """The shared map, with each layer's experts under its `experts` block."""
        base = super().weight_map(prefix, lm_head)

        def mapping(name: str):
            target = base(name)
            if target is not None and self.expert_shape is not None and ".experts." in target[0]:
                ours, shard = target
                head, _, tail = ours.partition(".experts.")
                return f"{head}.experts.experts.{tail}", shard
            return target

        return mapping


class Gemma4ForCausalLM(Gemma4Decoder):
    """Gemma 4's decoder alone (a `gemma4_text` checkpoint)."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        super().__init__(hf_config, self.tied_head(hf_config)[0], max_positions, device)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def checkpoint_map(self) -> Callable:
        return self.weight_map()
