"""The transformers config a GGUF file describes, built from its metadata as transformers 5.24's
GGUF loader builds it (`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`, whose
key tables `transformers.integrations.ggml` holds), with the metadata key behind each setting.

transformers' own reader of these files parses every token of the vocabulary into a numpy
view (half a minute for Gemma 3's 262,144 tokens); this reads the same keys from our parse of
the header (models/gguf/reader.py) in a fraction of a second. tests/test_gguf_files.py checks
that both give the same config.

What transformers does, step by step: `general.architecture` names the family (a "llama" file
whose `general.name` is exactly "mistral" is Mistral); each `<arch>.<key>` and `tokenizer.ggml.
<id>` the table lists becomes its config field; the head is tied when the file has no
`output.weight`; `vocab_size`, when the file does not state it, is the vocabulary's length;
a "gemma3" file is the text model `gemma3_text`. Settings the file does not hold take the config
class's defaults, as in transformers.

Metadata that would change the computation but that transformers does not read (rope scaling,
a rotary width other than the head's, keys of the family this table does not list) is refused
by name rather than ignored: the model would not be the one the file describes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.gguf.archs import PROJECTOR_ARCH, TEXT_ARCHS
from models.gguf.reader import GGUFError, GGUFFile

# GGUF family (after transformers' renames) -> the architecture our registry serves it as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# Family keys transformers' table does not map that we accept, each checked against the
# config it describes: (key, the config field it must equal, or None: changes nothing).
CHECKED = {
    "rope.dimension_count": "head_dim",
    "attention.key_length": "head_dim",
    "attention.value_length": "head_dim",
    "rope.freq_base_swa": "rope_parameters.sliding_attention.rope_theta",
}
# Prefixes of keys that describe the file, not the model.
INERT_PREFIXES = ("general.",)


@dataclass(frozen=True)
class GGUFConfig:
    """The config dict transformers builds from a GGUF file, where each setting came from, and
    the architecture it is served as."""

    values: dict[str, Any]
    sources: dict[str, str]
    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # the GGUF family after transformers' renames, e.g. "mistral"
    # Keys of a llama.cpp architecture read as `family` (models/gguf/archs.py) that the
    # family's table lacks: "rope.dimension_sections" -> its value.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def model_type(self) -> str:
        return self.values["model_type"]


def read_config(file: GGUFFile) -> GGUFConfig:
    """`file`'s config as transformers reads it; a GGUFError for a family we do not serve or a
    key that changes the model and that nothing reads."""
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    name = file.path.name
    arch = file.architecture
    if arch == PROJECTOR_ARCH:
        raise GGUFError(
            f"{name}: general.architecture={arch!r}: a projector (mmproj) file, a tower for "
            "images or sound, not a text model; pass it as --mmproj (LLM(..., mmproj=)) beside "
            "its text model's GGUF")
    alias = TEXT_ARCHS.get(arch)
    family = "mistral" if "llama" in arch and file.get("general.name") == "mistral" else arch
    family = alias.family if alias else family
    family = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(family, family)
    if family not in ARCHITECTURES:
        raise GGUFError(
            f"{name}: general.architecture={arch!r} is not a family mmserve serves from GGUF "
            f"({', '.join(sorted(ARCHITECTURES))})")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for key, value in GGUF_CONFIG_DEFAULTS_MAPPING.get(family, {}).items():
        values[key], sources[key] = value, "transformers' GGUF default"
    values["tie_word_embeddings"] = "output.weight" not in file.tensor_by_name
    sources["tie_word_embeddings"] = ("tensors: no output.weight" if values["tie_word_embeddings"]
                                      else "tensors: output.weight present")
    tables = {"general": GGUF_CONFIG_MAPPING["general"], "tokenizer": GGUF_CONFIG_MAPPING[
        "tokenizer"], family: GGUF_CONFIG_MAPPING[family]}
    unread: list[str] = []
    extra: dict[str, Any] = {}
    for key, raw in file.metadata.items():
        if alias and key.removeprefix(arch + ".") in alias.extra:
            extra[key.removeprefix(arch + ".")] = raw
            continue
        if alias and key.removeprefix(arch + ".") in alias.fields:
            field_name = alias.fields[key.removeprefix(arch + ".")]
            values[field_name], sources[field_name] = _plain(raw), key
            continue
        renamed = key.replace(arch, family, 1) if key.startswith(arch + ".") else key
        prefix, _, rest = renamed.partition(".")
        value = _plain(raw)
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, family)
        field = tables.get(prefix, {}).get(rest)
        if field is not None and field != -1:
            values[field], sources[field] = value, key
        elif prefix == family and field is None and rest not in tables[family]:
            if rest not in CHECKED:
                unread.append(f"{key}={_short(raw)}")
    if values.get("model_type") == "gemma3":
        values["model_type"] = "gemma3_text"
    if "vocab_size" not in values and "tokenizer.ggml.tokens" in file.metadata:
        values["vocab_size"] = len(file.metadata["tokenizer.ggml.tokens"])
        sources["vocab_size"] = "tokenizer.ggml.tokens (its length)"
    if unread:
        raise GGUFError(
            f"{name}: metadata {', '.join(unread)} would change the model, and neither "
            "transformers' GGUF loader nor mmserve reads it; refusing rather than computing a "
            "different model")
    _check_rope_scaling(file, values)
    return GGUFConfig(values, sources, ARCHITECTURES[family], family, extra)


def check_against(config: GGUFConfig, hf_config: Any, file: GGUFFile) -> None:
    """Family keys transformers does not read must agree with the config it built (a rotary
    width or key length other than the head's, or a sliding layer's rotary base other than the
    config's, is a model transformers would compute wrongly)."""
    head_dim = getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads)
    sliding = (getattr(hf_config, "rope_parameters", None) or {}).get("sliding_attention", {})
    for rest, checked in CHECKED.items():
        key = f"{file.architecture}.{rest}"
        if key not in file.metadata:
            continue
        if checked == "head_dim":
            expected, source = head_dim, config.sources.get(checked, "hidden_size / heads")
            same = int(file.metadata[key]) == head_dim
        else:
            expected = sliding.get("rope_theta")
            source = f"the default of {type(hf_config).__name__}"
            same = expected is not None and abs(float(file.metadata[key]) - expected) <= (
                1e-6 * expected)
        if not same:
            raise GGUFError(
                f"{file.path.name}: metadata {key}={file.metadata[key]} contradicts the config's "
                f"{checked}={expected} (from {source}), and transformers' GGUF loader does not "
                "read it; refusing rather than computing a different model")


def _check_rope_scaling(file: GGUFFile, values: dict[str, Any]) -> None:
    for key in ("rope_freqs.weight",):
        if key in file.tensor_by_name:
            raise GGUFError(
                f"{file.path.name}: tensor {key} (per-frequency rope factors) is not read by "
                "transformers' GGUF loader nor by mmserve; refusing rather than computing "
                "different positions")


def _plain(value: Any) -> Any:
    """A metadata value as transformers' parser gives it (a one-item array as its item)."""
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def _short(value: Any) -> str:
    text = repr(_plain(value))
    return text if len(text) <= 60 else text[:57] + "..."
