"""A clip's encoder items for Qwen2.5-Omni's audio encoder: one per attention window.

The encoder attends within windows of 2 * n_window mel frames (2 s) and restarts its positions
at each, so a window's output is the same encoded alone; each window is an encoder item, keyed
by the clip's content hash and its index. The log-mel features themselves are computed over the
whole clip, as transformers' feature extractor does (its peak normalisation spans the clip). A
clip longer than the extractor's window is refused: transformers would cut it there silently.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from models.encoders.whisper import encoder_lengths
from models.media_inputs import AudioClip, MediaError
from models.processing.base import ProcessedCache
from models.processing.hashing import hash_audio
from models.processing.log_mel import LogMelExtractor, MelConfig


@dataclass(frozen=True)
class Window:
    """One encoder item of a clip: its inputs, its embeddings and the seconds it covers."""

    identifier: str
    data: dict  # {"input_features": [n_mels, frames], "num_frames": frames}
    embeds: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Clip:
    """A clip's content hash and its windows (those that give any embedding)."""

    identifier: str
    windows: list[Window]

    @property
    def num_tokens(self) -> int:
        return sum(w.embeds for w in self.windows)


class SoundWindows:
    """Cuts clips into the audio encoder's windows: their sizes alone (for the plan) or their
    features through the processed-inputs cache."""

    def __init__(self, mel: MelConfig, window_frames: int, cache: ProcessedCache,
                 model_id: str) -> None:
        self.mel = mel
        self.window_frames = window_frames
        self.extractor = LogMelExtractor(mel)
        self.cache = cache
        self.model_id = model_id

    def max_embeds(self) -> int:
        return encoder_lengths(self.window_frames)[1]

    def sizes(self, clip: AudioClip, what: str) -> list[int]:
        """Embeddings of each of the clip's windows, from its length alone."""
        self._check(clip, what)
        return [n for _, _, n in self._cuts(self.mel.num_frames(len(clip.samples)))]

    def clip(self, clip: AudioClip, what: str, stages: dict[str, float]) -> Clip:
        """The clip's windows with their features; `what` names it in errors ("audio 2",
        "video 1: its sound track")."""
        self._check(clip, what)
        t0 = time.perf_counter()
        identifier = hash_audio(clip, model_id=self.model_id, processor_kwargs=asdict(self.mel))
        t1 = time.perf_counter()

        def compute() -> list[Window]:
            mel = self.extractor([clip.samples])
            features, frames = mel.features[0], mel.num_frames[0]
            seconds = self.mel.hop_length / self.mel.sample_rate  # per frame
            return [Window(f"{identifier}:w{start // self.window_frames}",
                           {"input_features": features[:, start:start + n].clone(),
                            "num_frames": n}, embeds, start * seconds, (start + n) * seconds)
                    for start, n, embeds in self._cuts(frames)]

        windows = self.cache.get_or_compute(identifier, compute)
        stages["hashing"] += t1 - t0
        stages["preprocess"] += time.perf_counter() - t1
        return Clip(identifier, windows)

    def _cuts(self, frames: int) -> list[tuple[int, int, int]]:
        """(first frame, frames, embeddings) of each window with any embedding (a tail of one
        or two frames pools into nothing)."""
        cuts = []
        for start in range(0, frames, self.window_frames):
            n = min(self.window_frames, frames - start)
            embeds = encoder_lengths(n)[1]
            if embeds:
                cuts.append((start, n, embeds))
        return cuts

    def _check(self, clip: AudioClip, what: str) -> None:
        if clip.sample_rate != self.mel.sample_rate:
            raise ValueError(f"{what} is at {clip.sample_rate} Hz, expected "
                             f"{self.mel.sample_rate} Hz (load it through engine.media)")
        if len(clip.samples) > self.mel.window_samples:
            hint = (" (send the video with mm_processor_kwargs use_audio_in_video=false to "
                    "see its frames only)" if what.startswith("video") else "")
            raise MediaError(
                f"{what}: duration {clip.duration_s:.1f} s exceeds the audio window of "
                f"{self.mel.chunk_length} s (the feature extractor's chunk_length){hint}")
