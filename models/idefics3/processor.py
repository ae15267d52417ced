"""Prompt processing for Idefics3 and SmolVLM / SmolVLM2: images (and SmolVLM videos) -> tower
inputs, and the text transformers' processors write around their `<image>` tokens.

The chat template writes one `<image>` per image (`<video>` per video). An image cut into a
rows x cols grid reads, for each row, `<fake_token_around_image><row_r_col_c>` + `<image>` x L
per tile then "\\n"; then "\\n<fake_token_around_image><global-img>" + `<image>` x L +
`<fake_token_around_image>` for the global image (an image of one tile: only that last part).
A video reads "You are provided the following series of {count} frames from a {H:MM:SS}
[H:MM:SS] video.\\n", then per frame "\\nFrame from {MM:SS}:" and the one-tile text, then
"\\n\\n". L is the tokens of one tile (models/idefics3/model.py).

Videos are sampled by the media layer as the reference's video processor samples them: at its
rate (`video_sampling.fps`), at most its `max_frames`, spread over the source frames from the
first to the last (a second skipped at both ends of long videos; engine.media.sampling's
"frame_linspace").

Text prompts are expanded before tokenizing, as the reference does, so the video's sentences
merge with their neighbours exactly alike; token-id prompts are expanded here. Each image or
video is ONE span, from its first `<fake_token_around_image>` to its last; `is_embed` marks its
`<image>` tokens, the structure and timestamp tokens inside keep their text embeddings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Schema, choose_schema, read_settings
from models.idefics3.model import tokens_per_tile
from models.idefics3.preprocess import (
    IMAGE_PROCESSORS,
    MAX_IMAGE_SIDE,
    VIDEO_PROCESSORS,
    Idefics3PreprocessConfig,
    frame_clock,
    frame_count_words,
    image_layout,
    preprocess_frames,
    preprocess_image,
    video_clock,
)
from models.interfaces import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.media_inputs import MAX_FPS
from models.processing.base import (
    Pieces,
    ProcessedCache,
    ProcessorDefaults,
    check_mm_kwargs,
    check_placeholder_count,
    expand_placeholders,
    hashed_and_processed,
    special_token_id,
)
from models.processing.hashing import hash_image, hash_video
from models.processing.options import OptionRange

FAKE, GLOBAL, IMAGE, VIDEO = "<fake_token_around_image>", "<global-img>", "<image>", "<video>"
_FRAME_BEFORE = re.compile(r"Frame from \d\d:\d\d:$")


# transformers' processors' own field (processor_config.json), with its default.
PROCESSORS = {"idefics3": Schema("Idefics3Processor", {"image_seq_len": 169}),
              "smolvlm": Schema("SmolVLMProcessor", {"image_seq_len": 169})}


class Idefics3Processor(ProcessorDefaults):
    modalities = ("image", "video")  # an instance without video support narrows this

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg, tok = ctx.hf_config, ctx.tokenizer
        self.model_id = ctx.model_id
        self.tokenizer = tok
        self.videos = cfg.model_type == "smolvlm"  # SmolVLM's processor also takes videos
        if not self.videos:
            self.modalities = ("image",)
        self.per_tile = tokens_per_tile(cfg)
        self.image_id = cfg.image_token_id
        writer = f"{PROCESSORS[cfg.model_type].cls} (the tokens it writes)"
        self.fake_id, self.global_id = (special_token_id(tok, t, writer) for t in (FAKE, GLOBAL))
        if special_token_id(tok, IMAGE, writer) != self.image_id:
            raise CheckpointError(f"{writer}: the tokenizer's {IMAGE} is not config.json's "
                                  f"image_token_id={self.image_id}")
        # Token-id prompts can hold a video only where `<video>` is one token.
        self.video_id = None
        if self.videos:
            try:
                self.video_id = special_token_id(tok, VIDEO, writer)
            except CheckpointError:
                pass
        files = ctx.files
        image = files.component("image_processor")
        image_settings = read_settings(image, choose_schema(
            image, IMAGE_PROCESSORS,
            "SmolVLMImageProcessor" if self.videos else "Idefics3ImageProcessor"))
        self.read = {"image_processor": image_settings}
        video_settings = None
        if self.videos:
            video = files.component("video_processor")
            video_settings = read_settings(video, choose_schema(
                video, VIDEO_PROCESSORS, "SmolVLMVideoProcessor", "video_processor_type"))
            self.read["video_processor"] = video_settings
        own = read_settings(files.processor_fields(), PROCESSORS[cfg.model_type])
        self.read["processor"] = own
        if own["image_seq_len"] != self.per_tile:
            raise CheckpointError(
                f"{own.sources['image_seq_len']}: image_seq_len={own['image_seq_len']} but the "
                f"model emits {self.per_tile} embeddings per tile (config.json: vision_config "
                "image_size / patch_size / scale_factor): transformers would fail on this "
                "checkpoint too")
        self.pre = Idefics3PreprocessConfig.from_settings(image_settings, video_settings)
        if self.pre.tile != cfg.vision_config.image_size:
            raise NotImplementedError(
                f"tiles of {self.pre.tile} pixels for a tower of {cfg.vision_config.image_size}: "
                "only tiles of the tower's own size are supported"
            )
        self.option_ranges: dict[str, OptionRange] = {}
        if self.videos:
            most = max(1, ctx.max_item_embeds // self.per_tile)
            self.option_ranges = {
                "fps": OptionRange(0, MAX_FPS, low_open=True),
                "max_frames": OptionRange(1, most, integer=True,
                                          why="a video's frames must fit the encoder budget"),
            }
        self.cache = ProcessedCache(ctx.processed_cache_items)

    # ---- options ------------------------------------------------------------------------------

    def _options(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return check_mm_kwargs(mm_kwargs, self.option_ranges, "Idefics3/SmolVLM")

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Videos sampled at the video processor's rate, at most its frame count."""
        options = self._options(mm_kwargs)
        if not self.videos:
            return {}
        return {"video_kwargs": {"fps": options.get("fps", self.pre.video_fps),
                                 "max_frames": options.get("max_frames",
                                                           self.pre.video_max_frames),
                                 "spread": "frame_linspace"}}

    def max_embeds_per_item(self) -> int:
        side = -(-min(self.pre.longest_edge, MAX_IMAGE_SIDE) // self.pre.tile)
        image = self.per_tile * (side * side + 1 if self.pre.do_image_splitting else 1)
        return max(image, self.per_tile * self.pre.video_max_frames if self.videos else 0)

    # ---- the text around the tokens -----------------------------------------------------------

    def _tile_text(self) -> str:
        return FAKE + GLOBAL + IMAGE * self.per_tile + FAKE

    def image_text(self, rows: int, cols: int) -> str:
        """An image's text: its tiles row by row, then the global image."""
        if not rows and not cols:
            return self._tile_text()
        grid = "".join(
            "".join(f"{FAKE}<row_{r + 1}_col_{c + 1}>" + IMAGE * self.per_tile
                    for c in range(cols)) + "\n"
            for r in range(rows))
        return grid + "\n" + self._tile_text()

    def _frames_text(self, timestamps) -> str:
        """The video's span: its frames, each after the first with its timestamp line."""
        return self._tile_text() + "".join(
            f"\nFrame from {frame_clock(t)}:" + self._tile_text() for t in timestamps[1:])

    def video_text(self, video) -> str:
        """A video's whole text: the introduction, the frames, two newlines."""
        count = len(video.timestamps)
        duration = video.duration_s if video.duration_s is not None else video.timestamps[-1]
        intro = (f"You are provided the following series of {frame_count_words(count)} frames "
                 f"from a {video_clock(duration)} [H:MM:SS] video.\n")
        first = f"\nFrame from {frame_clock(video.timestamps[0])}:"
        return intro + first + self._frames_text(video.timestamps) + "\n\n"

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        """Each `<image>` / `<video>` replaced by its text (the images' grids from their
        sizes); unchanged when the counts do not match (`process` then says why)."""
        images, videos = list(media.get("image", [])), list(media.get("video", []))
        pattern = f"({re.escape(IMAGE)}|{re.escape(VIDEO)})" if self.videos else re.escape(IMAGE)
        pieces = re.split(pattern, text)
        if pieces.count(IMAGE) != len(images) or pieces.count(VIDEO) != len(videos):
            return text
        out, images, videos = [], iter(images), iter(videos)
        for piece in pieces:
            if piece == IMAGE:
                image = next(images)
                out.append(self.image_text(*image_layout(image.height, image.width,
                                                         self.pre)[1:]))
            elif piece == VIDEO:
                out.append(self.video_text(next(videos)))
            else:
                out.append(piece)
        return "".join(out)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- planning and processing --------------------------------------------------------------

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """Items' embeddings and the expanded length, from the images' sizes and the videos'
        frame times (nothing resized)."""
        self._options(mm_kwargs)
        images, videos = media.get("image", []), media.get("video", [])
        if self.fake_id not in token_ids:
            token_ids = self._expand_ids(token_ids, images, videos)
        grids = [image_layout(i.height, i.width, self.pre)[1:] for i in images]
        found = self._locate(token_ids, {
            "image": [(self._image_pattern(g), None) for g in grids],
            "video": [(self._video_pattern(v), None) for v in videos],
        })
        items = [(m, sum(t == self.image_id for t in pattern)) for m, _, pattern, _ in found]
        return PromptPlan(len(token_ids), items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        self._options(mm_kwargs)
        images, videos = media.get("image", []), media.get("video", [])
        if self.fake_id not in token_ids:  # a token-id prompt: expand here
            token_ids = self._expand_ids(token_ids, images, videos)
        stages: dict[str, float] = {}
        encoded = {"image": [self._image(i, stages) for i in images],
                   "video": [self._video(v, stages) for v in videos]}
        found = self._locate(token_ids, {
            "image": [(self._image_pattern(d["grid"]), (ident, d))
                      for ident, d in encoded["image"]],
            "video": [(self._video_pattern(v), item)
                      for v, item in zip(videos, encoded["video"], strict=True)],
        })
        features = [
            MultiModalFeature(modality, identifier, PlaceholderRange(
                offset, len(pattern), is_embed=tuple(t == self.image_id for t in pattern),
                parts=self._parts(pattern, data)), data)
            for modality, offset, pattern, (identifier, data) in found
        ]
        return ProcessedPrompt(None, list(token_ids), features, None, stages)

    def _expand_ids(self, token_ids: list[int], images, videos) -> list[int]:
        placeholders = {self.image_id: "image", self.video_id: "video"}
        check_placeholder_count(token_ids, placeholders, {"image": images, "video": videos})

        def text(modality: str, item) -> Pieces:
            if modality == "video":
                return [self._encode(self.video_text(item))]
            return [self._encode(self.image_text(*image_layout(item.height, item.width,
                                                               self.pre)[1:]))]

        return expand_placeholders(token_ids, placeholders, {"image": images, "video": videos},
                                   text)[0]

    def _image_pattern(self, grid: tuple[int, int]) -> list[int]:
        return self._encode(self.image_text(*grid))

    def _video_pattern(self, video) -> list[int]:
        return self._encode(self._frames_text(video.timestamps))

    def _locate(self, ids: list[int], pending: dict[str, list]) -> list[tuple]:
        """(modality, offset, pattern, payload) per item, in prompt order: at each
        `<fake_token_around_image>` outside a span, the next image's or the next video's exact
        token pattern (`pending`: modality -> [(pattern, payload)] in prompt order)."""
        queues = {m: list(reversed(items)) for m, items in pending.items()}
        found: list[tuple] = []
        i = 0
        while i < len(ids):
            if ids[i] != self.fake_id:
                i += 1
                continue
            fits = [m for m in ("image", "video") if queues.get(m)
                    and ids[i:i + len(queues[m][-1][0])] == queues[m][-1][0]]
            if len(fits) == 2:  # a one-tile image and a one-frame video read alike
                before = self.tokenizer.decode(ids[max(0, i - 16):i])
                fits = ["video" if _FRAME_BEFORE.search(before) else "image"]
            if not fits:
                raise ValueError(
                    f"the prompt's image tokens at position {i} match none of its images or "
                    f"videos; write one {IMAGE} per image (and {VIDEO} per video) and no "
                    "image structure tokens"
                )
            pattern, payload = queues[fits[0]].pop()
            found.append((fits[0], i, pattern, payload))
            i += len(pattern)
        left = sum(map(len, queues.values()))
        embeds = sum(t == self.image_id for _, _, pattern, _ in found for t in pattern)
        if left or ids.count(self.image_id) != embeds:
            raise ValueError(
                f"the prompt's {ids.count(self.image_id)} {IMAGE} tokens do not match its "
                f"{len(found) + left} item(s); write one {IMAGE} per image (and {VIDEO} per "
                "video) and no image structure tokens"
            )
        return found

    def _parts(self, pattern: list[int], data: dict) -> tuple[tuple[str, int], ...]:
        rows, cols = data.get("grid", (0, 0))
        if not rows:
            return ()
        split = pattern.index(self.global_id) - 1  # the global image's opening token
        return ((f"tiles {rows}x{cols}", split), ("global image", len(pattern) - split))

    def _settings(self) -> dict[str, Any]:
        return {"tile": self.pre.tile, "longest_edge": self.pre.longest_edge,
                "split": self.pre.do_image_splitting}

    def _image(self, image, stages: dict[str, float]) -> tuple[str, dict]:
        def compute() -> dict:
            pixels, rows, cols = preprocess_image(image, self.pre)
            return {"pixel_values": pixels, "grid": (rows, cols)}

        identify = partial(hash_image, image, model_id=self.model_id,
                           processor_kwargs=self._settings())
        return hashed_and_processed(self.cache, identify, compute, stages)

    def _video(self, video, stages: dict[str, float]) -> tuple[str, dict]:
        def compute() -> dict:
            return {"pixel_values": preprocess_frames(video.frames, self.pre)}

        options = {**self._settings(), "video_longest_edge": self.pre.video_longest_edge}
        identify = partial(hash_video, video, model_id=self.model_id, processor_kwargs=options)
        return hashed_and_processed(self.cache, identify, compute, stages)

