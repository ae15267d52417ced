"""Gemma 4 (Gemma4ForConditionalGeneration): the Gemma 4 decoder (models/gemma4/text.py) fed by
a vision tower for images and video frames (models/encoders/gemma4_vision.py) and, on the
E-size models, a conformer audio encoder (models/encoders/gemma4_audio.py), each followed by its
embedder (an RMS norm without weight and a projection into the decoder's width).

A media placeholder token reads the pad token's rows of both embedding tables, as the reference
reads them: the towers' embeddings replace the main one where the token stands for an item, the
pad's stays where it does not (a placeholder the model generated).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from models.encoders.gemma4_audio import ConformerConfig, ConformerEncoder, subsampled
from models.encoders.gemma4_vision import (
    Gemma4VisionConfig,
    Gemma4VisionTower,
    MultimodalEmbedder,
)
from models.gemma4.text import Gemma4Decoder
from models.interfaces import EncoderItem
from models.layers.transfer import to_device

VISION = ("image", "video")


class Gemma4ForConditionalGeneration(Gemma4Decoder):
    """Gemma 4 decoder + vision tower + audio encoder."""

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        text = hf_config.text_config
        super().__init__(text, self.tied_head(hf_config)[0], max_positions, device)
        media = [getattr(hf_config, name, None)
                 for name in ("image_token_id", "video_token_id", "audio_token_id")]
        # Explicitly on the CPU first: the model is built on the meta device.
        self.media_token_ids = torch.tensor([i for i in media if i is not None],
                                            dtype=torch.int64, device="cpu").to(device)
        self.pad_token_id = text.pad_token_id
        self.vision_tower = self.embed_vision = None
        self.audio_tower = self.embed_audio = None
        if hf_config.vision_config is not None:
            vc = hf_config.vision_config
            self.vision_tower = Gemma4VisionTower(Gemma4VisionConfig.from_hf(vc))
            self.embed_vision = MultimodalEmbedder(vc.hidden_size, text.hidden_size,
                                                   vc.rms_norm_eps)
        if hf_config.audio_config is not None:
            ac = hf_config.audio_config
            self.audio_tower = ConformerEncoder(ConformerConfig.from_hf(ac))
            self.embed_audio = MultimodalEmbedder(ac.output_proj_dims, text.hidden_size,
                                                  ac.rms_norm_eps)

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    def per_layer_token_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Media placeholders read the pad token's rows."""
        media = torch.isin(input_ids, self.media_token_ids.to(input_ids.device))
        return input_ids.masked_fill(media, self.pad_token_id)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(self.per_layer_token_ids(input_ids))

    def encode(self, items: Sequence[EncoderItem]) -> list[torch.Tensor]:
        """Items -> embeddings [n_i, hidden] each: every image and video frame of the step in
        one vision forward ({"pixel_values", "positions", "grid"}), every audio clip in one
        audio forward ({"input_features", "mask"})."""
        out: list[torch.Tensor | None] = [None] * len(items)
        for kinds, run in ((VISION, self._encode_vision), (("audio",), self._encode_audio)):
            picked = [i for i, (modality, _) in enumerate(items) if modality in kinds]
            if picked:
                for i, emb in zip(picked, run([items[i][1] for i in picked]), strict=True):
                    out[i] = emb
        missing = [items[i][0] for i, o in enumerate(out) if o is None]
        if missing:
            raise ValueError(f"Gemma 4 does not encode {', '.join(sorted(set(missing)))}")
        return out  # type: ignore[return-value]

    def _encode_vision(self, items: list[dict]) -> list[torch.Tensor]:
        if self.vision_tower is None:
            raise ValueError("this checkpoint has no vision tower (no vision_config)")
        weight = self.embed_tokens.weight
        batch = self.vision_tower.batch(items, weight.device)
        pooled = self.vision_tower(batch).to(weight.dtype)
        k = self.vision_tower.cfg.pooling
        sizes = [r * c // (k * k) for r, c in batch.grids]
        return list(self.embed_vision(pooled).split(sizes))

    def _encode_audio(self, items: list[dict]) -> list[torch.Tensor]:
        if self.audio_tower is None:
            raise ValueError("this checkpoint has no audio encoder (no audio_config)")
        device = self.embed_tokens.weight.device
        frames = max(d["input_features"].shape[0] for d in items)
        mels = items[0]["input_features"].shape[1]
        features = torch.zeros(len(items), frames, mels)
        mask = torch.zeros(len(items), frames, dtype=torch.bool)
        rows: list[torch.Tensor] = []  # each clip's real output positions, found on the host
        for b, d in enumerate(items):
            n = d["input_features"].shape[0]
            features[b, :n], mask[b, :n] = d["input_features"], d["mask"]
            real = d["mask"][::2][::2]
            rows.append(torch.arange(real.shape[0])[real] + b * subsampled(frames))
        states, _ = self.audio_tower(to_device(features, device), to_device(mask, device))
        flat = states.reshape(-1, states.shape[-1])
        embeds = self.embed_audio(flat[to_device(torch.cat(rows), device)])
        return list(embeds.split([len(r) for r in rows]))

    def checkpoint_map(self) -> Callable:
        """transformers 5's layout (the Hub's): model.language_model.*, model.vision_tower.*,
        model.embed_vision.*, model.audio_tower.*, model.embed_audio.*, lm_head.*. Buffers the
        reference recomputes (rotary and relative-position tables) are not read."""
        lm = self.weight_map(prefix="model.language_model.", lm_head="lm_head.")
        towers = {"model.vision_tower.": self.vision_tower, "model.embed_vision.":
                  self.embed_vision, "model.audio_tower.": self.audio_tower,
                  "model.embed_audio.": self.embed_audio}

        def mapping(name: str):
            if name.startswith(("model.language_model.", "lm_head.")):
                return lm(name)
            for prefix, module in towers.items():
                if name.startswith(prefix) and module is not None:
                    ours = name[len("model."):]
                    if ours.endswith(("inv_freq", "inv_timescales")):
                        return None
                    return ours, None
            return None

        return mapping

