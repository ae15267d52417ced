"""Whisper (WhisperForConditionalGeneration): an audio encoder over one 30 s window of log-mel
frames and a text decoder that attends to it through cross-attention in every layer.

The encoder (models/encoders/whisper.py, no pooling: all 1500 positions of the window) runs once
per clip; each decoder layer's cross-attention keys and values are computed from its output in
`encode` ([L, 2, H, 1500, D]) and cached by the engine by the clip's content, exactly as Llama 3.2
Vision's image states are (engine/cross_states.py). Every row of a request attends to its clip
(models/whisper/processor.py). The decoder's self-attention runs over the paged KV cache, so
many requests' decoders batch together; positions are learned (`embed_positions`, at most
`max_target_positions`), layers are pre-LayerNorm with biases (none on the key projections), the
MLP is fc1 -> GELU -> fc2, and the LM head (`proj_out`, our `lm_head`) is tied to the token
embeddings as transformers' class ties it.

Checkpoint names are transformers' (the same in transformers 4 and 5): `model.encoder.*`,
`model.decoder.*`, `proj_out.weight`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from models.checkpoint import tie_word_embeddings
from models.encoders.whisper import (
    AudioEncoder,
    AudioEncoderConfig,
    build_audio_batch,
    whisper_block_name,
)
from models.interfaces import EncoderItem
from models.kernels.linear import Linear, float32_logits
from models.layers.activations import rowwise
from models.layers.attention import LayerAttention, paged_attention
from models.layers.attention_metadata import AttentionMetadata
from models.layers.cross_attention import attend_segments
from models.layers.cross_metadata import CrossSegment
from models.layers.decoder_config import DecoderConfig
from models.whisper.alignment import alignment_probabilities

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}


def decoder_config(cfg: Any, tied: bool) -> DecoderConfig:
    """The decoder's shape as the engine sizes its KV cache and sampler with (a WhisperConfig)."""
    if cfg.activation_function not in _ACTIVATIONS:
        raise NotImplementedError(f"Whisper activation_function={cfg.activation_function!r} is "
                                  f"not built ({', '.join(_ACTIVATIONS)})")
    if cfg.d_model % cfg.decoder_attention_heads:
        raise ValueError(f"d_model={cfg.d_model} is not a multiple of decoder_attention_heads="
                         f"{cfg.decoder_attention_heads}")
    layers = cfg.decoder_layers
    return DecoderConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model,
        intermediate_size=cfg.decoder_ffn_dim, num_layers=layers,
        num_heads=cfg.decoder_attention_heads, num_kv_heads=cfg.decoder_attention_heads,
        head_dim=cfg.d_model // cfg.decoder_attention_heads, rms_norm_eps=1e-5,
        max_position_embeddings=cfg.max_target_positions, tie_word_embeddings=tied,
        hidden_act=cfg.activation_function, layer_rope=({},) * layers,
        layer_attention=(LayerAttention(bidirectional=False),) * layers,
        qkv_bias=True, o_bias=True, mlp_bias=True)


class WhisperAttention(nn.Module):
    """Whisper's attention projections: q, v and out with biases, k without; the scale is
    head_dim ** -0.5."""

    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = self.num_kv_heads = cfg.num_heads
        self.head_dim = cfg.head_dim
        self.scale = self.head_dim**-0.5
        width = cfg.num_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, width, bias=True)
        self.k_proj = Linear(cfg.hidden_size, width, bias=False)
        self.v_proj = Linear(cfg.hidden_size, width, bias=True)
        self.out_proj = Linear(width, cfg.hidden_size, bias=True)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], self.num_heads, self.head_dim)


class WhisperSelfAttention(WhisperAttention):
    """Causal self-attention over the paged KV cache (the runner binds `kv_cache`)."""

    layout = LayerAttention(bidirectional=False)
    kv_source = None

    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__(cfg, index)
        self.kv_cache = torch.empty(0)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (self.heads(p(x)) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(paged_attention(q, k, v, self.kv_cache, meta, self.scale,
                                             self.layout))


class WhisperCrossAttention(WhisperAttention):
    """The decoder rows' attention over their clip's encoder states (keys and values computed
    once per clip by `key_values`)."""

    def key_values(self, states: torch.Tensor) -> torch.Tensor:
        """Encoder states [n, H] -> this layer's keys and values [2, heads, n, D]."""
        k, v = self.heads(self.k_proj(states)), self.heads(self.v_proj(states))
        return torch.stack([k, v]).transpose(1, 2).contiguous()

    def forward(self, x: torch.Tensor, segments: list[CrossSegment]) -> torch.Tensor:
        q = self.heads(self.q_proj(x))
        out = attend_segments(q, segments, self.index, self.num_kv_heads, self.scale)
        return self.out_proj(out.view(x.shape[0], -1))


class WhisperDecoderLayer(nn.Module):
    """h + self_attn(ln(h)); h + encoder_attn(ln(h)) at the rows that attend to a clip;
    h + fc2(act(fc1(ln(h))))."""

    mixer = "attention"
    is_linear = False

    def __init__(self, cfg: DecoderConfig, index: int) -> None:
        super().__init__()
        width = cfg.hidden_size
        self.self_attn = WhisperSelfAttention(cfg, index)
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.encoder_attn = WhisperCrossAttention(cfg, index)
        self.encoder_attn_layer_norm = nn.LayerNorm(width)
        self.fc1 = Linear(width, cfg.intermediate_size, bias=True)
        self.fc2 = Linear(cfg.intermediate_size, width, bias=True)
        self.final_layer_norm = nn.LayerNorm(width)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.self_attn(self.self_attn_layer_norm(h), meta)
        plan = meta.cross
        if plan is not None:
            x = h if plan.rows is None else h.index_select(0, plan.rows)
            x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), plan.segments)
            h = x if plan.rows is None else h.index_copy(0, plan.rows, x)
        return h + self.fc2(rowwise(self.act, self.fc1(self.final_layer_norm(h))))


class WhisperTextDecoder(nn.Module):
    """Token and learned position embeddings, the layers, the final LayerNorm."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.layer_norm = nn.LayerNorm(cfg.hidden_size)


class WhisperForConditionalGeneration(nn.Module):
    """A models.interfaces.LanguageModel: the decoder over the paged cache, `encode` for clips."""

    position_rows = 1
    deepstack_layers = 0
    adapters = None

    def __init__(self, hf_config: Any, max_positions: int, device: torch.device) -> None:
        super().__init__()
        if max_positions > hf_config.max_target_positions:
            raise ValueError(f"max_model_len={max_positions} exceeds Whisper's "
                             f"max_target_positions={hf_config.max_target_positions}")
        self.cfg = decoder_config(hf_config, self.tied_head(hf_config)[0])
        self.encoder = AudioEncoder(AudioEncoderConfig.from_whisper(hf_config))
        self.decoder = WhisperTextDecoder(self.cfg)
        # transformers' proj_out, named as every family's head (models/kernels/quantization.py
        # quantizes `lm_head` and the linears of `layers`).
        self.lm_head = Linear(self.cfg.hidden_size, self.cfg.vocab_size, bias=False)
        self.tie_weights()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder's layers (whose linears `quantization` quantizes)."""
        return self.decoder.layers

    def tie_weights(self) -> None:
        """The LM head shares the token embeddings when tied (run again after loading)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.decoder.embed_tokens.weight

    @classmethod
    def from_hf_config(cls, hf_config: Any, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    @classmethod
    def tied_head(cls, hf_config: Any) -> tuple[bool, str]:
        """transformers ties `proj_out` to the decoder's token embeddings as the config's
        `tie_word_embeddings` says (default True)."""
        return tie_word_embeddings(hf_config)

    @classmethod
    def modality_adapters(cls) -> tuple[tuple[str, str, str], ...]:
        return ()

    # ---- what the runner binds and asks -----------------------------------------------------

    def attention_layers(self) -> list[WhisperSelfAttention]:
        return [layer.self_attn for layer in self.decoder.layers]

    def cross_attention_layers(self) -> list[WhisperDecoderLayer]:
        return list(self.decoder.layers)

    def state_layers(self) -> list:
        return []

    def attention_windows(self) -> tuple[int | None, ...]:
        return (None,)

    def per_layer_table_bytes(self) -> int:
        return 0

    def prepare_decode(self) -> bool:
        return False  # the one-call native decode serves the shared decoder's layers only

    # ---- the forward ------------------------------------------------------------------------

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.decoder.embed_tokens(input_ids)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        inputs_embeds: torch.Tensor | None = None,
        residuals: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """input_ids [T], positions [T] -> final hidden states [T, H]."""
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        h = h + self.decoder.embed_positions(positions)
        for layer in self.decoder.layers:
            h = layer(h, meta)
        return self.decoder.layer_norm(h)

    def alignment_probabilities(self, input_ids: torch.Tensor, states: torch.Tensor,
                                heads: Sequence[tuple[int, int]]) -> torch.Tensor:
        """input_ids [T], one clip's keys and values [L, 2, H, n, D] -> the cross-attention
        probabilities [len(heads), T, n] of each (layer, head) (models/whisper/alignment.py)."""
        return alignment_probabilities(self, input_ids, states, heads)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return float32_logits(self.lm_head, hidden)

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("audio", {"input_features" [n_mels, frames], "num_frames"}) -> each clip's
        cross-attention keys and values [L, 2, H, positions, D]: every clip of the step in one
        encoder forward, each layer's projections in one matmul over all of them."""
        weight = self.decoder.embed_tokens.weight
        batch = build_audio_batch([d["input_features"] for _, d in items],
                                  [d["num_frames"] for _, d in items], weight.device,
                                  weight.dtype, pool=False)
        states = self.encoder(batch)  # [sum(positions), H]
        kv = torch.stack([layer.encoder_attn.key_values(states)
                          for layer in self.decoder.layers])  # [L, 2, H, n, D]
        return [part.contiguous() for part in kv.split(batch.sizes, dim=3)]

    # ---- weights ----------------------------------------------------------------------------

    def checkpoint_tensors(
        self, tensors: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return tensors

    def checkpoint_map(self) -> Callable:
        """transformers' names (both layouts): model.encoder.* (its layers as our shared
        blocks), model.decoder.*, proj_out.weight (skipped when tied)."""
        tied = self.cfg.tie_word_embeddings

        def mapping(name: str):
            if name.startswith("proj_out."):
                return None if tied else ("lm_head." + name[len("proj_out."):], None)
            if name.startswith("model.encoder."):
                return "encoder." + whisper_block_name(name[len("model.encoder."):]), None
            if name.startswith("model.decoder."):
                return name[len("model."):], None
            return name, None  # not ours: the loader names it

        return mapping


def encoder_state_bytes(hf_config: Any, dtype_bytes: int) -> int:
    """Bytes of one clip's cross-attention keys and values (every decoder layer, 30 s)."""
    return (2 * hf_config.decoder_layers * hf_config.d_model * hf_config.max_source_positions
            * dtype_bytes)

