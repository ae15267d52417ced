"""Tiny random LoRA adapters in PEFT's own folder format (adapter_config.json and
adapter_model.safetensors, written by PEFT's `save_pretrained`) for a checkpoint built here.

PEFT initialises B to zeros (an adapter that changes nothing); both factors are re-drawn here
with a scale that moves the logits decisively, so a test that matches with the adapter could
not also match without it.
"""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_adapter(
    model: torch.nn.Module,
    path: Path,
    target_modules: list[str] | str,
    *,
    r: int = 4,
    lora_alpha: float = 8,
    seed: int = 0,
    std: float = 0.3,
    **lora_options,
) -> Path:
    """Wrap `model` (a transformers model, left unchanged) in a PEFT LoRA adapter on
    `target_modules`, draw its weights and save the adapter folder at `path`. `lora_options`
    go to LoraConfig as they are (use_rslora, rank_pattern, alpha_pattern, ...)."""
    import copy

    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=target_modules,
                        lora_dropout=0.0, **lora_options)
    peft_model = get_peft_model(copy.deepcopy(model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5 * 4)
    path = Path(path)
    peft_model.save_pretrained(path)
    return path


def write_lora_folder(
    path: Path,
    shapes: dict[str, tuple[int, int]],
    target_modules: list[str] | str,
    *,
    r: int = 4,
    lora_alpha: float = 8,
    seed: int = 0,
    std: float = 0.3,
) -> Path:
    """A PEFT LoRA folder written without PEFT (the demo builds its checkpoints with the engine
    extra alone): `shapes` maps each base module's name to its (in, out) features. The files
    are what PEFT writes (tests/test_phi4mm_vs_hf.py loads them with PEFT); the config lists
    the fields an older PEFT wrote, as the Hub's adapters do."""
    import json

    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (fan_in, fan_out) in sorted(shapes.items()):
        for kind, shape in (("lora_A", (r, fan_in)), ("lora_B", (fan_out, r))):
            weight = std * torch.randn(shape, generator=gen) / shape[-1] ** 0.5 * 4
            tensors[f"base_model.model.{name}.{kind}.weight"] = weight.contiguous()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "revision": None, "inference_mode": True, "r": r, "lora_alpha": lora_alpha,
        "lora_dropout": 0.0, "target_modules": target_modules, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": [], "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "use_rslora": False, "use_dora": False, "auto_mapping": None,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path


def llama_with_attention_adapter(root: Path) -> tuple[Path, Path]:
    """A tiny Llama at root/llama and a random adapter of its attention's q, k, v and o
    projections (rank 4) at root/attn: (checkpoint, adapter folder)."""
    from transformers import AutoModelForCausalLM

    from testing.tiny import build_text_model

    path = build_text_model(root / "llama", "llama", num_kv_heads=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    folder = save_random_adapter(hf, root / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"],
                                 r=4, lora_alpha=8, seed=1)
    return path, folder
