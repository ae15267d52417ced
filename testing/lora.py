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
