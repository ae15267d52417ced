"""`python -m engine.inspect PATH_OR_HUB_ID`: what the engine will do with a checkpoint, read
without loading its weights. It prints the architecture and the model class, the dtype, whether
the LM head is tied, the chat template's source, the EOS ids and default sampling, every
processor setting with the file (or class default) it came from, the weights' and the KV cache's
estimated bytes (a per-layer embedding table, read a few rows per step, apart; layers that read
another layer's keys and values add no KV cache; the KV cache also with `--kv-cache-dtype
int8`), the LoRA adapters it ships, and what is not supported. For a GGUF file: every config
setting with the metadata key it came from (or the config class's default), and its tensors per
block type; with its projector file (`--mmproj`, or beside it in a folder), the tower's and the
processor's settings with the projector's keys.
Run it first on a new download; it exits with 1 when the engine would refuse the checkpoint.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine import kv_pool
from engine.checkpoint_setup import CheckpointSetup
from engine.config import EngineConfig
from engine.device import resolve_dtype
from engine.hub import resolve_files
from engine.memory_plan import context_length, default_kv_bytes
from models.adapters import CONFIG, read_lora_config
from models.checkpoint import CheckpointError, safetensors_header, weight_files
from models.gguf.load import GGUFWeights
from models.gguf.mmproj import projector_weights
from models.interfaces import ProcessorContext
from models.loader import on_meta
from models.whisper.ctranslate2 import held_bytes, is_ctranslate2

DTYPE_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


@dataclass
class Report:
    """What `inspect` found: (component, setting, value, source) rows, sizes, and problems."""

    model: str
    rows: list[tuple[str, str, Any, str]] = field(default_factory=list)
    weight_bytes: int | None = None
    per_layer_table_bytes: int = 0  # of weight_bytes: a table read a few rows per step
    kv_bytes_per_token: int | None = None
    kv_int8_bytes_per_token: int | None = None  # with kv_cache_dtype="int8"
    # Cross-attention models: keys and values of one media key position, and of the largest item.
    cross_bytes_per_key: int | None = None
    cross_largest_item: int | None = None  # key positions
    kv_layers: str = ""
    max_model_len: int | None = None
    # The automatic KV budget on this host at the default options, and the context it holds
    # when that is less than the model's (the engine then starts at it).
    automatic_kv_bytes: int | None = None
    fitted_context: int | None = None
    unsupported: list[str] = field(default_factory=list)


def inspect(model: str | Path, dtype: str = "auto", mmproj: str | Path | None = None) -> Report:
    """Read `model`'s configuration, tokenizer and processor settings (no weights) as the engine
    would, on the CPU (`mmproj`: a GGUF model's projector file). Problems that would stop the
    engine are listed in `unsupported`."""
    report = Report(str(model))
    try:
        files = resolve_files(model, mmproj)
        path = files.path
        setup = CheckpointSetup.load(path, files.mmproj, files.stored)
    except (ValueError, OSError) as e:
        report.unsupported.append(str(e))
        return report
    report.rows += [("model", *row) for row in setup.rows()]
    engine_dtype = resolve_dtype(dtype, torch.device("cpu"), setup.dtype)
    report.rows.append(("model", "engine dtype on this CPU", str(engine_dtype).removeprefix(
        "torch."), f"--dtype {dtype}"))
    processor = None
    if setup.spec.processor is not None:
        try:
            processor = setup.spec.processor(ProcessorContext(
                setup.hf_config, setup.tokenizer, path, str(model), 0, files=setup.files))
        except (CheckpointError, NotImplementedError, ValueError) as e:
            report.unsupported.append(f"processor: {e}")
        else:
            report.rows.append(("processor", "modalities", ", ".join(processor.modalities),
                                "models/registry.py"))
            for component, settings in processor.settings().items():
                report.rows += [(component, key, settings.values[key], settings.sources[key])
                                for key in settings.values]
    _adapters(report, setup, path)
    try:
        _sizes(report, setup, engine_dtype, processor)
    except (CheckpointError, NotImplementedError, ValueError, KeyError) as e:
        report.unsupported.append(f"model: {e}")
    return report


def _adapters(report: Report, setup: CheckpointSetup, path: Path) -> None:
    """The LoRA adapters the checkpoint ships for its modalities (their configs only)."""
    for name, modality, folder in setup.spec.model.modality_adapters():
        if not (path / folder).is_dir():
            report.rows.append(("lora", name, f"absent: {modality} requests use the base model",
                                f"{folder}/"))
            continue
        try:
            settings = read_lora_config(path / folder)
        except CheckpointError as e:
            report.unsupported.append(f"lora {name}: {e}")
            continue
        report.rows.append(("lora", name, f"for {modality} requests: r={settings['r']}, "
                            f"lora_alpha={settings['lora_alpha']}", f"{folder}/{CONFIG}"))


def _sizes(report: Report, setup: CheckpointSetup, dtype: torch.dtype, processor) -> None:
    """Weight bytes (the checkpoint tensors the model maps, at the engine's dtype), KV bytes per
    token (its attention layers'), a cross-attention model's keys and values per media key
    position and for the largest item, and whether the LM head is provided; the model is built
    on the meta device."""
    report.max_model_len = context_length(setup.hf_config)[0]
    with on_meta():
        model = setup.spec.model.from_hf_config(setup.hf_config, 1, torch.device("meta"))
    mapping = model.checkpoint_map()
    total, names = 0, set()
    skipped: dict[str, int] = {}  # tensors the model does not read, by their name's first part
    if setup.gguf is not None:
        report.weight_bytes = gguf_weight_bytes(setup, model, dtype, report)
    for file in weight_files(setup.path) if setup.gguf is None else []:
        for name, info in safetensors_header(file).items():
            if name == "__metadata__":
                continue
            if mapping(name) is None:
                parts = name.split(".")
                group = ".".join(parts[:2] if parts[0] == "model" else parts[:1]) + ".*"
                skipped[group] = skipped.get(group, 0) + 1
                continue
            names.add(mapping(name)[0])
            total += DTYPE_BYTES[dtype] * _numel(info["shape"])
    if skipped:
        report.rows.append(("model", "tensors read past", ", ".join(
            f"{group} ({n})" for group, n in sorted(skipped.items())),
            "the weights files (e.g. a drafter's or speech output's: not built)"))
    if is_ctranslate2(setup.path):  # a CTranslate2 Whisper folder: its model.bin
        total = held_bytes(setup.path, DTYPE_BYTES[dtype])
        names.add("lm_head.weight")
    if setup.gguf is None:
        report.weight_bytes = total
    table = model.per_layer_table_bytes()
    report.per_layer_table_bytes = table and table // DTYPE_BYTES[
        model.embed_tokens.weight.dtype] * DTYPE_BYTES[dtype]
    layers = model.attention_layers()
    own = [a for a in layers if a.kv_source is None]
    report.kv_bytes_per_token = sum(2 * a.num_kv_heads * a.head_dim for a in own) * DTYPE_BYTES[
        dtype]
    report.kv_int8_bytes_per_token = kv_pool.bytes_per_token(layers, dtype, "int8")
    _context_fit(report, bool(model.cross_attention_layers()))
    if len(own) < len(layers):
        report.kv_layers = f"{len(own)} of {len(layers)} layers hold it, {len(layers) - len(own)}" \
            " read another layer's"
    cross = model.cross_attention_layers()
    if cross:
        shape = model.cfg
        report.cross_bytes_per_key = len(cross) * 2 * shape.num_kv_heads * shape.head_dim \
            * DTYPE_BYTES[dtype]
        if processor is not None:
            report.cross_largest_item = processor.max_embeds_per_item()
    if not setup.tie_word_embeddings and "lm_head.weight" not in names and setup.gguf is None:
        report.unsupported.append(
            "the checkpoint has no lm_head.weight and the config does not tie the head to the "
            "token embeddings")


def _context_fit(report: Report, cross: bool) -> None:
    """The automatic KV budget on this host at the default options (engine/memory_plan.py; a
    cross-attention model leaves half of it to those layers) and the context it holds, where
    that is shorter than the model's."""
    defaults = EngineConfig()
    per_block = report.kv_bytes_per_token * defaults.block_size
    if not per_block or report.max_model_len is None:
        return
    automatic = default_kv_bytes(torch.device("cpu"))
    budget = automatic - (automatic // 2 if cross else 0)
    report.automatic_kv_bytes = budget
    held = budget // per_block * defaults.block_size
    if held < report.max_model_len:
        report.fitted_context = held


def gguf_weight_bytes(setup: CheckpointSetup, model: torch.nn.Module, dtype: torch.dtype,
                      report: Report | None = None) -> int:
    """A GGUF file's weights as the engine holds them (without `quantization`): its linears in
    their ggml blocks where our kernels run the type (the file's bytes), the other tensors
    dequantized to `dtype` (models.gguf.load). With `report`, a row per way the tensors are
    held: the block types, as stored or dequantized and why. Raises GGUFError as loading
    would."""
    weights = GGUFWeights(setup.path, setup.hf_config, dequantize_all=False, stored_q8=True,
                          as_blocks=True)
    mapping, tower = model.checkpoint_map(), 0
    if setup.mmproj is None:
        weights.plan(model, mapping)
    else:  # the projector's tower, dense at the dtype
        projector = projector_weights(setup.mmproj)
        weights.plan(model, lambda name: mapping(projector.text_name(name)),
                     projector.plan(model, mapping))
        tower = sum(info.numel for target in projector.targets.values()
                    for info in target.parts.values())
    if report is not None:
        source = f"{setup.path.name}: models/gguf/load.py on the CPU"
        report.rows += [("model", f"tensors {how}", counts, source)
                        for how, counts in weights.type_counts().items()]
    return weights.resident_bytes(dtype) + tower * dtype.itemsize


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def render(report: Report) -> str:
    """The report as plain text."""
    lines = [f"checkpoint: {report.model}"]
    width = max((len(f"{c}.{k}") for c, k, _, _ in report.rows), default=0)
    for component, key, value, source in report.rows:
        lines.append(f"  {f'{component}.{key}':<{width}}  {_short(value)!s:<40}  <- {source}")
    if report.weight_bytes is not None:
        table = (f", of which the per-layer embedding table {_size(report.per_layer_table_bytes)}"
                 " (a step reads a few rows of it)" if report.per_layer_table_bytes else "")
        lines.append(f"weights: {_size(report.weight_bytes)} at the engine dtype{table}")
    if report.kv_bytes_per_token is not None:
        full = (f", {_size(report.kv_bytes_per_token * report.max_model_len)} for one "
                f"{report.max_model_len}-token sequence" if report.max_model_len else "")
        layers = f" ({report.kv_layers})" if report.kv_layers else ""
        lines.append(f"KV cache: {_size(report.kv_bytes_per_token)} per token{full}{layers}")
        if report.kv_int8_bytes_per_token:
            gain = report.kv_bytes_per_token / report.kv_int8_bytes_per_token
            lines.append(f"KV cache with --kv-cache-dtype int8: "
                         f"{_size(report.kv_int8_bytes_per_token)} per token ({gain:.2f}x the "
                         "tokens in the same bytes)")
    if report.fitted_context is not None:
        lines.append(f"context: the automatic KV budget on this host "
                     f"({_size(report.automatic_kv_bytes)}) holds {report.fitted_context} tokens "
                     f"of the model's {report.max_model_len}: the engine starts at "
                     f"{report.fitted_context} unless kv_cache_bytes or max_model_len is set")
    if report.cross_bytes_per_key is not None:
        largest = report.cross_largest_item
        item = (f", {_size(report.cross_bytes_per_key * largest)} for the largest image "
                f"({largest} key positions)" if largest else "")
        lines.append(f"cross-attention keys and values: {_size(report.cross_bytes_per_key)} per "
                     f"media key position{item}")
    if report.unsupported:
        lines.append("NOT SUPPORTED (the engine would refuse this checkpoint):")
        lines += [f"  - {problem}" for problem in report.unsupported]
    else:
        lines.append("supported: the engine can serve this checkpoint")
    return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.inspect", description=__doc__)
    parser.add_argument("model", help="a local checkpoint directory, a GGUF file, "
                        "ollama:NAME:TAG, lmstudio:PUBLISHER/REPO or a Hugging Face Hub id")
    parser.add_argument("--mmproj", default=None,
                        help="a GGUF model's projector file (its vision or audio tower)")
    parser.add_argument("--dtype", default="auto", help="the dtype the engine would run in")
    args = parser.parse_args(argv)
    report = inspect(args.model, args.dtype, args.mmproj)
    print(render(report))
    return 1 if report.unsupported else 0


if __name__ == "__main__":
    sys.exit(main())
