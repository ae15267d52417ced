"""The model's weights at start-up: built on the meta device, filled from a safetensors folder or
a GGUF file (quantized as they stream in when `quantization` is set, with a progress line, and
kept on disk for the next start: engine/weight_cache.py), the LoRA adapters attached, and on
the CPU placed in huge pages and their kernels planned. On the CPU, weights stored as they run
(a GGUF's blocks, safetensors tensors at the model dtype, not fused) are read-only views of the
files' mappings (models/mapped_files.py), which the model keeps: not copied, not moved."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import weight_cache
from engine.config import EngineConfig
from models import mapped_files
from models.checkpoint import CheckpointError, describe_tie
from models.gguf.load import load_gguf
from models.gguf.reader import is_gguf
from models.interfaces import LanguageModel
from models.kernels.huge_pages import place_weights
from models.kernels.linear_choice import choose_linear_kernels
from models.kernels.quantization import QuantizeOnLoad, quantize_language_model
from models.layers.lora import attach_adapters
from models.loader import MissingWeights, build_on_meta, iter_checkpoint, load_weights
from models.whisper.ctranslate2 import is_ctranslate2, load_ctranslate2

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run: `gguf_summary` says which of a GGUF file's tensors run as stored
    (empty otherwise); `adapters` / `modality_adapters` as models.layers.lora.attach_adapters
    returns them."""

    model: LanguageModel
    gguf_summary: str
    adapters: object
    modality_adapters: dict


def load_model(path: Path, hf_config, model_cls: type[LanguageModel], config: EngineConfig,
               device: torch.device, dtype: torch.dtype, max_len: int,
               mmproj: Path | None = None) -> LoadedModel:
    """Build `model_cls` for sequences up to `max_len` and fill it from `path` (`mmproj`: a
    GGUF model's projector file, its tower)."""
    if config.quantization is not None and device.type != "cpu":  # before loading weights
        raise ValueError(
            f"quantization={config.quantization!r} runs on the CPU only for now "
            f"(device {device}); leave it unset on {device.type}"
        )

    def factory() -> LanguageModel:
        return model_cls.from_hf_config(hf_config, max_len, device)

    entry = None
    if config.quantization is not None and not config.lora_adapters and not any(
            (Path(path) / folder).is_dir() for _, _, folder in model_cls.modality_adapters()):
        entry = weight_cache.entry_path(path, mmproj, model_cls, config, dtype, max_len)
    cached = None if entry is None else weight_cache.load(entry, factory, device, dtype)
    if cached is not None:
        model, summary = cached
        model.eval()
        adapters, modality_adapters = attach_adapters(model, path, (), device, dtype)
    else:
        model, summary, adapters, modality_adapters = _load(
            path, hf_config, model_cls, factory, config, device, dtype, mmproj)
        if entry is not None and adapters is None:
            weight_cache.save(entry, model, summary)
    if device.type == "cpu":
        place_weights(model)  # before planning: the plan times them where they run
        choose_linear_kernels(model, dtype)
    return LoadedModel(model, summary, adapters, modality_adapters)


def _load(path: Path, hf_config, model_cls: type[LanguageModel],
          factory: Callable[[], LanguageModel], config: EngineConfig, device: torch.device,
          dtype: torch.dtype, mmproj: Path | None):
    """The model read from its checkpoint (quantized as it loads where asked) with its
    adapters: (model, GGUF summary, adapters, modality adapters)."""
    # Quantized weights are quantized as they stream in: the dense model need not fit.
    quantizer = None if config.quantization is None else QuantizeOnLoad(
        config.quantization, config.quantization_group_size,
        _progress_line(f"quantizing linears to {config.quantization}"))
    defer = None if quantizer is None else quantizer.defer
    summary = ""
    try:
        if is_gguf(path):
            model, summary = load_gguf(path, hf_config, factory, device, dtype, quantizer, defer,
                                       config.dequantize_gguf, mmproj)
        elif is_ctranslate2(path):  # a CTranslate2 Whisper folder (faster-whisper's)
            model = load_ctranslate2(path, factory, device, dtype, quantizer)
        else:
            model = build_on_meta(factory, device, dtype, defer=defer)
            # Tensors at the model dtype are mapped from the file where they run as stored.
            mapped = (dtype if quantizer is None and device.type == "cpu"
                      and mapped_files.enabled() else None)
            mappings: list[mapped_files.MappedFile] = []
            load_weights(model, model.checkpoint_tensors(iter_checkpoint(path, "", mapped,
                                                                         mappings)),
                         model.checkpoint_map(), quantizer)
            mapped_files.keep(model, mappings)
    except MissingWeights as e:
        if "lm_head.weight" not in e.missing:
            raise
        raise CheckpointError(
            f"{e}: the checkpoint has no lm_head.weight and the LM head is not tied to the "
            f"token embeddings ({describe_tie(hf_config)}; "
            f"{model_cls.tied_head(hf_config)[1]} decides, as in transformers)"
        ) from e
    model.eval()
    # LoRA adapters requests may choose: the checkpoint's, per modality, and the configured.
    adapters, modality_adapters = attach_adapters(model, path, config.lora_adapters, device,
                                                  dtype)
    if quantizer is not None:
        quantize_language_model(model, config.quantization,
                                config.quantization_group_size)  # the LM head
        log.info("%d linears quantized to %s as they loaded; at most %.1f MiB of them "
                 "dense at once", quantizer.count, config.quantization,
                 quantizer.peak_dense_bytes / 2**20)
    return model, summary, adapters, modality_adapters


def _progress_line(what: str) -> Callable[[int, int], None]:
    """A progress line on the terminal (rewritten in place), or a log line at each quarter
    where stderr is not a terminal."""
    def report(done: int, total: int) -> None:
        if sys.stderr.isatty():
            sys.stderr.write(f"\r{what}: {done}/{total}" + ("\n" if done == total else ""))
            sys.stderr.flush()
        elif done == total or done * 4 // total != (done - 1) * 4 // total:
            log.info("%s: %d/%d", what, done, total)
    return report
