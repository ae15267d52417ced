"""A projector file's tensors (`mmproj-*.gguf`) as the Hugging Face checkpoint's: llama.cpp's
names (`v.blk.3.attn_q.weight`, `mm.0.weight`) mapped back to the transformers names our towers'
checkpoint maps read, the converter's rearrangements undone, every tensor checked against the
model before anything is allocated.

What llama.cpp's converter does to a tower, undone here per projector type: a fused q / k / v
projection split into three (joined again along the output rows), a Qwen patch kernel over two
frames split into one kernel per frame (stacked again on the frame axis), a Gemma norm stored
as 1 + w (1 subtracted), a Whisper convolution's bias stored as a column (its last axis
dropped), a Pixtral tower's q / k rows permuted for llama.cpp's rotary layout (put back).
Every other tensor is the checkpoint's, renamed.

Projector weights are dequantized into the model dtype as they stream in: a tower runs dense
(never quantized, as from safetensors). F32 / F16 / BF16 tensors hold the checkpoint's values
exactly where the model dtype does (float32; bfloat16 for a BF16 file); Q8_0 and other blocks
(a `--outtype q8_0` projector) are dequantized by gguf-py.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf.quants import dequantize
from torch import nn

from models.gguf.reader import GGUFError, GGUFFile, TensorInfo
from models.gguf.tensors import readable

# Our decoder's parameters (models/layers/decoder.py): the text file fills them.
DECODER_PARAMS = ("layers.", "embed_tokens.", "norm.", "lm_head.")


@dataclass(frozen=True)
class Rule:
    """GGUF tensor names matching `pattern` are (part of) the checkpoint tensor `target`
    (`pattern`'s groups substituted; "": a tensor not read, a copy of one the text file
    holds): `join` "cat" (parts along the first axis, in `part` order), "frames" (parts
    stacked on a new third axis: a kernel per frame), or "" (whole); `values` "minus_one" (a
    norm stored as 1 + w), "column" (a bias stored as [n, 1]) or "unpermute" (q / k rows in
    llama.cpp's rotary order)."""

    pattern: str
    target: str
    join: str = ""
    part: int = 0
    parts: int = 1
    values: str = ""


def _qkv(gguf: str, target: str) -> list[Rule]:
    """Rules for q, k, v split by the converter from one projection `target` (\\1: block,
    \\2: weight or bias)."""
    return [Rule(gguf.format(p), target, "cat", i, 3) for i, p in enumerate("qkv")]


def _patch_frames(target: str) -> list[Rule]:
    return [Rule(r"v\.patch_embd\.weight", target, "frames", 0, 2),
            Rule(r"v\.patch_embd\.weight\.1", target, "frames", 1, 2)]


_BLK = r"v\.blk\.(\d+)\."
_WB = r"\.(weight|bias)"
_QWEN2VL = [
    *_patch_frames("visual.patch_embed.proj.weight"),
    *_qkv(_BLK + "attn_{}" + _WB, r"visual.blocks.\1.attn.qkv.\2"),
    Rule(_BLK + "attn_out" + _WB, r"visual.blocks.\1.attn.proj.\2"),
    Rule(_BLK + "ln1" + _WB, r"visual.blocks.\1.norm1.\2"),
    Rule(_BLK + "ln2" + _WB, r"visual.blocks.\1.norm2.\2"),
    Rule(_BLK + "ffn_up" + _WB, r"visual.blocks.\1.mlp.fc1.\2"),
    Rule(_BLK + "ffn_down" + _WB, r"visual.blocks.\1.mlp.fc2.\2"),
    Rule(r"v\.post_ln" + _WB, r"visual.merger.ln_q.\1"),
    Rule(r"mm\.(0|2)" + _WB, r"visual.merger.mlp.\1.\2"),
]
_QWEN25VL = [r for r in _QWEN2VL if ".mlp.fc" not in r.target] + [
    Rule(_BLK + "ffn_gate" + _WB, r"visual.blocks.\1.mlp.gate_proj.\2"),
    Rule(_BLK + "ffn_up" + _WB, r"visual.blocks.\1.mlp.up_proj.\2"),
    Rule(_BLK + "ffn_down" + _WB, r"visual.blocks.\1.mlp.down_proj.\2"),
]
_QWEN3VL = [
    *_patch_frames("model.visual.patch_embed.proj.weight"),
    Rule(r"v\.patch_embd\.bias", "model.visual.patch_embed.proj.bias"),
    Rule(r"v\.position_embd\.weight", "model.visual.pos_embed.weight"),
    Rule(_BLK + "attn_qkv" + _WB, r"model.visual.blocks.\1.attn.qkv.\2"),
    Rule(_BLK + "attn_out" + _WB, r"model.visual.blocks.\1.attn.proj.\2"),
    Rule(_BLK + "ln1" + _WB, r"model.visual.blocks.\1.norm1.\2"),
    Rule(_BLK + "ln2" + _WB, r"model.visual.blocks.\1.norm2.\2"),
    Rule(_BLK + "ffn_up" + _WB, r"model.visual.blocks.\1.mlp.linear_fc1.\2"),
    Rule(_BLK + "ffn_down" + _WB, r"model.visual.blocks.\1.mlp.linear_fc2.\2"),
    Rule(r"v\.post_ln" + _WB, r"model.visual.merger.norm.\1"),
    Rule(r"mm\.0" + _WB, r"model.visual.merger.linear_fc1.\1"),
    Rule(r"mm\.2" + _WB, r"model.visual.merger.linear_fc2.\1"),
    # DeepStack mergers, numbered by the tower block they read (renumbered in `_deepstack`).
    Rule(r"v\.deepstack\.(\d+)\.norm" + _WB, r"model.visual.deepstack_merger_list.\1.norm.\2"),
    Rule(r"v\.deepstack\.(\d+)\.fc1" + _WB,
         r"model.visual.deepstack_merger_list.\1.linear_fc1.\2"),
    Rule(r"v\.deepstack\.(\d+)\.fc2" + _WB,
         r"model.visual.deepstack_merger_list.\1.linear_fc2.\2"),
]
_SIGLIP = "vision_tower."
_GEMMA3 = [
    Rule(r"v\.patch_embd" + _WB, _SIGLIP + r"embeddings.patch_embedding.\1"),
    Rule(r"v\.position_embd\.weight", _SIGLIP + "embeddings.position_embedding.weight"),
    Rule(_BLK + "ln1" + _WB, _SIGLIP + r"encoder.layers.\1.layer_norm1.\2"),
    Rule(_BLK + "ln2" + _WB, _SIGLIP + r"encoder.layers.\1.layer_norm2.\2"),
    *[Rule(_BLK + f"attn_{p}" + _WB, _SIGLIP + rf"encoder.layers.\1.self_attn.{p}_proj.\2")
      for p in "qkv"],
    Rule(_BLK + "attn_out" + _WB, _SIGLIP + r"encoder.layers.\1.self_attn.out_proj.\2"),
    Rule(_BLK + "ffn_up" + _WB, _SIGLIP + r"encoder.layers.\1.mlp.fc1.\2"),
    Rule(_BLK + "ffn_down" + _WB, _SIGLIP + r"encoder.layers.\1.mlp.fc2.\2"),
    Rule(r"v\.post_ln" + _WB, _SIGLIP + r"post_layernorm.\1"),
    Rule(r"mm\.input_projection\.weight", "multi_modal_projector.mm_input_projection_weight"),
    Rule(r"mm\.soft_emb_norm\.weight", "multi_modal_projector.mm_soft_emb_norm.weight",
         values="minus_one"),
]
_ABLK = r"a\.blk\.(\d+)\."
_WHISPER = "audio_tower."
_AUDIO_BLOCKS = [
    Rule(_ABLK + "ln1" + _WB, _WHISPER + r"layers.\1.self_attn_layer_norm.\2"),
    Rule(_ABLK + "ln2" + _WB, _WHISPER + r"layers.\1.final_layer_norm.\2"),
    *[Rule(_ABLK + f"attn_{p}" + _WB, _WHISPER + rf"layers.\1.self_attn.{p}_proj.\2")
      for p in "qkv"],
    Rule(_ABLK + "attn_out" + _WB, _WHISPER + r"layers.\1.self_attn.out_proj.\2"),
    Rule(_ABLK + "ffn_up" + _WB, _WHISPER + r"layers.\1.fc1.\2"),
    Rule(_ABLK + "ffn_down" + _WB, _WHISPER + r"layers.\1.fc2.\2"),
]
_QWEN2A = [
    Rule(r"a\.conv1d\.(1|2)\.weight", _WHISPER + r"conv\1.weight"),
    Rule(r"a\.conv1d\.(1|2)\.bias", _WHISPER + r"conv\1.bias", values="column"),
    Rule(r"a\.position_embd\.weight", _WHISPER + "embed_positions.weight"),
    *_AUDIO_BLOCKS,
    Rule(r"a\.post_ln" + _WB, _WHISPER + r"layer_norm.\1"),
    Rule(r"mm\.a\.fc" + _WB, r"multi_modal_projector.linear.\1"),
]
_PIXTRAL = r"vision_tower.transformer.layers.\1."
_MISTRAL3 = [
    Rule(r"v\.patch_embd\.weight", "vision_tower.patch_conv.weight"),
    Rule(r"v\.pre_ln\.weight", "vision_tower.ln_pre.weight"),
    # the converter permutes q / k rows as it does a llama model's, for its rotary layout
    *[Rule(_BLK + f"attn_{p}\\.weight", _PIXTRAL + f"attention.{p}_proj.weight",
           values="unpermute") for p in "qk"],
    Rule(_BLK + r"attn_v\.weight", _PIXTRAL + "attention.v_proj.weight"),
    Rule(_BLK + r"attn_out\.weight", _PIXTRAL + "attention.o_proj.weight"),
    Rule(_BLK + r"ln1\.weight", _PIXTRAL + "attention_norm.weight"),
    Rule(_BLK + r"ln2\.weight", _PIXTRAL + "ffn_norm.weight"),
    *[Rule(_BLK + f"ffn_{p}\\.weight", _PIXTRAL + f"feed_forward.{p}_proj.weight")
      for p in ("gate", "up", "down")],
    Rule(r"mm\.input_norm\.weight", "multi_modal_projector.norm.weight"),
    Rule(r"mm\.patch_merger\.weight", "multi_modal_projector.patch_merger.merging_layer.weight"),
    Rule(r"mm\.(1|2)" + _WB, r"multi_modal_projector.linear_\1.\2"),
    # [IMG_BREAK]'s row of the text embedding, copied for libmtmd: the text file holds it
    Rule(r"v\.token_embd\.img_break", ""),
]
# Qwen2.5-Omni's thinker: Qwen2.5-VL's tower with q, k, v apart, and a Whisper encoder whose
# projection and last norm are its own (its sinusoidal positions, which the converter writes
# out, are computed by the model).
_QWEN25O = [
    *[Rule(_BLK + f"attn_{p}" + _WB, rf"visual.blocks.\1.attn.{p}.\2") for p in "qkv"],
    *[r for r in _QWEN25VL if ".attn.qkv." not in r.target],
    Rule(r"a\.conv1d\.(1|2)\.weight", _WHISPER + r"conv\1.weight"),
    Rule(r"a\.conv1d\.(1|2)\.bias", _WHISPER + r"conv\1.bias", values="column"),
    Rule(r"a\.position_embd\.weight", ""),
    *_AUDIO_BLOCKS,
    Rule(r"a\.post_ln" + _WB, _WHISPER + r"ln_post.\1"),
    Rule(r"mm\.a\.fc" + _WB, _WHISPER + r"proj.\1"),
]
THINKER_TEXT = ("qwen2.5o",)  # projector types whose text names are a thinker's `model.*`
RULES = {"qwen2vl_merger": _QWEN2VL, "qwen2.5vl_merger": _QWEN25VL, "qwen3vl_merger": _QWEN3VL,
         "gemma3": _GEMMA3, "qwen2a": _QWEN2A, "pixtral": _MISTRAL3, "qwen2.5o": _QWEN25O}


@dataclass
class _Target:
    """One checkpoint tensor and the GGUF tensors it is made of."""

    rule: Rule
    parts: dict[int, TensorInfo]


class ProjectorWeights:
    """A projector file's tensors for one model (its tower and projector)."""

    def __init__(self, path: Path, kind: str, deepstack: Collection[int] = (),
                 heads: int = 0) -> None:
        self.file = GGUFFile(path)
        self.kind = kind
        self.heads = heads  # the tower's attention heads (to undo a rotary permutation)
        self.rules = [(re.compile(r.pattern), r) for r in RULES[kind]]
        self.deepstack = list(deepstack)  # tower blocks read by DeepStack mergers, in order
        self.targets: dict[str, _Target] = {}  # checkpoint name -> its parts
        self.filled: set[str] = set()  # our parameters these fill

    def text_name(self, name: str) -> str:
        """A text file's checkpoint name (models/gguf/tensors.py: a causal LM's `model.*`) as
        this multimodal checkpoint's: transformers 5's `model.language_model.*` (the head
        stays), a Qwen2.5-Omni thinker's own `model.*`."""
        if self.kind in THINKER_TEXT or not name.startswith("model."):
            return name
        return "model.language_model." + name[len("model."):]

    def checkpoint_name(self, info: TensorInfo) -> tuple[str, Rule] | None:
        for pattern, rule in self.rules:
            match = pattern.fullmatch(info.name)
            if match:
                name = match.expand(rule.target)
                return self._deepstack(name), rule
        return None

    def _deepstack(self, name: str) -> str:
        """A DeepStack merger's GGUF number is the tower block it reads; transformers numbers
        them in the order of `deepstack_visual_indexes`."""
        head, found, rest = name.partition("deepstack_merger_list.")
        if not found:
            return name
        block, _, tail = rest.partition(".")
        if int(block) not in self.deepstack:
            raise GGUFError(f"{self.file.path.name}: a DeepStack merger reads block {block}, "
                            "which clip.vision.is_deepstack_layers does not name")
        return f"{head}{found}{self.deepstack.index(int(block))}.{tail}"

    def plan(self, model: nn.Module, mapping: Callable) -> set[str]:
        """Check every tensor against `model` (on the meta device): a name no rule knows, a
        type we cannot read, a missing part, a shape the config does not make, or a tower
        parameter no tensor fills is a GGUFError naming it. -> our parameters it fills."""
        name = self.file.path.name
        for info in self.file.tensors:
            if not readable(info.ggml_type):
                raise GGUFError(f"{name}: tensor {info.name} is of type {info.type_name}, which "
                                "mmserve does not read")
            found = self.checkpoint_name(info)
            if found is None:
                raise GGUFError(f"{name}: tensor {info.name} ({info.type_name} "
                                f"{list(info.shape)}) is not a tensor of a {self.kind} "
                                "projector mmserve reads")
            checkpoint, rule = found
            if not rule.target:
                continue  # a copy of what the text file holds
            target = self.targets.setdefault(checkpoint, _Target(rule, {}))
            target.parts[rule.part] = info
        params = dict(model.named_parameters())
        for checkpoint, target in self.targets.items():
            missing = [i for i in range(target.rule.parts) if i not in target.parts]
            if missing:
                raise GGUFError(f"{name}: {checkpoint} is made of {target.rule.parts} tensors "
                                f"and the file holds {len(target.parts)} of them: missing tensor")
            mapped = mapping(checkpoint)
            if mapped is None:
                raise GGUFError(f"{name}: {checkpoint} (from "
                                f"{', '.join(i.name for i in target.parts.values())}) has no "
                                "place in the model the metadata describes")
            ours, shard = mapped
            param = params.get(ours)
            shape = _shape(target)
            expected = None if param is None else tuple(
                param.shape if shard is None else (shard.size, *param.shape[1:]))
            if expected != shape:
                raise GGUFError(f"{name}: {checkpoint} (from "
                                f"{', '.join(i.name for i in target.parts.values())}) has shape "
                                f"{list(shape)}, but the config in the metadata makes {ours} "
                                f"{list(expected) if expected else 'no parameter'}")
            self.filled.add(ours)
        unfilled = [p for p in params if p not in self.filled and not p.startswith(DECODER_PARAMS)]
        if unfilled:
            raise GGUFError(f"{name}: no tensors for {', '.join(unfilled[:6])}"
                            f"{' ...' if len(unfilled) > 6 else ''} (the metadata's config "
                            "describes more than the file holds: missing tensors)")
        return self.filled

    def tensors(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(checkpoint name, tensor in `dtype`) of every planned checkpoint tensor."""
        for checkpoint, target in self.targets.items():
            parts = [_values(self.file, target.parts[i], target.rule.values, self.heads)
                     for i in range(target.rule.parts)]
            if target.rule.join == "cat":
                value = np.concatenate(parts, axis=0)
            elif target.rule.join == "frames":
                value = np.stack(parts, axis=2)
            else:
                (value,) = parts
            yield checkpoint, torch.from_numpy(np.ascontiguousarray(value)).to(dtype)

    def summary(self) -> str:
        types = sorted({i.type_name for t in self.targets.values() for i in t.parts.values()})
        count = sum(len(t.parts) for t in self.targets.values())
        return f"projector {self.file.path.name}: {count} {'/'.join(types)} tensors dequantized"


def _shape(target: _Target) -> tuple[int, ...]:
    first = target.parts[0].shape
    if target.rule.join == "cat":
        return (sum(i.shape[0] for i in target.parts.values()), *first[1:])
    if target.rule.join == "frames":
        return (*first[:2], target.rule.parts, *first[2:])
    if target.rule.values == "column":
        return first[:-1] if first[-1] == 1 else first
    return first


def _values(file: GGUFFile, info: TensorInfo, how: str, heads: int = 0) -> np.ndarray:
    """A tensor dequantized to float32 in its own shape, its stored rearrangement undone."""
    values = dequantize(file.read(info), info.ggml_type).reshape(info.shape).astype(np.float32)
    if how == "unpermute":
        # the converter's order: each head's rows as (half, pair) for llama.cpp's rotary
        # layout; ours as (pair, half)
        rows = values.shape[0]
        if not heads or rows % (2 * heads):
            raise GGUFError(f"{file.path.name}: tensor {info.name} has {rows} rows, not whole "
                            f"heads of {heads}")
        return np.ascontiguousarray(values.reshape(heads, rows // heads // 2, 2, -1)
                                    .swapaxes(1, 2).reshape(values.shape))
    if how == "minus_one":
        return values - np.float32(1)
    if how == "column":
        if values.shape[-1] != 1:
            raise GGUFError(f"{file.path.name}: tensor {info.name} has shape "
                            f"{list(info.shape)}, not a column")
        return values[..., 0]
    return values


def projector_weights(path: Path) -> ProjectorWeights:
    """The projector file at `path`, its type and DeepStack blocks (if any) read from it."""
    file = GGUFFile(path)
    kind = file.get("clip.projector_type")
    if kind not in RULES:
        raise GGUFError(f"{path.name}: clip.projector_type={kind!r} is not a projector type "
                        f"mmserve reads ({', '.join(sorted(RULES))})")
    layers = file.get("clip.vision.is_deepstack_layers")
    deepstack = [] if layers is None else [i for i, on in enumerate(np.asarray(layers)) if on]
    return ProjectorWeights(path, kind, deepstack,
                            int(file.get("clip.vision.attention.head_count", 0)))


