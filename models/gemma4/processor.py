"""Prompt processing for Gemma 4: images, videos and audio clips -> encoder inputs, spans, hashes.

The chat template writes `<|image|>`, `<|video|>` or `<|audio|>` per item. As transformers'
Gemma4Processor writes them out, an image becomes `<|image>` + `<|image|>` x n + `<image|>`
(n its soft tokens at its budget); a video, per sampled frame, "mm:ss " + the frame's sequence,
frames separated by spaces (`<|video|>` as its soft token); an audio clip `<|audio>` +
`<|audio|>` x n + `<audio|>`. A text prompt is expanded before tokenizing (the timestamps' text
then merges as the reference's tokenizer merges it), a token-id prompt on its ids: a soft token
that does not follow its opening token is a placeholder still to expand.

Each image, each video frame and each clip is an encoder item with its own span (the soft
tokens) and content hash; with `use_bidirectional_attention="vision"` image and frame spans are
attended both ways (on the sliding-window layers, as the reference does), so none is cut
between prefill chunks.

The soft-token budget (`max_soft_tokens`, one of 70, 140, 280, 560, 1120; the image and video
processors' settings by default) is a per-request option, applied to images and video frames
alike as transformers applies a flat processor kwarg to both; `num_frames` sets how many frames
a video is sampled to (uniformly over its length). Both are checked against what the engine can
encode (min(encoder_cache_size, max_num_encoder_input_tokens) per item), naming the option.
Clips longer than the feature extractor's 30 s window are refused rather than cut.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict
from functools import partial
from typing import Any

import numpy as np

from models.checkpoint import CheckpointError, choose_schema, own_keys, read_settings
from models.encoders.gemma4_audio import ConformerConfig
from models.gemma4.audio_features import (
    FEATURE_EXTRACTOR,
    MAX_SAMPLES,
    AudioFeatureConfig,
    AudioFeatures,
)
from models.gemma4.preprocess import (
    IMAGE_PROCESSOR,
    PROCESSOR,
    SOFT_TOKEN_BUDGETS,
    VIDEO_PROCESSOR,
    PixelConfig,
    patches,
    soft_tokens,
)
from models.interfaces import (
    MultiModalFeature,
    PlaceholderRange,
    ProcessedPrompt,
    ProcessorContext,
    PromptPlan,
)
from models.media_inputs import MAX_FPS, AudioClip, MediaError, VideoFrames
from models.processing.base import (
    Pieces,
    ProcessedCache,
    ProcessorDefaults,
    check_placeholder_count,
    expand_placeholders,
    hashed_and_processed,
    soft_runs,
)
from models.processing.hashing import hash_audio, hash_image, hash_video
from models.processing.options import Choice, OptionRange, check_mm_kwargs


def timestamp(seconds: float) -> str:
    """mm:ss, as the reference writes a frame's time."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class Gemma4Processor(ProcessorDefaults):
    # The modalities of a checkpoint with both towers; one without a tower takes fewer.
    modalities: tuple[str, ...] = ("image", "video", "audio")

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg, tok = ctx.hf_config, ctx.tokenizer
        self.model_id, self.tokenizer = ctx.model_id, tok
        self.vision = cfg.vision_config is not None
        # Image and frame spans are attended both ways (by the sliding-window layers) only
        # with use_bidirectional_attention="vision" (the E-size models attend causally).
        self.both_ways = cfg.text_config.use_bidirectional_attention == "vision"
        self.audio = cfg.audio_config is not None
        self.modalities = tuple(m for m, on in (("image", self.vision), ("video", self.vision),
                                                ("audio", self.audio)) if on)
        self.ids = {"boi": cfg.boi_token_id, "eoi": cfg.eoi_token_id,
                    "image": cfg.image_token_id, "video": cfg.video_token_id,
                    "boa": cfg.boa_token_id, "eoa": cfg.eoa_token_index,
                    "audio": cfg.audio_token_id}
        self.tokens = {k: tok.convert_ids_to_tokens(v) for k, v in self.ids.items()}
        files = ctx.files
        self.read = {"processor": read_settings(files.processor_fields(), PROCESSOR)}
        # The Hub's older layout keeps the image processor and the feature extractor (and,
        # without a video_preprocessor_config.json, the video processor) in one file.
        found = {k: files.component(k)
                 for k in ("image_processor", "video_processor", "feature_extractor")}
        if self.vision:
            image = read_settings(own_keys(found["image_processor"], found["feature_extractor"],
                                           FEATURE_EXTRACTOR), choose_schema(
                found["image_processor"], {IMAGE_PROCESSOR.cls: IMAGE_PROCESSOR},
                IMAGE_PROCESSOR.cls))
            video = read_settings(own_keys(found["video_processor"], found["feature_extractor"],
                                           FEATURE_EXTRACTOR), choose_schema(
                found["video_processor"], {VIDEO_PROCESSOR.cls: VIDEO_PROCESSOR},
                VIDEO_PROCESSOR.cls, "video_processor_type"))
            self.read |= {"image_processor": image, "video_processor": video}
            self.image, self.video = PixelConfig.from_settings(image), PixelConfig.from_settings(
                video)
            vc = cfg.vision_config
            for name, pixels, settings in (("image", self.image, image),
                                           ("video", self.video, video)):
                _check_pixels(name, pixels, settings, vc)
            self.num_frames = int(video["num_frames"])
        if self.audio:
            mel = read_settings(own_keys(found["feature_extractor"], found["image_processor"],
                                         IMAGE_PROCESSOR, VIDEO_PROCESSOR), choose_schema(
                found["feature_extractor"], {FEATURE_EXTRACTOR.cls: FEATURE_EXTRACTOR},
                FEATURE_EXTRACTOR.cls, "feature_extractor_type"))
            self.read["feature_extractor"] = mel
            self.mel = AudioFeatureConfig.from_settings(mel)
            if not ConformerConfig.from_hf(cfg.audio_config).accepts_mel_bins(self.mel.n_mels):
                raise CheckpointError(
                    f"{mel.sources['feature_size']}: feature_size={self.mel.n_mels} does not "
                    "fit the audio encoder (config.json's audio_config.subsampling_conv_"
                    f"channels[0] // 4 = {cfg.audio_config.subsampling_conv_channels[0] // 4} "
                    "frequency rows after two halvings)")
            self.features = AudioFeatures(self.mel)
        # The budgets a request may ask for: those whose items the engine can encode.
        self.budgets = tuple(b for b in SOFT_TOKEN_BUDGETS if b <= ctx.max_item_embeds)
        self.max_item_embeds = ctx.max_item_embeds
        self.options: dict[str, Any] = {}
        if self.vision:
            self.options["max_soft_tokens"] = Choice(
                self.budgets, why="soft tokens per image or video frame, at most "
                f"min(encoder_cache_size, max_num_encoder_input_tokens)={ctx.max_item_embeds}")
            self.options["num_frames"] = OptionRange(
                1, integer=True, why="frames sampled per video, at most "
                "MediaLimits.max_video_frames")
        self.cache = ProcessedCache(ctx.processed_cache_items)

    # ---- options and sizes ----------------------------------------------------------------------

    def _options(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return check_mm_kwargs(mm_kwargs, self.options, "Gemma 4")

    def _budget(self, options: Mapping[str, Any], video: bool) -> int:
        return options.get("max_soft_tokens",
                           (self.video if video else self.image).max_soft_tokens)

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Videos sampled to `num_frames` frames spread over their length (every frame of a
        shorter one); audio at the feature extractor's rate."""
        options = self._options(mm_kwargs)
        out: dict[str, Any] = {}
        if self.vision:
            frames = options.get("num_frames", self.num_frames)
            out["video_kwargs"] = {"fps": MAX_FPS, "max_frames": frames}
        if self.audio:
            out["audio_kwargs"] = {"sample_rate": self.mel.sample_rate}
        return out

    def max_embeds_per_item(self) -> int:
        sizes = [*self.budgets]
        if self.vision:
            sizes += [self.image.max_soft_tokens, self.video.max_soft_tokens]
        if self.audio:  # a longer clip than the budget takes is refused per request
            sizes.append(min(self.mel.num_embeds(MAX_SAMPLES), self.max_item_embeds))
        return max(sizes)

    def max_bidirectional_span(self) -> int:
        if not (self.vision and self.both_ways):
            return 0
        return max(*self.budgets, self.image.max_soft_tokens, self.video.max_soft_tokens)

    # ---- text ---------------------------------------------------------------------------------

    def _image_text(self, n: int, soft: str = "image") -> str:
        t = self.tokens
        return f"{t['boi']}{t[soft] * n}{t['eoi']}"

    def _video_text(self, video: VideoFrames, n: int) -> str:
        return " ".join(f"{timestamp(s)} {self._image_text(n, 'video')}"
                        for s in video.timestamps)

    def _audio_text(self, n: int) -> str:
        t = self.tokens
        return f"{t['boa']}{t['audio'] * n}{t['eoa']}"

    def _texts(self, media: dict[str, list], options: Mapping[str, Any]) -> dict[str, list]:
        """Each item's expansion text, by modality."""
        out: dict[str, list[str]] = {}
        if "image" in media:
            b = self._budget(options, False)
            out["image"] = [self._image_text(soft_tokens(i.height, i.width, self.image, b))
                            for i in media["image"]]
        if "video" in media:
            b = self._budget(options, True)
            out["video"] = [self._video_text(v, self._frame_tokens(v, b)) for v in media["video"]]
        if "audio" in media:
            out["audio"] = [self._audio_text(self._clip_tokens(c)) for c in media["audio"]]
        return out

    def _frame_tokens(self, video: VideoFrames, budget: int) -> int:
        _, h, w, _ = video.frames.shape
        return soft_tokens(h, w, self.video, budget)

    def _clip_tokens(self, clip: AudioClip) -> int:
        if len(clip.samples) > MAX_SAMPLES:
            raise MediaError(
                f"an audio clip of {clip.duration_s:.1f} s is longer than Gemma 4's "
                f"{MAX_SAMPLES / self.mel.sample_rate:g} s window (the feature extractor's "
                "max_length, which transformers truncates to); cut it or send it in parts")
        n = self.mel.num_embeds(len(clip.samples))
        if n == 0:
            raise MediaError(f"an audio clip of {len(clip.samples)} samples is too short: it "
                             "gives no embedding (at least about 30 ms are needed)")
        return n

    def expand_text(self, text: str, media: dict[str, list], mm_kwargs: Mapping[str, Any]) -> str:
        """Every placeholder of the text written out (see the module docstring)."""
        counts = {m: text.count(self.tokens[m]) for m in ("image", "video", "audio")}
        if any(counts[m] != len(media.get(m, [])) for m in counts):
            return text  # `process` reports the mismatch
        texts = {m: iter(v) for m, v in self._texts(media, self._options(mm_kwargs)).items()}
        pattern = "|".join(re.escape(self.tokens[m]) for m in ("image", "video", "audio"))
        kinds = {self.tokens[m]: m for m in ("image", "video", "audio")}
        return re.sub(pattern, lambda match: next(texts[kinds[match.group(0)]]), text)

    # ---- prompts ------------------------------------------------------------------------------

    def _expanded(self, token_ids: list[int]) -> bool:
        """Whether the prompt's media tokens are already written out (each soft token follows
        its opening token or another soft token)."""
        opener = {self.ids["image"]: self.ids["boi"], self.ids["video"]: self.ids["boi"],
                  self.ids["audio"]: self.ids["boa"]}
        for i, token in enumerate(token_ids):
            if token in opener and (i == 0 or token_ids[i - 1] not in (opener[token], token)):
                return False
        return True

    def _expand_ids(self, token_ids: list[int], media: dict[str, list],
                    options: Mapping[str, Any]) -> list[int]:
        check_placeholder_count(token_ids, self._soft_kinds(), media)

        def text(_: str, written: str) -> Pieces:
            return [self.tokenizer.encode(written, add_special_tokens=False)]

        return expand_placeholders(token_ids, self._soft_kinds(), self._texts(media, options),
                                   text)[0]

    def plan(self, token_ids: list[int], media: dict[str, list],
             mm_kwargs: Mapping[str, Any]) -> PromptPlan:
        """Items and the expanded length from the media's sizes (nothing resized)."""
        options = self._options(mm_kwargs)
        items: list[tuple[str, int]] = []
        for image in media.get("image", []):
            items.append(("image", soft_tokens(image.height, image.width, self.image,
                                               self._budget(options, False))))
        for video in media.get("video", []):
            n = self._frame_tokens(video, self._budget(options, True))
            items += [("video", n)] * len(video.frames)
        items += [("audio", self._clip_tokens(c)) for c in media.get("audio", [])]
        if self._expanded(token_ids):
            return PromptPlan(len(token_ids), items)
        return PromptPlan(len(self._expand_ids(token_ids, media, options)), items)

    def process(self, token_ids: list[int], media: dict[str, list],
                mm_kwargs: Mapping[str, Any]) -> ProcessedPrompt:
        options = self._options(mm_kwargs)
        if not self._expanded(token_ids):
            token_ids = self._expand_ids(token_ids, media, options)
        stages: dict[str, float] = {}
        queues = {
            "image": iter(self._image_items(media.get("image", []), options, stages)),
            "video": iter(self._video_items(media.get("video", []), options, stages)),
            "audio": iter(self._audio_items(media.get("audio", []), stages)),
        }
        features = []
        for offset, length, soft in soft_runs(token_ids, self._soft_kinds()):
            item = next(queues[soft], None)
            if item is None:
                raise ValueError(f"the prompt has more {soft} token runs than {soft} items")
            identifier, data, n, part, group = item
            if n != length:
                raise ValueError(f"a {soft} span of {length} tokens for an item of {n} "
                                 "embeddings; write one placeholder per item, no soft tokens")
            span = PlaceholderRange(offset, length,
                                    bidirectional=self.both_ways and soft != "audio")
            features.append(MultiModalFeature(soft, identifier, span, data, item=group,
                                              part=part))
        left = [m for m, q in queues.items() if next(q, None) is not None]
        if left:
            raise ValueError(f"the prompt has fewer {left[0]} token runs than {left[0]} items")
        return ProcessedPrompt(None, token_ids, features, None, stages)

    def _soft_kinds(self) -> dict[int, str]:
        return {self.ids[m]: m for m in ("image", "video", "audio")}

    # ---- items --------------------------------------------------------------------------------

    def _image_items(self, images, options, stages) -> list[tuple]:
        budget = self._budget(options, False)
        out = []
        for image in images:
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            kwargs = {**asdict(self.image), "max_soft_tokens": budget}
            identify = partial(hash_image, rgb, model_id=self.model_id, processor_kwargs=kwargs)
            compute = partial(patches, np.asarray(rgb), self.image, budget)
            identifier, data = hashed_and_processed(self.cache, identify, compute, stages)
            n = soft_tokens(rgb.height, rgb.width, self.image, budget)
            out.append((identifier, data, n, f"budget {budget}", None))
        return out

    def _video_items(self, videos, options, stages) -> list[tuple]:
        budget = self._budget(options, True)
        out = []
        for video in videos:
            kwargs = {**asdict(self.video), "max_soft_tokens": budget}
            identify = partial(hash_video, video, model_id=self.model_id, processor_kwargs=kwargs)
            compute = partial(lambda v: [patches(f, self.video, budget) for f in v.frames], video)
            identifier, frames = hashed_and_processed(self.cache, identify, compute, stages)
            n = self._frame_tokens(video, budget)
            for i, (data, seconds) in enumerate(zip(frames, video.timestamps, strict=True)):
                out.append((f"{identifier}:f{i}", data, n,
                            f"frame {timestamp(seconds)}, budget {budget}", identifier))
        return out

    def _audio_items(self, clips, stages) -> list[tuple]:
        out = []
        for clip in clips:
            n = self._clip_tokens(clip)
            identify = partial(hash_audio, clip, model_id=self.model_id,
                               processor_kwargs=asdict(self.mel))
            compute = partial(lambda c: self.features(c.samples), clip)
            identifier, data = hashed_and_processed(self.cache, identify, compute, stages)
            out.append((identifier, data, n, "", None))
        return out


def _check_pixels(name: str, pixels: PixelConfig, settings, vc) -> None:
    """Refuse processor settings the tower cannot honour."""
    if pixels.patch_size != vc.patch_size or pixels.pooling != vc.pooling_kernel_size:
        raise CheckpointError(
            f"{settings.sources['patch_size']}: the {name} processor's patch_size="
            f"{pixels.patch_size} / pooling_kernel_size={pixels.pooling} differ from config."
            f"json's vision_config ({vc.patch_size} / {vc.pooling_kernel_size})")
    if pixels.max_soft_tokens not in SOFT_TOKEN_BUDGETS:
        raise CheckpointError(
            f"{settings.sources['max_soft_tokens']}: max_soft_tokens={pixels.max_soft_tokens} "
            f"is not one of {SOFT_TOKEN_BUDGETS} (transformers refuses it too)")

