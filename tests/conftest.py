"""Shared fixtures: tiny random checkpoints in Hugging Face format, built once per session."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Weights quantized at load are not kept between engines (engine/weight_cache.py): a test that
# changes how weights are quantized must not read another test's; tests/test_weight_cache.py
# turns it on in a folder of its own.
os.environ["MMSERVE_WEIGHT_CACHE"] = "0"
# The tests' small weights would run each linear on the calling thread alone (kernels.h,
# team_threads): on a team, so that the kernels' splits between threads are what they check;
# tests/test_native.py checks the default rule.
os.environ["MMSERVE_SOLO_BYTES"] = "0"
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory):
    """Linear kernel choices (models.kernels.choice) are cached here, never in the home dir."""
    path = tmp_path_factory.mktemp("kernels")
    os.environ["MMSERVE_KERNEL_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def qwen2_path(tmp_path_factory):
    from testing.tiny import build_text_model

    return build_text_model(tmp_path_factory.mktemp("ckpt") / "qwen2", "qwen2")


@pytest.fixture(scope="session")
def llama_path(tmp_path_factory):
    """Llama with tied embeddings, llama3 rope scaling and a sharded checkpoint."""
    from testing.tiny import build_text_model

    rope = {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    return build_text_model(
        tmp_path_factory.mktemp("ckpt") / "llama", "llama", tie_word_embeddings=True,
        rope_parameters=rope, num_kv_heads=1, max_shard_size="100KB",
    )


@pytest.fixture(scope="session")
def hf_models():
    """Cache of transformers reference models by checkpoint path (float32, eval)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    cache = {}

    def get(path):
        if path not in cache:
            vision = getattr(AutoConfig.from_pretrained(path), "vision_config", None) is not None
            auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
            cache[path] = auto.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get


@pytest.fixture(scope="session", params=["qwen2_vl", "qwen2_5_vl"])
def vl_path(request, tmp_path_factory):
    """Tiny Qwen2-VL and Qwen2.5-VL checkpoints (each test using this runs for both)."""
    from testing.tiny import build_qwen2_vl_model

    return build_qwen2_vl_model(tmp_path_factory.mktemp("ckpt") / request.param, request.param)


@pytest.fixture(scope="session")
def qwen2_vl_path(tmp_path_factory):
    from testing.tiny import build_qwen2_vl_model

    return build_qwen2_vl_model(tmp_path_factory.mktemp("ckpt") / "qwen2_vl_only", "qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_audio_path(tmp_path_factory):
    from testing.tiny import build_qwen2_audio_model

    return build_qwen2_audio_model(tmp_path_factory.mktemp("ckpt") / "qwen2_audio")


@pytest.fixture(scope="session")
def hf_audio_model(qwen2_audio_path):
    """transformers' Qwen2-Audio on the tiny checkpoint (float32, eval)."""
    from transformers import Qwen2AudioForConditionalGeneration

    return Qwen2AudioForConditionalGeneration.from_pretrained(
        qwen2_audio_path, dtype=torch.float32
    ).eval()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item (`item.report_call`), so fixtures can act on
    a failure (the browser tests save a screenshot)."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report
