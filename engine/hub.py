"""Turn `model` (a local directory or a Hugging Face Hub id) into a local checkpoint directory."""

from __future__ import annotations

import os
from pathlib import Path

# What a checkpoint needs: config, weights, tokenizer, chat template, generation defaults.
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def resolve_model(model: str | os.PathLike) -> Path:
    """A local directory as-is; otherwise download the Hub repo `model` (with a progress bar).

    Raises ValueError naming the problem when the path is not a checkpoint or the Hub cannot be
    reached, suggesting a local path.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"{path} is a directory but has no config.json (not a checkpoint)")
        return path
    text = str(model)
    if path.exists() or text.startswith((".", "/", "~")) or text.count("/") > 1:
        raise ValueError(f"model path {text!r} does not exist or is not a directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(text, allow_patterns=_PATTERNS))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; all mean "no model"
        raise ValueError(
            f"could not get {text!r} from the Hugging Face Hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else 'no detail'}). If the checkpoint is on "
            "this machine, pass its local directory instead."
        ) from e
