"""What the engine takes from a GGUF file besides its weights: the transformers config and
tokenizer as transformers builds them from the file's metadata, the chat template, the EOS ids
and the dtype, each with the metadata key it came from. With a projector file (`mmproj`), the
config is the multimodal model's, its tower and processor settings from the projector's
metadata (models/gguf/clip_config.py).

The config is models/gguf/config.py's (transformers' GGUF key tables, over our parse of the
header); the tokenizer is the class `AutoTokenizer` picks for that config, built by transformers
from the same file (`from_pretrained(folder, gguf_file=name)`: vocabulary, merges or scores,
special and added tokens, BOS / EOS, pre-tokenizer, chat template). `AutoTokenizer` itself
would first rebuild the config through transformers' slower reader; the class it then picks
is the one this picks (tests/test_gguf_files.py compares both on the real files). The second
start of the same file reads the tokenizer back from disk (engine/tokenizer_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig, TokenizersBackend

from engine.tokenizer_cache import cached_tokenizer
from models.checkpoint import CheckpointFiles, Found, GenerationDefaults
from models.gguf.clip_config import ProjectorConfig, multimodal_values, read_projector
from models.gguf.config import GGUFConfig, check_against, read_config
from models.gguf.reader import GGUFFile

# End-of-generation ids llama.cpp stops at besides EOS (an instruct model's end of turn).
END_OF_GENERATION_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True)
class GGUFSetup:
    """A GGUF file's config, tokenizer and what the engine reads besides, with sources."""

    file: GGUFFile
    config: GGUFConfig
    hf_config: Any
    tokenizer: Any
    eos_token_ids: frozenset[int]
    eos_source: str
    dtype: str
    dtype_source: str
    projector: ProjectorConfig | None = None
    sources: dict[str, str] | None = None  # a multimodal config's fields (dotted) -> source

    @classmethod
    def load(cls, path: Path, mmproj: Path | None = None) -> GGUFSetup:
        file = GGUFFile(path)
        config = read_config(file)
        projector, sources = None, None
        if mmproj is None:
            hf_config = AutoConfig.for_model(**config.values)
            hf_config.architectures = [config.architecture]
        else:
            projector = read_projector(GGUFFile(mmproj), file, config)
            values, sources = multimodal_values(config, projector)
            hf_config = AutoConfig.for_model(**values)
            hf_config.architectures = [projector.spec.architecture]
        check_against(config, hf_config.get_text_config(), file)
        tokenizer = _tokenizer(path, hf_config)
        eos, eos_sources = set(), []
        config_eos = getattr(hf_config.get_text_config(), "eos_token_id", None)
        if config_eos is not None:  # generate() stops at the config's EOS, as the file says
            eos.add(config_eos)
            eos_sources.append(config.sources["eos_token_id"])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.add(tokenizer.eos_token_id)
            eos_sources.append("the tokenizer's eos_token")
        for key in END_OF_GENERATION_KEYS:
            if file.get(key) is not None and int(file.get(key)) not in eos:
                eos.add(int(file.get(key)))
                eos_sources.append(f"{key} (llama.cpp stops there too)")
        dtype, dtype_source = file_dtype(file)
        return cls(file, config, hf_config, tokenizer, frozenset(eos),
                   " + ".join(eos_sources) or "none", dtype, dtype_source, projector, sources)

    def rows(self) -> list[tuple[str, Any, str]]:
        """(setting, value, metadata key or default) of every config setting, and the tensors
        per block type."""
        rows: list[tuple[str, Any, str]] = [
            ("tensors per type", self.file.type_counts(), f"{self.file.path.name}: tensor table")]
        if self.projector is not None:
            projector = self.projector.file
            rows += [("projector", f"{self.projector.kind} ({projector.path.name})",
                      "clip.projector_type"),
                     ("projector tensors per type", projector.type_counts(),
                      f"{projector.path.name}: tensor table (dequantized to the dtype)")]
        generic = set(PretrainedConfig().to_dict())  # fields every config has (labels, ...)
        sources = dict(self.sources) if self.sources is not None else dict(self.config.sources)
        for prefix in ("", "text_config."):  # transformers folds rope_theta into rope_parameters
            if f"{prefix}rope_theta" in sources and f"{prefix}rope_parameters" not in sources:
                sources[f"{prefix}rope_parameters"] = (
                    f"{sources[f'{prefix}rope_theta']} (as rope_theta)")
        configs = [("", self.hf_config)] + [
            (f"{key}.", sub) for key, sub in vars(self.hf_config).items()
            if isinstance(sub, PretrainedConfig)]
        for prefix, config in configs:
            name = type(config).__name__
            for key, value in sorted(config.to_dict().items()):
                path = prefix + key
                if isinstance(value, dict) and isinstance(getattr(config, key, None),
                                                          PretrainedConfig):
                    continue  # a sub-config: its fields are rows of their own
                if path in sources:
                    rows.append((f"config.{path}", value, sources[path]))
                elif key not in generic and not key.startswith("_"):
                    rows.append((f"config.{path}", value, f"default of {name} (not in the file)"))
        return rows

    def processor_files(self) -> CheckpointFiles | None:
        """The processor settings a projector file holds, in the place a checkpoint folder's
        files hold them (None without a projector)."""
        return None if self.projector is None else ProjectorFiles(self.file.path,
                                                                   self.projector)


class ProjectorFiles(CheckpointFiles):
    """A GGUF pair's processor settings: the components and processor fields read from the
    projector's metadata; nothing is read from the files beside the GGUFs."""

    def __init__(self, path: Path, projector: ProjectorConfig) -> None:
        super().__init__(path.parent)
        self.projector = projector

    def json(self, name: str) -> Any:
        return None

    def text(self, name: str) -> str | None:
        return None

    def component(self, kind: str) -> Found | None:
        return self.projector.components.get(kind)

    def processor_fields(self) -> Found:
        return self.projector.processor

    def chat_template(self) -> tuple[str | None, str]:
        return None, "none"

    def generation(self) -> GenerationDefaults:
        return GenerationDefaults((), {}, "none")


def _tokenizer(path: Path, hf_config: Any) -> Any:
    """The tokenizer AutoTokenizer builds from the file: the class it maps the config to
    (TokenizersBackend where it maps none), built by transformers from the GGUF."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    tokenizer_class = TOKENIZER_MAPPING.get(type(hf_config), TokenizersBackend)
    return cached_tokenizer(path, tokenizer_class, lambda: tokenizer_class.from_pretrained(
        path.parent, gguf_file=path.name))


def file_dtype(file: GGUFFile) -> tuple[str, str]:
    """The dtype transformers loads the file in by default: the file's half type where its
    tensors are F16 or BF16 values only (beside F32 norms), else float32 (quantized blocks
    included: transformers dequantizes them to float32)."""
    types = set(file.type_counts())
    if types <= {"F32", "BF16", "F16"}:
        half = "bfloat16" if "BF16" in types else "float16" if "F16" in types else "float32"
        return half, f"{file.path.name}: its tensors' types ({', '.join(sorted(types))})"
    return "float32", (f"{file.path.name} holds quantized blocks ({', '.join(sorted(types))}); "
                       "transformers dequantizes them to float32")
