"""KV cache quantization (`kv_cache_dtype="int8"`, models/layers/kv_quant.py).

- The rounding: every value within half a step (max|row| / 254) of its row, zero rows exact.
- Our int8 decode attention kernel, and the PyTorch paths that gather and dequantize blocks,
  against a float64 reference on random data (GQA, sliding window, soft-cap, paged tables);
  with VNNI the kernel's query and weights in digits, within their bound.
- Every attention path of a model with an int8 cache (chunked prefill, decodes through our
  kernel and through PyTorch's, sliding windows, layers sharing another's keys and values)
  equals, to float32 summation order, the model run with a float32 cache holding the very
  values the int8 cache holds (its keys and values rounded through int8 as they are written):
  the int8 storage changes what is stored, never what is attended. Against the unquantized
  cache, the logits move within a bound measured on a bfloat16 cache (DRIFT_FACTOR).
- The engine with an int8 cache under chunked prefill, prefix hits and preemption: the tokens
  and log-probabilities of the unquantized engine writing those same values; the fused native
  decode step writes and reads the int8 cache as the modules do, to the bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams, kv_pool
from models.kernels import native
from models.layers import kv_quant
from models.layers.attention import LayerAttention, _attend_group
from models.layers.attention_metadata import AttentionGroup, _decode_view, _Shape, build_metadata
from models.layers.native_decode import NativeDecode
from tests.model_fixtures import GEMMA3_1B_SHAPE

needs_native = pytest.mark.skipif(native.load() is None, reason="native kernels unavailable")

# How far int8 storage may move the logits is measured, not set: against how far a bfloat16
# cache (each key and value rounded to 8 significant bits) moves them on the same model and
# tokens. Rounding to bfloat16 moves a value x by at most |x| / 512; int8 moves it by at most
# max|row| / 254, the row's largest magnitude being ~2.5x a typical |x| in a head of 32 to 256
# Gaussian-like values: ~5x bfloat16's step on a typical value, ~2x on the largest. Allowed: 8x
# the bfloat16 cache's drift (measured: 3.5x on these tiny random models, which amplify any
# rounding, each a logit or more at some position); a wrong scale, row or block is far past it.
DRIFT_FACTOR = 8
# The same stored values attended in another summation order (our kernel scales a key's dot
# product, the float cache holds the scaled values): ~1e-6 relative, which these tiny random
# models amplify as they amplify bfloat16's 2e-3 into their drift (measured up to 8e-4). Any
# mishandled scale, row or block moves logits by at least a bfloat16 cache's drift (~0.1+).
SAME_VALUES_TOL = 4e-3


def test_round_trip_within_half_a_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, 32, generator=gen) * torch.logspace(-3, 3, 64)[:, None, None]
    x[0] = 0.0  # an all-zero row: scale 0, values 0
    x[1, 0, 5] = 1e4  # an outlier sets its row's step
    rows = kv_quant.quantize_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (64, 3, 32 + kv_quant.SCALE_BYTES)
    values = rows[..., :32].int()
    assert values.abs().max() <= 127
    assert (values.abs().amax(-1)[1:] == 127).all()  # the largest magnitude lands on 127
    back = kv_quant.dequantize_rows(rows, torch.float32)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((back - x).abs() <= step / 2 * (1 + 1e-5)).all()
    assert torch.equal(back[0], torch.zeros_like(back[0]))
    half = x.to(torch.bfloat16)
    back16 = kv_quant.dequantize_rows(kv_quant.quantize_rows(half), torch.float32)
    bound = half.float().abs().amax(-1, keepdim=True) / 254
    assert ((back16 - half.float()).abs() <= bound * (1 + 1e-5)).all()


def _reference(q, raw, tables, key0, contexts, block_size, scale, window, softcap,
               rows=None):
    """Decode attention in float64 over the dequantized cache raw [2, Hkv, blocks, bs, D].
    With the int8 `rows` [2, Hkv, blocks, bs, D + SCALE_BYTES] that hold it, also the bound
    [B, H, D] on how far weighting the values with digits can move each output: per tile of 16
    keys (from the window's first), each weight p s within one unit (the tile's largest / 65535)
    of its value, which meets the row's int8 values (models/kernels/cpu/attention.c,
    values_i8_vnni)."""
    batch, heads, dim = q.shape
    kv_heads = raw.shape[1]
    out = torch.zeros(batch, heads, dim, dtype=torch.float64)
    bound = torch.zeros_like(out)
    for b in range(batch):
        ctx = contexts[b]
        lo = max(ctx - window if window and ctx > window else 0, key0[b])
        slots = [tables[b][(p - key0[b]) // block_size] * block_size + p % block_size
                 for p in range(lo, ctx)]
        for h in range(heads):
            kv = h // (heads // kv_heads)
            keys = raw[0, kv].reshape(-1, dim)[slots].double()
            values = raw[1, kv].reshape(-1, dim)[slots].double()
            scores = keys @ q[b, h].double() * scale
            if softcap:
                scores = softcap * torch.tanh(scores / softcap)
            out[b, h] = scores.softmax(-1) @ values
            if rows is not None:
                ints = rows[1, kv, ..., :dim].reshape(-1, dim)[slots].double().abs()
                scales = rows[1, kv, ..., dim:].contiguous().view(torch.float32)
                w = scores.softmax(-1) * scales.reshape(-1)[slots].double()
                for t0 in range(0, len(slots), 16):
                    bound[b, h] += w[t0:t0 + 16].max() / 65535 * ints[t0:t0 + 16].sum(0)
    return out if rows is None else (out, bound)


# Our variants whose int8-cache kernel meets the query in two int8 digits (head sizes a multiple
# of 64, up to 256: models/kernels/cpu/attention.c, scores_i8_vnni).
VNNI_SCORES = ("avx512-vnni", "avx512-bf16")


def query_digits(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] as that kernel sees it (the ggml decode path's two digits, mm_digits_row, one
    group a head): per row unit * (256 h + l), h = rint(q / step) and l = rint((q / step - h) *
    256) clamped to 127, step = max|q| / 127, in float32 as the C rounds each operation."""
    q = q.float()
    top = q.abs().amax(-1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(127.0) / top, torch.zeros_like(top))
    u = q * inv
    first = torch.round(u)
    second = torch.round((u - first) * 256).clamp(-127, 127)
    unit = top / 127 / 256
    return unit.double() * (256 * first.double() + second.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads, heads, dim", [(2, 6, 64), (1, 4, 256)])
def test_int8_decode_attention_against_a_float_reference(dtype, kv_heads, heads, dim):
    """Three sequences of different contexts in scattered blocks, grouped query heads (a head
    size of 64, and Gemma 3's 256: four stretches of 64 values), a window that cuts the
    longest, a soft-cap: our int8 kernel (where it builds) and the PyTorch paths (gather the
    blocks, dequantize them, attend)."""
    gen = torch.Generator().manual_seed(1)
    bs, blocks, scale = 4, 48, dim ** -0.5
    raw = torch.randn(2, kv_heads, blocks, bs, dim, generator=gen) * 2
    cache = kv_quant.quantize_rows(raw)
    stored = kv_quant.dequantize_rows(cache, torch.float32)  # what the cache holds
    perm = torch.randperm(blocks, generator=gen).tolist()
    contexts, window = [37, 130, 5], 50
    tables = [perm[0:10], perm[10:43], perm[43:45]]
    q = torch.randn(3, heads, dim, generator=gen).to(dtype)
    view = _decode_view(_Shape(bs, torch.device("cpu"), dtype), contexts, tables, window)
    key0 = view.key0.tolist()
    firsts = [t[k // bs:] for t, k in zip(tables, key0, strict=True)]
    ref = _reference(q.float(), stored, firsts, key0, contexts, bs, scale, window, 30.0)
    loaded = native.load()
    # the VNNI kernel's scores: exact integer sums of the query's digits and the stored keys;
    # its weighted sum: the weights in digits, within `digits_bound` of the exact one
    digits_ref, digits_bound = _reference(query_digits(q), stored, firsts, key0, contexts, bs,
                                          scale, window, 30.0, rows=cache)
    layer = LayerAttention(sliding_window=window, softcap=30.0)
    kernels = ["sdpa", "matmul"] + (["native"] if loaded is not None else [])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for kernel in kernels:
        view.workspace = None
        group = AttentionGroup(torch.arange(3), 3, 1, {window: view})
        out = _attend_group(q, q, q, cache, group, scale, layer, kernel)
        assert out.dtype == dtype
        if kernel == "native" and loaded.variant in VNNI_SCORES:
            assert digits_bound.max() < 1e-3  # a weight's unit, not a test that cannot fail
            err = (out.double() - digits_ref).abs()
            assert (err <= tol * (1 + digits_ref.abs()) + digits_bound).all(), err.max()
        else:
            torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=kernel)
    assert (query_digits(q) - q.double()).abs().max() <= q.abs().max() / 32512
    if loaded is not None:  # a NaN query head gives NaN in its sequence's heads, not numbers
        bad = q.clone()
        bad[1, 0, 5] = float("nan")
        view.workspace = None
        group = AttentionGroup(torch.arange(3), 3, 1, {window: view})
        out = _attend_group(bad, bad, bad, cache, group, scale, layer, "native")
        assert out[1, 0].isnan().all() and not out[[0, 2]].isnan().any()


def _gemma3(root):
    from testing.tiny import build_text_model

    return build_text_model(root / "gemma3", "gemma3_text", num_layers=6, num_heads=4,
                            num_kv_heads=1, tie_word_embeddings=True,
                            config_overrides=GEMMA3_1B_SHAPE)


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    """Gemma 3's 5 local : 1 global layers, a 6-token window shorter than the prompts."""
    return _gemma3(tmp_path_factory.mktemp("kvq"))


@pytest.fixture(scope="module")
def gemma4_path(tmp_path_factory):
    """Gemma 4 text: its last two layers read the keys and values of earlier ones."""
    from testing.gemma4 import build_gemma4_model

    return build_gemma4_model(tmp_path_factory.mktemp("kvq") / "gemma4", text_only=True)


def _logits(model, ids, pieces, kernel, kv_cache_dtype, store=None):
    """Logits of every position of `ids` run as `pieces` (prefill chunks, then decodes through
    `kernel`), in caches of `kv_cache_dtype` bound for this run (the engine's own are bound
    back after it); `store` replaces how keys and values are written."""
    blocks, bs = [5, 0, 7, 2, 9, 1, 3, 8, 11, 4], 4
    layers = model.attention_layers()
    bound = [a.kv_cache for a in layers]
    # pools are reserved, not written: here every slot starts as NaN (an int8 cache's scales
    # too: all bytes 0xFF), which the padded gathers must keep out of attention
    for cache in kv_pool.allocate(layers, 12, bs, torch.float32, kv_cache_dtype,
                                  torch.device("cpu")):
        cache.fill_(math.nan if cache.is_floating_point() else -1)
    out = []
    try:
        with pytest.MonkeyPatch.context() as patch:
            if store is not None:
                patch.setattr(kv_quant, "store", store)
            for start, end in pieces:
                meta = build_metadata([start], [end - start], [blocks], bs,
                                      torch.device("cpu"), windows=model.attention_windows(),
                                      decode_kernel=kernel)
                with torch.inference_mode():
                    hidden = model(torch.tensor(ids[start:end]), torch.arange(start, end),
                                   meta)
                    out.append(model.compute_logits(hidden))
    finally:
        for attn, cache in zip(layers, bound, strict=True):
            attn.kv_cache = cache
    return torch.cat(out)


def _rounded_store(rounded):
    """A `kv_quant.store` for an unquantized cache that writes `rounded(k)`, `rounded(v)`."""
    def store(kv_cache, slot_mapping, k, v):
        num_kv_heads = k.shape[1]
        slots = kv_cache.view(2, num_kv_heads, -1, kv_cache.shape[-1])
        slots[0].index_copy_(1, slot_mapping, rounded(k).transpose(0, 1))
        slots[1].index_copy_(1, slot_mapping, rounded(v).transpose(0, 1))
    return store


# The unquantized cache written with the values an int8 cache holds, or a bfloat16 cache would.
_store_as_int8 = _rounded_store(
    lambda x: kv_quant.dequantize_rows(kv_quant.quantize_rows(x), x.dtype))
_store_as_bf16 = _rounded_store(lambda x: x.to(torch.bfloat16).to(x.dtype))


@pytest.mark.parametrize("checkpoint", ["gemma3_int8", "gemma4_path"])
def test_every_attention_path_attends_what_the_int8_cache_holds(request, checkpoint):
    if checkpoint == "gemma3_int8":
        llm = request.getfixturevalue(checkpoint)
    else:
        llm = LLM(request.getfixturevalue(checkpoint), dtype="float32", max_model_len=64,
                  block_size=4, enable_prefix_caching=False)
    model = llm.engine.runner.model
    if checkpoint == "gemma4_path":  # its layers' head sizes differ too (16 and 32)
        assert any(a.kv_source is not None for a in model.attention_layers())
    else:
        assert None in model.attention_windows() and 6 in model.attention_windows()
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, llm.engine.runner.vocab_size, (34,), generator=gen).tolist()
    # a prefill chunk from 0 (its own keys), one reading the cache (a prefix-hit's shape),
    # then decodes reading the cache through the window
    pieces = [(0, 9), (9, 23)] + [(p, p + 1) for p in range(23, 34)]
    plain = _logits(model, ids, pieces, "sdpa", "auto")
    noise = (_logits(model, ids, pieces, "sdpa", "auto", _store_as_bf16) - plain).abs().max()
    assert 0 < noise < 2, noise  # a real measurement, not a broken reference
    # SDPA after gathering and dequantizing the blocks ("matmul" gathers the same way), and
    # our kernel reading the int8 rows in place
    kernels = ["sdpa"] + (["native"] if native.load() is not None else [])
    for kernel in kernels:
        quantized = _logits(model, ids, pieces, kernel, "int8")
        rounded = _logits(model, ids, pieces, kernel, "auto", _store_as_int8)
        torch.testing.assert_close(quantized, rounded, atol=SAME_VALUES_TOL, rtol=0,
                                   msg=kernel)
        drift = (quantized - plain).abs().max()
        assert 0 < drift <= DRIFT_FACTOR * noise, (kernel, drift, noise)
        assert torch.equal(quantized[:9], plain[:9])  # the first chunk attends its own keys


def _engine(path, kv_cache_dtype: str, device: str = "cpu") -> LLM:
    """The tiny Gemma 3 in float32 with 22 blocks of 4 tokens and 16-token steps."""
    per_block = 4 * 6 * 2 * (32 + kv_quant.SCALE_BYTES if kv_cache_dtype == "int8" else 32 * 4)
    llm = LLM(path, device=device, dtype="float32", max_model_len=64, block_size=4,
              kv_cache_bytes=22 * per_block, kv_cache_dtype=kv_cache_dtype,
              max_num_batched_tokens=16)
    assert llm.engine.block_manager.num_blocks == 22
    return llm


@pytest.fixture(scope="module")
def gemma3_int8(gemma3_path):
    return _engine(gemma3_path, "int8")


CUDA = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_engine_chunks_prefix_hits_and_preemption(gemma3_path, monkeypatch, device):
    """A prompt extending a finished one hits the prefix cache (whole blocks, and a block's
    tail copied with its scales: engine/block_manager.py); 22 blocks of 4 tokens cannot hold
    four ~38-token sequences: the newest are preempted and recomputed; 16-token steps cut the
    prompts into chunks. The int8 engine's
    greedy tokens and log-probabilities are those of the unquantized engine writing the values
    the int8 cache holds. On CUDA the same code (SDPA over the gathered, dequantized blocks)."""
    import engine.runner_setup as runner

    if device == "cpu":  # both engines' decodes through our paged kernel, whatever is faster
        monkeypatch.setattr(runner, "choose_decode_attention", lambda *args, **kwargs: "native")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (30, 26, 33, 28)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    runs = {}
    for kv in ("int8", "auto"):
        if kv == "auto":
            monkeypatch.setattr(kv_quant, "store", _store_as_int8)
            # the one-call decode step writes keys and values in C, past that store: the
            # unquantized engine's decodes run the modules (the int8 engine's take the call,
            # which quantizes as kv_quant does)
            monkeypatch.setattr(NativeDecode, "build", staticmethod(lambda model: None))
        llm = _engine(gemma3_path, kv, device)
        first = llm.generate(prompts[:1], params)
        again = llm.generate([prompts[0] + [7, 8, 9, 10, 11]], params)
        # 7 full blocks of the first prompt's 30 tokens, and 2 of its 8th copied
        assert again[0].num_cached_tokens == 30
        batch = llm.generate(prompts, params)
        assert sum(o.metrics.num_preemptions for o in batch) > 0
        llm.engine.check_integrity()
        runs[kv] = first + again + batch
        if kv == "int8":
            stats = llm.engine.stats()
            assert stats["kv_cache_dtype"] == "int8"
            assert stats["kv_capacity_gain"] == pytest.approx(128 / 36, abs=0.01)
    for a, b in zip(runs["auto"], runs["int8"], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert abs(next(iter(x.values())) - next(iter(y.values()))) <= SAME_VALUES_TOL


@needs_native
def test_fused_decode_step_writes_and_reads_int8_as_the_modules(llama_path):
    """The one-call decode step (models.layers.native_decode) quantizes each new key and
    value as kv_quant does and attends through the same int8 kernel: the modules' logits."""
    from models.kernels.choice import BUCKETS
    from models.kernels.linear import Linear
    from tests.model_fixtures import run_decode_steps

    llm = LLM(llama_path, dtype="bfloat16", max_model_len=128, enable_prefix_caching=False,
              block_size=4, kv_cache_dtype="int8")
    runner = llm.engine.runner
    for module in runner.model.modules():
        if isinstance(module, Linear):
            module.kernels = ("native",) * len(BUCKETS)
    runner.decode_kernel = "native"
    runner.model.prepare_decode()
    assert runner.model.native_decode is not None
    assert runner.kv_caches[0].dtype == torch.int8
    native_logits, native_tokens, taken = run_decode_steps(llm, True)
    module_logits, module_tokens, _ = run_decode_steps(llm, False)
    assert taken and native_tokens == module_tokens
    for a, b in zip(native_logits, module_logits, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_option_is_validated():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8"):
        EngineConfig(kv_cache_dtype="fp8")
