"""The dictation engine of `python app.py --transcription-model PATH`: a Whisper engine started
beside the chat models, which the UI's dictation and /v1/audio/transcriptions use."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ui.dictation import Dictation

log = logging.getLogger("mmserve")


def load_dictation(args: argparse.Namespace) -> Dictation | None:
    """The --transcription-model's engine for the UI's dictation and the API (None: none)."""
    if not args.transcription_model:
        return None
    if args.backend:
        raise ValueError("--transcription-model loads a Whisper engine here; it does not "
                         "combine with --backend")
    from engine import AsyncLLM
    from ui.dictation import Dictation

    source = args.transcription_model
    path = Path(source).expanduser()
    log.info("loading %s for dictation", source)
    llm = AsyncLLM(source, device=args.device, dtype=args.dtype)
    return Dictation(llm, path.name if path.exists() else source)
