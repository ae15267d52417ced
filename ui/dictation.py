"""Dictation: the microphone's recording (or an uploaded audio file) transcribed by a Whisper
engine loaded beside the chat models (`--transcription-model`) and written into the message
box, with a panel of what the engine did: the clip, each 30 s window's encoder cache entry
(its content hash, hit or computed), its decode time, attempts and temperature, and the
real-time factor. Never imports torch (engine.transcription does not)."""

from __future__ import annotations

import asyncio
import html
import time
from pathlib import Path
from typing import Any

from engine.media import load_audio_sync
from engine.transcription import RATE, Transcript, TranscriptionOptions, transcribe
from ui.markup import ms, section


class Dictation:
    """Speech to text for the composer with one Whisper engine (an AsyncLLM)."""

    def __init__(self, llm: Any, name: str) -> None:
        self.llm = llm
        self.name = name

    async def into_message(self, path: str | None, message: dict | None,
                           language: str = "") -> tuple[dict, str]:
        """The message with the recording's transcript appended to its text, and the panel."""
        message = message or {"text": "", "files": []}
        if not path:
            return message, section("Dictation", ["Record or upload audio first."])
        data = Path(path).read_bytes()
        try:
            clip = await asyncio.to_thread(load_audio_sync, data, sample_rate=RATE)
            t0 = time.perf_counter()
            transcript = None
            async for item in transcribe(self.llm, clip.samples,
                                         TranscriptionOptions(language=language or None)):
                transcript = item
        except ValueError as e:  # refused audio (MediaError), an unknown language
            return message, section("Dictation", [html.escape(str(e))])
        wall = time.perf_counter() - t0
        text = " ".join(p for p in (message.get("text", "").strip(), transcript.text) if p)
        return {"text": text, "files": message.get("files", [])}, panel(transcript, wall,
                                                                         self.name)


def panel(t: Transcript, wall: float, model: str) -> str:
    """The transcription's panel: the clip, then one line per window."""
    rtf = wall / t.duration if t.duration else 0.0
    lines = [f"{html.escape(model)}: {t.duration:.1f} s of audio, language "
             f"{html.escape(t.language or '?')}, {ms(wall)} in all (real-time factor "
             f"{rtf:.2f})"]
    for w in t.windows:
        cache = "cache hit" if w.cache_hit else "encoded" if w.cache_hit is False else "?"
        lines.append(f"window {w.start:.0f} s: encoder entry {html.escape(w.item[:12])} "
                     f"({cache}), decoded in {ms(w.seconds)}, {w.attempts} attempt"
                     f"{'s' if w.attempts > 1 else ''} (temperature {w.temperature:g})"
                     f"{', skipped: no speech' if w.skipped else ''}")
    return section("Dictation", lines)
