"""Spoken sentences with known text, synthesized by espeak-ng (Debian's `espeak-ng` package) at
test or bench time: no audio is committed. `speak` returns None where espeak-ng is absent."""

from __future__ import annotations

import shutil
import subprocess

ESPEAK = "espeak-ng"
MISSING = "espeak-ng is not installed (apt-get install espeak-ng; .ci/run installs it)"


def speak(text: str, voice: str = "en-us", words_per_minute: int = 140) -> bytes | None:
    """`text` spoken by espeak-ng as WAV bytes (22,050 Hz mono), or None without espeak-ng."""
    if shutil.which(ESPEAK) is None:
        return None
    out = subprocess.run([ESPEAK, "-v", voice, "-s", str(words_per_minute), "--stdout", text],
                         capture_output=True, check=True, timeout=60)
    return out.stdout
