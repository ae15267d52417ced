"""Llama 3.2 Vision (MllamaForConditionalGeneration): a Llama decoder with tanh-gated
cross-attention layers among its self-attention layers (`cross_attention_layers`), fed by a tiled
vision tower (models/encoders/mllama_vision.py) and a linear projector.

An encoder item is one image: its own tiles' features, projected to the decoder's width, become
every cross-attention layer's keys and values, computed once here ([L, 2, Hkv, tiles x
positions, D]) and cached by the engine by the image's content. The image's `<|image|>` token
keeps its text embedding (the embedding table has 8 rows past the vocabulary, as transformers'
has, for it and its kind); the LM head covers the vocabulary only and is never tied
(transformers' class declares no tied weights).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from models.encoders.mllama_vision import MllamaVisionConfig, MllamaVisionTower
from models.interfaces import EncoderItem
from models.kernels.linear import EncoderLinear
from models.layers.decoder import Decoder, DecoderConfig
from models.layers.transfer import to_device

# transformers' MllamaTextModel embeds vocab_size + 8 ids (the image token is the first past
# the vocabulary in Meta's checkpoints).
EXTRA_EMBEDDINGS = 8


class MllamaForConditionalGeneration(Decoder):
    """Llama decoder with cross-attention layers + tiled vision tower + projector."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        cross = set(text.cross_attention_layers)
        if not cross <= set(range(text.num_hidden_layers)):
            raise ValueError(f"cross_attention_layers {sorted(cross)} are not layers of the "
                             f"{text.num_hidden_layers}-layer decoder")
        mixers = tuple("cross_attention" if i in cross else "attention"
                       for i in range(text.num_hidden_layers))
        cfg = DecoderConfig.from_hf(text, layer_mixers=mixers,
                                    embedding_rows=text.vocab_size + EXTRA_EMBEDDINGS,
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        vision = MllamaVisionConfig.from_hf(hf_config.vision_config)
        self.vision_model = MllamaVisionTower(vision)
        self.multi_modal_projector = EncoderLinear(vision.output_dim, cfg.hidden_size)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    @classmethod
    def tied_head(cls, hf_config) -> tuple[bool, str]:
        return False, "MllamaForConditionalGeneration never ties its LM head (transformers)"

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items ("image", {"pixel_values" [T, 3, S, S], "aspect_ratio_id", "num_tiles"}) ->
        each image's cross-attention keys and values [L, 2, Hkv, num_tiles x P, D]: every image
        of the step in one tower forward, every layer's projections in one matmul each."""
        data = [d for _, d in items]
        weight = self.multi_modal_projector.weight
        pixels = torch.stack([d["pixel_values"] for d in data]).to(weight.dtype)
        ratios = torch.tensor([d["aspect_ratio_id"] for d in data], dtype=torch.int64)
        tiles = [d["num_tiles"] for d in data]
        features = self.vision_model(to_device(pixels, weight.device),
                                     to_device(ratios, weight.device), tiles)
        states = self.multi_modal_projector(features)  # [N, T, P, H]
        own = torch.cat([s[:t].flatten(0, 1) for s, t in zip(states, tiles, strict=True)])
        kv = torch.stack([layer.cross_attn.key_values(own)
                          for layer in self.cross_attention_layers()])  # [L, 2, Hkv, n, D]
        sizes = [t * states.shape[2] for t in tiles]
        return [part.contiguous() for part in kv.split(sizes, dim=3)]

    def checkpoint_map(self) -> Callable:
        """Both layouts: the Hub's (language_model.model.*, language_model.lm_head.*,
        vision_model.*, multi_modal_projector.*) and transformers 5's (model.language_model.*,
        lm_head.*, model.vision_model.*, model.multi_modal_projector.*). The cross-attention
        layers keep the checkpoint's names (no q/k/v fusion: keys and values project media)."""
        hub = self.weight_map(prefix="language_model.model.", lm_head="language_model.lm_head.")
        new = self.weight_map(prefix="model.language_model.", lm_head="lm_head.")

        def mapping(name: str):
            for prefix in ("language_model.model.", "model.language_model."):
                if name.startswith(prefix) and ".cross_attn" in name:
                    return name[len(prefix):], None
            inner = name.removeprefix("model.")
            if inner.startswith(("vision_model.", "multi_modal_projector.")):
                return inner, None
            return (hub if name.startswith("language_model.") else new)(name)

        return mapping
