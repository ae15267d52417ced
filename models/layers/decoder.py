"""The pre-norm decoder shared by every family, assembled from options named by feature: token
embeddings (optionally scaled, `embed_scale`), the layers of models/layers/decoder_layer.py, RoPE
tables precomputed once per distinct rope setting (Gemma 3's local and global layers use different
bases), the final norm, a tied or untied LM head and a final logit soft-cap. `weight_map` says
which checkpoint tensor fills which rows. Text-only checkpoints are `CausalLM`; `text_features`
holds the options each family's text config does not spell out. With `per_layer_inputs` the
decoder computes every layer's per-layer input from the step's tokens
(models/layers/per_layer_inputs.py); with KV sharing (`LayerShape.kv_source`) the layers that
store keys and values for later ones hand them over through the step's metadata.

On the CPU, decode steps the native call can take run all layers in one call of ours
(models.layers.native_decode, set up by `prepare_decode`), with the same result. LoRA adapters
chosen per request (models/layers/lora.py) add their updates beside the layers' linears; the
step's metadata says which tokens use which (`meta.adapters`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from models.checkpoint import tie_word_embeddings
from models.interfaces import EncoderItem
from models.kernels.linear import Linear, float32_logits
from models.layers.activations import rowwise
from models.layers.attention_metadata import AttentionMetadata
from models.layers.cross_attention import CrossAttentionLayer
from models.layers.decoder_attention import Attention
from models.layers.decoder_config import DecoderConfig
from models.layers.decoder_layer import DecoderLayer
from models.layers.gated_deltanet import GatedDeltaNet
from models.layers.lora import AdapterSet
from models.layers.moe import MoEShape, RoutedExperts, sparse_layers, unfuse_experts
from models.layers.native_decode import NativeDecode
from models.layers.norm import RMSNorm
from models.layers.per_layer_inputs import PerLayerInputs
from models.layers.rotary import RotaryTable
from models.loader import Shard

log = logging.getLogger(__name__)


class Decoder(nn.Module):
    """Embeddings, layers, final norm and LM head. Positions are [T] (or [3, T] for mRoPE).

    A `models.interfaces.LanguageModel`; families with encoders subclass it and add `encode`.
    """

    position_rows = 1
    deepstack_layers = 0  # per-layer media residuals each encoder item carries (DeepStack)
    native_decode: NativeDecode | None = None  # set by prepare_decode
    adapters: AdapterSet | None = None  # LoRA adapters requests may choose (set by the runner)

    def __init__(self, cfg: DecoderConfig, max_positions: int, device: torch.device) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.embedding_rows or cfg.vocab_size, cfg.hidden_size)
        # One table per distinct (rope setting, head size): layers of different head sizes
        # rotate different widths even with one setting.
        keys = [(repr(sorted(r.items())), cfg.shape(i).head_dim)
                for i, r in enumerate(cfg.layer_rope)]
        distinct = list(dict.fromkeys(keys))
        cross = [i for i in range(cfg.num_layers) if cfg.mixer(i) == "cross_attention"]
        self.layers = nn.ModuleList(
            CrossAttentionLayer(cfg, cross.index(i)) if i in cross
            else self.make_layer(cfg, layout, distinct.index(key), i)
            for i, (layout, key) in enumerate(zip(cfg.layer_attention, keys, strict=True))
        )
        self.per_layer_inputs: PerLayerInputs | None = None
        if cfg.per_layer_inputs is not None:
            self.per_layer_inputs = PerLayerInputs(cfg.hidden_size, cfg.num_layers,
                                                   cfg.per_layer_inputs, cfg.rms_norm_eps,
                                                   cfg.norm_float32_scale)
        self.shares_kv = any(cfg.shape(i).kv_source is not None for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset,
                            fused_decode=True, float32_scale=cfg.norm_float32_scale)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        first = [keys.index(key) for key in distinct]  # a layer of each table
        self.rotaries = [
            self.make_rotary(max_positions, cfg.layer_rope[i], device, cfg.shape(i).head_dim)
            for i in first]

    def make_layer(self, cfg: DecoderConfig, layout, rope_index: int, index: int) -> nn.Module:
        """Layer `index` (families whose layers add a block of their own override this)."""
        return DecoderLayer(cfg, layout, rope_index, index)

    @classmethod
    def tied_head(cls, hf_config: Any) -> tuple[bool, str]:
        """Whether transformers' class ties this model's LM head to the token embeddings, and
        the flag that says so: the top-level config's `tie_word_embeddings` (a text-only
        model's own config; a composite model's outer one). Families whose reference class
        decides otherwise override this."""
        return tie_word_embeddings(hf_config)

    @classmethod
    def modality_adapters(cls) -> tuple[tuple[str, str, str], ...]:
        """LoRA adapters the checkpoint ships for its modalities, in order of precedence:
        (adapter name, modality, folder inside the checkpoint). A request without an adapter of
        its own that has media of a listed modality uses the first such adapter. None for most
        families."""
        return ()

    def tie_weights(self) -> None:
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def make_rotary(self, max_positions: int, rope: dict, device: torch.device,
                    head_dim: int | None = None) -> RotaryTable:
        head_dim = head_dim or self.cfg.head_dim
        return RotaryTable(self.cfg.rotary_dim or head_dim, max_positions, rope, device)

    def rotary_cos_sin(self, rotary: RotaryTable, positions: torch.Tensor, dtype: torch.dtype):
        return rotary.lookup(positions, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids [T] (or inputs_embeds [T, H]) -> final hidden states [T, H].

        `residuals` (rows [R] int64, values [K, R, H]): added to the rows' hidden states after
        each of the first K layers (DeepStack's per-layer media features)."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        if self.adapters is not None:
            self.adapters.step = meta.adapters  # which tokens' linears add which adapter
        rotary = [self.rotary_cos_sin(r, positions, h.dtype) for r in self.rotaries]
        layers_out = None
        if self.native_decode is not None and residuals is None:
            layers_out = self.native_decode.run(h, rotary, meta)  # None: not a step it takes
        if layers_out is not None:
            return self.norm(layers_out)
        extra = None
        if self.per_layer_inputs is not None:  # [T, L, P]
            extra = self.per_layer_inputs(self.per_layer_token_ids(input_ids), h)
        if self.shares_kv:
            meta.shared_kv = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, rotary, meta, None if extra is None else extra[:, i])
            if residuals is not None and i < residuals[1].shape[0]:
                h = h.index_add(0, residuals[0], residuals[1][i].to(h.dtype))
        meta.shared_kv = None  # the step's keys and values go with it
        return self.norm(h)

    def per_layer_table_bytes(self) -> int:
        """Bytes of the per-layer embedding table (0: none), which a step reads a few rows of."""
        return 0 if self.per_layer_inputs is None else self.per_layer_inputs.table_bytes()

    def per_layer_token_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The ids whose rows of the per-layer table the tokens read (families whose media
        placeholders read another row override this)."""
        return input_ids

    def prepare_decode(self) -> bool:
        """Once the KV caches are bound and the linears planned, on the CPU: run the decode
        steps it can take through one native call (models.layers.native_decode), and a sparse
        block's routed experts in one call (models.kernels.native_experts). Whether the
        whole-decoder call will."""
        self.native_decode = NativeDecode.build(self)
        sparse = [m for m in self.modules() if isinstance(m, RoutedExperts)]
        dtype = self.embed_tokens.weight.dtype
        taken = sum(block.prepare_decode(dtype) for block in sparse)
        if taken:
            log.info("decode steps run the routed experts of %d of %d sparse blocks in one "
                     "native call each", taken, len(sparse))
        return self.native_decode is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        if self.cfg.embed_scale is not None:
            # The reference rounds the scale to the weights' dtype first.
            h = h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype)
        return h

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        raise NotImplementedError(f"{type(self).__name__} takes no media")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        logits = float32_logits(self.lm_head, hidden)
        cap = self.cfg.final_logit_softcap
        return logits if cap is None else rowwise("tanh", logits / cap) * cap

    def attention_layers(self) -> list[Attention]:
        """The layers' attention modules, whose KV caches the runner binds (a hybrid stack's
        linear-attention layers have none)."""
        return [layer.self_attn for layer in self.layers if layer.mixer == "attention"]

    def state_layers(self) -> list[GatedDeltaNet]:
        """The linear-attention modules, whose state pools the runner binds."""
        return [layer.linear_attn for layer in self.layers if layer.is_linear]

    def cross_attention_layers(self) -> list[CrossAttentionLayer]:
        """The layers that attend to media items' keys and values, in order (their `index`)."""
        return [layer for layer in self.layers if layer.mixer == "cross_attention"]

    def attention_windows(self) -> tuple[int | None, ...]:
        """The distinct sliding windows of the layers (None: full attention)."""
        return tuple(dict.fromkeys(a.layout.sliding_window for a in self.attention_layers()))

    def checkpoint_tensors(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as the weight map reads them: a fused experts tensor
        (models/layers/moe.py) becomes one view per expert; the rest pass through."""
        moe = self.cfg.moe
        return tensors if moe is None else unfuse_experts(tensors, moe, self.cfg.hidden_size)

    def weight_map(self, prefix: str = "model.", lm_head: str = "lm_head.") -> Callable:
        """Maps a checkpoint tensor name to (our parameter name, row shard) or None (skip)."""
        fused: dict[str, tuple[str, Shard | None]] = {}
        attention = {a.index: a for a in self.attention_layers()}
        for attn in self.attention_layers()[:1]:  # the default: the first layer's shape
            fused |= _qkv_shards(attn)
        linear = self.cfg.linear_attention
        if linear is not None:  # Gated DeltaNet's four input projections, in one
            offset = 0
            for name, rows in zip(("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
                                  self.state_layers()[0].splits, strict=True):
                fused[name] = ("in_proj", Shard(offset, rows))
                offset += rows
            fused["conv1d"] = ("conv_weight", None)
        moe = self.cfg.moe
        tied = self.cfg.tie_word_embeddings

        def mlp_rows(parts: list[str]) -> int:
            """The intermediate size of the MLP a gate_proj / up_proj belongs to."""
            if moe is not None and "experts" in parts:
                return moe.intermediate_size
            if moe is not None and "shared_expert" in parts:
                return moe.shared_expert_size or 0
            if parts[0] == "layers" and parts[1].isdigit():
                return self.cfg.mlp_size(int(parts[1]))
            return self.cfg.intermediate_size

        def mapping(name: str) -> tuple[str, Shard | None] | None:
            if name.startswith(lm_head):
                return None if tied else ("lm_head." + name[len(lm_head):], None)
            if not name.startswith(prefix) or name.endswith("rotary_emb.inv_freq"):
                return None
            ours = name[len(prefix):]
            parts = ours.split(".")
            if len(parts) < 2:
                return ours, None
            if parts[0] in PER_LAYER_INPUTS:
                return "per_layer_inputs." + ours, None
            if len(parts) > 3 and parts[-2] in PER_LAYER_GATE:
                return ".".join(parts[:-2] + ["per_layer_input"] + parts[-2:]), None
            if parts[-2] in ("k_norm", "v_norm") and parts[1].isdigit():
                layer = attention.get(int(parts[1]))
                if layer is not None and not layer.own_kv:
                    return None  # KV sharing: this layer has no keys of its own
            if parts[-2] in ("gate_proj", "up_proj"):  # gate and up, in one
                inter = mlp_rows(parts)
                shard = Shard(0 if parts[-2] == "gate_proj" else inter, inter)
                return ".".join(parts[:-2] + ["gate_up_proj", parts[-1]]), shard
            if parts[-2] in fused:
                target, shard = fused[parts[-2]]
                if parts[-2] in QKV and parts[0] == "layers" and parts[1].isdigit():
                    layer = attention.get(int(parts[1]))
                    if layer is None or parts[-2] not in _qkv_shards(layer):
                        return None  # a projection this layer does not have (KV sharing)
                    target, shard = _qkv_shards(layer)[parts[-2]]
                if shard is None:  # a renamed parameter
                    return ".".join(parts[:-2] + [target]), None
                return ".".join(parts[:-2] + [target, parts[-1]]), shard
            return ours, None

        return mapping


QKV = ("q_proj", "k_proj", "v_proj")
PER_LAYER_INPUTS = ("embed_tokens_per_layer", "per_layer_model_projection",
                    "per_layer_projection_norm")
PER_LAYER_GATE = ("per_layer_input_gate", "per_layer_projection", "post_per_layer_input_norm")


def _qkv_shards(attn: Attention) -> dict[str, tuple[str, Shard]]:
    """Where one attention layer's q / k / v projections sit in its fused qkv_proj (a layer
    reading another's keys and values has only q; one whose values are its keys, no v)."""
    q, kv = attn.q_rows, attn.kv_size
    shards = {"q_proj": ("qkv_proj", Shard(0, q))}
    if attn.own_kv:
        shards["k_proj"] = ("qkv_proj", Shard(q, kv))
        if not attn.values_are_keys:
            shards["v_proj"] = ("qkv_proj", Shard(q + kv, kv))
    return shards


class CausalLM(Decoder):
    """A text-only causal LM of any family in TEXT_FEATURES (Llama, Mistral, Qwen2/3, Qwen3.5,
    Gemma 3)."""

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device) -> CausalLM:
        return cls(DecoderConfig.from_hf(hf_config, **text_features(hf_config)), max_positions,
                   device)

    def checkpoint_map(self) -> Callable:
        return self.weight_map()


QWEN2_FEATURES = {"qkv_bias": True, "o_bias": False}  # bias on q/k/v, none on o
# Qwen3.5: hybrid layers (read from `layer_types`), (1 + w) norms, gated attention output.
QWEN3_5_FEATURES = {"qk_norm": True, "norm_unit_offset": True, "attn_output_gate": True}


def moe_features(cfg, normalize_top_k: bool) -> dict:
    """Sparse feed-forward blocks where the config places them (models/layers/moe.py)."""
    return {"moe": MoEShape.from_hf(cfg, normalize_top_k), "moe_layers": sparse_layers(cfg)}


def gemma_features(cfg) -> dict:
    """Gemma 2/3 decoders: (1 + w) norms before and after attention and MLP, qk-norm,
    embeddings scaled by sqrt(hidden), attention scaled by `query_pre_attn_scalar`."""
    return {
        "qk_norm": True,
        "norm_unit_offset": True,
        "sandwich_norms": True,
        "embed_scale": math.sqrt(cfg.hidden_size),
        "attn_scale": cfg.query_pre_attn_scalar**-0.5,
    }


# Options each family's text config does not spell out, by `model_type`; the rest is read from
# the config (DecoderConfig.from_hf). Llama and Mistral need none.
TEXT_FEATURES: dict[str, Callable[[object], dict]] = {
    "llama": lambda cfg: {},
    "mistral": lambda cfg: {},
    "qwen2": lambda cfg: QWEN2_FEATURES,
    "qwen2_vl_text": lambda cfg: QWEN2_FEATURES,
    "qwen2_5_vl_text": lambda cfg: QWEN2_FEATURES,
    "qwen3": lambda cfg: {"qk_norm": True},
    "qwen3_vl_text": lambda cfg: {"qk_norm": True},
    # Mixtures of experts: Qwen3-MoE renormalises the top k as its config says; Qwen3-VL-MoE's
    # and Qwen3.5-MoE's routers always do.
    "qwen3_moe": lambda cfg: {"qk_norm": True, **moe_features(cfg, cfg.norm_topk_prob)},
    "qwen3_vl_moe_text": lambda cfg: {"qk_norm": True, **moe_features(cfg, True)},
    "qwen3_5_text": lambda cfg: QWEN3_5_FEATURES,
    "qwen3_5_moe_text": lambda cfg: {**QWEN3_5_FEATURES, **moe_features(cfg, True)},
    "gemma3_text": gemma_features,
}


def text_features(cfg) -> dict:
    """The feature options of a text config's family (a clear error for unknown families)."""
    if cfg.model_type not in TEXT_FEATURES:
        raise NotImplementedError(
            f"text model type {cfg.model_type!r} is not supported "
            f"({', '.join(sorted(TEXT_FEATURES))})"
        )
    return TEXT_FEATURES[cfg.model_type](cfg)
