"""The model's weights at start-up: built on the meta device, filled from a safetensors folder or
a GGUF file (quantized as they stream in when `quantization` is set, and kept on disk for the
next start: engine/weight_cache.py), the LoRA adapters attached, and on the CPU placed in huge
pages and their kernels planned. On the CPU, weights stored as they run (a GGUF's blocks,
safetensors tensors at the model dtype, not fused) are read-only views of the files' mappings
(models/mapped_files.py), which the model keeps: not copied, not moved. Each stage reports how
far it is to a StartupProgress (engine/load_progress.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import weight_cache
from engine.config import EngineConfig
from engine.load_progress import StartupProgress
from models import mapped_files
from models.checkpoint import CheckpointError, describe_tie
from models.gguf.load import load_gguf
from models.gguf.reader import is_gguf
from models.interfaces import LanguageModel
from models.kernels import native
from models.kernels.ggml_blocks import set_activation_digits
from models.kernels.huge_pages import place_weights, return_freed_memory
from models.kernels.linear_choice import choose_linear_kernels
from models.kernels.quantization import QuantizeOnLoad, quantize_language_model
from models.layers.lora import AdapterSet, attach_adapters
from models.loader import (
    MissingWeights,
    build_on_meta,
    checkpoint_tensor_count,
    counted,
    iter_checkpoint,
    load_weights,
)
from models.whisper.ctranslate2 import is_ctranslate2, load_ctranslate2

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A model ready to run: `gguf_summary` says which of a GGUF file's tensors run as stored
    (empty otherwise); `adapters` / `modality_adapters` as models.layers.lora.attach_adapters
    returns them."""

    model: LanguageModel
    gguf_summary: str
    adapters: AdapterSet | None
    modality_adapters: dict[str, str]


def load_model(path: Path, hf_config, model_cls: type[LanguageModel], config: EngineConfig,
               device: torch.device, dtype: torch.dtype, max_len: int,
               mmproj: Path | None = None,
               progress: StartupProgress | None = None) -> LoadedModel:
    """Build `model_cls` for sequences up to `max_len` and fill it from `path` (`mmproj`: a
    GGUF model's projector file, its tower), each stage reported to `progress`."""
    progress = progress or StartupProgress()
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
    cached = None
    if entry is not None and entry.exists():
        with progress.step("reading the quantized weights kept on disk"):
            cached = weight_cache.load(entry, factory, device, dtype)
    if cached is not None:
        model, summary = cached
        model.eval()
        adapters, modality_adapters = attach_adapters(model, path, (), device, dtype)
    else:
        model, summary, adapters, modality_adapters = _load(
            path, hf_config, model_cls, factory, config, device, dtype, mmproj, progress)
        if entry is not None and adapters is None:
            with progress.step("keeping the quantized weights on disk for the next start"):
                weight_cache.save(entry, model, summary)
                # and run what the next start will run: the entry's mapped weights, the
                # quantized copies in this process's memory let go
                kept = weight_cache.load(entry, factory, device, dtype)
            if kept is not None:
                del model
                model, summary = kept
                model.eval()
                adapters, modality_adapters = attach_adapters(model, path, (), device, dtype)
                return_freed_memory()
    if set_activation_digits(model, config.gguf_activation_digits) and (
            config.gguf_activation_digits == 1):
        summary += "; their inputs in one int8 digit (llama.cpp's Q8 activations)"
    if device.type == "cpu":
        with progress.step("placing the weights in huge pages"):
            place_weights(model)  # before planning: the plan times them where they run
        with progress.step("loading the C kernels (built once per CPU)"):
            native.load()  # the plan's first call would build them: their own stage here
        with progress.step("planning the linear kernels (timed once per CPU)"):
            choose_linear_kernels(model, dtype)
    return LoadedModel(model, summary, adapters, modality_adapters)


def _load(path: Path, hf_config, model_cls: type[LanguageModel],
          factory: Callable[[], LanguageModel], config: EngineConfig, device: torch.device,
          dtype: torch.dtype, mmproj: Path | None, progress: StartupProgress):
    """The model read from its checkpoint (quantized as it loads where asked) with its
    adapters: (model, GGUF summary, adapters, modality adapters)."""
    # Quantized weights are quantized as they stream in: the dense model need not fit.
    quantizer = None if config.quantization is None else QuantizeOnLoad(
        config.quantization, config.quantization_group_size)
    defer = None if quantizer is None else quantizer.defer
    reading = ("reading weights" if quantizer is None
               else f"reading weights, quantizing linears to {config.quantization}")
    summary = ""
    try:
        if is_gguf(path):
            entry = (weight_cache.repacks_path(path) if device.type == "cpu"
                     and quantizer is None and not config.dequantize_gguf else None)
            kept = None if entry is None else weight_cache.KeptRepacks(entry, path)
            model, summary = load_gguf(path, hf_config, factory, device, dtype, quantizer, defer,
                                       config.dequantize_gguf, mmproj, progress, reading, kept)
        elif is_ctranslate2(path):  # a CTranslate2 Whisper folder (faster-whisper's)
            with progress.step(reading):
                model = load_ctranslate2(path, factory, device, dtype, quantizer)
        else:
            model = build_on_meta(factory, device, dtype, defer=defer)
            # Tensors at the model dtype are mapped from the file where they run as stored (and
            # those quantized are read through the mapping, their pages let go as they are).
            mapped = dtype if device.type == "cpu" and mapped_files.enabled() else None
            mappings: list[mapped_files.MappedFile] = []
            tensors = counted(iter_checkpoint(path, "", mapped, mappings), reading,
                              checkpoint_tensor_count(path), progress)
            load_weights(model, model.checkpoint_tensors(tensors), model.checkpoint_map(),
                         quantizer)
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
        with progress.step(f"quantizing the LM head to {config.quantization}"):
            quantize_language_model(model, config.quantization, config.quantization_group_size)
        log.info("%d linears quantized to %s as they loaded; at most %.1f MiB of them "
                 "dense at once", quantizer.count, config.quantization,
                 quantizer.peak_dense_bytes / 2**20)
    return model, summary, adapters, modality_adapters

