"""The decode step through one native call (models.layers.native_decode) against the modules it
replaces, through the engine: the same logits to the bit at every step, for float32 and
bfloat16, dense, int8 and int4 weights, biases, tied heads, one and several requests per step;
q / k norms (Qwen3) within float32 summation order; Gemma 3's layers (sandwich norms, GELU,
sliding windows). The steps it must decline go through the
modules, and models it cannot run are refused with the reason."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from models.kernels import native
from models.kernels.choice import BUCKETS
from models.kernels.linear import Linear
from models.kernels.quantization import QuantizedLinear
from models.layers.native_decode import NativeDecode, unsupported
from tests.model_fixtures import NATIVE_DECODE_PROMPTS, run_decode_steps, tiny_tied_model

pytestmark = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")

# Prompts of different lengths: several requests decode in one step, their contexts differ.
PROMPTS = NATIVE_DECODE_PROMPTS


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    from testing.tiny import build_text_model

    return build_text_model(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3",
                            config_overrides={"head_dim": 16})


def _engine(path, dtype: str, quantization: str | None) -> LLM:
    """An engine whose every linear is planned "native" and whose decodes attend through our
    paged kernel, so that the native call takes every decode step (what measurement picks on a
    machine where ours win)."""
    llm = LLM(path, dtype=dtype, max_model_len=128, quantization=quantization,
              quantization_group_size=32, enable_prefix_caching=False, block_size=4)
    runner = llm.engine.runner
    for module in runner.model.modules():
        if isinstance(module, Linear | QuantizedLinear):
            module.kernels = ("native",) * len(BUCKETS)
    runner.decode_kernel = "native"
    runner.model.prepare_decode()
    assert runner.model.native_decode is not None
    return llm


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("checkpoint", ["qwen2_path", "llama_path"])
def test_the_same_logits_as_the_modules(request, checkpoint, dtype, quantization):
    llm = _engine(request.getfixturevalue(checkpoint), dtype, quantization)
    native_logits, native_tokens, taken = run_decode_steps(llm, True)
    module_logits, module_tokens, none_taken = run_decode_steps(llm, False)
    assert taken and max(taken) == len(PROMPTS) and not none_taken
    assert native_tokens == module_tokens
    assert len(native_logits) == len(module_logits)
    for a, b in zip(native_logits, module_logits, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("threads", [1, 3])
def test_the_same_logits_on_any_team(qwen2_path, threads):
    """The step runs on one team that meets at its own barrier after every kernel (kernels.h,
    team_sync): one thread, and more threads than this machine's cores, give the modules'
    logits too (int8: its digits made per thread; int4 rows stored per block)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for quantization in (None, "int8", "int4"):
            llm = _engine(qwen2_path, "bfloat16", quantization)
            native_logits, native_tokens, taken = run_decode_steps(llm, True)
            module_logits, module_tokens, _ = run_decode_steps(llm, False)
            assert taken and native_tokens == module_tokens, quantization
            for a, b in zip(native_logits, module_logits, strict=True):
                assert torch.equal(a, b), (quantization, (a - b).abs().max())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qk_norms_within_summation_order(qwen3_path, dtype):
    """At several rows the modules normalize q / k with PyTorch's operators (the heads are not
    contiguous there), which sum in another order than ours."""
    llm = _engine(qwen3_path, dtype, None)
    native_logits, native_tokens, taken = run_decode_steps(llm, True)
    module_logits, module_tokens, _ = run_decode_steps(llm, False)
    assert taken and native_tokens == module_tokens
    tol = 1e-5 if dtype == "float32" else 0.05
    for a, b in zip(native_logits, module_logits, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    """Gemma 3's layers: norms after attention and MLP (sandwich), GELU (tanh), q / k norms
    with a unit offset, a sliding window of 6 keys on all layers but every third (two rope
    tables), shorter than most prompts."""
    from testing.tiny import build_text_model

    return build_text_model(
        tmp_path_factory.mktemp("ckpt") / "gemma3", "gemma3_text", num_layers=3,
        tie_word_embeddings=True,
        config_overrides={"head_dim": 16, "sliding_window": 6, "sliding_window_pattern": 3,
                          "layer_types": ["sliding_attention", "sliding_attention",
                                          "full_attention"]})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_layers_as_the_modules(gemma3_path, dtype):
    """Sandwich norms, GELU and sliding windows: one request's steps are the modules' to the
    bit; several requests' within the q / k norms' summation order (as Qwen3's above)."""
    llm = _engine(gemma3_path, dtype, None)
    model = llm.engine.runner.model
    assert {layer.self_attn.layout.sliding_window for layer in model.layers} == {6, None}
    assert model.layers[0].sandwich and model.layers[0].mlp.activation == "gelu_pytorch_tanh"
    native_logits, native_tokens, taken = run_decode_steps(llm, True, PROMPTS[:1])
    module_logits, module_tokens, _ = run_decode_steps(llm, False, PROMPTS[:1])
    assert taken and native_tokens == module_tokens
    for a, b in zip(native_logits, module_logits, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    native_logits, native_tokens, taken = run_decode_steps(llm, True)
    module_logits, module_tokens, _ = run_decode_steps(llm, False)
    assert taken and max(taken) == len(PROMPTS) and native_tokens == module_tokens
    tol = 1e-5 if dtype == "float32" else 0.05
    for a, b in zip(native_logits, module_logits, strict=True):
        torch.testing.assert_close(a, b, atol=tol, rtol=0)


def test_declines_what_it_does_not_take(qwen2_path):
    llm = _engine(qwen2_path, "float32", None)
    model = llm.engine.runner.model
    # Linears planned otherwise at some row count: those steps go through the modules.
    rest = ("native",) * (len(BUCKETS) - 2)
    model.layers[0].mlp.down_proj.kernels = ("native", "F.linear") + rest
    model.prepare_decode()
    assert model.native_decode.buckets == (True, False) + (True,) * len(rest)
    _, _, taken = run_decode_steps(llm, True, PROMPTS[:1])
    assert taken and set(taken) == {1}
    _, _, taken = run_decode_steps(llm, True)
    assert taken == []  # the steps of 2-8 rows ran the modules
    # Prefill chunks and steps attended by another decode kernel are declined.
    llm.engine.runner.decode_kernel = "sdpa"
    _, _, taken = run_decode_steps(llm, True)
    assert taken == []


def test_refuses_layers_it_does_not_implement(tmp_path):
    from testing.tiny import build_text_model

    path = build_text_model(tmp_path / "moe", "qwen3_moe", num_layers=1)
    model = LLM(path, dtype="float32", max_model_len=64).engine.runner.model
    assert model.native_decode is None
    assert "mixture-of-experts" in unsupported(model)


def test_refuses_a_model_whose_caches_are_not_bound():
    assert unsupported(tiny_tied_model()) == "the KV cache is not bound"


def test_disabled_by_the_environment(qwen2_path, monkeypatch):
    llm = _engine(qwen2_path, "float32", None)
    monkeypatch.setenv("MMSERVE_NATIVE_DECODE", "0")
    assert NativeDecode.build(llm.engine.runner.model) is None
