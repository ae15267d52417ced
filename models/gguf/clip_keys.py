"""The reading state of a projector file (models/gguf/clip_config.py): its `clip.*` metadata as
the readers ask for it (a key nobody asked for is refused afterwards), and what a reader fills:
config fields, processor settings, and the source of each (a metadata key, a tensor, a token of
the text file's vocabulary, or a class default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.gguf.reader import GGUFError, GGUFFile

REQUIRED = object()  # a key's default meaning: absent is an error
# Keys of every projector read for what they say about the file, not the model.
_DESCRIPTIVE = ("general.",)


class ProjectorKeys:
    """A projector's metadata as the readers ask for it; a `clip.*` key nobody asked for is
    refused afterwards (see `unread`)."""

    def __init__(self, file: GGUFFile) -> None:
        self.file, self.name = file, file.path.name
        self.asked: set[str] = set()

    def get(self, key: str, default: Any = REQUIRED) -> Any:
        self.asked.add(key)
        if key in self.file.metadata:
            value = self.file.metadata[key]
            return value.tolist() if isinstance(value, np.ndarray) else value
        if default is REQUIRED:
            raise GGUFError(f"{self.name}: metadata has no {key}, which a "
                            f"{self.kind} projector needs")
        return default

    def source(self, key: str) -> str:
        return f"{self.name}: {key}"

    def expect(self, key: str, value: Any, what: str) -> None:
        """`key` may be absent; present, it must be `value` (approximately, for floats)."""
        got = self.get(key, None)
        if got is None:
            return
        same = (abs(float(got) - float(value)) <= 1e-6 * abs(float(value))
                if isinstance(value, float) else got == value)
        if not same:
            raise GGUFError(f"{self.name}: {key}={got!r}, but {what} is {value!r} (the only "
                            "value mmserve computes with); refusing rather than computing a "
                            "different tower")

    def unread(self) -> list[str]:
        return sorted(k for k in self.file.metadata
                      if not k.startswith(_DESCRIPTIVE) and k not in self.asked)

    kind = ""


@dataclass
class ProjectorBuild:
    """What a projector reader fills: config fields ("vision_config.depth"), processor
    components' settings, and the source of each."""

    keys: ProjectorKeys
    text: GGUFFile
    fields: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    origins: dict[str, dict[str, str]] = field(default_factory=dict)

    def set(self, path: str, value: Any, source: str) -> Any:
        self.fields[path], self.sources[path] = value, source
        return value

    def key(self, path: str, key: str, default: Any = REQUIRED,
            default_source: str = "") -> Any:
        """Config field `path` from metadata `key` (or `default`, said by `default_source`)."""
        value = self.keys.get(key, default)
        present = key in self.keys.file.metadata
        return self.set(path, value, self.keys.source(key) if present else default_source)

    def setting(self, component: str, name: str, value: Any, source: str) -> None:
        self.components.setdefault(component, {})[name] = value
        self.origins.setdefault(component, {})[name] = source

    def token(self, path: str, token: str, what: str) -> int:
        """Config field `path`: the id of `token` in the text file's vocabulary."""
        tokens = self.text.metadata.get("tokenizer.ggml.tokens") or []
        try:
            index = tokens.index(token)
        except ValueError:
            raise GGUFError(
                f"{self.text.path.name}: the vocabulary has no {token!r} token, which is "
                f"{what} of a {self.keys.kind} model: {self.keys.name} is a projector of "
                "another family than this text model") from None
        return self.set(path, index, f"{self.text.path.name}: tokenizer.ggml.tokens ({token})")

    def tensor_rows(self, path: str, tensor: str) -> int:
        info = self.keys.file.tensor_by_name.get(tensor)
        if info is None:
            raise GGUFError(f"{self.keys.name}: no tensor {tensor}, which a {self.keys.kind} "
                            "projector holds")
        return self.set(path, info.shape[0], f"{self.keys.name}: tensor {tensor} (its rows)")
