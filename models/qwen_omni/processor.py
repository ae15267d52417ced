"""Prompt processing for Qwen2.5-Omni's thinker: images, videos, audio, and videos heard with
their sound; placeholder spans, content hashes and TMRoPE positions (models/qwen_omni/layout.py).

The chat template writes `<|vision_bos|><|IMAGE|><|vision_eos|>` per image, the same with
`<|VIDEO|>` per video and `<|audio_bos|><|AUDIO|><|audio_eos|>` per clip; the i-th placeholder of
a modality takes the i-th item of it. Encoder items:
- an image: one item, its merged patches;
- a video: one item per temporal patch (two frames), as for Qwen2.5-VL: the tower never attends
  across them, so the scheduler can spread a long video's encoder work over its chunks;
- a clip: one item per attention window of the audio encoder (2 * n_window mel frames, 2 s):
  the encoder attends within a window and restarts its positions there, so a window's output is
  the same alone (the mel features themselves are computed over the whole clip, as transformers
  does, and keyed by the clip's hash).

`use_audio_in_video` (a per-request option, true by default as the model card recommends): a
video with a sound track becomes one span in which each 2 s chunk's frames are followed by that
chunk's sound, both encoders' items keyed by their own content (frames, samples) and grouped as
one media item for display; the sound is decoded from the same source by the media loader. A
video without a sound track is seen only, and its parts say so.

Pixel budgets: images follow the image processor's settings; videos follow Qwen2_5OmniProcessor's
own `videos_kwargs` (128*28*28 to 768*28*28 pixels a frame), which transformers passes over the
video processor's settings. A clip (or a video's sound) longer than the feature extractor's
window (`chunk_length`) is refused: transformers would cut it there without saying so.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict
from functools import partial
from typing import Any

import torch

from models.checkpoint import (
    CheckpointError,
    Found,
    Schema,
    Settings,
    choose_schema,
    read_settings,
)
from models.encoders.whisper import encoder_lengths
from models.interfaces import (
    MAX_FPS,
    AudioClip,
    MediaError,
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
    VideoFrames,
)
from models.layers.mrope import MRopePositions
from models.processing.base import ProcessedCache, ProcessorDefaults, hashed_and_processed
from models.processing.hashing import hash_audio, hash_image, hash_video
from models.processing.log_mel import FEATURE_EXTRACTOR, LogMelExtractor, MelConfig
from models.processing.options import Flag, OptionRange, check_mm_kwargs
from models.processing.qwen_vision import (
    IMAGE_PROCESSORS,
    VIDEO_PROCESSORS,
    VisionPreprocessConfig,
    preprocess_image,
    preprocess_video,
    smart_resize,
)
from models.qwen_omni.family import thinker_config
from models.qwen_omni.layout import Positions, grid_offsets, interleave

# The model card's recommendation (and vLLM's default for the Qwen-Omni thinkers).
USE_AUDIO_IN_VIDEO = True
# Qwen2_5OmniProcessor.videos_kwargs: passed to the video processor over its own `size`.
VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)
# transformers' Qwen2_5OmniProcessor's own fields (class attributes, or processor_config.json).
PROCESSOR_SCHEMA = Schema("Qwen2_5OmniProcessor", {
    "seconds_per_chunk": 2.0, "position_id_per_seconds": 25})


@dataclasses.dataclass(frozen=True)
class _Clip:
    """A clip's encoder windows: (identifier, encoder inputs, embeddings) each, and its hash."""

    identifier: str
    windows: list[tuple[str, dict, int]]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, _, n in self.windows)


class QwenOmniProcessor(ProcessorDefaults):
    modalities = ("image", "video", "audio")

    def __init__(self, ctx: ProcessorContext) -> None:
        thinker = thinker_config(ctx.hf_config)
        self.model_id = ctx.model_id
        self.image_token_id = thinker.image_token_id
        self.video_token_id = thinker.video_token_id
        self.audio_token_id = thinker.audio_token_id
        self.audio_bos_id = thinker.audio_start_token_id
        self.audio_eos_id = thinker.audio_end_token_id
        self.vision_bos_id = getattr(thinker, "vision_start_token_id", None)
        if self.vision_bos_id is None:
            raise CheckpointError(
                "config.json: the thinker has no vision_start_token_id, which transformers' "
                "get_rope_index reads to find images and videos")
        files = ctx.files
        image, video = files.component("image_processor"), files.component("video_processor")
        found = files.component("feature_extractor")
        image_schema = choose_schema(image, IMAGE_PROCESSORS, "Qwen2VLImageProcessor")
        video_schema = choose_schema(video, VIDEO_PROCESSORS, "Qwen2VLVideoProcessor",
                                     "video_processor_type")
        mel_schema = choose_schema(found, {FEATURE_EXTRACTOR.cls: FEATURE_EXTRACTOR},
                                   FEATURE_EXTRACTOR.cls, "feature_extractor_type")
        # The Hub's checkpoints keep the image processor and the feature extractor (and, read
        # from there too, the video processor) in one preprocessor_config.json: each reads its
        # own keys of it, as transformers' classes do.
        image_settings = read_settings(_own_keys(image, found, mel_schema), image_schema)
        video_settings = read_settings(_own_keys(video, found, mel_schema), video_schema)
        mel = read_settings(_own_keys(found, image, image_schema, video_schema), mel_schema)
        own = read_settings(files.processor_fields(), PROCESSOR_SCHEMA)
        # Shown with the settings: the video budget transformers passes over video_processor's.
        own = Settings(own.schema, {**own.values, "videos_kwargs.size": {
            "shortest_edge": VIDEO_PIXELS[0], "longest_edge": VIDEO_PIXELS[1]}}, {
            **own.sources, "videos_kwargs.size": "default of Qwen2_5OmniProcessor (passed to "
            "its video processor over the video processor's own size)"})
        self.read = {"image_processor": image_settings, "video_processor": video_settings,
                     "feature_extractor": mel, "processor": own}
        cfg = VisionPreprocessConfig.from_settings(image_settings, video_settings)
        self.cfg = dataclasses.replace(cfg, video_min_pixels=VIDEO_PIXELS[0],
                                       video_max_pixels=VIDEO_PIXELS[1])
        for key in ("seconds_per_chunk", "position_id_per_seconds"):
            if float(own[key]) != float(getattr(thinker, key)):
                raise CheckpointError(
                    f"{own.sources[key]}: {key}={own[key]} lays the tokens out, but config.json's "
                    f"{key}={getattr(thinker, key)} places them: they must agree")
        self.per_second = float(thinker.position_id_per_seconds)
        self.tokens_per_chunk = int(self.per_second * float(thinker.seconds_per_chunk))
        self.mel = MelConfig.from_settings(mel)
        audio = thinker.audio_config
        if self.mel.n_mels != audio.num_mel_bins:
            raise CheckpointError(
                f"{mel.sources['feature_size']}: feature_size={self.mel.n_mels} but the audio "
                f"encoder expects config.json's audio_config.num_mel_bins={audio.num_mel_bins}")
        if audio.n_window % 2:
            # Pooling pairs would straddle windows, which then are not independent items.
            raise NotImplementedError(f"audio_config.n_window={audio.n_window} is odd")
        self.window_frames = 2 * audio.n_window
        self.extractor = LogMelExtractor(self.mel)
        self.cache = ProcessedCache(ctx.processed_cache_items)
        self.option_ranges = _option_ranges(self.cfg, ctx.max_item_embeds)

    # ---- the processor interface ------------------------------------------------------------

    def loader_kwargs(self, mm_kwargs: dict[str, Any]) -> dict[str, Any]:
        """Options for engine.media: frames to sample from a video and, when its sound is to be
        heard, the sound track at the feature extractor's rate; audio at that rate."""
        options = self._options(mm_kwargs)
        video: dict[str, Any] = {"fps": options.get("fps", self.cfg.video_fps)}
        if "max_frames" in options:
            video["max_frames"] = options["max_frames"]
        if options["use_audio_in_video"]:
            video["audio_sample_rate"] = self.mel.sample_rate
        return {"video_kwargs": video, "audio_kwargs": {"sample_rate": self.mel.sample_rate}}

    def max_embeds_per_item(self) -> int:
        """The largest encoder item: an image at max_pixels, a video's temporal patch at the
        video budget, or a full audio window."""
        return max(self.cfg.max_pixels // self.cfg.factor**2,
                   self.cfg.video_max_pixels // self.cfg.factor**2,
                   encoder_lengths(self.window_frames)[1])

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: dict[str, Any]
    ) -> PromptPlan:
        """The expanded prompt's length and each encoder item's embeddings, from the items'
        sizes alone."""
        options = self._options(mm_kwargs)
        self._check_placeholders(token_ids, media)
        merge = self.cfg.factor**2
        items: list[tuple[str, int]] = []
        extra = 0
        for image in media.get("image", []):
            h, w = smart_resize(image.height, image.width, self.cfg.factor,
                                **self._pixel_budget(options, video=False))
            items.append(("image", h * w // merge))
        for number, video in enumerate(media.get("video", []), start=1):
            count, height, width = video.frames.shape[:3]
            h, w = smart_resize(height, width, self.cfg.factor,
                                **self._pixel_budget(options, video=True))
            items.extend([("video", h * w // merge)] * -(-count // self.cfg.temporal_patch_size))
            if self._heard(video, options):
                items.extend(("audio", n) for n in self._window_sizes(
                    video.audio, f"video {number}: its sound track"))
                extra += 2  # <|audio_bos|>, <|audio_eos|>
        for number, clip in enumerate(media.get("audio", []), start=1):
            items.extend(("audio", n) for n in self._window_sizes(clip, f"audio {number}"))
        placeholders = sum(token_ids.count(t) for t in self._pads())
        num_tokens = len(token_ids) - placeholders + extra + sum(n for _, n in items)
        return PromptPlan(num_tokens, items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: dict[str, Any]
    ) -> ProcessedPrompt:
        options = self._options(mm_kwargs)
        self._check_placeholders(token_ids, media)
        stages = {"hashing": 0.0, "preprocess": 0.0}
        images = [self._image(img, options, stages) for img in media.get("image", [])]
        videos = []
        for number, video in enumerate(media.get("video", []), start=1):
            sound = None
            if self._heard(video, options):
                sound = self._clip(video.audio, f"video {number}: its sound track", stages)
            videos.append((video, self._video(video, options, stages), sound))
        clips = [self._clip(clip, f"audio {n}", stages)
                 for n, clip in enumerate(media.get("audio", []), start=1)]
        t0 = time.perf_counter()
        expanded = _Expansion(self)
        expanded.run(token_ids, iter(images), iter(videos), iter(clips))
        rows = torch.tensor(expanded.positions.rows, dtype=torch.int64)  # [3, L]
        delta = expanded.positions.next - len(expanded.ids)
        stages["preprocess"] += time.perf_counter() - t0
        # A heard video's frames and sound items were made modality by modality.
        features = sorted(expanded.features, key=lambda f: f.placeholder.offset)
        return ProcessedPrompt(None, expanded.ids, features, MRopePositions(rows, delta), stages)

    # ---- options and checks -----------------------------------------------------------------

    def _options(self, mm_kwargs: dict[str, Any]) -> dict[str, Any]:
        options = check_mm_kwargs(mm_kwargs, self.option_ranges, "Qwen2.5-Omni")
        low, high = options.get("min_pixels"), options.get("max_pixels")
        if low is not None and high is not None and low > high:
            raise ValueError(
                f"mm_processor_kwargs min_pixels={low} must not exceed max_pixels={high}")
        options.setdefault("use_audio_in_video", USE_AUDIO_IN_VIDEO)
        return options

    def _pads(self) -> dict[int, str]:
        return {self.image_token_id: "image", self.video_token_id: "video",
                self.audio_token_id: "audio"}

    def _check_placeholders(self, token_ids: list[int], media: dict[str, list]) -> None:
        for token, name in self._pads().items():
            found, given = token_ids.count(token), len(media.get(name, []))
            if found != given:
                raise ValueError(
                    f"the prompt has {found} {name} placeholder(s) but {given} {name}(s) "
                    f"were given; each {name} needs one placeholder (the chat template adds it)")

    @staticmethod
    def _heard(video: VideoFrames, options: dict[str, Any]) -> bool:
        return bool(options["use_audio_in_video"]) and video.audio is not None

    def _pixel_budget(self, options: dict[str, Any], *, video: bool) -> dict[str, int]:
        cfg = self.cfg
        return {
            "min_pixels": options.get("min_pixels",
                                      cfg.video_min_pixels if video else cfg.min_pixels),
            "max_pixels": options.get("max_pixels",
                                      cfg.video_max_pixels if video else cfg.max_pixels),
        }

    # ---- items ------------------------------------------------------------------------------

    def _image(self, image, options, stages) -> tuple[str, dict]:
        budget = self._pixel_budget(options, video=False)

        def compute():
            pixels, grid = preprocess_image(image, self.cfg, **budget)
            return {"pixel_values": pixels, "grid_thw": grid}

        identify = partial(hash_image, image, model_id=self.model_id, processor_kwargs=budget)
        return hashed_and_processed(self.cache, identify, compute, stages)

    def _video(self, video: VideoFrames, options, stages) -> tuple[str, dict]:
        budget = self._pixel_budget(options, video=True)

        def compute():
            pixels, grid = preprocess_video(video.frames, self.cfg, **budget)
            # Seconds one temporal patch covers: its TMRoPE time step.
            per_grid = self.cfg.temporal_patch_size / video.sampled_fps
            return {"pixel_values": pixels, "grid_thw": grid, "second_per_grid_t": per_grid}

        identify = partial(hash_video, video, model_id=self.model_id, processor_kwargs=budget)
        return hashed_and_processed(self.cache, identify, compute, stages)

    def _check_clip(self, clip: AudioClip, what: str) -> None:
        if clip.sample_rate != self.mel.sample_rate:
            raise ValueError(f"{what} is at {clip.sample_rate} Hz, expected "
                             f"{self.mel.sample_rate} Hz (load it through engine.media)")
        if len(clip.samples) > self.mel.window_samples:
            hint = (" (send the video with mm_processor_kwargs use_audio_in_video=false to "
                    "see its frames only)" if what.startswith("video") else "")
            raise MediaError(
                f"{what}: duration {clip.duration_s:.1f} s exceeds the audio window of "
                f"{self.mel.chunk_length} s (the feature extractor's chunk_length){hint}")

    def _window_sizes(self, clip: AudioClip, what: str) -> list[int]:
        """Embeddings of each of the clip's encoder windows (those with any)."""
        self._check_clip(clip, what)
        frames = self.mel.num_frames(len(clip.samples))
        sizes = [encoder_lengths(min(self.window_frames, frames - start))[1]
                 for start in range(0, frames, self.window_frames)]
        return [n for n in sizes if n]

    def _clip(self, clip: AudioClip, what: str, stages) -> _Clip:
        """A clip's log-mel features (over the whole clip, as the reference), cut into its
        encoder windows."""
        self._check_clip(clip, what)
        t0 = time.perf_counter()
        identifier = hash_audio(clip, model_id=self.model_id, processor_kwargs=asdict(self.mel))
        t1 = time.perf_counter()

        def compute() -> list[tuple[str, dict, int]]:
            mel = self.extractor([clip.samples])
            features, frames = mel.features[0], mel.num_frames[0]
            windows = []
            for j, start in enumerate(range(0, frames, self.window_frames)):
                n = min(self.window_frames, frames - start)
                embeds = encoder_lengths(n)[1]
                if embeds:  # a tail of one or two frames pools into nothing
                    data = {"input_features": features[:, start:start + n].clone(),
                            "num_frames": n}
                    windows.append((f"{identifier}:w{j}", data, embeds))
            return windows

        windows = self.cache.get_or_compute(identifier, compute)
        stages["hashing"] += t1 - t0
        stages["preprocess"] += time.perf_counter() - t1
        return _Clip(identifier, windows)


class _Expansion:
    """One pass over the prompt's tokens: each placeholder expanded into its item's tokens, the
    encoder items with their spans, and every token's TMRoPE position."""

    def __init__(self, processor: QwenOmniProcessor) -> None:
        self.p = processor
        self.ids: list[int] = []
        self.features: list[MultiModalFeature] = []
        self.positions = Positions()
        self.repeat_next = False  # a heard video's closing token shares the previous position

    def run(self, token_ids: list[int], images, videos, clips) -> None:
        p = self.p
        for i, token in enumerate(token_ids):
            if token == p.image_token_id:
                self._image(*next(images))
            elif token == p.video_token_id:
                video, (identifier, data), sound = next(videos)
                if sound is None:
                    self._video(identifier, data, video)
                else:
                    if i == 0 or token_ids[i - 1] != p.vision_bos_id or i + 1 == len(token_ids):
                        raise ValueError(
                            "a video heard with its sound must sit between <|vision_bos|> and a "
                            "closing token, as the chat template writes it")
                    self._heard_video(identifier, data, sound)
            elif token == p.audio_token_id:
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
        m = self.p.cfg.merge_size
        start = len(self.ids)
        n = t * h * w // m**2
        self.ids.extend([self.p.image_token_id] * n)
        self.positions.content(*grid_offsets([0] * t, h // m, w // m))
        self._span("image", identifier, data, list(range(start, start + n)), identifier, "")

    def _time_index(self, data: dict) -> list[int]:
        """Each temporal patch's TMRoPE time, as the reference computes it (float32, truncated)."""
        step = torch.tensor(data["second_per_grid_t"], dtype=torch.float32)
        return (torch.arange(data["grid_thw"][0]) * step * self.p.per_second).long().tolist()

    def _patch_parts(self, identifier: str, data: dict, note: str = ""):
        """(identifier, inputs, label) per temporal patch: views of the video's rows."""
        t, h, w = data["grid_thw"]
        rows, seconds = h * w, data["second_per_grid_t"]
        return [(f"{identifier}:t{i}",
                 {"pixel_values": data["pixel_values"][i * rows:(i + 1) * rows],
                  "grid_thw": (1, h, w)},
                 f"frames {i * seconds:g}-{(i + 1) * seconds:g} s{note}") for i in range(t)]

    def _video(self, identifier: str, data: dict, video: VideoFrames) -> None:
        """A video seen only: its temporal patches' tokens in a row."""
        t, h, w = data["grid_thw"]
        m = self.p.cfg.merge_size
        per_patch = h * w // m**2
        note = " (no sound track)" if video.has_audio_track is False else ""
        start = len(self.ids)
        self.ids.extend([self.p.video_token_id] * (t * per_patch))
        self.positions.content(*grid_offsets(self._time_index(data), h // m, w // m))
        for i, (part_id, part, label) in enumerate(self._patch_parts(identifier, data, note)):
            first = start + i * per_patch
            self._span("video", part_id, part, list(range(first, first + per_patch)),
                       identifier, label)

    def _heard_video(self, identifier: str, data: dict, sound: _Clip) -> None:
        """A video heard with its sound: <|audio_bos|>, per chunk its frames then its sound,
        <|audio_eos|>; the begin-tokens share a position, as do the end-tokens."""
        p = self.p
        t, h, w = data["grid_thw"]
        m = p.cfg.merge_size
        per_patch = h * w // m**2
        self.ids.append(p.audio_bos_id)
        self.positions.repeat_last()  # <|vision_bos|><|audio_bos|>: one position
        # The layout's times are the processor's (float64); the positions' the model's.
        seconds = data["second_per_grid_t"]
        video_times = [i * seconds * p.per_second for i in range(t) for _ in range(per_patch)]
        runs = interleave(video_times, sound.num_tokens, p.tokens_per_chunk)
        t_off, h_off, w_off = grid_offsets(self._time_index(data), h // m, w // m)
        video_at: list[int] = []  # absolute offset of each video token, in video order
        audio_at: list[int] = []
        rows: tuple[list[int], list[int], list[int]] = ([], [], [])
        for run in runs:
            at = video_at if run.modality == "video" else audio_at
            for k in range(run.start, run.end):
                at.append(len(self.ids))
                if run.modality == "video":
                    self.ids.append(p.video_token_id)
                    offsets = (t_off[k], h_off[k], w_off[k])
                else:
                    self.ids.append(p.audio_token_id)
                    offsets = (k, k, k)
                for row, o in zip(rows, offsets, strict=True):
                    row.append(o)
        self.positions.content(*rows)
        self.ids.append(p.audio_eos_id)
        self.positions.text()
        self.positions.next -= 1  # the closing <|vision_eos|> repeats this position
        self.repeat_next = True
        for i, (part_id, part, label) in enumerate(self._patch_parts(identifier, data)):
            self._span("video", part_id, part, video_at[i * per_patch:(i + 1) * per_patch],
                       identifier, label)
        self._windows(sound, audio_at, identifier)

    def _audio(self, clip: _Clip) -> None:
        """A clip alone: its windows' tokens in a row, consecutive positions."""
        start = len(self.ids)
        self.ids.extend([self.p.audio_token_id] * clip.num_tokens)
        n = clip.num_tokens
        self.positions.content(range(n), range(n), range(n))
        self._windows(clip, list(range(start, start + n)), clip.identifier)

    def _windows(self, clip: _Clip, at: list[int], item: str) -> None:
        """One feature per encoder window of `clip`, its tokens at offsets `at`."""
        mel = self.p.mel
        frame_seconds = mel.hop_length / mel.sample_rate
        done = 0
        for window_id, data, n in clip.windows:
            start = int(window_id.rsplit(":w", 1)[1]) * self.p.window_frames * frame_seconds
            end = start + data["num_frames"] * frame_seconds
            self._span("audio", window_id, data, at[done:done + n], item,
                       f"sound {start:g}-{end:g} s")
            done += n


def _own_keys(found: Found | None, other: Found | None, *schemas: Schema) -> Found | None:
    """`found` less the keys of `schemas` (another component's) when both components were read
    from the same file."""
    if found is None or other is None or found.source != other.source:
        return found
    foreign = set().union(*(set(s.defaults) | set(s.fixed) | s.inert for s in schemas))
    return Found({k: v for k, v in found.data.items() if k not in foreign}, found.source)


def _option_ranges(cfg: VisionPreprocessConfig, max_item_embeds: int) -> dict[str, Any]:
    """Per-request options: pixel budgets bounded so that no item outgrows the encoder budget,
    the video sampling rate and frame cap, and whether a video's sound is heard."""
    pixels = OptionRange(
        cfg.factor**2, max_item_embeds * cfg.factor**2, integer=True,
        why=f"pixels per image or video frame: at least one {cfg.factor}x{cfg.factor} patch, at "
        f"most {max_item_embeds} of them, min(encoder_cache_size, max_num_encoder_input_tokens)")
    return {
        "min_pixels": pixels,
        "max_pixels": pixels,
        "fps": OptionRange(0, MAX_FPS, low_open=True, why="video frames sampled per second"),
        "max_frames": OptionRange(
            1, integer=True, why="frames per video, at most MediaLimits.max_video_frames"),
        "use_audio_in_video": Flag(why="hear a video's sound track with its frames"),
    }

