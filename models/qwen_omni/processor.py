"""Prompt processing for Qwen2.5-Omni's thinker: images, videos, audio, and videos heard with
their sound; placeholder spans, content hashes and TMRoPE positions (models/qwen_omni/layout.py).

The chat template writes `<|vision_bos|><|IMAGE|><|vision_eos|>` per image, the same with
`<|VIDEO|>` per video and `<|audio_bos|><|AUDIO|><|audio_eos|>` per clip; the i-th placeholder of
a modality takes the i-th item of it. Encoder items: one per image; one per temporal patch (two
frames) of a video, as for Qwen2.5-VL (models/processing/qwen_items.py); one per attention
window of a clip (models/qwen_omni/sound.py). The prompt is expanded and its positions computed
in one pass (models/qwen_omni/expand.py).

`use_audio_in_video` (a per-request option, true by default as the model card recommends): a
video with a sound track becomes one span in which each 2 s chunk's frames are followed by that
chunk's sound, both encoders' items keyed by their own content (frames, samples) and grouped as
one media item for display; the sound is decoded from the same source by the media loader. A
video without a sound track is seen only, and its parts say so.

Pixel budgets: images follow the image processor's settings; videos follow Qwen2_5OmniProcessor's
own `videos_kwargs` (128*28*28 to 768*28*28 pixels a frame), which transformers passes over the
video processor's settings.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import torch

from models.checkpoint import (
    CheckpointError,
    Schema,
    Settings,
    choose_schema,
    own_keys,
    read_settings,
)
from models.interfaces import MultiModalFeature, ProcessedPrompt, ProcessorContext, PromptPlan
from models.layers.mrope import MRopePositions
from models.media_inputs import VideoFrames
from models.processing.base import ProcessedCache, ProcessorDefaults, check_placeholder_count
from models.processing.log_mel import FEATURE_EXTRACTOR, MelConfig
from models.processing.options import Flag, check_mm_kwargs
from models.processing.qwen_items import (
    checked_vision_options,
    image_item,
    pixel_budget,
    video_item,
    vision_options,
)
from models.processing.qwen_vision import (
    IMAGE_PROCESSORS,
    VIDEO_PROCESSORS,
    VisionPreprocessConfig,
    smart_resize,
)
from models.qwen_omni.expand import Expansion, OmniTokens
from models.qwen_omni.family import thinker_config
from models.qwen_omni.sound import SoundWindows

# The model card's recommendation (and vLLM's default for the Qwen-Omni thinkers).
USE_AUDIO_IN_VIDEO = True
# Qwen2_5OmniProcessor.videos_kwargs: passed to the video processor over its own `size`.
VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)
# transformers' Qwen2_5OmniProcessor's own fields (class attributes, or processor_config.json).
PROCESSOR_SCHEMA = Schema("Qwen2_5OmniProcessor", {
    "seconds_per_chunk": 2.0, "position_id_per_seconds": 25})


class QwenOmniProcessor(ProcessorDefaults):
    modalities = ("image", "video", "audio")

    def __init__(self, ctx: ProcessorContext) -> None:
        thinker = thinker_config(ctx.hf_config)
        self.model_id = ctx.model_id
        vision_bos = getattr(thinker, "vision_start_token_id", None)
        if vision_bos is None:
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
        image_settings = read_settings(own_keys(image, found, mel_schema), image_schema)
        video_settings = read_settings(own_keys(video, found, mel_schema), video_schema)
        mel = read_settings(own_keys(found, image, image_schema, video_schema), mel_schema)
        own = read_settings(files.processor_fields(), PROCESSOR_SCHEMA)
        for key in ("seconds_per_chunk", "position_id_per_seconds"):
            if float(own[key]) != float(getattr(thinker, key)):
                raise CheckpointError(
                    f"{own.sources[key]}: {key}={own[key]} lays the tokens out, but config.json's "
                    f"{key}={getattr(thinker, key)} places them: they must agree")
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
        per_second = float(thinker.position_id_per_seconds)
        self.tokens = OmniTokens(
            image=thinker.image_token_id, video=thinker.video_token_id,
            audio=thinker.audio_token_id, audio_bos=thinker.audio_start_token_id,
            audio_eos=thinker.audio_end_token_id, vision_bos=vision_bos,
            merge_size=self.cfg.merge_size, per_second=per_second,
            tokens_per_chunk=int(per_second * float(thinker.seconds_per_chunk)))
        mel_cfg = MelConfig.from_settings(mel)
        audio = thinker.audio_config
        if mel_cfg.n_mels != audio.num_mel_bins:
            raise CheckpointError(
                f"{mel.sources['feature_size']}: feature_size={mel_cfg.n_mels} but the audio "
                f"encoder expects config.json's audio_config.num_mel_bins={audio.num_mel_bins}")
        if audio.n_window % 2:
            # Pooling pairs would straddle windows, which then are not independent items.
            raise NotImplementedError(f"audio_config.n_window={audio.n_window} is odd")
        self.cache = ProcessedCache(ctx.processed_cache_items)
        self.sound = SoundWindows(mel_cfg, 2 * audio.n_window, self.cache, ctx.model_id)
        self.option_ranges = {
            **vision_options(self.cfg, ctx.max_item_embeds),
            "use_audio_in_video": Flag(why="hear a video's sound track with its frames"),
        }

    # ---- the processor interface ------------------------------------------------------------

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Options for engine.media: frames to sample from a video and, when its sound is to be
        heard, the sound track at the feature extractor's rate; audio at that rate."""
        options = self._options(mm_kwargs)
        rate = self.sound.mel.sample_rate
        video: dict[str, Any] = {"fps": options.get("fps", self.cfg.video_fps)}
        if "max_frames" in options:
            video["max_frames"] = options["max_frames"]
        if options["use_audio_in_video"]:
            video["audio_sample_rate"] = rate
        return {"video_kwargs": video, "audio_kwargs": {"sample_rate": rate}}

    def max_embeds_per_item(self) -> int:
        """The largest encoder item: an image at max_pixels, a video's temporal patch at the
        video budget, or a full audio window."""
        return max(self.cfg.max_pixels // self.cfg.factor**2,
                   self.cfg.video_max_pixels // self.cfg.factor**2, self.sound.max_embeds())

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """The expanded prompt's length and each encoder item's embeddings, from the items'
        sizes alone."""
        options = self._options(mm_kwargs)
        check_placeholder_count(token_ids, self._pads(), media)
        merge = self.cfg.factor**2
        items: list[tuple[str, int]] = []
        extra = 0
        for image in media.get("image", []):
            h, w = smart_resize(image.height, image.width, self.cfg.factor,
                                **pixel_budget(self.cfg, options, video=False))
            items.append(("image", h * w // merge))
        for number, video in enumerate(media.get("video", []), start=1):
            count, height, width = video.frames.shape[:3]
            h, w = smart_resize(height, width, self.cfg.factor,
                                **pixel_budget(self.cfg, options, video=True))
            items.extend([("video", h * w // merge)] * -(-count // self.cfg.temporal_patch_size))
            if _heard(video, options):
                items.extend(("audio", n) for n in self.sound.sizes(
                    video.audio, f"video {number}: its sound track"))
                extra += 2  # <|audio_bos|>, <|audio_eos|>
        for number, clip in enumerate(media.get("audio", []), start=1):
            items.extend(("audio", n) for n in self.sound.sizes(clip, f"audio {number}"))
        placeholders = sum(token_ids.count(t) for t in self._pads())
        num_tokens = len(token_ids) - placeholders + extra + sum(n for _, n in items)
        return PromptPlan(num_tokens, items)

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        options = self._options(mm_kwargs)
        check_placeholder_count(token_ids, self._pads(), media)
        stages = {"hashing": 0.0, "preprocess": 0.0}
        cfg, model_id = self.cfg, self.model_id
        budget = pixel_budget(cfg, options, video=False)
        images = [image_item(self.cache, img, cfg, budget, model_id, stages)
                  for img in media.get("image", [])]
        budget = pixel_budget(cfg, options, video=True)
        videos = []
        for number, video in enumerate(media.get("video", []), start=1):
            sound = None
            if _heard(video, options):
                sound = self.sound.clip(video.audio, f"video {number}: its sound track", stages)
            frames = video_item(self.cache, video, cfg, budget, model_id, stages)
            videos.append((video, frames, sound))
        clips = [self.sound.clip(clip, f"audio {n}", stages)
                 for n, clip in enumerate(media.get("audio", []), start=1)]
        t0 = time.perf_counter()
        expanded = Expansion(self.tokens)
        expanded.run(token_ids, iter(images), iter(videos), iter(clips))
        rows = torch.tensor(expanded.positions.rows, dtype=torch.int64)  # [3, L]
        delta = expanded.positions.next - len(expanded.ids)
        stages["preprocess"] += time.perf_counter() - t0
        # A heard video's frames and sound items were made modality by modality.
        features: list[MultiModalFeature] = sorted(expanded.features,
                                                   key=lambda f: f.placeholder.offset)
        return ProcessedPrompt(None, expanded.ids, features, MRopePositions(rows, delta), stages)

    # ---- options and checks -----------------------------------------------------------------

    def _options(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        options = checked_vision_options(
            check_mm_kwargs(mm_kwargs, self.option_ranges, "Qwen2.5-Omni"))
        options.setdefault("use_audio_in_video", USE_AUDIO_IN_VIDEO)
        return options

    def _pads(self) -> dict[int, str]:
        return {self.tokens.image: "image", self.tokens.video: "video",
                self.tokens.audio: "audio"}


def _heard(video: VideoFrames, options: dict[str, Any]) -> bool:
    """Whether a video's sound is heard: asked for, and the video has a sound track."""
    return bool(options["use_audio_in_video"]) and video.audio is not None
