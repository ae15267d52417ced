"""Phi-4-multimodal through the whole engine, against transformers' Phi4MultimodalForCausalLM with
the checkpoint's own LoRA adapters loaded by PEFT (vision-lora set for requests with an image,
speech-lora for audio, none for text), on a tiny random checkpoint (testing/phi4mm.py: real
448-pixel crop geometry on a narrow tower, a two-block conformer, longrope with partial rotary).

transformers' image processor needs torchvision, which cannot be installed here: the reference
model gets our crops, masks and sizes (their token counts are checked against the rule
transformers' processor counts with); audio features come from transformers' own
Phi4MultimodalFeatureExtractor and must equal ours. Greedy tokens identical and top-3
log-probabilities within 1e-3 for an image, audio, an image with audio (the "vision" audio
projection), text only, a clip longer than the encoder's 500-position window, and a batch mixing
an image, audio and text (three adapters, none among them, in one step) under a small chunk
budget; encoder-cache and prefix-cache hits.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import (
    assert_matches_reference,
    assert_released,
    count_calls,
    greedy,
    hf_greedy,
    process_chat,
    random_image,
    user,
)

N = 6
GREEDY = greedy(N, logprobs=3)


def tone(seconds: float, seed: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    wave = 0.3 * np.sin(2 * np.pi * (300 + 100 * seed) * t) + 0.05 * rng.standard_normal(len(t))
    return wave.astype(np.float32), 16000


CASES = {
    "image": (user(random_image(300, 500, 0), "Describe the image in detail."), "vision"),
    "audio": (user(tone(2.3, 1), "Transcribe the audio clip."), "speech"),
    "image_audio": (user(random_image(120, 90, 2), tone(1.1, 3), "What is shown and heard?"),
                    "vision"),
    "text": (user("Hello there, how are you today?"), None),
}


@pytest.fixture(scope="module")
def phi_path(tmp_path_factory):
    from testing.phi4mm import build_phi4mm_model

    return build_phi4mm_model(tmp_path_factory.mktemp("phi4mm") / "m")


@pytest.fixture(scope="module")
def reference(phi_path):
    """transformers' model with PEFT's adapters (vision and speech)."""
    from peft import PeftModel
    from transformers import Phi4MultimodalForCausalLM

    hf = Phi4MultimodalForCausalLM.from_pretrained(phi_path, dtype=torch.float32).eval()
    peft = PeftModel.from_pretrained(hf, phi_path / "vision-lora", adapter_name="vision")
    peft.load_adapter(phi_path / "speech-lora", adapter_name="speech")
    return peft


def hf_inputs(phi_path, proc, media, crop: int = 448) -> dict:
    """transformers' forward inputs for our processed prompt: our crops (its image processor
    needs torchvision), transformers' own audio features (checked equal to ours)."""
    from transformers import Phi4MultimodalFeatureExtractor

    ids = torch.tensor([proc.token_ids])
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    images = [f.data for f in proc.mm_features if f.modality == "image"]
    if images:
        crops = max(len(d["pixel_values"]) for d in images)

        def padded(t, fill):
            extra = crops - len(t)
            return torch.cat([t, fill(extra, *t.shape[1:])]) if extra else t

        kwargs["image_pixel_values"] = torch.stack(
            [padded(d["pixel_values"], torch.zeros) for d in images])
        kwargs["image_attention_mask"] = torch.stack(
            [padded(d["patch_mask"].float(), torch.ones) for d in images])
        kwargs["image_sizes"] = torch.tensor([[r * crop, c * crop] for r, c in
                                              (d["grid"] for d in images)])
    clips = [c.samples for c in media.get("audio", [])]
    if clips:
        extractor = Phi4MultimodalFeatureExtractor.from_pretrained(phi_path)
        ref = extractor(clips, sampling_rate=16000, return_tensors="pt")
        ours = [f.data["audio_input_features"] for f in proc.mm_features if f.modality == "audio"]
        for row, mine in zip(ref["audio_input_features"], ours, strict=True):
            torch.testing.assert_close(mine, row[: len(mine)], atol=1e-5, rtol=1e-5)
        kwargs["audio_input_features"] = ref["audio_input_features"]
        kwargs["audio_embed_sizes"] = ref["audio_embed_sizes"]
    return kwargs


def reference_greedy(peft, phi_path, llm, messages, adapter):
    proc, media = process_chat(llm, messages)
    kwargs = hf_inputs(phi_path, proc, media)
    if adapter is None:
        with peft.disable_adapter():
            return hf_greedy(peft, kwargs, len(proc.token_ids), N)
    peft.set_adapter(adapter)
    return hf_greedy(peft, kwargs, len(proc.token_ids), N)


@pytest.fixture(scope="module")
def refs(phi_path, reference):
    llm = LLM(phi_path, max_model_len=2048)
    return {case: reference_greedy(reference, phi_path, llm, msgs, adapter)
            for case, (msgs, adapter) in CASES.items()}


def test_each_case_matches_transformers_with_its_adapter(phi_path, refs):
    """Each request computes with the adapter of the first of its modalities that has one (none
    for text); a request may name another, which changes its output."""
    llm = LLM(phi_path, max_model_len=2048)
    engine = llm.engine
    for case, (msgs, adapter) in CASES.items():
        out = llm.chat(msgs, GREEDY)[0]
        assert_matches_reference(out, *refs[case], case)
        processed, _ = process_chat(llm, msgs)
        assert engine.adapter_for(SamplingParams(), processed) == adapter, case
    other = llm.chat(CASES["image"][0], SamplingParams(max_tokens=N, temperature=0,
                                                       ignore_eos=True, lora="speech"))[0]
    assert other.outputs[0].token_ids != refs["image"][0]
    assert_released(llm)


def test_mixed_batch_three_adapters_in_one_step_with_a_small_budget(phi_path, refs):
    """An image request, an audio request and a text request in 96-token steps: the image's
    span is prefilled over several chunks, and steps hold rows of the vision adapter, the
    speech adapter and none together."""
    llm = LLM(phi_path, max_model_len=2048, max_num_batched_tokens=96, max_num_seqs=4)
    model = llm.engine.runner.model
    seen = []

    def record(*_):
        step = model.adapters.step
        seen.append(0 if step is None else len(step.groups))

    model.layers[0].register_forward_pre_hook(record)
    cases = ["image", "audio", "text"]
    outs = llm.chat([CASES[c][0] for c in cases], GREEDY)
    for case, out in zip(cases, outs, strict=True):
        assert_matches_reference(out, *refs[case], case)
    assert max(seen) == 2  # vision and speech rows (and base rows) in one step
    assert_released(llm)


def test_encoder_cache_and_prefix_cache_hits(phi_path, refs):
    llm = LLM(phi_path, max_model_len=2048, enable_prefix_caching=False)
    tower = count_calls(llm.engine.runner.model.image_embed.img_processor.patch_embedding)
    audio = count_calls(llm.engine.runner.model.audio_embed.encoder.embed)
    llm.chat(CASES["image"][0], GREEDY)
    again = llm.chat(CASES["image"][0], GREEDY)[0]
    assert tower[0] == 1 and again.multi_modal_placeholders[0].cache_hit
    assert_matches_reference(again, *refs["image"], "image again")
    llm.chat(CASES["audio"][0], GREEDY)
    # The same clip beside an image is projected by the vision projection: another entry.
    same_clip = user(random_image(120, 90, 2), tone(2.3, 1), "What is shown and heard?")
    out = llm.chat(same_clip, GREEDY)[0]
    assert audio[0] == 2 and not out.multi_modal_placeholders[1].cache_hit
    out = llm.chat(CASES["audio"][0], GREEDY)[0]
    assert audio[0] == 2 and out.multi_modal_placeholders[0].cache_hit
    assert_matches_reference(out, *refs["audio"], "audio again")
    assert_released(llm)
    llm = LLM(phi_path, max_model_len=2048, block_size=8)
    first = llm.chat(CASES["image"][0], GREEDY)[0]
    again = llm.chat(CASES["image"][0], GREEDY)[0]  # the image's blocks from the prefix cache
    assert again.num_cached_tokens > first.multi_modal_placeholders[0].length
    assert_matches_reference(again, *refs["image"], "image from the prefix cache")
    assert_released(llm)


def test_a_clip_past_the_encoder_window(phi_path, reference):
    """42 s: 525 encoder positions, attended in windows of 500 (the second padded with zeros
    as transformers pads it)."""
    llm = LLM(phi_path, max_model_len=2048)
    msgs = user(tone(42.0, 4), "Summarize.")
    tokens, logprobs = reference_greedy(reference, phi_path, llm, msgs, "speech")
    out = llm.chat(msgs, GREEDY)[0]
    assert out.multi_modal_placeholders[0].length == 525
    assert_matches_reference(out, *(tokens, logprobs), "42 s")


def test_token_counts_and_grids():
    """The processor's rule (transformers' Phi4MultimodalImageProcessor): a grid of
    ceil(w / 448) x ceil(h / 448) crops, or past dynamic_hd the closest aspect among smaller
    grids; 256 + 16 tokens for the global view, 1 separator, the useful pooled patches of the
    crops and one separator per row."""
    from models.phi4mm.preprocess import HDConfig, hd_layout

    cfg = HDConfig(dynamic_hd=4)
    small = hd_layout(80, 100, cfg)  # one crop, resized to 358 x 448, 6 patch columns padding
    assert small.grid == (1, 1) and small.resized == (448, 358)
    assert small.useful == (16, 13) and small.num_tokens(cfg) == 272 + 1 + 16 * 14
    wide = hd_layout(2000, 300, cfg)  # 5 x 1 crops would be needed: 4 x 1 is the closest
    assert wide.grid == (1, 4) and wide.resized == (268, 1792)
    assert hd_layout(500, 300, cfg).num_tokens(cfg) == 721
    with pytest.raises(ValueError, match="aspect ratio is very extreme"):
        hd_layout(4000, 5, cfg)


def test_another_crop_geometry_of_32_patches_matches_transformers(tmp_path):
    """128-pixel crops of 4-pixel patches: 32 x 32 patches per crop, as in 448 / 14, so
    transformers' count (256 + 1 + the crops' useful pooled patches and a separator per row +
    16) holds and its model runs it: our span is that count and the greedy tokens are its. A
    grid of another patch count is refused by name."""
    from transformers import Phi4MultimodalForCausalLM

    from testing.phi4mm import build_phi4mm_model

    path = build_phi4mm_model(tmp_path / "m", crop=128, patch=4, adapters=False)
    llm = LLM(path, max_model_len=2048)
    msgs = user(random_image(200, 90, 0), "Describe the image.")
    proc, media = process_chat(llm, msgs)
    (feature,) = proc.mm_features
    rows, cols = feature.data["useful"]
    assert feature.data["grid"] == (2, 1) and feature.placeholder.length == (
        256 + 1 + rows * cols + rows + 16)
    hf = Phi4MultimodalForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ref = hf_greedy(hf, hf_inputs(path, proc, media, crop=128), len(proc.token_ids), N)
    assert_matches_reference(llm.chat(msgs, GREEDY)[0], *ref, "128 px crops of 4 px patches")
    assert_released(llm)
    other = shutil.copytree(path, tmp_path / "other")  # 8 px patches: 16 x 16 per crop
    for name, section in (("config.json", "vision_config"),
                          ("processor_config.json", "image_processor")):
        settings = json.loads((other / name).read_text())
        settings[section]["patch_size"] = 8
        (other / name).write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="16 x 16 patches: transformers' processor counts an "
                                         "image's tokens for crops of 32 x 32 patches"):
        LLM(other, max_model_len=2048)


def test_kaldi_filterbank_is_transformers():
    from transformers.audio_utils import mel_filter_bank

    from models.phi4mm.fbank import FbankConfig, kaldi_mel_filters

    ref = mel_filter_bank(257, 80, 0, 7690, 16000, triangularize_in_mel_space=True,
                          mel_scale="kaldi")
    np.testing.assert_allclose(kaldi_mel_filters(FbankConfig()), ref, rtol=1e-12, atol=1e-12)


def test_refusals(phi_path):
    llm = LLM(phi_path, max_model_len=2048)
    with pytest.raises(ValueError, match="shorter than one analysis window"):
        llm.chat(user((np.zeros(300, np.float32), 16000), "Hi"), GREEDY)
    with pytest.raises(ValueError, match="dynamic_hd=9 is not an integer in \\[1, 4\\]"):
        llm.chat(CASES["image"][0], GREEDY, mm_processor_kwargs={"dynamic_hd": 9})
    with pytest.raises(ValueError, match="max_model_len=4096 exceeds .*longrope"):
        LLM(phi_path, max_model_len=4096)


def test_encoders_have_no_host_sync(phi_path):
    """Contract 1 for both encoders: crops of two images and two clips (one past the 500
    position window) in one encode, nothing read back from the device."""
    from tests.model_fixtures import SyncRecorder

    llm = LLM(phi_path, max_model_len=2048)
    msgs = user(random_image(300, 500, 0), random_image(120, 90, 2), tone(1.1, 3),
                tone(41.0, 5), "Hi")
    proc, _ = process_chat(llm, msgs)
    items = [(f.modality, f.data) for f in proc.mm_features]
    with torch.inference_mode(), SyncRecorder() as rec:
        out = llm.engine.runner.model.encode(items)
    assert rec.seen == []
    assert [len(o) for o in out] == [f.placeholder.length for f in proc.mm_features]


def test_the_adapter_folders_are_what_peft_writes(phi_path, tmp_path):
    """testing/phi4mm.py writes its adapters without PEFT (the demo has no PEFT): the same
    tensors, names and shapes PEFT's own save_pretrained writes for the same targets."""
    from peft import LoraConfig
    from safetensors import safe_open

    from testing.lora import save_random_adapter
    from testing.phi4mm import LORA_TARGETS

    def shapes(folder):
        with safe_open(folder / "adapter_model.safetensors", "pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118

    from transformers import Phi4MultimodalForCausalLM

    base = Phi4MultimodalForCausalLM.from_pretrained(phi_path, dtype=torch.float32)
    peft_written = save_random_adapter(base, tmp_path / "peft", LORA_TARGETS, r=8)
    assert shapes(phi_path / "vision-lora") == shapes(peft_written)
    config = LoraConfig.from_pretrained(phi_path / "speech-lora")
    assert (config.r, config.lora_alpha) == (6, 12)


def test_setting_defaults_are_the_classes():
    """The schemas' defaults are transformers' own: the image processor's class attributes (its
    module needs torchvision to import: read from its source) and the feature extractor's
    constructor defaults."""
    import inspect

    import transformers

    from models.phi4mm.fbank import FEATURE_EXTRACTOR
    from models.phi4mm.processor import IMAGE_PROCESSOR
    from tests.hf_references import class_attributes, same_value

    theirs = class_attributes(
        "transformers.models.phi4_multimodal.image_processing_phi4_multimodal",
        "Phi4MultimodalImageProcessor")
    for key, ours in {**IMAGE_PROCESSOR.defaults, **IMAGE_PROCESSOR.fixed}.items():
        if key == "rescale_factor":  # the base class's 1 / 255
            assert ours == 1 / 255
            continue
        assert same_value(ours, theirs[key]), key
    params = inspect.signature(transformers.Phi4MultimodalFeatureExtractor.__init__).parameters
    for key, ours in {**FEATURE_EXTRACTOR.defaults, **FEATURE_EXTRACTOR.fixed}.items():
        assert params[key].default == ours, key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_the_cpu_and_encodes_without_a_host_sync(phi_path):
    """An image, audio and text (three adapters, none among them) on CUDA: the CPU's tokens;
    both encoders under CUDA's sync debug mode."""
    cases = ["image", "audio", "image_audio", "text"]
    msgs = [CASES[c][0] for c in cases]
    cpu = [o.outputs[0].token_ids
           for o in LLM(phi_path, device="cpu", dtype="float32",
                        max_model_len=2048).chat(msgs, GREEDY)]
    gpu = LLM(phi_path, device="cuda", dtype="float32", max_model_len=2048,
              max_num_batched_tokens=96)
    assert [o.outputs[0].token_ids for o in gpu.chat(msgs, GREEDY)] == cpu
    proc, _ = process_chat(gpu, user(random_image(300, 500, 0), tone(41.0, 5), "Hi"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            gpu.engine.runner.model.encode([(f.modality, f.data) for f in proc.mm_features])
    finally:
        torch.cuda.set_sync_debug_mode("default")
