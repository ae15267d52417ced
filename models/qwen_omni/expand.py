"""One pass over a Qwen2.5-Omni prompt's tokens: each placeholder expanded into its item's
tokens, one encoder item (MultiModalFeature) per image, temporal patch and sound window with its
span, and every token's TMRoPE position (models/qwen_omni/layout.py has the layout rules)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from models.interfaces import MultiModalFeature, PlaceholderRange
from models.media_inputs import VideoFrames
from models.processing.qwen_items import temporal_patches
from models.qwen_omni.layout import Positions, grid_offsets, interleave
from models.qwen_omni.sound import Clip


@dataclass(frozen=True)
class OmniTokens:
    """The thinker's media token ids and its TMRoPE clock."""

    image: int
    video: int
    audio: int
    audio_bos: int
    audio_eos: int
    vision_bos: int
    merge_size: int
    per_second: float  # positions per second of time
    tokens_per_chunk: int  # positions per interleaving chunk


# (the video, its (hash, processed frames), its sound's windows or None when seen only)
VideoItem = tuple[VideoFrames, tuple[str, dict], Clip | None]


class Expansion:
    """Holds the expanded ids, the features (in the order made) and the positions."""

    def __init__(self, tokens: OmniTokens) -> None:
        self.t = tokens
        self.ids: list[int] = []
        self.features: list[MultiModalFeature] = []
        self.positions = Positions()
        self.repeat_next = False  # a heard video's closing token shares the previous position

    def run(self, token_ids: list[int], images: Iterator[tuple[str, dict]],
            videos: Iterator[VideoItem], clips: Iterator[Clip]) -> None:
        t = self.t
        for i, token in enumerate(token_ids):
            if token == t.image:
                self._image(*next(images))
            elif token == t.video:
                video, (identifier, data), sound = next(videos)
                if sound is None:
                    self._video(identifier, data, video)
                else:
                    if i == 0 or token_ids[i - 1] != t.vision_bos or i + 1 == len(token_ids):
                        raise ValueError(
                            "a video heard with its sound must sit between <|vision_bos|> and a "
                            "closing token, as the chat template writes it")
                    self._heard_video(identifier, data, sound)
            elif token == t.audio:
                self._audio(next(clips))
            else:
                self.ids.append(token)
                if self.repeat_next:
                    self.positions.repeat_last()
                    self.positions.next += 1
                    self.repeat_next = False
                else:
                    self.positions.text()

    def _span(self, modality: str, identifier: str, data: dict, offsets: list[int],
              item: str, part: str) -> None:
        """A feature whose embeddings go to absolute positions `offsets` (increasing)."""
        first, last = offsets[0], offsets[-1]
        mask = None
        if last - first + 1 != len(offsets):
            taken = set(offsets)
            mask = tuple(o in taken for o in range(first, last + 1))
        span = PlaceholderRange(first, last - first + 1, mask)
        self.features.append(MultiModalFeature(modality, identifier, span, data, item=item,
                                               part=part))

    def _image(self, identifier: str, data: dict) -> None:
        t, h, w = data["grid_thw"]
        m = self.t.merge_size
        start = len(self.ids)
        n = t * h * w // m**2
        self.ids.extend([self.t.image] * n)
        self.positions.content(*grid_offsets([0] * t, h // m, w // m))
        self._span("image", identifier, data, list(range(start, start + n)), identifier, "")

    def _time_index(self, data: dict) -> list[int]:
        """Each temporal patch's TMRoPE time, as the reference computes it (float32, truncated)."""
        step = torch.tensor(data["second_per_grid_t"], dtype=torch.float32)
        return (torch.arange(data["grid_thw"][0]) * step * self.t.per_second).long().tolist()

    def _patches(self, identifier: str, data: dict, at: list[int], per_patch: int,
                 note: str = "") -> None:
        """One feature per temporal patch; patch i's tokens at offsets at[i * per_patch ...]."""
        seconds = data["second_per_grid_t"]
        for i, (part_id, part) in enumerate(temporal_patches(identifier, data)):
            self._span("video", part_id, part, at[i * per_patch:(i + 1) * per_patch],
                       identifier, f"frames {i * seconds:g}-{(i + 1) * seconds:g} s{note}")

    def _video(self, identifier: str, data: dict, video: VideoFrames) -> None:
        """A video seen only: its temporal patches' tokens in a row."""
        t, h, w = data["grid_thw"]
        m = self.t.merge_size
        per_patch = h * w // m**2
        start = len(self.ids)
        self.ids.extend([self.t.video] * (t * per_patch))
        self.positions.content(*grid_offsets(self._time_index(data), h // m, w // m))
        note = " (no sound track)" if video.has_audio_track is False else ""
        self._patches(identifier, data, list(range(start, len(self.ids))), per_patch, note)

    def _heard_video(self, identifier: str, data: dict, sound: Clip) -> None:
        """A video heard with its sound: <|audio_bos|>, per chunk its frames then its sound,
        <|audio_eos|>; the begin-tokens share a position, as do the end-tokens."""
        tok = self.t
        t, h, w = data["grid_thw"]
        m = tok.merge_size
        per_patch = h * w // m**2
        self.ids.append(tok.audio_bos)
        self.positions.repeat_last()  # <|vision_bos|><|audio_bos|>: one position
        # The layout's times are the processor's (float64); the positions' the model's.
        seconds = data["second_per_grid_t"]
        video_times = [i * seconds * tok.per_second for i in range(t) for _ in range(per_patch)]
        runs = interleave(video_times, sound.num_tokens, tok.tokens_per_chunk)
        t_off, h_off, w_off = grid_offsets(self._time_index(data), h // m, w // m)
        video_at: list[int] = []  # absolute offset of each video token, in video order
        audio_at: list[int] = []
        rows: tuple[list[int], list[int], list[int]] = ([], [], [])
        for run in runs:
            video = run.modality == "video"
            (video_at if video else audio_at).extend(range(len(self.ids),
                                                           len(self.ids) + run.length))
            self.ids.extend([tok.video if video else tok.audio] * run.length)
            for k in range(run.start, run.end):
                for row, o in zip(rows, (t_off[k], h_off[k], w_off[k]) if video else (k, k, k),
                                  strict=True):
                    row.append(o)
        self.positions.content(*rows)
        self.ids.append(tok.audio_eos)
        self.positions.text()
        self.positions.next -= 1  # the closing <|vision_eos|> repeats this position
        self.repeat_next = True
        self._patches(identifier, data, video_at, per_patch)
        self._windows(sound, audio_at, identifier)

    def _audio(self, clip: Clip) -> None:
        """A clip alone: its windows' tokens in a row, consecutive positions."""
        start, n = len(self.ids), clip.num_tokens
        self.ids.extend([self.t.audio] * n)
        self.positions.content(range(n), range(n), range(n))
        self._windows(clip, list(range(start, start + n)), clip.identifier)

    def _windows(self, clip: Clip, at: list[int], item: str) -> None:
        """One feature per encoder window of `clip`, its tokens at offsets `at`."""
        done = 0
        for w in clip.windows:
            self._span("audio", w.identifier, w.data, at[done:done + w.embeds], item,
                       f"sound {w.start_s:g}-{w.end_s:g} s")
            done += w.embeds
