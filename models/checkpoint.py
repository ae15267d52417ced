"""Reads a checkpoint directory's settings where transformers' `from_pretrained` finds them, and
records where each one came from.

Checkpoints on the Hub come in two layouts. transformers 5 writes a processor's components
nested in `processor_config.json` (`image_processor`, `video_processor`, `feature_extractor`)
beside the processor's own fields, and the chat template in `chat_template.jinja`; older ones
have `preprocessor_config.json` (and `video_preprocessor_config.json`), a flat
`processor_config.json` and the template in `chat_template.json` or `tokenizer_config.json`.
The precedence below is transformers 5.24's:

- image processor: `processor_config.json`'s `image_processor`, else `preprocessor_config.json`;
- video processor: `processor_config.json`'s `video_processor`, else
  `video_preprocessor_config.json`, else `preprocessor_config.json`;
- feature extractor: `processor_config.json`'s `feature_extractor` (or `audio_processor`), else
  `preprocessor_config.json`;
- the processor's own fields: the top level of `processor_config.json`;
- chat template: `processor_config.json`'s `chat_template`, `chat_template.json`,
  `chat_template.jinja`, `tokenizer_config.json`'s `chat_template` (the first three are where a
  multimodal processor looks, the last two where a tokenizer does);
- generation defaults: `generation_config.json`.

A component's settings are read against a `Schema`: the transformers class's own defaults for
every setting we compute with, the settings we do not implement with the one value we accept,
and the metadata that changes nothing. A setting outside the schema, or an unsupported value, is
a `CheckpointError` naming the file, the field and the value, raised at load time; a setting the
file lacks takes the class's default, named in its schema, never a guess of ours.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROCESSOR = "processor_config.json"
PREPROCESSOR = "preprocessor_config.json"
VIDEO_PREPROCESSOR = "video_preprocessor_config.json"
CHAT_TEMPLATE_JSON = "chat_template.json"
CHAT_TEMPLATE_JINJA = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"

# Keys a processor's files carry that change nothing computed: class names, loading hints,
# output formats.
INERT = frozenset({
    "image_processor_type", "video_processor_type", "feature_extractor_type", "processor_class",
    "_processor_class", "auto_map", "_valid_processor_keys", "_valid_kwargs_names",
    "return_tensors", "data_format", "input_data_format", "device", "disable_grouping",
    "return_metadata", "return_attention_mask", "padding_side", "padding_value",
    "image_processor_class", "tokenizer_class",
})
# Keys of processor_config.json that hold its components (read through `component`) or the
# template (read through `chat_template`), not processor fields.
COMPONENTS = ("image_processor", "video_processor", "feature_extractor", "audio_processor")


class CheckpointError(ValueError):
    """A checkpoint holds a setting we do not read or a value we do not support; the message
    names the file, the field and the value."""


@dataclass(frozen=True)
class Schema:
    """What mmserve reads of one transformers class's settings.

    `defaults`: every setting we compute with, mapped to the class's own default (the value a
    checkpoint without it gets). `fixed`: settings we do not implement, mapped to the only value
    we accept (the class's default, where implementing the setting's other values is not done).
    `inert`: settings of this class that change nothing we compute (said why beside them)."""

    cls: str
    defaults: Mapping[str, Any]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    inert: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Settings:
    """One component's settings after reading: a value for every setting of its schema, and the
    file (and field) or class default each came from."""

    schema: Schema
    values: Mapping[str, Any]
    sources: Mapping[str, str]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def given(self, key: str) -> bool:
        """Whether the checkpoint set `key` (rather than the class's default applying)."""
        return not self.sources[key].startswith("default")


@dataclass(frozen=True)
class Found:
    """A raw settings dict and where it was read (`file` or `file: key`); `origins` names
    where single settings came from when that is not `source: key` (settings derived from a
    GGUF projector's metadata name its key)."""

    data: Mapping[str, Any]
    source: str
    origins: Mapping[str, str] = field(default_factory=dict)


class CheckpointFiles:
    """The settings files of one checkpoint directory, each parsed once."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._cache: dict[str, Any] = {}

    def json(self, name: str) -> Any:
        """A JSON file's content, or None when the checkpoint has no such file."""
        if name not in self._cache:
            file = self.path / name
            try:
                self._cache[name] = json.loads(file.read_text()) if file.exists() else None
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{name} is not valid JSON: {e}") from e
        return self._cache[name]

    def text(self, name: str) -> str | None:
        file = self.path / name
        return file.read_text() if file.exists() else None

    # ---- processor components ------------------------------------------------------------------

    def component(self, kind: str) -> Found | None:
        """The settings dict of a processor component ("image_processor", "video_processor" or
        "feature_extractor") where transformers finds it, or None if the checkpoint has none."""
        nested = self.json(PROCESSOR) or {}
        keys = ("feature_extractor", "audio_processor") if kind == "feature_extractor" else (kind,)
        for key in keys:
            if isinstance(nested.get(key), Mapping):
                return Found(nested[key], f"{PROCESSOR}: {key}")
        files = {"image_processor": (PREPROCESSOR,),
                 "video_processor": (VIDEO_PREPROCESSOR, PREPROCESSOR),
                 "feature_extractor": (PREPROCESSOR,)}[kind]
        for name in files:
            data = self.json(name)
            if data is not None:
                return Found(data, name)
        return None

    def processor_fields(self) -> Found:
        """The processor's own fields (`image_seq_length`, `patch_size`, token strings, ...): the
        top level of processor_config.json, its components and template left out."""
        data = self.json(PROCESSOR) or {}
        own = {k: v for k, v in data.items() if k not in COMPONENTS and k != "chat_template"}
        return Found(own, PROCESSOR)

    def read(self, found: Found | None, schema: Schema) -> Settings:
        """`found`'s settings against `schema` (see `read_settings`)."""
        return read_settings(found, schema)

    # ---- templates and generation --------------------------------------------------------------

    def chat_template(self) -> tuple[str | None, str]:
        """(template, where it was found) in the order of precedence above; (None, "none")
        when the checkpoint has none."""
        processor = self.json(PROCESSOR) or {}
        if isinstance(processor.get("chat_template"), str):
            return processor["chat_template"], f"{PROCESSOR}: chat_template"
        legacy = self.json(CHAT_TEMPLATE_JSON)
        if legacy is not None:
            template = legacy.get("chat_template") if isinstance(legacy, Mapping) else None
            if not isinstance(template, str):
                raise CheckpointError(f"{CHAT_TEMPLATE_JSON} has no chat_template string")
            return template, CHAT_TEMPLATE_JSON
        jinja = self.text(CHAT_TEMPLATE_JINJA)
        if jinja is not None:
            return jinja, CHAT_TEMPLATE_JINJA
        tokenizer = self.json(TOKENIZER_CONFIG) or {}
        template = tokenizer.get("chat_template")
        if isinstance(template, list):  # named templates: transformers takes "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
            if template is None:
                raise CheckpointError(f"{TOKENIZER_CONFIG}: chat_template lists named templates "
                                      f"{sorted(named)} and none is 'default'")
        if isinstance(template, str):
            return template, f"{TOKENIZER_CONFIG}: chat_template"
        return None, "none"

    def generation(self) -> GenerationDefaults:
        """EOS ids and default sampling from generation_config.json (empty without one)."""
        data = self.json(GENERATION_CONFIG)
        if data is None:
            return GenerationDefaults((), {}, "none")
        eos = data.get("eos_token_id")
        ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise CheckpointError(f"{GENERATION_CONFIG}: eos_token_id={eos!r} is not token ids")
        sampling = {k: data[k] for k in SAMPLING_KEYS if data.get(k) is not None}
        if data.get("do_sample") is False:
            sampling = {"temperature": 0.0}  # transformers' generate() is greedy then
        return GenerationDefaults(ids, sampling, GENERATION_CONFIG)


SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# The keys of a quantization_config that say its format (AWQ, GPTQ, compressed-tensors, fp8).
QUANT_FORMAT_KEYS = ("format", "version", "bits", "group_size", "fmt", "weight_block_size",
                     "activation_scheme", "load_in_4bit", "load_in_8bit")


def refuse_quantized(files: CheckpointFiles) -> None:
    """CheckpointError for a checkpoint whose config.json carries a `quantization_config`
    (weights stored quantized by AWQ, GPTQ, llm-compressor's compressed-tensors, fp8 ...):
    mmserve loads unquantized weights only (and quantizes them itself on request), so such a
    checkpoint is refused at load, its method and format named, rather than failing on its
    first packed tensor."""
    config = files.json("config.json") or {}
    quant = config.get("quantization_config") if isinstance(config, Mapping) else None
    if quant is None:
        return
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"config.json: quantization_config={_short(quant)} is not "
                              "supported (mmserve loads unquantized weights only)")
    method = quant.get("quant_method", "unnamed")
    details = [f"{k}={_short(quant[k])}" for k in QUANT_FORMAT_KEYS if quant.get(k) is not None]
    for name, group in (quant.get("config_groups") or {}).items():  # compressed-tensors
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if isinstance(weights, Mapping):
            scheme = "{type}{num_bits}".format(type=weights.get("type", "?"),
                                               num_bits=weights.get("num_bits", "?"))
            details.append(f"{name}: weights {scheme}")
    said = f" ({', '.join(details)})" if details else ""
    raise CheckpointError(
        f"config.json: quantization_config quant_method={method!r}{said} is not supported: "
        "mmserve loads checkpoints with unquantized (float32 / bfloat16 / float16) weights "
        "only; use the model's unquantized checkpoint (mmserve can quantize its linears on "
        "load, see --quantization) or a GGUF file")


@dataclass(frozen=True)
class GenerationDefaults:
    """What generation_config.json sets: EOS ids and the sampling a request that sets none
    gets (transformers' generate() samples so; greedy where do_sample is false)."""

    eos_token_ids: tuple[int, ...]
    sampling: Mapping[str, Any]
    source: str


def read_settings(found: Found | None, schema: Schema) -> Settings:
    """`found`'s settings against `schema` (None: the checkpoint has no such file, every setting
    takes the class's default). Raises CheckpointError for a setting the schema does not know or
    a value it does not support."""
    data = dict(found.data) if found is not None else {}
    where = found.source if found is not None else ""
    for key, value in data.items():
        if key in schema.fixed:
            if value is not None and value != schema.fixed[key]:
                raise CheckpointError(
                    f"{where}: {key}={_short(value)} is not supported (mmserve implements "
                    f"{schema.cls} with {key}={schema.fixed[key]!r} only)")
        elif key not in schema.defaults and key not in schema.inert and key not in INERT:
            raise CheckpointError(
                f"{where}: unknown setting {key}={_short(value)} (not a setting mmserve reads "
                f"for {schema.cls}; refusing rather than computing something else)")
    values, sources = {}, {}
    origins = found.origins if found is not None else {}
    for key, default in schema.defaults.items():
        if data.get(key) is not None:
            values[key], sources[key] = data[key], origins.get(key, f"{where}: {key}")
        else:
            values[key], sources[key] = default, f"default of {schema.cls}"
    return Settings(schema, values, sources)


def own_keys(found: Found | None, other: Found | None, *schemas: Schema) -> Found | None:
    """`found` less the keys of `schemas` (another component's) when both components were read
    from the same file (the Hub's merged preprocessor_config.json holds an image processor's
    and a feature extractor's settings side by side: each class reads its own keys)."""
    if found is None or other is None or found.source != other.source:
        return found
    foreign = set().union(*(set(s.defaults) | set(s.fixed) | s.inert for s in schemas))
    return Found({k: v for k, v in found.data.items() if k not in foreign}, found.source,
                 found.origins)


def choose_schema(found: Found | None, schemas: Mapping[str, Schema], default: str,
                  type_key: str = "image_processor_type") -> Schema:
    """The schema of the class the settings name (`image_processor_type`, its Fast / Pil
    suffix dropped: both compute alike), else `default`, the class transformers' Auto* picks
    for the model type."""
    named = (found.data.get(type_key) if found is not None else None) or default
    base = str(named).removesuffix("Fast").removesuffix("Pil")
    if base not in schemas:
        raise CheckpointError(
            f"{found.source if found else 'checkpoint'}: {type_key}={named!r} is not one mmserve "
            f"implements for this model ({', '.join(sorted(schemas))})")
    return schemas[base]


def tie_word_embeddings(config: Any) -> tuple[bool, str]:
    """Whether `config`'s flag ties the LM head to the token embeddings, as transformers reads
    it: `config.tie_word_embeddings` (a composite config class forwards an older checkpoint's
    text-level flag up where transformers does so); a config without the flag does not tie.
    -> (tied, where the flag was read)."""
    name = type(config).__name__
    tied = getattr(config, "tie_word_embeddings", None)
    if tied is None:
        return False, f"{name} has no tie_word_embeddings: untied"
    return bool(tied), f"config.json: tie_word_embeddings of {name}"


def checkpoint_dtype(hf_config: Any, files: CheckpointFiles) -> tuple[str | None, str]:
    """The dtype the checkpoint's weights are meant for, as transformers' `dtype="auto"` finds
    it: the config's `dtype` (`torch_dtype` in transformers 4's config.json, which its config
    class reads as `dtype`), else the first floating-point tensor's in the first weights file.
    -> (dtype name such as "bfloat16" or None, where it was read)."""
    value = getattr(hf_config, "dtype", None)
    if value is not None:
        return str(value).removeprefix("torch."), "config.json: dtype (or torch_dtype)"
    for file in weight_files(files.path)[:1]:
        for name, info in safetensors_header(file).items():
            kind = SAFETENSORS_FLOATS.get(info.get("dtype", "")) if name != "__metadata__" else None
            if kind is not None:
                return kind, f"{file.name}: {name} (config.json sets no dtype)"
    return None, "none (no dtype in config.json, no floating-point weights)"


SAFETENSORS_FLOATS = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, sharded (with index) or single (an
    empty list when there are none)."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / n for n in names]
    single = path / "model.safetensors"
    return [single] if single.exists() else sorted(path.glob("*.safetensors"))


def safetensors_header(file: Path) -> dict[str, Any]:
    """A safetensors file's header: tensor name -> {"dtype", "shape", "data_offsets"} (no
    tensor data is read)."""
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size < 1 << 30:
            raise CheckpointError(f"{file.name} is not a safetensors file (header size {size})")
        return json.loads(f.read(size))


def describe_tie(hf_config: Any) -> str:
    """Both flags, for error messages: the top-level one and the text config's."""
    top = getattr(hf_config, "tie_word_embeddings", None)
    text = getattr(getattr(hf_config, "text_config", None), "tie_word_embeddings", None)
    return f"config.json tie_word_embeddings={top!r}, text_config.tie_word_embeddings={text!r}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
