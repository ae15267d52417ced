"""GGUF text architectures transformers has no GGUF reader for, served as a family it does read.

llama.cpp's converter writes the text half of a multimodal model under an architecture of its
own: Qwen2-VL, Qwen2.5-VL and Qwen2.5-Omni as `qwen2vl`, Qwen3-VL as `qwen3vl`, Mistral Small
3.1 as `mistral3`. Their keys are the base family's (`qwen2.*`, `qwen3.*`, `llama.*`:
transformers' key table reads them) plus the mRoPE bands (`rope.dimension_sections`) and, for
Qwen3-VL, how many decoder layers take DeepStack features (`n_deepstack_layers`) and its head
width. Their tensors are the base family's.

Alone (no projector file), such a file is its base family's text model: with text only, the
three mRoPE position rows are equal, so every band rotates by the same position and mRoPE is
the base family's rotary embedding (interleaved or not); DeepStack adds to media positions only.
With its projector it is the text model of the multimodal architecture the projector names
(models/gguf/clip_config.py), where these keys are read.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextArch:
    """A llama.cpp text architecture read as transformers' GGUF `family`: `extra`, keys of its
    own that the family's table lacks (read by the multimodal config, changing nothing for the
    text alone); `fields`, keys the family's table lacks that set a config field."""

    family: str
    extra: tuple[str, ...]
    fields: dict[str, str]


TEXT_ARCHS = {
    "qwen2vl": TextArch("qwen2", ("rope.dimension_sections",), {}),
    # Qwen3's head width is its own (not hidden / heads), written as the key length.
    "qwen3vl": TextArch("qwen3", ("rope.dimension_sections", "n_deepstack_layers"),
                        {"attention.key_length": "head_dim"}),
    # Mistral Small 3.1's text model: a llama file (q / k rows permuted alike).
    "mistral3": TextArch("llama", (), {}),
}
# A projector file's architecture: a tower and projector for libmtmd, not a text model.
PROJECTOR_ARCH = "clip"
