"""Turn `model` (a local directory, a GGUF file, a model of Ollama's or LM Studio's store, or a
Hugging Face Hub id) into a local checkpoint: a directory, or a GGUF file with its projector
file if it has one (`resolve_files`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from engine.model_stores import StoredModel, gguf_pair, is_store_name, open_stored
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
        found = gguf_pair(path)[0]
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


@dataclass(frozen=True)
class ModelFiles:
    """What `model` resolved to: a checkpoint directory or a GGUF file, the GGUF's projector
    file (`mmproj`) if it has one, and the store entry it came from."""

    path: Path
    mmproj: Path | None = None
    stored: StoredModel | None = None


def resolve_files(model: str | os.PathLike, mmproj: str | os.PathLike | None = None
                  ) -> ModelFiles:
    """`model` as resolve_model resolves it, or a store entry (`ollama:NAME:TAG`,
    `lmstudio:PUBLISHER/REPO`: engine/model_stores.py), with its projector: `mmproj` when
    given, else the store's, else for a folder the `mmproj*.gguf` beside its model file (as
    LM Studio keeps them). A ValueError names a projector passed with a model that is not a
    GGUF file, or a projector file that is missing."""
    stored = open_stored(str(model)) if is_store_name(model) else None
    path = stored.model if stored else resolve_model(model)
    folder = Path(model).expanduser() if stored is None and not is_gguf(
        Path(model).expanduser()) else None
    if mmproj is not None:
        projector = Path(mmproj).expanduser()
        if not is_gguf(path):
            raise ValueError(f"--mmproj {projector} is a projector for a GGUF model file; "
                             f"{path} is not one")
        if not projector.is_file() or not is_gguf(projector):
            raise ValueError(f"--mmproj {projector} is not a GGUF file")
    elif stored is not None:
        projector = stored.mmproj
    elif folder is not None and folder.is_dir() and is_gguf(path):
        projector = gguf_pair(folder)[1]
    else:
        projector = None
    return ModelFiles(path, projector, stored)
