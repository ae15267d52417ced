"""Writes a Whisper checkpoint as a CTranslate2 folder the way CTranslate2's own converter
(`ct2-transformers-converter`, 4.x) lays it out, for tests without the ctranslate2 package: q, k
and v fused (the key's missing bias as zeros), k and v of the cross-attention fused, LayerNorm
scales as gamma / beta, the head an alias of the embeddings, int8 per output channel with
`weight_scale` = 127 / max |w| (convolutions and embeddings included), and config.json's
suppressed and language ids. Checked once against the converter's own output (every variable
read back equal; int8 scales within one float32 ulp).
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import torch

TYPE_IDS = {torch.float32: 0, torch.int8: 1, torch.int16: 2, torch.float16: 4}


def _string(text: str) -> bytes:
    raw = text.encode() + b"\0"
    return struct.pack("<H", len(raw)) + raw


def _variables(sd: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def norm(src: str, dst: str) -> None:
        out[f"{dst}/gamma"], out[f"{dst}/beta"] = sd[f"{src}.weight"], sd[f"{src}.bias"]

    def linear(src: str, dst: str) -> None:
        out[f"{dst}/weight"] = sd[f"{src}.weight"]
        if f"{src}.bias" in sd:
            out[f"{dst}/bias"] = sd[f"{src}.bias"]

    def fused(src: str, parts: list[str], dst: str) -> None:
        out[f"{dst}/weight"] = torch.cat([sd[f"{src}.{p}.weight"] for p in parts])
        out[f"{dst}/bias"] = torch.cat([
            sd.get(f"{src}.{p}.bias", torch.zeros(sd[f"{src}.{p}.weight"].shape[0]))
            for p in parts])

    for side, layers in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        for i in range(layers):
            src, dst = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            fused(f"{src}.self_attn", ["q_proj", "k_proj", "v_proj"],
                  f"{dst}/self_attention/linear_0")
            linear(f"{src}.self_attn.out_proj", f"{dst}/self_attention/linear_1")
            norm(f"{src}.self_attn_layer_norm", f"{dst}/self_attention/layer_norm")
            if side == "decoder":
                linear(f"{src}.encoder_attn.q_proj", f"{dst}/attention/linear_0")
                fused(f"{src}.encoder_attn", ["k_proj", "v_proj"], f"{dst}/attention/linear_1")
                linear(f"{src}.encoder_attn.out_proj", f"{dst}/attention/linear_2")
                norm(f"{src}.encoder_attn_layer_norm", f"{dst}/attention/layer_norm")
            linear(f"{src}.fc1", f"{dst}/ffn/linear_0")
            linear(f"{src}.fc2", f"{dst}/ffn/linear_1")
            norm(f"{src}.final_layer_norm", f"{dst}/ffn/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        out[f"{side}/position_encodings/encodings"] = sd[f"model.{side}.embed_positions.weight"]
        heads = getattr(cfg, f"{side}_attention_heads")
        out[f"{side}/num_heads"] = torch.tensor(heads, dtype=torch.int16)
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    out["decoder/embeddings/weight"] = sd["model.decoder.embed_tokens.weight"]
    out["decoder/scale_embeddings"] = torch.tensor(0, dtype=torch.int8)
    out["decoder/pre_norm"] = torch.tensor(1, dtype=torch.int8)
    return out


def write_ctranslate2_whisper(checkpoint: Path, out: Path, quantization: str = "float32",
                              vocabulary_only: bool = False) -> Path:
    """`checkpoint` (a transformers Whisper folder) as a CTranslate2 folder at `out`, its
    weights in `quantization` (float32, float16 or int8), tokenizer.json copied (or, with
    `vocabulary_only`, vocabulary.txt written instead as the converter writes it: each id's
    token, one a line)."""
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    variables = _variables(sd, model.config)
    stored: dict[str, torch.Tensor] = {}
    for name, value in sorted(variables.items()):
        weight = name.endswith("/weight") and value.dim() >= 2
        if quantization == "int8" and weight:
            amax = value.abs().flatten(1).amax(1).clamp(min=1e-10)
            scale = 127.0 / amax
            shape = (-1,) + (1,) * (value.dim() - 1)
            stored[name] = torch.round(value * scale.view(shape)).clamp(-127, 127).to(torch.int8)
            stored[name.removesuffix("weight") + "weight_scale"] = scale.float()
        elif quantization == "float16" and value.is_floating_point():
            stored[name] = value.half()
        else:
            stored[name] = value
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    blob = struct.pack("<I", 6) + _string("WhisperSpec") + struct.pack("<I", 3)
    blob += struct.pack("<I", len(stored))
    for name, value in sorted(stored.items()):
        data = value.contiguous().numpy().tobytes()
        blob += _string(name) + struct.pack("<B", value.dim())
        blob += struct.pack(f"<{value.dim()}I", *value.shape) if value.dim() else b""
        blob += struct.pack("<BI", TYPE_IDS[value.dtype], len(data)) + data
    blob += struct.pack("<I", 1) + _string("decoder/projection/weight")
    blob += _string("decoder/embeddings/weight")
    (out / "model.bin").write_bytes(blob)
    gen = json.loads((Path(checkpoint) / "generation_config.json").read_text())
    config = {"alignment_heads": gen.get("alignment_heads") or [],
              "lang_ids": sorted((gen.get("lang_to_id") or {}).values()),
              "suppress_ids": gen.get("suppress_tokens") or [],
              "suppress_ids_begin": gen.get("begin_suppress_tokens") or []}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if vocabulary_only:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(checkpoint)
        tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
        (out / "vocabulary.txt").write_text("".join(t + "\n" for t in tokens), encoding="utf-8")
    else:
        shutil.copy(Path(checkpoint) / "tokenizer.json", out / "tokenizer.json")
    return out
