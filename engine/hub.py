"""Turn `model` (a local directory, a GGUF file, or a Hugging Face Hub id) into a local
checkpoint: a directory, or a GGUF file."""

from __future__ import annotations

import os
from pathlib import Path

from models.gguf.reader import is_gguf

# What a checkpoint needs: config, weights, tokenizer, chat template, generation defaults.
_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "tokenizer*"]


def resolve_model(model: str | os.PathLike) -> Path:
    """A local checkpoint directory or GGUF file as-is (a directory without config.json that
    holds one GGUF file: that file); otherwise download the Hub repo `model` (with a progress
    bar).

    Raises ValueError naming the problem when the path is not a checkpoint or the Hub cannot be
    reached, suggesting a local path.
    """
    path = Path(model).expanduser()
    if path.is_file():
        if not is_gguf(path):
            raise ValueError(f"{path} is a file but not a GGUF file (a checkpoint is a directory "
                             "with config.json, or a .gguf file)")
        return path
    if path.is_dir():
        if (path / "config.json").exists():
            return path
        found = sorted(p for p in path.glob("*.gguf") if not p.name.startswith("mmproj"))
        if len(found) == 1:
            return found[0]
        raise ValueError(
            f"{path} is a directory but has no config.json (not a checkpoint)" if not found
            else f"{path} holds {len(found)} GGUF files ({', '.join(p.name for p in found)}); "
            "pass the one to serve")
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
