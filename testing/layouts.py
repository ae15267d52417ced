"""Rewrite a checkpoint that transformers 5 saved into the layout older transformers releases
wrote, which the Hub still holds: a processor's components in their own files
(`preprocessor_config.json`, `video_preprocessor_config.json`) beside a flat
`processor_config.json`, the chat template in `tokenizer_config.json` (or in the processors'
`chat_template.json`), and `torch_dtype` for `dtype` in `config.json`. Only files are moved and
keys renamed: every value stays as transformers wrote it."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE_HOMES = ("tokenizer_config.json", "chat_template.json")


def to_legacy_layout(path: Path, template_home: str = "tokenizer_config.json") -> Path:
    """Rewrite `path` in place into the legacy layout; the template goes to `template_home`."""
    if template_home not in TEMPLATE_HOMES:
        raise ValueError(f"template_home must be one of {TEMPLATE_HOMES}")
    path = Path(path)
    processor_file = path / "processor_config.json"
    if processor_file.exists():
        processor = json.loads(processor_file.read_text())
        files: dict[str, dict] = {}
        for key, name in (("image_processor", "preprocessor_config.json"),
                          ("feature_extractor", "preprocessor_config.json"),
                          ("audio_processor", "preprocessor_config.json"),
                          ("video_processor", "video_preprocessor_config.json")):
            if key in processor:
                component = processor.pop(key)
                # transformers 4 wrote the owning processor's class into each component file.
                if "processor_class" in processor:
                    component.setdefault("processor_class", processor["processor_class"])
                # An image processor and a feature extractor share one file, merged (the
                # Hub's Qwen2.5-Omni has them so).
                files.setdefault(name, {}).update(component)
        for name, component in files.items():
            _write(path / name, component)
        _write(processor_file, processor)
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        template = jinja.read_text()
        jinja.unlink()
        if template_home == "chat_template.json":
            _write(path / "chat_template.json", {"chat_template": template})
        else:
            tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
            tokenizer_config["chat_template"] = template
            _write(path / "tokenizer_config.json", tokenizer_config)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    _rename_dtype(config)
    _write(config_file, config)
    return path


def _rename_dtype(config: dict) -> None:
    if "dtype" in config:
        config["torch_dtype"] = config.pop("dtype")
    for value in config.values():
        if isinstance(value, dict):
            _rename_dtype(value)


def _write(file: Path, data: dict) -> None:
    file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_processor(path: Path, processor_class: str, tokenizer, *, image_processor=None,
                   video_settings: dict | None = None, fields: dict | None = None,
                   components: dict[str, dict] | None = None) -> Path:
    """What transformers 5's `save_pretrained` writes for a processor that cannot be built here
    (its video processor needs torchvision): processor_config.json with the image processor's
    own `to_dict()`, the video processor's settings and any other `components` (e.g. a feature
    extractor's `to_dict()`) nested beside the processor's fields and class, and the tokenizer's
    chat template in chat_template.jinja."""
    path = Path(path)
    config = {**(fields or {}), "processor_class": processor_class}
    if image_processor is not None:
        config["image_processor"] = image_processor.to_dict()
    if video_settings is not None:
        config["video_processor"] = video_settings
    config.update(components or {})
    _write(path / "processor_config.json", config)
    if tokenizer.chat_template:
        (path / "chat_template.jinja").write_text(tokenizer.chat_template)
    return path


def transpose_fused_experts(path: Path) -> Path:
    """Rewrite `path`'s fused experts tensors (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]) as transformers 4 wrote Qwen3-VL-MoE's, the layout of its
    Hub checkpoints: [E, H, 2I] and [E, I, H] (every other tensor as it was)."""
    from safetensors.torch import load_file, save_file

    file = Path(path) / "model.safetensors"
    tensors = load_file(file)
    fused = [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    if not fused:
        raise ValueError(f"{file} has no fused experts tensors")
    for key in fused:
        tensors[key] = tensors[key].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})
    return path
