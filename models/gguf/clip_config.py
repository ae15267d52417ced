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

from dataclasses import dataclass
from typing import Any

import numpy as np

from models.checkpoint import Found
from models.gguf.archs import PROJECTOR_ARCH
from models.gguf.clip_families import SPECS, ProjectorSpec, V
from models.gguf.clip_keys import ProjectorBuild, ProjectorKeys
from models.gguf.config import GGUFConfig
from models.gguf.reader import GGUFError, GGUFFile

# Flags older converters (llama.cpp's per-family surgery scripts) wrote, accepted with the value
# that changes nothing here: no text encoder and no projector of another kind.
_LEGACY_FLAGS = {"clip.has_text_encoder": False, "clip.has_llava_projector": False,
                 "clip.has_minicpmv_projector": False, "clip.has_glm_projector": False}


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
    keys = ProjectorKeys(file)
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
    built = ProjectorBuild(keys, text_file)
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
