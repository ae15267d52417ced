"""What a projector file (`mmproj-*.gguf`: llama.cpp's converter's `--mmproj` output, a vision or
audio tower and its projector, as LM Studio and llama.cpp users hold them) describes: from its
`clip.*` metadata, the multimodal architecture it belongs to, its tower's transformers config
fields and its processor's settings, each with the metadata key (or the tensor, or the class
default) it came from; with the text model's GGUF (models/gguf/config.py), the whole
multimodal config.

llama.cpp's converter writes, per projector type (`clip.projector_type`), the tower's widths and
depth, image size and patch, mean and std, the merge size, and the few settings that differ
between a family's checkpoints; the rest of a family's config is fixed by llama.cpp per type,
as it is by transformers' classes: a setting absent from the file takes the transformers
class's default (which for every setting read here is also llama.cpp's value). Token ids a
multimodal config holds (the image placeholder, ...) are the text file's vocabulary entries of
those tokens, by name.

Refused by name, before anything loads: a file that is not a projector, a projector type we do
not read, a `clip.*` key that no reader here asked for (it would change the model), a value we
do not compute with (a norm epsilon other than the tower's), and a projector of another family
than the text file (its text architecture, its projection width, a placeholder token its
vocabulary lacks).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.checkpoint import Found
from models.gguf.archs import PROJECTOR_ARCH
from models.gguf.config import GGUFConfig
from models.gguf.reader import GGUFError, GGUFFile

_REQUIRED = object()
# Keys of every projector read for what they say about the file, not the model.
_DESCRIPTIVE = ("general.",)
# Flags older converters (llama.cpp's per-family surgery scripts) wrote, accepted with the value
# that changes nothing here: no text encoder and no projector of another kind.
_LEGACY_FLAGS = {"clip.has_text_encoder": False, "clip.has_llava_projector": False,
                 "clip.has_minicpmv_projector": False, "clip.has_glm_projector": False}


class _Keys:
    """A projector's metadata as the readers ask for it; a `clip.*` key nobody asked for is
    refused afterwards (see `unread`)."""

    def __init__(self, file: GGUFFile) -> None:
        self.file, self.name = file, file.path.name
        self.asked: set[str] = set()

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        self.asked.add(key)
        if key in self.file.metadata:
            value = self.file.metadata[key]
            return value.tolist() if isinstance(value, np.ndarray) else value
        if default is _REQUIRED:
            raise GGUFError(f"{self.name}: metadata has no {key}, which a "
                            f"{self.kind} projector needs")
        return default

    def source(self, key: str) -> str:
        return f"{self.name}: {key}"

    def expect(self, key: str, value: Any, what: str) -> None:
        """`key` may be absent; present, it must be `value` (approximately, for floats)."""
        got = self.get(key, None)
        if got is None:
            return
        same = (abs(float(got) - float(value)) <= 1e-6 * abs(float(value))
                if isinstance(value, float) else got == value)
        if not same:
            raise GGUFError(f"{self.name}: {key}={got!r}, but {what} is {value!r} (the only "
                            "value mmserve computes with); refusing rather than computing a "
                            "different tower")

    def unread(self) -> list[str]:
        return sorted(k for k in self.file.metadata
                      if not k.startswith(_DESCRIPTIVE) and k not in self.asked)

    kind = ""


@dataclass
class _Built:
    """What a projector reader fills: config fields ("vision_config.depth"), processor
    components' settings, and the source of each."""

    keys: _Keys
    text: GGUFFile
    fields: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    components: dict[str, dict[str, Any]] = field(default_factory=dict)
    origins: dict[str, dict[str, str]] = field(default_factory=dict)

    def set(self, path: str, value: Any, source: str) -> Any:
        self.fields[path], self.sources[path] = value, source
        return value

    def key(self, path: str, key: str, default: Any = _REQUIRED,
            default_source: str = "") -> Any:
        """Config field `path` from metadata `key` (or `default`, said by `default_source`)."""
        value = self.keys.get(key, default)
        present = key in self.keys.file.metadata
        return self.set(path, value, self.keys.source(key) if present else default_source)

    def setting(self, component: str, name: str, value: Any, source: str) -> None:
        self.components.setdefault(component, {})[name] = value
        self.origins.setdefault(component, {})[name] = source

    def token(self, path: str, token: str, what: str) -> int:
        """Config field `path`: the id of `token` in the text file's vocabulary."""
        tokens = self.text.metadata.get("tokenizer.ggml.tokens") or []
        try:
            index = tokens.index(token)
        except ValueError:
            raise GGUFError(
                f"{self.text.path.name}: the vocabulary has no {token!r} token, which is "
                f"{what} of a {self.keys.kind} model: {self.keys.name} is a projector of "
                "another family than this text model") from None
        return self.set(path, index, f"{self.text.path.name}: tokenizer.ggml.tokens ({token})")

    def tensor_rows(self, path: str, tensor: str) -> int:
        info = self.keys.file.tensor_by_name.get(tensor)
        if info is None:
            raise GGUFError(f"{self.keys.name}: no tensor {tensor}, which a {self.keys.kind} "
                            "projector holds")
        return self.set(path, info.shape[0], f"{self.keys.name}: tensor {tensor} (its rows)")


@dataclass(frozen=True)
class ProjectorSpec:
    """One projector type: the multimodal architecture it belongs to and how its metadata
    becomes that architecture's config and processor settings."""

    architecture: str  # transformers' architecture of the whole model
    model_type: str  # its config's model_type
    text_model_type: str  # its text_config's model_type
    text_archs: tuple[str, ...]  # the text GGUF's general.architecture it pairs with
    modalities: tuple[str, ...]  # its towers: "vision", "audio"
    read: Callable[[_Built], None]


@dataclass(frozen=True)
class ProjectorConfig:
    """A projector file read against its text model: the multimodal config's fields (dotted
    paths, text_config aside), the processor's components (`image_processor`, ...) and own
    fields as Found settings, and where each came from."""

    file: GGUFFile
    kind: str  # clip.projector_type, e.g. "qwen2.5vl_merger"
    spec: ProjectorSpec
    fields: dict[str, Any]
    sources: dict[str, str]
    components: dict[str, Found]
    processor: Found
    text_name: str  # the text model's file name


def read_projector(file: GGUFFile, text_file: GGUFFile, text: GGUFConfig) -> ProjectorConfig:
    """`file` read as the projector of the text model `text_file` (config `text`); a
    GGUFError naming the key, tensor or type for anything refused (module docstring)."""
    name = file.path.name
    if file.architecture != PROJECTOR_ARCH:
        raise GGUFError(f"{name}: general.architecture={file.architecture!r}, not "
                        f"{PROJECTOR_ARCH!r}: not a projector (mmproj) file")
    keys = _Keys(file)
    kind = keys.get("clip.projector_type", None)
    if kind is None:
        vision = keys.get("clip.vision.projector_type", None)
        audio = keys.get("clip.audio.projector_type", None)
        raise GGUFError(f"{name}: a projector with a vision tower ({vision}) and an audio "
                        f"tower ({audio}) apart is not read by mmserve (its types: "
                        f"{', '.join(sorted(SPECS))})")
    spec = SPECS.get(kind)
    if spec is None:
        raise GGUFError(f"{name}: clip.projector_type={kind!r} is not a projector type mmserve "
                        f"reads ({', '.join(sorted(SPECS))})")
    keys.kind = kind
    if text_file.architecture not in spec.text_archs:
        raise GGUFError(
            f"{name} is a {kind} projector, whose text model is a GGUF of architecture "
            f"{' or '.join(spec.text_archs)}; {text_file.path.name} is "
            f"{text_file.architecture!r}: a projector of another family than the text model")
    for modality in ("vision", "audio"):
        keys.expect(f"clip.has_{modality}_encoder", modality in spec.modalities,
                    f"whether a {kind} projector has a {modality} tower")
    for key, value in _LEGACY_FLAGS.items():
        keys.expect(key, value, f"what a {kind} projector holds")
    keys.expect("clip.has_qwen2vl_merger", kind in ("qwen2vl_merger", "qwen2.5vl_merger"),
                f"what a {kind} projector holds")
    hidden = text.values.get("hidden_size")
    for modality in spec.modalities:
        width = keys.get(f"clip.{modality}.projection_dim")
        if width != hidden:
            raise GGUFError(
                f"{name}: clip.{modality}.projection_dim={width}, but {text_file.path.name}'s "
                f"embeddings are {hidden} wide ({text.sources.get('hidden_size')}): a "
                "projector of another model than the text model")
    built = _Built(keys, text_file)
    spec.read(built)
    unread = keys.unread()
    if unread:
        raise GGUFError(
            f"{name}: metadata {', '.join(f'{k}={_short(file.metadata[k])}' for k in unread)} "
            f"is not read for a {kind} projector by mmserve; refusing rather than computing a "
            "different tower")
    components = {c: Found(data, name, built.origins[c]) for c, data in built.components.items()
                  if c != "processor"}
    processor = Found(built.components.get("processor", {}), name,
                      built.origins.get("processor", {}))
    return ProjectorConfig(file, kind, spec, built.fields, built.sources, components, processor,
                           text_file.path.name)


# ---- readers per projector type ---------------------------------------------------------------

V, A = "vision_config.", "audio_config."
_ABSENT = "not in the file: default of {}"


def _tower_eps(b: _Built, value: float, tower: str) -> None:
    b.keys.expect("clip.vision.attention.layer_norm_epsilon", value,
                  f"the norm epsilon transformers' {tower} fixes")


def _temporal_patch(b: _Built, path: str) -> None:
    """Qwen towers patch two frames at once: the converter splits the 3-D patch kernel into
    `v.patch_embd.weight` and `.weight.1` (and writes nothing else)."""
    if "v.patch_embd.weight.1" not in b.keys.file.tensor_by_name:
        raise GGUFError(f"{b.keys.name}: no tensor v.patch_embd.weight.1 (the second frame of a "
                        f"{b.keys.kind} tower's patch kernel)")
    b.set(path, 2, f"{b.keys.name}: tensors v.patch_embd.weight and .weight.1 (two frames)")


def _qwen_vision_processor(b: _Built, image_class: str, video_class: str) -> None:
    """Image and video processor settings of a Qwen tower: patch, merge, frames per patch,
    mean and std; the pixel budget where the file states one (else the classes' defaults)."""
    keys = b.keys
    settings = {"patch_size": (b.fields[V + "patch_size"], b.sources[V + "patch_size"]),
                "merge_size": (b.fields[V + "spatial_merge_size"],
                               b.sources[V + "spatial_merge_size"]),
                "temporal_patch_size": (2, b.sources[V + "temporal_patch_size"]),
                "image_mean": (keys.get("clip.vision.image_mean"),
                               keys.source("clip.vision.image_mean")),
                "image_std": (keys.get("clip.vision.image_std"),
                              keys.source("clip.vision.image_std"))}
    for key, name in (("clip.vision.image_min_pixels", "min_pixels"),
                      ("clip.vision.image_max_pixels", "max_pixels")):
        if keys.get(key, None) is not None:
            settings[name] = (keys.get(key), keys.source(key))
    for component, cls, type_key in (("image_processor", image_class, "image_processor_type"),
                                     ("video_processor", video_class, "video_processor_type")):
        b.setting(component, type_key, cls, f"projector type {keys.kind}")
        for name, (value, source) in settings.items():
            if component == "video_processor" and name in ("min_pixels", "max_pixels"):
                continue  # the file's budget is an image's
            b.setting(component, name, value, source)
    # The size libmtmd warms its graph up with; it bounds nothing.
    keys.get("clip.vision.image_size")


def _qwen_vision_tokens(b: _Built) -> None:
    b.token("image_token_id", "<|image_pad|>", "the image placeholder")
    b.token("video_token_id", "<|video_pad|>", "the video placeholder")
    b.token("vision_start_token_id", "<|vision_start|>", "the start of a vision span")
    b.token("vision_end_token_id", "<|vision_end|>", "the end of a vision span")


def _keys(b: _Built, prefix: str, fields: dict[str, str]) -> dict[str, Any]:
    """Config fields `prefix` + name, each from its (required) metadata key."""
    return {name: b.key(prefix + name, key) for name, key in fields.items()}


# A Qwen tower's widths and depth (Qwen2.5-VL's, Qwen2.5-Omni's and Qwen3-VL's config fields).
_QWEN_TOWER = {"depth": "clip.vision.block_count", "hidden_size": "clip.vision.embedding_length",
               "intermediate_size": "clip.vision.feed_forward_length",
               "num_heads": "clip.vision.attention.head_count",
               "out_hidden_size": "clip.vision.projection_dim",
               "patch_size": "clip.vision.patch_size"}
# A SigLIP-style tower's (Gemma 3's, Pixtral's config fields).
_SIGLIP_TOWER = {"hidden_size": "clip.vision.embedding_length",
                 "intermediate_size": "clip.vision.feed_forward_length",
                 "num_hidden_layers": "clip.vision.block_count",
                 "num_attention_heads": "clip.vision.attention.head_count",
                 "image_size": "clip.vision.image_size", "patch_size": "clip.vision.patch_size"}
# A Whisper-style audio encoder's (Qwen2-Audio's and Qwen2.5-Omni's config fields).
_WHISPER_ENCODER = {"d_model": "clip.audio.embedding_length",
                    "encoder_ffn_dim": "clip.audio.feed_forward_length",
                    "encoder_layers": "clip.audio.block_count",
                    "encoder_attention_heads": "clip.audio.attention.head_count",
                    "num_mel_bins": "clip.audio.num_mel_bins"}


def _whisper_encoder(b: _Built, model: str) -> None:
    """The audio encoder's fields, its positions (the rows of its table) and the Whisper
    feature extractor reading its mel bins; `model` names transformers' class in errors."""
    mels = _keys(b, A, _WHISPER_ENCODER)["num_mel_bins"]
    b.tensor_rows(A + "max_source_positions", "a.position_embd.weight")
    b.keys.expect("clip.audio.attention.layer_norm_epsilon", 1e-5,
                  f"the norm epsilon of transformers' {model} audio encoder")
    b.setting("feature_extractor", "feature_extractor_type", "WhisperFeatureExtractor",
              f"projector type {b.keys.kind}")
    b.setting("feature_extractor", "feature_size", mels, b.keys.source("clip.audio.num_mel_bins"))


def _image_mean_std(b: _Built) -> None:
    for name in ("image_mean", "image_std"):
        b.setting("image_processor", name, b.keys.get(f"clip.vision.{name}"),
                  b.keys.source(f"clip.vision.{name}"))


def _merge(b: _Built, config_class: str) -> None:
    b.key(V + "spatial_merge_size", "clip.vision.spatial_merge_size", 2,
          _ABSENT.format(config_class))


def _read_qwen2vl(b: _Built) -> None:
    cls = "Qwen2VLVisionConfig"
    b.key(V + "depth", "clip.vision.block_count")
    embed = b.key(V + "embed_dim", "clip.vision.embedding_length")
    b.key(V + "num_heads", "clip.vision.attention.head_count")
    b.key(V + "hidden_size", "clip.vision.projection_dim")
    ffn = b.keys.get("clip.vision.feed_forward_length")
    if ffn % embed:
        raise GGUFError(f"{b.keys.name}: clip.vision.feed_forward_length={ffn} is not a whole "
                        f"multiple of {embed} (Qwen2VLVisionConfig's mlp_ratio)")
    b.set(V + "mlp_ratio", ffn // embed, b.keys.source("clip.vision.feed_forward_length")
          + " / clip.vision.embedding_length")
    b.key(V + "patch_size", "clip.vision.patch_size")
    _merge(b, cls)
    _temporal_patch(b, V + "temporal_patch_size")
    _tower_eps(b, 1e-6, "Qwen2-VL tower")
    _qwen_vision_tokens(b)
    _qwen_vision_processor(b, "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor")


def _read_qwen25vl(b: _Built) -> None:
    _qwen25_tower(b, "Qwen2_5_VLVisionConfig")
    _qwen_vision_tokens(b)
    _qwen_vision_processor(b, "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor")


def _qwen25_tower(b: _Built, cls: str) -> None:
    """Qwen2.5-VL's tower (also Qwen2.5-Omni's)."""
    depth = _keys(b, V, _QWEN_TOWER)["depth"]
    _merge(b, cls)
    _temporal_patch(b, V + "temporal_patch_size")
    b.key(V + "window_size", "clip.vision.window_size", 112, _ABSENT.format(cls))
    # Every n-th block attends to the whole image, the others within windows.
    pattern = b.keys.get("clip.vision.n_wa_pattern")
    b.set(V + "fullatt_block_indexes", [i for i in range(depth) if (i + 1) % pattern == 0],
          b.keys.source("clip.vision.n_wa_pattern") + " (blocks n-1, 2n-1, ...)")
    b.keys.expect("clip.use_silu", True, "Qwen2.5-VL's tower activation (SiLU)")
    _tower_eps(b, 1e-6, "Qwen2.5-VL tower")


def _read_qwen25o(b: _Built) -> None:
    """Qwen2.5-Omni's thinker: Qwen2.5-VL's tower and a Whisper encoder with its own
    projection (to the text width) and last norm."""
    _qwen25_tower(b, "Qwen2_5OmniVisionEncoderConfig")
    _whisper_encoder(b, "Qwen2.5-Omni")
    b.key(A + "output_dim", "clip.audio.projection_dim")
    for path, token, what in (
            ("image_token_index", "<|IMAGE|>", "the image placeholder"),
            ("video_token_index", "<|VIDEO|>", "the video placeholder"),
            ("audio_token_index", "<|AUDIO|>", "the audio placeholder"),
            ("vision_start_token_id", "<|vision_bos|>", "the start of a vision span"),
            ("vision_end_token_id", "<|vision_eos|>", "the end of a vision span"),
            ("audio_start_token_id", "<|audio_bos|>", "the start of an audio span"),
            ("audio_end_token_id", "<|audio_eos|>", "the end of an audio span")):
        b.token(path, token, what)
    _qwen_vision_processor(b, "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor")


def _read_qwen3vl(b: _Built) -> None:
    cls = "Qwen3VLVisionConfig"
    tower = _keys(b, V, _QWEN_TOWER)
    depth, patch = tower["depth"], tower["patch_size"]
    _merge(b, cls)
    _temporal_patch(b, V + "temporal_patch_size")
    positions = b.tensor_rows(V + "num_position_embeddings", "v.position_embd.weight")
    if int(positions**0.5 * patch) != b.keys.get("clip.vision.image_size"):
        raise GGUFError(f"{b.keys.name}: clip.vision.image_size contradicts the "
                        f"{positions} learned positions of {patch}-px patches")
    layers = b.keys.get("clip.vision.is_deepstack_layers", [False] * depth)
    if len(layers) != depth:
        raise GGUFError(f"{b.keys.name}: clip.vision.is_deepstack_layers has {len(layers)} "
                        f"entries for {depth} blocks")
    b.set(V + "deepstack_visual_indexes", [i for i, on in enumerate(layers) if on],
          b.keys.source("clip.vision.is_deepstack_layers"))
    b.keys.expect("clip.use_gelu", True, "Qwen3-VL's tower activation (tanh GELU)")
    _tower_eps(b, 1e-6, "Qwen3-VL tower")
    _qwen_vision_tokens(b)
    _qwen_vision_processor(b, "Qwen2VLImageProcessor", "Qwen3VLVideoProcessor")


def _read_gemma3(b: _Built) -> None:
    tower = _keys(b, V, _SIGLIP_TOWER)
    size, patch = tower["image_size"], tower["patch_size"]
    b.key(V + "layer_norm_eps", "clip.vision.attention.layer_norm_epsilon")
    b.set(V + "vision_use_head", False, f"{b.keys.name}: no pooling head (Gemma 3 reads none)")
    b.keys.expect("clip.use_gelu", True, "SigLIP's activation (tanh GELU)")
    # The projector pools each side's patches by this factor (llama.cpp's and Gemma 3's 4).
    pool = b.keys.get("clip.vision.projector.scale_factor", 4)
    if (size // patch) % pool:
        raise GGUFError(f"{b.keys.name}: {size // patch} patches a side do not pool by "
                        f"{pool} (clip.vision.projector.scale_factor)")
    tokens = b.set("mm_tokens_per_image", (size // patch // pool) ** 2,
                   f"{b.keys.name}: (clip.vision.image_size / patch_size / "
                   f"clip.vision.projector.scale_factor, {pool}) squared")
    b.token("boi_token_index", "<start_of_image>", "the start of an image")
    b.token("eoi_token_index", "<end_of_image>", "the end of an image")
    b.token("image_token_index", "<image_soft_token>", "the image placeholder")
    keys = b.keys
    b.setting("image_processor", "image_processor_type", "Gemma3ImageProcessor",
              f"projector type {keys.kind}")
    b.setting("image_processor", "size", {"height": size, "width": size},
              keys.source("clip.vision.image_size"))
    _image_mean_std(b)
    b.setting("processor", "image_seq_length", tokens, b.sources["mm_tokens_per_image"])


def _read_qwen2a(b: _Built) -> None:
    _whisper_encoder(b, "Qwen2-Audio")
    b.token("audio_token_id", "<|AUDIO|>", "the audio placeholder")


def _read_pixtral(b: _Built) -> None:
    keys = b.keys
    tower = _keys(b, V, _SIGLIP_TOWER)
    size, patch = tower["image_size"], tower["patch_size"]
    gelu, silu = keys.get("clip.use_gelu", False), keys.get("clip.use_silu", False)
    if gelu == silu:
        raise GGUFError(f"{keys.name}: clip.use_gelu={gelu} and clip.use_silu={silu}: a "
                        "pixtral tower's activation is one of them")
    b.set(V + "hidden_act", "gelu" if gelu else "silu",
          keys.source("clip.use_gelu" if gelu else "clip.use_silu"))
    keys.expect("clip.vision.attention.layer_norm_epsilon", 1e-5,
                "the norm epsilon transformers' Pixtral tower fixes")
    merge = b.key("spatial_merge_size", "clip.vision.spatial_merge_size")
    if "mm.patch_merger.weight" not in keys.file.tensor_by_name:
        raise GGUFError(f"{keys.name}: no tensor mm.patch_merger.weight: a pixtral projector "
                        "without Mistral 3's patch merger (Pixtral-12B's) is not read")
    b.set("multimodal_projector_bias", "mm.1.bias" in keys.file.tensor_by_name,
          f"{keys.name}: tensor mm.1.bias (present or not)")
    b.token("image_token_index", "[IMG]", "the image placeholder")
    b.setting("image_processor", "image_processor_type", "PixtralImageProcessor",
              f"projector type {keys.kind}")
    b.setting("image_processor", "size", {"longest_edge": size},
              keys.source("clip.vision.image_size"))
    b.setting("image_processor", "patch_size", {"height": patch, "width": patch},
              keys.source("clip.vision.patch_size"))
    _image_mean_std(b)
    b.setting("processor", "patch_size", patch, keys.source("clip.vision.patch_size"))
    b.setting("processor", "spatial_merge_size", merge,
              keys.source("clip.vision.spatial_merge_size"))


SPECS = {
    "qwen2vl_merger": ProjectorSpec("Qwen2VLForConditionalGeneration", "qwen2_vl",
                                    "qwen2_vl_text", ("qwen2vl",), ("vision",), _read_qwen2vl),
    "qwen2.5vl_merger": ProjectorSpec("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl",
                                      "qwen2_5_vl_text", ("qwen2vl",), ("vision",), _read_qwen25vl),
    "qwen3vl_merger": ProjectorSpec("Qwen3VLForConditionalGeneration", "qwen3_vl",
                                    "qwen3_vl_text", ("qwen3vl",), ("vision",), _read_qwen3vl),
    "gemma3": ProjectorSpec("Gemma3ForConditionalGeneration", "gemma3", "gemma3_text",
                            ("gemma3",), ("vision",), _read_gemma3),
    "qwen2a": ProjectorSpec("Qwen2AudioForConditionalGeneration", "qwen2_audio", "qwen2",
                            ("qwen2",), ("audio",), _read_qwen2a),
    "qwen2.5o": ProjectorSpec("Qwen2_5OmniThinkerForConditionalGeneration",
                              "qwen2_5_omni_thinker", "qwen2_5_omni_text", ("qwen2vl",),
                              ("vision", "audio"), _read_qwen25o),
    "pixtral": ProjectorSpec("Mistral3ForConditionalGeneration", "mistral3", "mistral",
                             ("mistral3",), ("vision",), _read_pixtral),
}


def multimodal_values(text: GGUFConfig, projector: ProjectorConfig
                      ) -> tuple[dict[str, Any], dict[str, str]]:
    """The keyword arguments of the multimodal config (`AutoConfig.for_model(**values)`) the
    text model and its projector make, and the source of each field (dotted paths)."""
    spec, text_file = projector.spec, projector.text_name
    text_values = {k: v for k, v in text.values.items() if k != "model_type"}
    text_values["model_type"] = spec.text_model_type
    sources = {f"text_config.{k}": f"{text_file}: {s}" for k, s in text.sources.items()
               if k != "model_type"}
    sections = text.extra.get("rope.dimension_sections")
    if sections is not None:
        # llama.cpp pads the three bands (temporal, height, width) with a fourth of 0.
        bands = [int(x) for x in np.asarray(sections).tolist()]
        if len(bands) != 4 or bands[3] != 0:
            raise GGUFError(f"{text_file}: rope.dimension_sections={bands} are not the three "
                            f"mRoPE bands of a {spec.model_type} model")
        rope = {"rope_type": "default", "rope_theta": text_values.pop("rope_theta", None),
                "mrope_section": bands[:3]}
        if rope["rope_theta"] is None:
            rope.pop("rope_theta")
        if spec.model_type == "qwen3_vl":  # its bands interleave (llama.cpp's imrope)
            rope["mrope_interleaved"] = True
        text_values["rope_parameters"] = rope
        theta = sources.pop("text_config.rope_theta", "the class default")
        sources["text_config.rope_parameters"] = (
            f"{text_file}: rope.dimension_sections (bands); {theta} (theta)")
    deepstack = text.extra.get("n_deepstack_layers")
    indexes = projector.fields.get(V + "deepstack_visual_indexes")
    if indexes is not None and int(deepstack or 0) != len(indexes):
        raise GGUFError(f"{text_file}: n_deepstack_layers={deepstack}, but "
                        f"{projector.file.path.name} feeds {len(indexes)} DeepStack layers: a "
                        "projector of another model than the text model")
    values: dict[str, Any] = {"model_type": spec.model_type, "text_config": text_values,
                              "tie_word_embeddings": text_values["tie_word_embeddings"]}
    sources["tie_word_embeddings"] = sources["text_config.tie_word_embeddings"]
    for path, value in projector.fields.items():
        head, _, rest = path.partition(".")
        if rest:
            values.setdefault(head, {})[rest] = value
        else:
            values[head] = value
    sources.update(projector.sources)
    return values, sources


def _short(value: Any) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray) else value)
    return text if len(text) <= 60 else text[:57] + "..."
