"""Fill in the middle: a completion prompt with a `suffix`, for models whose tokenizer has
fill-in-the-middle tokens (Qwen2.5-Coder's `<|fim_prefix|>` ..., StarCoder's and SmolLM's
`<fim_prefix>` ...): the model writes what goes between the prompt and the suffix."""

from __future__ import annotations

_STYLES = (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
           ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"))


def fim_prompt(tokenizer, prompt: str, suffix: str) -> str:
    """The prefix-suffix-middle prompt; ValueError for a model without such tokens."""
    vocab = tokenizer.get_vocab()
    for prefix, middle_suffix, middle in _STYLES:
        if all(t in vocab for t in (prefix, middle_suffix, middle)):
            return f"{prefix}{prompt}{middle_suffix}{suffix}{middle}"
    raise ValueError("suffix: this model has no fill-in-the-middle tokens (such as "
                     "<|fim_prefix|> or <fim_prefix>), so it cannot complete before a suffix")
