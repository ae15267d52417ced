"""The model files Ollama and LM Studio keep, found and opened where they lie: read only, with
neither program running (nothing is downloaded, moved or written into either store).

Ollama (`$OLLAMA_MODELS`, else ~/.ollama/models): `ollama:NAME[:TAG]` (`qwen2.5vl:7b`;
`user/name:tag`; `host/namespace/name:tag`; the tag `latest` by default) names the manifest
`manifests/<host>/<namespace>/<name>/<tag>` (host registry.ollama.ai, namespace library by
default), a JSON list of layers by media type, each a blob `blobs/sha256-<hex>`:
`application/vnd.ollama.image.model` (the GGUF), `.projector` (an mmproj GGUF, for models
Ollama keeps as llama.cpp writes them), `.template` (a Go template: not used; the GGUF's own
Jinja `tokenizer.chat_template` is), `.params` (JSON: sampling defaults and stop strings, read),
`.system` (a default system prompt: not applied, said), `.license` (ignored). A LoRA adapter
layer is refused. Models Ollama converted with its own converter keep their vision tower inside
the model file under Ollama's own keys (`qwen25vl.vision.*`, `gemma3.vision.*`): refused by
name, as no file of llama.cpp's layout holds that tower.

LM Studio (~/.lmstudio/models, and the older ~/.cache/lm-studio/models):
`<publisher>/<repo>/` folders of GGUF files, a projector beside its model named
`mmproj-*.gguf`; `lmstudio:PUBLISHER/REPO[/FILE.gguf]` names one (the file where the folder
holds several quantizations).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OLLAMA = "ollama:"
LMSTUDIO = "lmstudio:"
OLLAMA_HOST, OLLAMA_NAMESPACE = "registry.ollama.ai", "library"
_MEDIA = "application/vnd.ollama.image."
# Ollama's parameters that are sampling defaults here, by their name here.
_OLLAMA_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                    "min_p": "min_p", "repeat_penalty": "repetition_penalty", "stop": "stop"}


class StoreError(ValueError):
    """A store entry that is missing or cannot be served; the message names it."""


@dataclass(frozen=True)
class StoredModel:
    """A model found in a store: its text GGUF, its projector (None for a text model), and
    what the store says besides."""

    name: str  # "ollama:qwen2.5vl:7b", "lmstudio:publisher/repo"
    model: Path
    mmproj: Path | None = None
    sampling: Mapping[str, Any] = field(default_factory=dict)  # SamplingParams fields
    notes: tuple[str, ...] = ()  # what the store holds that is not applied
    source: str = ""  # the manifest or folder

    @property
    def size(self) -> int:
        return sum(p.stat().st_size for p in (self.model, self.mmproj) if p is not None)


def ollama_root() -> Path:
    return Path(os.environ.get("OLLAMA_MODELS") or Path.home() / ".ollama" / "models")


def lmstudio_roots() -> list[Path]:
    home = Path.home()
    return [home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]


def is_store_name(model: object) -> bool:
    return isinstance(model, str) and model.startswith((OLLAMA, LMSTUDIO))


def open_stored(model: str) -> StoredModel:
    """The store entry `model` names (`ollama:...` or `lmstudio:...`); a StoreError naming
    what is missing or refused."""
    if model.startswith(OLLAMA):
        return ollama_model(model[len(OLLAMA):])
    if model.startswith(LMSTUDIO):
        return lmstudio_model(model[len(LMSTUDIO):])
    raise StoreError(f"{model!r} names no store (ollama:NAME:TAG or lmstudio:PUBLISHER/REPO)")


# ---- Ollama ---------------------------------------------------------------------------------


def ollama_manifest(name: str, root: Path | None = None) -> Path:
    """The manifest file of `name` ("qwen2.5vl:7b", "user/model:tag", "host/ns/model:tag")."""
    root = root or ollama_root()
    path, _, tag = name.partition(":")
    if not path or "/" in tag or any(p in ("", ".", "..") for p in path.split("/")):
        raise StoreError(f"ollama:{name}: not an Ollama model name (NAME, NAME:TAG, "
                         "USER/NAME:TAG)")
    parts = path.split("/")
    if len(parts) > 3:
        raise StoreError(f"ollama:{name}: not an Ollama model name (at most "
                         "HOST/NAMESPACE/NAME:TAG)")
    parts = [OLLAMA_HOST, OLLAMA_NAMESPACE][: 3 - len(parts)] + parts
    manifest = root / "manifests" / Path(*parts) / (tag or "latest")
    if not manifest.is_file():
        raise StoreError(f"ollama:{name}: no manifest {manifest} (not pulled into this "
                         "store; `ollama list` names the models it holds)")
    return manifest


def ollama_model(name: str, root: Path | None = None) -> StoredModel:
    """An Ollama model's files from its manifest and blobs (module docstring)."""
    root = root or ollama_root()
    manifest = ollama_manifest(name, root)
    try:
        layers = json.loads(manifest.read_text())["layers"]
        kinds = [(layer["mediaType"], layer["digest"]) for layer in layers]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise StoreError(f"ollama:{name}: {manifest} is not an Ollama manifest ({e})") from e
    blobs: dict[str, list[Path]] = {}
    for media, digest in kinds:
        kind = media.removeprefix(_MEDIA) if media.startswith(_MEDIA) else media
        blobs.setdefault(kind, []).append(_blob(root, name, digest))
    if "adapter" in blobs:
        raise StoreError(f"ollama:{name}: its manifest holds a LoRA adapter layer, which "
                         "mmserve does not apply to a GGUF model")
    if len(blobs.get("model", [])) != 1 or len(blobs.get("projector", [])) > 1:
        raise StoreError(f"ollama:{name}: its manifest holds {len(blobs.get('model', []))} "
                         f"model and {len(blobs.get('projector', []))} projector layers "
                         "(one model, at most one projector, are read)")
    model = blobs["model"][0]
    _refuse_ollama_layout(name, model)
    sampling, notes = {}, []
    for path in blobs.get("params", []):
        sampling.update(_ollama_params(name, path, notes))
    if "template" in blobs:
        notes.append("Ollama's template (Go syntax) is not used: the GGUF's own chat template "
                     "(tokenizer.chat_template) is")
    if "system" in blobs:
        notes.append("Ollama's default system prompt is not applied")
    projector = blobs.get("projector", [None])[0]
    return StoredModel(f"{OLLAMA}{name}", model, projector, sampling, tuple(notes),
                       str(manifest))


def ollama_models(root: Path | None = None) -> list[StoredModel]:
    """Every model of the Ollama store with a readable manifest (unreadable ones left out)."""
    root = root or ollama_root()
    found = []
    base = root / "manifests"
    for manifest in sorted(base.glob("*/*/*/*")) if base.is_dir() else []:
        host, namespace, model, tag = manifest.relative_to(base).parts
        short = model if (host, namespace) == (OLLAMA_HOST, OLLAMA_NAMESPACE) else (
            f"{namespace}/{model}" if host == OLLAMA_HOST else f"{host}/{namespace}/{model}")
        try:
            found.append(ollama_model(f"{short}:{tag}", root))
        except StoreError:
            continue
    return found


def _blob(root: Path, name: str, digest: str) -> Path:
    algorithm, _, hexdigest = str(digest).partition(":")
    if algorithm != "sha256" or not hexdigest.isalnum():
        raise StoreError(f"ollama:{name}: layer digest {digest!r} is not sha256:<hex>")
    path = root / "blobs" / f"sha256-{hexdigest}"
    if not path.is_file():
        raise StoreError(f"ollama:{name}: blob {path} is missing (an interrupted pull?)")
    return path


def _ollama_params(name: str, path: Path, notes: list[str]) -> dict[str, Any]:
    try:
        params = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StoreError(f"ollama:{name}: its params layer {path} is not JSON ({e})") from e
    out: dict[str, Any] = {}
    for key, value in params.items() if isinstance(params, dict) else ():
        if key in _OLLAMA_SAMPLING:
            out[_OLLAMA_SAMPLING[key]] = tuple(value) if key == "stop" else value
        else:
            notes.append(f"Ollama's parameter {key}={value!r} is not applied")
    return out


def _refuse_ollama_layout(name: str, model: Path) -> None:
    """A model file that holds its own vision tower in Ollama's layout."""
    from models.gguf.reader import GGUFError, GGUFFile

    try:
        file = GGUFFile(model)
    except GGUFError as e:
        raise StoreError(f"ollama:{name}: {e}") from e
    arch = file.architecture
    own = [k for k in file.metadata if k.startswith((f"{arch}.vision.", f"{arch}.audio."))]
    if own or any(t.name.startswith(("v.", "mm.")) for t in file.tensors):
        raise StoreError(
            f"ollama:{name}: the model file ({model.name}, general.architecture={arch!r}) holds "
            f"its own vision tower in Ollama's layout ({own[0] if own else 'v.* tensors'}), "
            "which mmserve does not read; the same model as llama.cpp writes it (a text GGUF "
            "and an mmproj GGUF, as LM Studio keeps them) opens with --mmproj")


# ---- LM Studio ------------------------------------------------------------------------------


def lmstudio_model(name: str, roots: list[Path] | None = None) -> StoredModel:
    """`PUBLISHER/REPO[/FILE.gguf]` in LM Studio's folders, with its projector."""
    parts = name.split("/")
    if len(parts) not in (2, 3) or any(p in ("", ".", "..") for p in parts):
        raise StoreError(f"lmstudio:{name}: not an LM Studio model (PUBLISHER/REPO or "
                         "PUBLISHER/REPO/FILE.gguf)")
    for root in roots or lmstudio_roots():
        folder = root / parts[0] / parts[1]
        if folder.is_dir():
            texts, projector = gguf_pair(folder)
            if len(parts) == 3:
                texts = [p for p in texts if p.name == parts[2]]
            if len(texts) != 1:
                raise StoreError(
                    f"lmstudio:{name}: {folder} holds {len(texts)} model files"
                    f"{' (' + ', '.join(p.name for p in texts) + ')' if texts else ''}; name "
                    "one as lmstudio:PUBLISHER/REPO/FILE.gguf")
            return StoredModel(f"{LMSTUDIO}{name}", texts[0], projector, source=str(folder))
    raise StoreError(f"lmstudio:{name}: no folder {parts[0]}/{parts[1]} under "
                     f"{' or '.join(map(str, roots or lmstudio_roots()))}")


def lmstudio_models(roots: list[Path] | None = None) -> list[StoredModel]:
    """Every model file in LM Studio's folders (one entry per text GGUF, with the folder's
    projector)."""
    found = []
    for root in roots or lmstudio_roots():
        for folder in sorted(p for p in root.glob("*/*") if p.is_dir()) if root.is_dir() else []:
            try:
                texts, projector = gguf_pair(folder)
            except StoreError:
                continue
            for text in texts:
                name = "/".join(folder.parts[-2:]) + ("" if len(texts) == 1 else f"/{text.name}")
                found.append(StoredModel(f"{LMSTUDIO}{name}", text, projector,
                                         source=str(folder)))
    return found


def gguf_pair(folder: Path) -> tuple[list[Path], Path | None]:
    """A folder's model GGUFs and its projector (`mmproj*.gguf`, as LM Studio and llama.cpp's
    converter name it), found by name; a StoreError for more than one projector."""
    files = sorted(p for p in folder.glob("*.gguf") if p.is_file())
    projectors = [p for p in files if p.name.lower().startswith("mmproj")]
    if len(projectors) > 1:
        raise StoreError(f"{folder} holds {len(projectors)} projector files "
                         f"({', '.join(p.name for p in projectors)}); pass the model file "
                         "and --mmproj the one to use")
    return [p for p in files if p not in projectors], (projectors[0] if projectors else None)


def discover() -> list[StoredModel]:
    """The models of both stores on this machine (nothing is opened but their manifests and
    GGUF headers)."""
    return [*ollama_models(), *lmstudio_models()]
