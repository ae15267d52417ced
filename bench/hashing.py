"""Benchmark of media content hashing: median time per item over repeated runs.

Run with ``python -m bench.hashing``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from engine.media import AudioClip, VideoFrames, VideoSampling
from models.processing.hashing import hash_audio, hash_image, hash_video

RUNS = 20


def median_ms(job: Callable[[], object], runs: int = RUNS) -> float:
    """Median wall time of ``job`` in milliseconds, after one warm-up call."""
    job()
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        job()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main() -> None:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8), "RGB")
    video = VideoFrames(
        frames=rng.integers(0, 256, (32, 448, 448, 3), dtype=np.uint8),
        timestamps=np.arange(32) / 2.0,
        sampled_fps=2.0,
        source_fps=30.0,
        duration_s=16.0,
        source_frame_count=480,
        sampling=VideoSampling(target_fps=2.0, min_frames=1, max_frames=768),
    )
    audio = AudioClip(samples=rng.standard_normal(30 * 16000).astype(np.float32), sample_rate=16000)
    cases = [
        ("image 1024x1024 RGB", lambda: hash_image(image), image.width * image.height * 3),
        ("video 32x448x448x3", lambda: hash_video(video), video.frames.nbytes),
        ("audio 30 s @ 16 kHz", lambda: hash_audio(audio), audio.samples.nbytes),
    ]
    print(f"median of {RUNS} runs")
    for name, job, nbytes in cases:
        ms = median_ms(job)
        print(f"{name:<22} {ms:8.2f} ms  {nbytes / ms / 1e6:6.2f} GB/s")


if __name__ == "__main__":
    main()
