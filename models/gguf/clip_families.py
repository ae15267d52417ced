"""The readers of each projector type (`clip.projector_type`) llama.cpp's converter writes: how a
type's `clip.*` metadata, tensors and the text file's vocabulary become the transformers config
fields and processor settings of its multimodal architecture (`SPECS`). Settings the file does
not state take the transformers class's default, said as the source (models/gguf/clip_config.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from models.gguf.clip_keys import ProjectorBuild
from models.gguf.reader import GGUFError


@dataclass(frozen=True)
class ProjectorSpec:
    """One projector type: the multimodal architecture it belongs to and how its metadata
    becomes that architecture's config and processor settings."""

    architecture: str  # transformers' architecture of the whole model
    model_type: str  # its config's model_type
    text_model_type: str  # its text_config's model_type
    text_archs: tuple[str, ...]  # the text GGUF's general.architecture it pairs with
    modalities: tuple[str, ...]  # its towers: "vision", "audio"
    read: Callable[[ProjectorBuild], None]



V, A = "vision_config.", "audio_config."
_ABSENT = "not in the file: default of {}"


def _tower_eps(b: ProjectorBuild, value: float, tower: str) -> None:
    b.keys.expect("clip.vision.attention.layer_norm_epsilon", value,
                  f"the norm epsilon transformers' {tower} fixes")


def _temporal_patch(b: ProjectorBuild, path: str) -> None:
    """Qwen towers patch two frames at once: the converter splits the 3-D patch kernel into
    `v.patch_embd.weight` and `.weight.1` (and writes nothing else)."""
    if "v.patch_embd.weight.1" not in b.keys.file.tensor_by_name:
        raise GGUFError(f"{b.keys.name}: no tensor v.patch_embd.weight.1 (the second frame of a "
                        f"{b.keys.kind} tower's patch kernel)")
    b.set(path, 2, f"{b.keys.name}: tensors v.patch_embd.weight and .weight.1 (two frames)")


def _qwen_vision_processor(b: ProjectorBuild, image_class: str, video_class: str) -> None:
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


def _qwen_vision_tokens(b: ProjectorBuild) -> None:
    b.token("image_token_id", "<|image_pad|>", "the image placeholder")
    b.token("video_token_id", "<|video_pad|>", "the video placeholder")
    b.token("vision_start_token_id", "<|vision_start|>", "the start of a vision span")
    b.token("vision_end_token_id", "<|vision_end|>", "the end of a vision span")


def _keys(b: ProjectorBuild, prefix: str, fields: dict[str, str]) -> dict[str, Any]:
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


def _whisper_encoder(b: ProjectorBuild, model: str) -> None:
    """The audio encoder's fields, its positions (the rows of its table) and the Whisper
    feature extractor reading its mel bins; `model` names transformers' class in errors."""
    mels = _keys(b, A, _WHISPER_ENCODER)["num_mel_bins"]
    b.tensor_rows(A + "max_source_positions", "a.position_embd.weight")
    b.keys.expect("clip.audio.attention.layer_norm_epsilon", 1e-5,
                  f"the norm epsilon of transformers' {model} audio encoder")
    b.setting("feature_extractor", "feature_extractor_type", "WhisperFeatureExtractor",
              f"projector type {b.keys.kind}")
    b.setting("feature_extractor", "feature_size", mels, b.keys.source("clip.audio.num_mel_bins"))


def _image_mean_std(b: ProjectorBuild) -> None:
    for name in ("image_mean", "image_std"):
        b.setting("image_processor", name, b.keys.get(f"clip.vision.{name}"),
                  b.keys.source(f"clip.vision.{name}"))


def _merge(b: ProjectorBuild, config_class: str) -> None:
    b.key(V + "spatial_merge_size", "clip.vision.spatial_merge_size", 2,
          _ABSENT.format(config_class))


def _read_qwen2vl(b: ProjectorBuild) -> None:
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


def _read_qwen25vl(b: ProjectorBuild) -> None:
    _qwen25_tower(b, "Qwen2_5_VLVisionConfig")
    _qwen_vision_tokens(b)
    _qwen_vision_processor(b, "Qwen2VLImageProcessor", "Qwen2VLVideoProcessor")


def _qwen25_tower(b: ProjectorBuild, cls: str) -> None:
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


def _read_qwen25o(b: ProjectorBuild) -> None:
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


def _read_qwen3vl(b: ProjectorBuild) -> None:
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


def _read_gemma3(b: ProjectorBuild) -> None:
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


def _read_qwen2a(b: ProjectorBuild) -> None:
    _whisper_encoder(b, "Qwen2-Audio")
    b.token("audio_token_id", "<|AUDIO|>", "the audio placeholder")


def _read_pixtral(b: ProjectorBuild) -> None:
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
