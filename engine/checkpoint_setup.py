"""What the engine takes from a checkpoint besides its weights, read once at start-up where
transformers reads it (models/checkpoint.py), each with the file it came from: the config and
the architecture's spec, the tokenizer and its chat template, the EOS ids and the default
sampling of generation_config.json, the dtype the weights are meant for and whether the LM head
is tied. `python -m engine.inspect` prints it; /v1/models and the engine panel show it. A GGUF
file holds all of these in its metadata (engine/gguf_setup.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, AutoTokenizer

from engine.gguf_setup import GGUFSetup
from engine.model_stores import StoredModel
from models.checkpoint import (
    CheckpointFiles,
    checkpoint_dtype,
    refuse_quantized,
)
from models.gguf.reader import is_gguf
from models.registry import ModelSpec, resolve


@dataclass(frozen=True)
class CheckpointSetup:
    """A checkpoint's configuration (no weights): what the engine builds from it."""

    path: Path
    files: CheckpointFiles
    hf_config: Any  # transformers PretrainedConfig
    tokenizer: Any  # transformers tokenizer, its chat template set as found
    spec: ModelSpec
    eos_token_ids: frozenset[int]
    sampling_defaults: Mapping[str, Any]  # what a request that sets none of these gets
    dtype: str | None  # the weights' intended dtype, e.g. "bfloat16"
    tie_word_embeddings: bool
    sources: Mapping[str, str]  # setting -> the file (and field) it came from
    gguf: GGUFSetup | None = None  # for a GGUF file: its metadata's settings and tensors
    mmproj: Path | None = None  # a GGUF's projector file (its tower), if any
    stored: StoredModel | None = None  # the Ollama / LM Studio entry it came from

    @classmethod
    def load(cls, path: Path, mmproj: Path | None = None,
             stored: StoredModel | None = None) -> CheckpointSetup:
        """Read the checkpoint at `path` (a directory, or a GGUF file with its projector file
        `mmproj`; `stored`: the store entry they came from, whose sampling defaults apply). An
        unsupported architecture is a ValueError naming the supported ones; a settings file we
        cannot read is a CheckpointError."""
        path = Path(path)
        if is_gguf(path):
            return cls.from_gguf(path, mmproj, stored)
        if mmproj is not None:
            raise ValueError(f"a projector file ({mmproj}) goes with a GGUF model; {path} is a "
                             "checkpoint folder")
        files = CheckpointFiles(path)
        refuse_quantized(files)
        hf_config = AutoConfig.from_pretrained(path)
        spec = resolve(hf_config)
        tokenizer = AutoTokenizer.from_pretrained(path)
        template, template_source = files.chat_template()
        if template is not None:
            tokenizer.chat_template = template
        generation = files.generation()
        eos, eos_source = set(generation.eos_token_ids), generation.source
        if not eos:  # generate() then takes the model config's
            config_eos = getattr(hf_config.get_text_config(), "eos_token_id", None)
            eos = set(config_eos if isinstance(config_eos, list) else
                      [] if config_eos is None else [config_eos])
            eos_source = "config.json: eos_token_id" if eos else "none"
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.add(tokenizer.eos_token_id)
            eos_source += " + the tokenizer's eos_token"
        dtype, dtype_source = checkpoint_dtype(hf_config, files)
        tie, tie_source = spec.model.tied_head(hf_config)
        return cls(
            path=path, files=files, hf_config=hf_config, tokenizer=tokenizer, spec=spec,
            eos_token_ids=frozenset(eos), sampling_defaults=dict(generation.sampling),
            dtype=dtype, tie_word_embeddings=tie,
            sources={"chat_template": template_source, "eos_token_ids": eos_source,
                     "sampling_defaults": generation.source if generation.sampling else "none",
                     "dtype": dtype_source, "tie_word_embeddings": tie_source},
        )

    @classmethod
    def from_gguf(cls, path: Path, mmproj: Path | None = None,
                  stored: StoredModel | None = None) -> CheckpointSetup:
        gguf = GGUFSetup.load(path, mmproj)
        spec = resolve(gguf.hf_config)
        tie, tie_source = spec.model.tied_head(gguf.hf_config)
        template = gguf.tokenizer.chat_template
        architecture = f"general.architecture={gguf.file.architecture!r}"
        if gguf.projector is not None:
            architecture += (f" with {gguf.projector.file.path.name}: clip.projector_type="
                             f"{gguf.projector.kind!r}")
        sampling = dict(stored.sampling) if stored is not None else {}
        sampling_source = f"{stored.source} (params)" if sampling else "none"
        sources = {"chat_template": "tokenizer.chat_template" if template else "none",
                   "eos_token_ids": gguf.eos_source, "sampling_defaults": sampling_source,
                   "dtype": gguf.dtype_source,
                   "tie_word_embeddings": f"{gguf.config.sources['tie_word_embeddings']}; "
                                          f"{tie_source}",
                   "architecture": architecture}
        return cls(
            path=path, files=gguf.processor_files() or CheckpointFiles(path.parent),
            hf_config=gguf.hf_config, tokenizer=gguf.tokenizer, spec=spec,
            eos_token_ids=gguf.eos_token_ids, sampling_defaults=sampling, dtype=gguf.dtype,
            tie_word_embeddings=tie, sources=sources, gguf=gguf, mmproj=mmproj, stored=stored,
        )

    @property
    def architecture(self) -> str:
        return (getattr(self.hf_config, "architectures", None) or ["?"])[0]

    def rows(self) -> list[tuple[str, Any, str]]:
        """(setting, value, where it came from) for display."""
        rows = [
            ("architecture", self.architecture,
             self.sources.get("architecture", "config.json: architectures")),
            ("model class", self.spec.model.__name__, "models/registry.py"),
            ("dtype", self.dtype, self.sources["dtype"]),
            ("tie_word_embeddings", self.tie_word_embeddings, self.sources["tie_word_embeddings"]),
            ("chat template", "present" if self.tokenizer.chat_template else "none",
             self.sources["chat_template"]),
            ("eos_token_ids", sorted(self.eos_token_ids), self.sources["eos_token_ids"]),
            ("default sampling", dict(self.sampling_defaults) or "none",
             self.sources["sampling_defaults"]),
        ]
        if self.stored is not None:
            rows.append(("store", self.stored.name, self.stored.source))
            rows += [("store note", note, self.stored.source) for note in self.stored.notes]
        return rows + (self.gguf.rows() if self.gguf is not None else [])


def checkpoint_settings(setup: CheckpointSetup, mm_processor,
                        adapters=None) -> tuple[tuple[str, ...], ...]:
    """(component, setting, value, where it came from) for every setting the engine read from
    the checkpoint: its own (dtype, template, EOS, ...), its processor's, and the LoRA adapters
    loaded (models.layers.lora.AdapterSet)."""
    rows = [("model", name, _shown(value), source) for name, value, source in setup.rows()]
    if mm_processor is not None:
        for component, settings in mm_processor.settings().items():
            rows += [(component, key, _shown(settings.values[key]), settings.sources[key])
                     for key in settings.values]
    for adapter in () if adapters is None else adapters.adapters:
        rows.append(("lora", adapter.name, adapter.describe(), str(adapter.path)))
    return tuple(rows)


def _shown(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
