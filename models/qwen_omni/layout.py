"""Where Qwen2.5-Omni's media tokens go and which TMRoPE positions they take. Pure Python.

TMRoPE: a token's position has three rows (time, row, column). Text advances all three by one;
an image's or video's merged patches take (t, h, w) offsets from the position after the token
before them, where a video's t counts time, `position_id_per_seconds` (25) per second of the
frames a temporal patch covers; audio tokens, one per 40 ms, take consecutive positions, which
is the same clock. Text after an item continues from the item's largest position + 1.

A video heard with its sound (`use_audio_in_video`) is one span: `<|vision_bos|><|audio_bos|>`,
then per `seconds_per_chunk` (2 s) of time that chunk's video tokens and then its audio tokens,
then `<|audio_eos|><|vision_eos|>`. Frames and sound share one clock and one base, so a frame and
what is heard at the same moment share the temporal position; both begin-tokens take one
position, as do both end-tokens. Chunks are cut by the reference's rule (`chunk_runs`): a
token opens the next chunk when its time reaches that chunk's start, one chunk per token, so a
gap of more than a chunk in the video's times shifts the later cuts exactly as it does there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def chunk_runs(times: Sequence[float], tokens_per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) runs of `times` (non-decreasing), one per chunk: a run ends before the
    first token whose time reaches `k * tokens_per_chunk` for the k-th cut (k = 1, 2, ...);
    the last run ends at the end (transformers' `get_chunked_index`, an empty input included:
    one empty run)."""
    runs, start, chunk = [], 0, 1
    for i, t in enumerate(times):
        if t >= chunk * tokens_per_chunk:
            runs.append((start, i))
            start, chunk = i, chunk + 1
    runs.append((start, len(times)))
    return runs


@dataclass(frozen=True)
class Run:
    """Tokens [start, end) of one modality's tokens of an item ("video" or "audio")."""

    modality: str
    start: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.start


def interleave(video_times: Sequence[float], num_audio: int, tokens_per_chunk: int) -> list[Run]:
    """The order of a heard video's tokens: per chunk j, its video run then its audio run
    (empty runs dropped). `video_times`: each video token's time in positions (t index times
    seconds per temporal patch times positions per second); audio token k's time is k."""
    video = chunk_runs(video_times, tokens_per_chunk)
    audio = chunk_runs(range(num_audio), tokens_per_chunk)
    runs = []
    for j in range(max(len(video), len(audio))):
        for modality, chunks in (("video", video), ("audio", audio)):
            if j < len(chunks) and chunks[j][1] > chunks[j][0]:
                runs.append(Run(modality, *chunks[j]))
    return runs


@dataclass
class Positions:
    """TMRoPE positions of a prompt, built token by token as its placeholders are expanded:
    rows[r][i] is row r of token i; `next` is the largest position so far + 1."""

    rows: tuple[list[int], list[int], list[int]] = field(default_factory=lambda: ([], [], []))
    next: int = 0

    def __len__(self) -> int:
        return len(self.rows[0])

    def text(self, n: int = 1) -> None:
        """n tokens one position apart."""
        for row in self.rows:
            row.extend(range(self.next, self.next + n))
        self.next += n

    def repeat_last(self) -> None:
        """One more token at the previous token's position (a heard video's second begin- or
        end-token)."""
        for row in self.rows:
            row.append(row[-1])

    def content(self, t: Sequence[int], h: Sequence[int], w: Sequence[int],
                base: int | None = None) -> None:
        """Media tokens at `base` (default: the next position) plus their (t, h, w) offsets."""
        base = self.next if base is None else base
        for row, offsets in zip(self.rows, (t, h, w), strict=True):
            row.extend(base + o for o in offsets)
        self.next = max(self.next, base + max(max(t), max(h), max(w)) + 1)


def grid_offsets(t_index: Sequence[int], h: int, w: int) -> tuple[list[int], list[int], list[int]]:
    """(t, h, w) offsets of merged patches laid out time-major, then rows, then columns:
    temporal patch i at time `t_index[i]`, on an h x w grid of merged patches."""
    t_rows, h_rows, w_rows = [], [], []
    for t in t_index:
        for y in range(h):
            t_rows.extend([t] * w)
            h_rows.extend([y] * w)
            w_rows.extend(range(w))
    return t_rows, h_rows, w_rows
