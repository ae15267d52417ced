"""Qwen2.5-Omni's thinker: the Qwen2 decoder with TMRoPE (multimodal rotary positions whose
temporal row counts time: 25 positions a second), fed by the Qwen2.5-VL vision tower
(models/encoders/qwen_vl.py) and the Omni's Whisper-style audio encoder
(models/encoders/whisper.py: sinusoidal positions, 2 s attention windows, a projection into the
decoder's width). Text out only: the talker and token-to-wave model are not built, and their
weights are skipped.

One step's images and video patches go through the vision tower in one forward, its audio
windows through the audio encoder in another; a video heard with its sound is two such kinds of
items whose spans interleave (models/qwen_omni/processor.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.encoders.qwen_vl import VisionConfig, VisionTower, build_vision_batch
from models.encoders.whisper import (
    AudioEncoder,
    AudioEncoderConfig,
    build_audio_batch,
    whisper_block_name,
)
from models.layers.decoder import QWEN2_FEATURES, Decoder, DecoderConfig
from models.layers.rotary import RotaryTable, mrope_bands, mrope_cos_sin
from models.loader import Shard
from models.qwen_omni.family import OMNI_TYPES, thinker_config

_DEFAULT_SECTION = [16, 24, 24]  # the reference's mrope_section when the config has none
_VISION_MODALITIES = ("image", "video")


class QwenOmniThinker(Decoder):
    """Decoder + vision tower + audio encoder. `encode` turns processed items into embeddings."""

    position_rows = 3  # TMRoPE: (temporal, row, column)

    def __init__(self, hf_config, max_positions: int, device: torch.device) -> None:
        thinker = thinker_config(hf_config)
        text = thinker.text_config
        cfg = DecoderConfig.from_hf(text, **QWEN2_FEATURES,
                                    tie_word_embeddings=self.tied_head(hf_config)[0])
        super().__init__(cfg, max_positions, device)
        self.visual = VisionTower(VisionConfig.from_hf(thinker.vision_config))
        self.audio_tower = AudioEncoder(AudioEncoderConfig.from_hf(thinker.audio_config))
        if self.audio_tower.cfg.output_dim != cfg.hidden_size:
            raise ValueError(f"audio_config.output_dim={self.audio_tower.cfg.output_dim} is not "
                             f"the decoder's hidden_size={cfg.hidden_size}")
        section = list(self.cfg.rope.get("mrope_section", _DEFAULT_SECTION))
        self.band = mrope_bands(section, self.cfg.head_dim // 2, interleaved=False).to(device)
        self.prefix = "thinker." if hf_config.model_type in OMNI_TYPES else ""

    @classmethod
    def from_hf_config(cls, hf_config, max_positions: int, device: torch.device):
        return cls(hf_config, max_positions, device)

    @classmethod
    def tied_head(cls, hf_config) -> tuple[bool, str]:
        """transformers' thinker ties its head by its own config's flag (the thinker config's
        top level, not its text_config's)."""
        thinker = thinker_config(hf_config)
        where = "thinker_config." if thinker is not hf_config else ""
        return bool(thinker.tie_word_embeddings), f"{where}tie_word_embeddings"

    def rotary_cos_sin(self, rotary: RotaryTable, positions: torch.Tensor, dtype: torch.dtype):
        """positions [3, T] -> cos, sin [T, 1, D/2], each band from its own position row."""
        return mrope_cos_sin(rotary, positions, self.band, dtype)

    def encode(self, items: list[tuple[str, dict]]) -> list[torch.Tensor]:
        """Items ("image" | "video", {"pixel_values", "grid_thw"}) or ("audio",
        {"input_features", "num_frames"}: one attention window of a clip) -> embeddings
        [n_i, hidden] each, in item order: one vision forward and one audio forward."""
        device, dtype = self.embed_tokens.weight.device, self.embed_tokens.weight.dtype
        out: list[torch.Tensor | None] = [None] * len(items)
        vision = [i for i, (m, _) in enumerate(items) if m in _VISION_MODALITIES]
        audio = [i for i, (m, _) in enumerate(items) if m == "audio"]
        unknown = [m for m, _ in items if m not in (*_VISION_MODALITIES, "audio")]
        if unknown:
            raise ValueError(f"Qwen2.5-Omni encodes images, videos and audio, not {unknown[0]!r}")
        if vision:
            batch = build_vision_batch(
                [items[i][1]["pixel_values"] for i in vision],
                [tuple(items[i][1]["grid_thw"]) for i in vision], self.visual.cfg, device, dtype)
            for i, emb in zip(vision, self.visual(batch).split(batch.sizes), strict=True):
                out[i] = emb
        if audio:
            batch = build_audio_batch(
                [items[i][1]["input_features"] for i in audio],
                [items[i][1]["num_frames"] for i in audio], device, dtype)
            for i, emb in zip(audio, self.audio_tower(batch).split(batch.sizes), strict=True):
                out[i] = emb
        return out

    def checkpoint_map(self) -> Callable:
        """The thinker's names as transformers saves them (model.*, visual.*, audio_tower.*,
        lm_head.*), under `thinker.` in a whole Omni checkpoint, whose talker.* and token2wav.*
        are skipped. The vision tower's separate q / k / v and gate / up projections load into
        our fused ones; the audio encoder's unused audio_bos_eos_token is skipped."""
        prefix = self.prefix
        lm = self.weight_map(prefix=prefix + "model.", lm_head=prefix + "lm_head.")
        width, inter = self.visual.cfg.width, self.visual.cfg.mlp_hidden
        vision_fused = {"q": ("qkv", Shard(0, width)), "k": ("qkv", Shard(width, width)),
                        "v": ("qkv", Shard(2 * width, width)),
                        "gate_proj": ("gate_up_proj", Shard(0, inter)),
                        "up_proj": ("gate_up_proj", Shard(inter, inter))}
        audio_renamed = {"ln_post": "layer_norm"}

        def mapping(name: str):
            if not name.startswith(prefix):
                return None  # talker.*, token2wav.*: speech output, not built
            local = name[len(prefix):]
            if local.startswith("visual."):
                parts = local.split(".")
                if len(parts) >= 2 and parts[-2] in vision_fused and parts[1] == "blocks":
                    target, shard = vision_fused[parts[-2]]
                    return ".".join(parts[:-2] + [target, parts[-1]]), shard
                return local, None
            if local.startswith("audio_tower."):
                rest = local[len("audio_tower."):]
                if rest.startswith("audio_bos_eos_token."):
                    return None
                head, _, tail = rest.partition(".")
                rest = f"{audio_renamed.get(head, head)}.{tail}"
                return "audio_tower." + whisper_block_name(rest), None
            return lm(name)

        return mapping
