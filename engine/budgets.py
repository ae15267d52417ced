"""Start-up checks that the engine's budgets can hold what the model accepts: the largest media
item within the encoder cache and a step's encoder budget, and a span attended both ways within
one prefill chunk. Each refusal names the setting and the value it needs."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.cross_states import CrossLayout
from engine.processing import EncoderBudget
from models.interfaces import MultimodalProcessor


def encoder_budget(config: EngineConfig, mm_processor: MultimodalProcessor,
                   vectors_per_embed: int, cross: CrossLayout | None = None) -> EncoderBudget:
    """Refuse a configuration in which the largest media item could never be encoded (an item
    occupies `vectors_per_embed` vectors per embedding in the cache: DeepStack residuals; a
    cross-attention model's cache holds key positions within `cross_attention_cache_bytes`)."""
    cache, setting = config.encoder_cache_size // vectors_per_embed, "encoder_cache_size"
    unit, scale = "embeddings", vectors_per_embed  # the setting's units per unit of an item
    if cross is not None:
        cache, setting = cross.num_keys, "cross_attention_cache_bytes"
        unit, scale = "key positions", cross.bytes_per_key
    step = config.max_num_encoder_input_tokens
    budget = EncoderBudget(cache, setting) if cache <= step else EncoderBudget(
        step, "max_num_encoder_input_tokens")
    largest = mm_processor.max_embeds_per_item()
    if largest > budget.max_embeds:
        raise ValueError(
            f"the largest media item this model accepts needs {largest} {unit}, but "
            f"{budget.setting} allows {budget.max_embeds}; raise {budget.setting} to at least "
            f"{largest * (scale if budget.setting == setting else 1)} "
            "(or, for images and videos, lower max_pixels in the checkpoint's preprocessor "
            "config)"
        )
    return budget


def check_bidirectional_budget(config: EngineConfig, largest_span: int) -> None:
    """A bidirectional span is prefilled in one chunk: the step's token budget must hold it."""
    if largest_span > config.max_num_batched_tokens:
        raise ValueError(
            f"this model attends media spans of up to {largest_span} tokens both ways, and each "
            f"must be prefilled in one chunk, but max_num_batched_tokens is "
            f"{config.max_num_batched_tokens}; raise it to at least {largest_span}"
        )
