"""A GGUF file's tokenizer, as transformers builds it from the file's metadata, kept on disk
after the first start, so that the second start reads it back instead of building it again.

transformers reads the vocabulary, merges and special tokens from the GGUF with its own reader
and converts them (seconds for a 150,000-token vocabulary). The entry is the built tokenizer
object pickled (the Rust tokenizer's state and every attribute of transformers' class, so the
one read back is the one built); unpickling takes a fraction of the build, and of reading back
`save_pretrained`'s files, which transformers parses several times over. The cache folder is the
user's own, as the compiled kernels beside it are. An entry is a file under `tokenizers/` beside
the kernel plan's cache
(models.kernels.choice.cache_path; $MMSERVE_TOKENIZER_CACHE overrides the folder, and "0" turns
the cache off), named by a hash of the file's path, size and modification time, the tokenizer
class, the transformers version and this format's version: a changed file, class or library
misses and is built anew. An entry that cannot be read back is logged, removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transformers

from models.kernels.choice import cache_path

log = logging.getLogger(__name__)

CACHE_ENV = "MMSERVE_TOKENIZER_CACHE"
FORMAT = 1  # bump when what an entry holds changes


def cache_dir() -> Path | None:
    """The folder of entries (None: turned off by $MMSERVE_TOKENIZER_CACHE=0)."""
    root = os.environ.get(CACHE_ENV)
    if root == "0":
        return None
    return Path(root) if root else cache_path().parent / "tokenizers"


def entry_path(path: Path, tokenizer_class: type) -> Path | None:
    """Where the tokenizer of the GGUF file at `path` built as `tokenizer_class` is kept (None:
    not cached)."""
    folder = cache_dir()
    if folder is None:
        return None
    stat = Path(path).stat()
    identity = {"format": FORMAT, "transformers": transformers.__version__,
                "file": [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns],
                "class": f"{tokenizer_class.__module__}.{tokenizer_class.__qualname__}"}
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]
    return folder / f"{Path(path).name[:48]}-{digest}.pickle"


def cached_tokenizer(path: Path, tokenizer_class: type, build: Callable[[], Any]) -> Any:
    """The tokenizer of the GGUF at `path`: read back from its entry, else `build()` and kept."""
    entry = entry_path(path, tokenizer_class)
    if entry is not None and entry.is_file():
        try:
            with open(entry, "rb") as f:
                tokenizer = pickle.load(f)
            if type(tokenizer) is tokenizer_class:
                return tokenizer
            raise TypeError(f"it holds a {type(tokenizer).__name__}")
        except Exception as e:  # noqa: BLE001 - any unreadable entry is rebuilt
            log.warning("the cached tokenizer %s could not be read (%s): rebuilt", entry, e)
            entry.unlink(missing_ok=True)
    tokenizer = build()
    if entry is not None:
        _save(entry, tokenizer)
    return tokenizer


def _save(entry: Path, tokenizer: Any) -> None:
    """Write the entry under a temporary name, then move it into place (a reader never sees a
    half-written entry; a failure to write, or a tokenizer that does not pickle, only logs)."""
    staging = None
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=entry.parent, prefix=".partial-",
                                         delete=False) as f:
            staging = Path(f.name)
            pickle.dump(tokenizer, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(staging, entry)
    except Exception as e:  # noqa: BLE001 - the cache is an optimization: the start goes on
        log.warning("the tokenizer could not be kept in %s (%s)", entry, e)
        if staging is not None:
            staging.unlink(missing_ok=True)
