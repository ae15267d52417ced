"""Where InternVL's media sit in a prompt, as transformers' InternVLProcessor writes them.

The chat template writes one `<IMG_CONTEXT>` per image and one `<video>` per video. An image of
n tiles becomes `<img>` + `<IMG_CONTEXT>` x (L * n) + `</img>`; a video of f frames becomes
"Frame1: <img>" + L context tokens + "</img>", then "\\nFrame2: <img>" ..., one such run per
frame (L: the embeddings of one tile, `image_seq_length`). Text prompts are expanded before
tokenizing, as the reference does, so the frame labels merge with their neighbours alike;
token-id prompts are expanded here.

In an expanded prompt every run `<img>` ... `</img>` is found and handed to the items in prompt
order: the next image if the run holds its L * n tokens, the next video if the next f runs hold
L tokens each. Where both fit (a one-tile image and a video's first frame hold the same run),
the frame labels decide: the video's runs each follow "Frame{k}:" (compared as decoded text
without whitespace, since tokenizers decode spacing differently).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from models.processing.base import Pieces, check_placeholder_count, expand_placeholders

_LABEL_WINDOW = 16  # tokens before a run that hold its frame label, decoded to check it


@dataclass(frozen=True)
class Placed:
    """One media item found in a prompt: its modality, its index among that modality's items,
    and the offset of each of its runs' first context token (an image: one run of all its
    tiles; a video: one run per frame)."""

    modality: str
    index: int
    runs: tuple[int, ...]


@dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's media tokens (InternVLProcessor reads them from the tokenizer)."""

    start: str  # start_image_token, "<img>"
    end: str  # end_image_token, "</img>"
    context: str  # context_image_token, "<IMG_CONTEXT>"
    video: str  # video_token, "<video>"
    start_id: int
    end_id: int
    context_id: int
    video_id: int


class PromptLayout:
    """The text and token ids of images and videos, and finding them in expanded prompts."""

    def __init__(self, tokens: SpecialTokens, per_tile: int, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str]) -> None:
        self.t = tokens
        self.per_tile = per_tile
        self.encode, self.decode = encode, decode

    # ---- writing ------------------------------------------------------------------------------

    def image_text(self, tiles: int) -> str:
        return self.t.start + self.t.context * (self.per_tile * tiles) + self.t.end

    def video_text(self, frames: int) -> str:
        run = self.t.start + self.t.context * self.per_tile + self.t.end
        return "\n".join(f"Frame{k + 1}: {run}" for k in range(frames))

    def image_ids(self, tiles: int) -> list[int]:
        return [self.t.start_id, *[self.t.context_id] * (self.per_tile * tiles), self.t.end_id]

    def video_ids(self, frames: int) -> list[int]:
        run = [self.t.start_id, *[self.t.context_id] * self.per_tile, self.t.end_id]
        ids: list[int] = []
        for k in range(frames):
            ids += self.encode(("\n" if k else "") + f"Frame{k + 1}: ") + run
        return ids

    def expand_text(self, text: str, tiles: Sequence[int], frames: Sequence[int]) -> str:
        """Each `<IMG_CONTEXT>` / `<video>` of `text` replaced by its item's text (the i-th
        placeholder of a modality takes its i-th item); unchanged when the counts differ."""
        pattern = f"({re.escape(self.t.context)}|{re.escape(self.t.video)})"
        pieces = re.split(pattern, text)
        if pieces.count(self.t.context) != len(tiles) or pieces.count(self.t.video) != len(frames):
            return text
        images, videos = iter(tiles), iter(frames)
        return "".join(self.image_text(next(images)) if p == self.t.context
                       else self.video_text(next(videos)) if p == self.t.video else p
                       for p in pieces)

    def expand_ids(self, ids: list[int], tiles: Sequence[int], frames: Sequence[int]
                   ) -> list[int]:
        """A prompt holding one placeholder token per item, expanded."""
        placeholders = {self.t.context_id: "image", self.t.video_id: "video"}
        items = {"image": tiles, "video": frames}
        check_placeholder_count(ids, placeholders, items)

        def written(modality: str, count: int) -> Pieces:
            return [self.image_ids(count) if modality == "image" else self.video_ids(count)]

        return expand_placeholders(ids, placeholders, items, written)[0]

    def is_expanded(self, ids: list[int]) -> bool:
        return self.t.start_id in ids

    # ---- finding ------------------------------------------------------------------------------

    def locate(self, ids: list[int], tiles: Sequence[int], frames: Sequence[int]
               ) -> list[Placed]:
        """The items of an expanded prompt, in prompt order (see the module docstring); a
        ValueError when its runs do not match the media given."""
        runs = self._runs(ids)
        placed: list[Placed] = []
        image = video = r = 0
        while r < len(runs):
            offset, length = runs[r]
            count = frames[video] if video < len(frames) else 0
            frame_runs = runs[r:r + count]
            video_fits = bool(count) and len(frame_runs) == count and all(
                n == self.per_tile for _, n in frame_runs)
            image_fits = image < len(tiles) and length == self.per_tile * tiles[image]
            if video_fits and (not image_fits or self._labelled(ids, frame_runs)):
                placed.append(Placed("video", video, tuple(o for o, _ in frame_runs)))
                r, video = r + count, video + 1
            elif image_fits:
                placed.append(Placed("image", image, (offset,)))
                r, image = r + 1, image + 1
            else:
                raise ValueError(
                    f"the prompt's image run at position {offset - 1} ({length} "
                    f"{self.t.context} tokens) matches none of its images or videos; write one "
                    f"{self.t.context} per image (and {self.t.video} per video) and no "
                    f"{self.t.start} / {self.t.end} tokens")
        if image != len(tiles) or video != len(frames):
            raise ValueError(
                f"the prompt holds {image} of its {len(tiles)} image(s) and {video} of its "
                f"{len(frames)} video(s); write one {self.t.context} per image (and "
                f"{self.t.video} per video)")
        return placed

    def _runs(self, ids: list[int]) -> list[tuple[int, int]]:
        """(offset of the first context token, count) of every `<img>` ... `</img>` run."""
        runs, inside = [], 0
        i = 0
        while i < len(ids):
            if ids[i] == self.t.start_id:
                j = i + 1
                while j < len(ids) and ids[j] == self.t.context_id:
                    j += 1
                if j == len(ids) or ids[j] != self.t.end_id:
                    raise ValueError(f"the prompt's {self.t.start} at position {i} is not "
                                     f"followed by {self.t.context} tokens and {self.t.end}")
                runs.append((i + 1, j - i - 1))
                inside += j - i - 1
                i = j
            i += 1
        if ids.count(self.t.context_id) != inside:
            raise ValueError(f"the prompt has {self.t.context} tokens outside "
                             f"{self.t.start} ... {self.t.end}; write one {self.t.context} per "
                             "image and nothing around it")
        return runs

    def _labelled(self, ids: list[int], runs: list[tuple[int, int]]) -> bool:
        """Whether each run follows its frame label "Frame{k}:"."""
        for k, (offset, _) in enumerate(runs):
            before = self.decode(ids[max(0, offset - 1 - _LABEL_WINDOW):offset - 1])
            if not "".join(before.split()).endswith(f"Frame{k + 1}:"):
                return False
        return True
