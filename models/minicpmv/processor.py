"""Prompt processing for MiniCPM-V 4.6: images and videos -> pictures for the tower, and the text
transformers' MiniCPMV4_6Processor writes in place of each `<|image_pad|>` / `<|video_pad|>`.

A picture (an image, or one video frame) reads `<image>` + pad x (overview embeddings) +
`</image>`, then, if it was sliced, each row of its grid as `<slice>` + pad x n + `</slice>` per
slice, rows joined by "\\n". With `use_image_id`, an image is preceded by
`<image_id>k</image_id>` (k counting the prompt's images from 0) and a video, once, by its own
count among the videos; a video's frames follow each other with nothing between them. The
token strings are the tokenizer's (`image_token`, `slice_start_token`, ...: where transformers'
processor reads them); they are added tokens, so the text between them tokenizes alone and the
placeholders are expanded on token ids.

Encoder items: one per picture (see models/minicpmv/model.py). Each picture is one span from its
`<image>` to its last `</image>` or `</slice>`, its pads marked by `is_embed`, the structure
tokens between them keeping their text embeddings. A slice's embeddings depend on its pixels
alone, but its pixels depend on the whole picture (the grid and the resize), so nothing could
reuse a slice without its picture: items per slice would only multiply the scheduler's items,
the prefix hashes and a hybrid decoder's state snapshots (one per item end) for no cache hit.
Videos are sampled a frame per second from the start (`max_num_frames` at most, spread over
0.1 s marks beyond that), as MiniCPMV4_6VideoProcessor.sample_frames picks them
(engine.media.sampling's "whole_seconds"), and each frame is processed as an image with the
video processor's settings; transformers' video processor resizes frames with torchvision
(absent here), ours with PIL as its image processor does, which rounds a little differently.
Sub-second frames stacked into composite pictures (stack_frames > 1) are not implemented.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from models.checkpoint import CheckpointError, Schema, choose_schema, read_settings
from models.interfaces import MultiModalFeature, ProcessedPrompt, ProcessorContext, PromptPlan
from models.minicpmv.preprocess import (
    IMAGE_PROCESSORS,
    MODES,
    VIDEO_PROCESSORS,
    PictureLayout,
    SliceConfig,
    image_pixels,
    picture_layout,
    preprocess_picture,
)
from models.processing.base import (
    Expansion,
    Pieces,
    ProcessedCache,
    ProcessorDefaults,
    check_placeholder_count,
    expand_placeholders,
    hashed_and_processed,
    tokenizer_special_tokens,
)
from models.processing.hashing import hash_image, hash_video
from models.processing.options import Choice, Flag, OptionRange, check_mm_kwargs

# The tokenizer attributes transformers' processor reads its token strings from.
TOKENS = ("image_token", "video_token", "image_start_token", "image_end_token",
          "slice_start_token", "slice_end_token", "image_id_start_token", "image_id_end_token")
# The processor's own field (processor_config.json): None defers to the image processor's.
PROCESSOR_SCHEMA = Schema("MiniCPMV4_6Processor", {"use_image_id": None})


@dataclass(frozen=True)
class Picture:
    """One picture of the prompt: its layout and, once processed, its encoder inputs."""

    modality: str
    layout: PictureLayout
    merge: int
    identifier: str = ""
    data: dict | None = None
    part: str = ""


class MiniCPMVProcessor(ProcessorDefaults):
    modalities = ("image", "video")

    def __init__(self, ctx: ProcessorContext) -> None:
        cfg, tok = ctx.hf_config, ctx.tokenizer
        self.model_id, self.tokenizer = ctx.model_id, tok
        self.token = {name: token for name, (_, token) in tokenizer_special_tokens(
            tok, TOKENS, "transformers' MiniCPMV4_6Processor").items()}
        for name, field in (("image_token", "image_token_id"), ("video_token", "video_token_id")):
            if getattr(cfg, field) != self.token[name]:
                raise CheckpointError(
                    f"config.json {field}={getattr(cfg, field)} but the tokenizer's {name} is "
                    f"id {self.token[name]}: transformers would find no placeholder to fill")
        files = ctx.files
        image, video = files.component("image_processor"), files.component("video_processor")
        image_settings = read_settings(image, choose_schema(
            image, IMAGE_PROCESSORS, "MiniCPMV4_6ImageProcessor"))
        video_settings = read_settings(video, choose_schema(
            video, VIDEO_PROCESSORS, "MiniCPMV4_6VideoProcessor", "video_processor_type"))
        own = read_settings(files.processor_fields(), PROCESSOR_SCHEMA)
        self.read = {"image_processor": image_settings, "video_processor": video_settings,
                     "processor": own}
        self.image_cfg = SliceConfig.from_settings(image_settings)
        self.video_cfg = SliceConfig.from_settings(video_settings)
        for settings, pre in ((image_settings, self.image_cfg), (video_settings, self.video_cfg)):
            _check_model(settings, pre, cfg)
        self.use_image_id = bool(own["use_image_id"] if own["use_image_id"] is not None
                                 else image_settings["use_image_id"])
        self.max_num_frames = int(video_settings["max_num_frames"])
        self.newline = tok.encode("\n", add_special_tokens=False)
        largest = max(_nominal_slice(self.image_cfg), _nominal_slice(self.video_cfg))
        self.option_ranges = {
            "max_slice_nums": OptionRange(
                1, max(1, ctx.max_item_embeds // largest - 1), integer=True,
                why="slices per image or video frame: a picture and its slices must fit "
                    "min(encoder_cache_size, max_num_encoder_input_tokens) embeddings in the "
                    "checkpoint's downsample_mode; a larger 4x picture is refused with the "
                    "budget named when its prompt is planned"),
            "max_num_frames": OptionRange(
                1, integer=True, why="frames per video, at most MediaLimits.max_video_frames"),
            "use_image_id": Flag("write <image_id>k</image_id> before each image and video"),
            "downsample_mode": Choice(MODES, "16x: an embedding per 4 x 4 patches, 4x: per 2 x 2"),
        }
        self.cache = ProcessedCache(ctx.processed_cache_items)

    # ---- options ------------------------------------------------------------------------------

    def _options(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        return check_mm_kwargs(mm_kwargs, self.option_ranges, "MiniCPM-V")

    def _configs(self, options: Mapping[str, Any]) -> dict[str, SliceConfig]:
        """The image and video settings a request's options give."""
        change = partial(SliceConfig.with_options, max_slice_nums=options.get("max_slice_nums"),
                         downsample_mode=options.get("downsample_mode"))
        return {"image": change(self.image_cfg), "video": change(self.video_cfg)}

    def loader_kwargs(self, mm_kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Videos sampled a frame per whole second, at most max_num_frames."""
        options = self._options(mm_kwargs)
        return {"video_kwargs": {"fps": 1.0, "spread": "whole_seconds",
                                 "max_frames": options.get("max_num_frames",
                                                           self.max_num_frames)}}

    def max_embeds_per_item(self) -> int:
        """The largest picture of the checkpoint's settings: its overview and max_slice_nums
        slices, each at about scale_resolution^2 pixels (a picture of an extreme aspect ratio
        can round to more; the engine refuses it with the budget named)."""
        return max((cfg.max_slice_nums + 1) * _nominal_slice(cfg)
                   for cfg in (self.image_cfg, self.video_cfg))

    # ---- planning and processing --------------------------------------------------------------

    def plan(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> PromptPlan:
        """The expanded length and each picture's embeddings, from the media's sizes alone."""
        options = self._options(mm_kwargs)
        configs = self._configs(options)
        pictures = {
            "image": [[self._layout("image", i.height, i.width, configs)]
                      for i in media.get("image", [])],
            "video": [[self._layout("video", *v.frames.shape[1:3], configs)] * len(v.frames)
                      for v in media.get("video", [])],
        }
        ids, features = self._expand(token_ids, pictures, options)
        return PromptPlan(len(ids), [(f.modality, f.placeholder.num_embeds) for f in features])

    def process(
        self, token_ids: list[int], media: dict[str, list], mm_kwargs: Mapping[str, Any]
    ) -> ProcessedPrompt:
        options = self._options(mm_kwargs)
        configs = self._configs(options)
        stages: dict[str, float] = {}
        pictures = {
            "image": [[self._image(i, configs["image"], stages)] for i in media.get("image", [])],
            "video": [self._video(v, configs["video"], stages) for v in media.get("video", [])],
        }
        ids, features = self._expand(token_ids, pictures, options)
        return ProcessedPrompt(None, ids, features, None, stages)

    def _layout(self, modality: str, height: int, width: int,
                configs: Mapping[str, SliceConfig]) -> Picture:
        cfg = configs[modality]
        return Picture(modality, picture_layout(height, width, cfg), cfg.merge)

    def _expand(self, token_ids: list[int], pictures: dict[str, list[list[Picture]]],
                options: Mapping[str, Any]) -> tuple[list[int], list[MultiModalFeature]]:
        """Each placeholder replaced by its item's text; one feature per picture, in prompt
        order (a picture not yet processed: no identifier, no data)."""
        pads = {self.token["image_token"]: "image", self.token["video_token"]: "video"}
        check_placeholder_count(token_ids, pads, pictures)
        use_id = options.get("use_image_id", self.use_image_id)
        counts = {"image": 0, "video": 0}

        def spans(modality: str, item: list[Picture]) -> Pieces:
            pieces: list[Expansion | list[int]] = []
            if use_id:
                pieces.append(self._id_tag(counts[modality]))
            counts[modality] += 1
            pad = self.token[f"{modality}_token"]
            for picture in item:
                run = self._picture_tokens(pad, picture)
                pieces.append(Expansion(run, tuple(t == pad for t in run),
                                        self._parts(run, picture), picture.identifier,
                                        picture.data, part=picture.part))
            return pieces

        return expand_placeholders(token_ids, pads, pictures, spans)

    def _parts(self, run: list[int], picture: Picture) -> tuple[tuple[str, int], ...]:
        """For display: the overview (with its `<image>` and `</image>`), then the slices."""
        rows, cols = picture.layout.grid
        if not rows:
            return ()
        split = run.index(self.token["slice_start_token"])
        return (("overview", split), (f"slices {rows}x{cols}", len(run) - split))

    def _id_tag(self, k: int) -> list[int]:
        return [self.token["image_id_start_token"],
                *self.tokenizer.encode(str(k), add_special_tokens=False),
                self.token["image_id_end_token"]]

    def _picture_tokens(self, pad: int, picture: Picture) -> list[int]:
        """`<image>` + the overview's pads + `</image>`, then the slices row by row."""
        t = self.token
        overview, *slices = picture.layout.embeddings(picture.merge)
        out = [t["image_start_token"], *[pad] * overview, t["image_end_token"]]
        rows, cols = picture.layout.grid
        for r in range(rows):
            if r:
                out += self.newline
            for n in slices[r * cols:(r + 1) * cols]:
                out += [t["slice_start_token"], *[pad] * n, t["slice_end_token"]]
        return out

    # ---- pixels -------------------------------------------------------------------------------

    def _image(self, image, cfg: SliceConfig, stages: dict[str, float]) -> Picture:
        def compute() -> dict:
            pixels, layout = preprocess_picture(image_pixels(image, cfg), cfg)
            return _inputs(pixels, layout, cfg)

        identify = partial(hash_image, image, model_id=self.model_id,
                           processor_kwargs=_hash_options(cfg))
        identifier, data = hashed_and_processed(self.cache, identify, compute, stages)
        return Picture("image", data["layout"], cfg.merge, identifier, data)

    def _video(self, video, cfg: SliceConfig, stages: dict[str, float]) -> list[Picture]:
        """One picture per frame, each an encoder item of its own."""
        def compute() -> list[dict]:
            return [_inputs(*preprocess_picture(frame, cfg), cfg) for frame in video.frames]

        identify = partial(hash_video, video, model_id=self.model_id,
                           processor_kwargs=_hash_options(cfg))
        identifier, frames = hashed_and_processed(self.cache, identify, compute, stages)
        return [Picture("video", d["layout"], cfg.merge, f"{identifier}:f{i}", d,
                        part=f"frame {i} at {t:.1f} s")
                for i, (d, t) in enumerate(zip(frames, video.timestamps, strict=True))]


def _inputs(pixels, layout: PictureLayout, cfg: SliceConfig) -> dict:
    """A picture's encoder inputs (models/minicpmv/model.py reads them)."""
    return {"pixel_values": pixels, "patch_grids": layout.patch_grids,
            "merged": cfg.downsample_mode == "16x", "layout": layout}


def _hash_options(cfg: SliceConfig) -> dict[str, Any]:
    """What a request may change of a picture's embeddings (the rest is the checkpoint's)."""
    return {"max_slice_nums": cfg.max_slice_nums, "downsample_mode": cfg.downsample_mode}


def _nominal_slice(cfg: SliceConfig) -> int:
    """Embeddings of a square picture of scale_resolution, rounded up to the merge step: about
    what one slice or an overview holds."""
    step = cfg.patch_size * cfg.merge
    side = -(-cfg.scale_resolution // step) * step // cfg.patch_size
    return side * side // cfg.merge**2


def _check_model(settings, pre: SliceConfig, hf_config) -> None:
    """Refuse a processor whose pictures the model cannot take (transformers would fail on the
    first one): another patch size than the tower's, another downsample mode than the model's."""
    patch = hf_config.vision_config.patch_size
    if pre.patch_size != patch:
        raise CheckpointError(f"{settings.sources['patch_size']}: patch_size={pre.patch_size} "
                              f"but the tower's is {patch} (config.json vision_config)")
    if pre.downsample_mode != hf_config.downsample_mode:
        raise CheckpointError(
            f"{settings.sources['downsample_mode']}: downsample_mode={pre.downsample_mode!r} "
            f"but config.json downsample_mode={hf_config.downsample_mode!r}: the placeholders "
            "would not match the embeddings")

