"""Where a Qwen2.5-Omni checkpoint keeps its thinker's settings: a whole Omni model
(Qwen2_5OmniForConditionalGeneration, the Hub's layout) nests them in `thinker_config`, beside
the talker and token-to-wave model (speech output) the engine does not build; a thinker saved
alone has them at the top level."""

from __future__ import annotations

from typing import Any

OMNI_TYPES = ("qwen2_5_omni",)


def thinker_config(hf_config: Any) -> Any:
    """The thinker's config (Qwen2_5OmniThinkerConfig) of either layout."""
    return hf_config.thinker_config if hf_config.model_type in OMNI_TYPES else hf_config
