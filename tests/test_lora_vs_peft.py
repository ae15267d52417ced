"""LoRA adapters chosen per request (models/layers/lora.py), against PEFT on a tiny Llama.

Two adapters written by PEFT itself (models/adapters.py reads the folders): one on attention
(q, k, v, o: parts of our fused qkv_proj), one on the MLP (gate, up inside our gate_up_proj;
rsLoRA scaling, a rank and an alpha pattern). Requests with either adapter or none share steps
(chunked, mixed with decodes); each must equal PEFT's model with that adapter set (or disabled):
greedy tokens identical, top-3 log-probabilities within 1e-3. Prefix caching never shares KV
between adapters; the native one-call decode declines steps that carry an adapter and still
takes the others; the API takes `lora` per request.
"""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams
from models.checkpoint import CheckpointError
from tests.helpers import assert_matches_reference, assert_released, greedy

N = 6
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Describe the image in detail.",
           "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100"]
ADAPTERS = (None, "attn", "mlp")


def params(lora: str | None, max_tokens: int = N) -> SamplingParams:
    return greedy(max_tokens, logprobs=3, lora=lora)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The checkpoint, the two adapter folders and transformers + PEFT's references."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from testing.lora import save_random_adapter
    from testing.tiny import build_text_model

    root = tmp_path_factory.mktemp("lora")
    path = build_text_model(root / "llama", "llama", num_kv_heads=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    folders = {
        "attn": save_random_adapter(hf, root / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"],
                                    r=4, lora_alpha=8, seed=1),
        "mlp": save_random_adapter(hf, root / "mlp", ["gate_proj", "up_proj", "down_proj"],
                                   r=8, lora_alpha=16, seed=2, use_rslora=True,
                                   rank_pattern={"down_proj": 6},
                                   alpha_pattern={"layers.1.mlp.up_proj": 4}),
    }
    peft = PeftModel.from_pretrained(hf, folders["attn"], adapter_name="attn")
    peft.load_adapter(folders["mlp"], adapter_name="mlp")
    tokenizer = AutoTokenizer.from_pretrained(path)
    refs = {}
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        for name in ADAPTERS:
            refs[prompt, name] = _peft_greedy(peft, ids, name)
    return path, folders, refs


def _peft_greedy(peft, ids, adapter):
    kwargs = dict(input_ids=ids, max_new_tokens=N, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, eos_token_id=10**6, pad_token_id=0)
    with torch.no_grad():
        if adapter is None:
            with peft.disable_adapter():
                out = peft.generate(**kwargs)
        else:
            peft.set_adapter(adapter)
            out = peft.generate(**kwargs)
    return (out.sequences[0, ids.shape[1]:].tolist(),
            torch.stack(out.scores)[:, 0].float().log_softmax(-1))


def engine(setup, **options) -> LLM:
    path, folders, _ = setup
    return LLM(path, max_model_len=256, lora_adapters={k: str(v) for k, v in folders.items()},
               **options)


def test_each_adapter_and_none_in_mixed_chunked_steps(setup):
    """Nine requests (three prompts x none / attn / mlp) in steps of 16 tokens: prefill chunks
    and decodes of different adapters share steps."""
    _, _, refs = setup
    llm = engine(setup, max_num_batched_tokens=16)
    model = llm.engine.runner.model
    mixed = []
    model.layers[0].register_forward_pre_hook(
        lambda *_: mixed.append(len(model.adapters.step.groups) if model.adapters.step else 0))
    cases = [(p, a) for p in PROMPTS for a in ADAPTERS]
    outs = llm.generate([p for p, _ in cases], [params(a) for _, a in cases])
    for (prompt, adapter), out in zip(cases, outs, strict=True):
        assert_matches_reference(out, *refs[prompt, adapter], f"{adapter}: {prompt}")
    assert max(mixed) == 2  # both adapters (and base rows) in one step
    assert_released(llm)


def test_adapters_change_the_output(setup):
    _, _, refs = setup
    for prompt in PROMPTS:
        assert refs[prompt, "attn"][0] != refs[prompt, None][0]
        assert refs[prompt, "mlp"][0] != refs[prompt, None][0]


def test_prefix_cache_never_shares_blocks_across_adapters(setup):
    _, _, refs = setup
    llm = engine(setup, block_size=4)
    prompt = PROMPTS[2]
    first = llm.generate(prompt, params("attn"))[0]
    other = llm.generate(prompt, params("mlp"))[0]
    base = llm.generate(prompt, params(None))[0]
    again = llm.generate(prompt, params("attn"))[0]
    assert first.num_cached_tokens == other.num_cached_tokens == base.num_cached_tokens == 0
    assert again.num_cached_tokens > 0
    for out, adapter in ((other, "mlp"), (base, None), (again, "attn")):
        assert_matches_reference(out, *refs[prompt, adapter], str(adapter))
    assert_released(llm)


def test_native_decode_declines_steps_with_an_adapter(setup):
    """Every linear planned to our kernel and decodes attended by ours, so that the one-call
    decode would take every decode step: it declines those carrying an adapter (the modules
    add the updates, matching PEFT) and takes the base request's steps alone."""
    from models.kernels import native
    from models.kernels.choice import BUCKETS
    from models.kernels.linear import Linear

    if native.load() is None:
        pytest.skip("native kernels unavailable")
    _, _, refs = setup
    llm = engine(setup, block_size=4)
    runner = llm.engine.runner
    for module in runner.model.modules():
        if isinstance(module, Linear):
            module.kernels = ("native",) * len(BUCKETS)
    runner.decode_kernel = "native"
    assert runner.model.prepare_decode()
    decode, taken, declined = runner.model.native_decode, [], []
    run = decode.run

    def spy(h, rotary, meta):
        out = run(h, rotary, meta)
        (taken if out is not None else declined).append(meta.adapters is not None)
        return out

    decode.run = spy
    outs = llm.generate(PROMPTS[:2], [params(None, 2 * N), params("attn")])
    assert taken and not any(taken)  # taken: steps without an adapter only
    assert any(declined)
    assert_matches_reference(outs[1], *refs[PROMPTS[1], "attn"], "attn")
    assert outs[0].outputs[0].token_ids[:N] == refs[PROMPTS[0], None][0]


def test_unknown_adapter_is_refused(setup):
    llm = engine(setup)
    rows = [r for r in llm.stats()["checkpoint"] if r[0] == "lora"]  # the engine panel's
    assert [r[1] for r in rows] == ["attn", "mlp"] and rows[0][2].startswith("r=4, 4 linears")
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope' \(loaded: attn, mlp\)"):
        llm.generate("Hi", params("nope"))
    plain = LLM(setup[0], max_model_len=64)
    with pytest.raises(ValueError, match=r"loaded: none"):
        plain.generate("Hi", params("attn"))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("use_dora", True, "use_dora=True is not supported"),
    ("bias", "all", "bias='all' is not supported"),
    ("modules_to_save", ["lm_head"], "modules_to_save"),
    ("some_future_option", 3, "unknown setting some_future_option=3"),
])
def test_unsupported_adapter_settings_are_refused(setup, tmp_path, field, value, message):
    import shutil

    folder = shutil.copytree(setup[1]["attn"], tmp_path / "bad")
    config = json.loads((folder / "adapter_config.json").read_text())
    config[field] = value
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        LLM(setup[0], max_model_len=64, lora_adapters={"bad": str(folder)})


def test_adapters_on_a_quantized_model(setup):
    """int8 base weights keep their quantized kernels; the adapter still applies."""
    from models.kernels.quantization import QuantizedLinear

    llm = engine(setup, quantization="int8")
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantizedLinear) and qkv._forward_hooks
    base, attn = llm.generate([PROMPTS[1]] * 2, [params(None), params("attn")])
    assert base.outputs[0].token_ids != attn.outputs[0].token_ids


async def test_the_api_takes_lora_per_request(setup):
    import httpx

    from api import create_app
    from engine import AsyncLLM
    from tests.helpers import serve_in_thread

    _, _, refs = setup
    llm = AsyncLLM(setup[0], max_model_len=256,
                   lora_adapters={k: str(v) for k, v in setup[1].items()})
    try:
        with serve_in_thread(create_app({"m": llm})) as url:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client:
                body = {"model": "m", "prompt": PROMPTS[1], "max_tokens": N,
                        "temperature": 0, "ignore_eos": True, "return_token_ids": True}
                ok = await client.post("/v1/completions", json={**body, "lora": "mlp"})
                bad = await client.post("/v1/completions", json={**body, "lora": "nope"})
    finally:
        llm.shutdown()
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["token_ids"] == refs[PROMPTS[1], "mlp"][0]
    assert bad.status_code == 400 and "unknown LoRA adapter 'nope'" in bad.text


def test_a_step_with_adapters_has_no_host_sync(setup):
    """Contract 1: a forward whose rows use two adapters and none (the hooks' gathers and
    indexed adds) reads nothing back from the device."""
    from models.layers.attention_metadata import build_metadata
    from models.layers.lora import build_adapter_batch
    from tests.model_fixtures import SyncRecorder

    model = engine(setup).engine.runner.model
    lens, starts, tables = [5, 1, 4], [0, 7, 0], [[0], [1], [2]]
    meta = build_metadata(starts, lens, tables, 16, torch.device("cpu"))
    meta.adapters = build_adapter_batch([1, 0, 2], lens, torch.device("cpu"))
    assert len(meta.adapters.groups) == 2
    ids, pos = torch.arange(10) % 50, torch.tensor([0, 1, 2, 3, 4, 7, 0, 1, 2, 3])
    with torch.inference_mode(), SyncRecorder() as rec:
        model.compute_logits(model(ids, pos, meta))
    assert rec.seen == []


def test_the_config_schema_is_loraconfigs():
    """Every field PEFT's LoraConfig writes is read, refused unless off, or inert; the defaults
    we compute with are its own."""
    import dataclasses

    from peft import LoraConfig

    from models.adapters import LORA_CONFIG

    fields = {f.name: f for f in dataclasses.fields(LoraConfig)}
    written = set(LoraConfig(r=4).to_dict())
    known = set(LORA_CONFIG.defaults) | set(LORA_CONFIG.fixed) | LORA_CONFIG.inert
    assert written <= known, sorted(written - known)
    for key, ours in LORA_CONFIG.defaults.items():
        f = fields[key]
        theirs = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        assert theirs == ours, key


def test_engine_and_command_line_options(tmp_path):
    from engine.config import EngineConfig
    from launch.options import engine_options, parse_args

    args = parse_args(["--lora", "sql=/a/b", "--lora", "chat.v2=/c"])
    assert engine_options(args)["lora_adapters"] == (("sql", "/a/b"), ("chat.v2", "/c"))
    with pytest.raises(SystemExit):
        parse_args(["--lora", "no-path"])
    assert EngineConfig(lora_adapters={"a": tmp_path}).lora_adapters == (("a", str(tmp_path)),)
    for bad in ({"bad name": "/x"}, [("a", "/x"), ("a", "/y")], "a=/x"):
        with pytest.raises(ValueError, match="lora_adapters"):
            EngineConfig(lora_adapters=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_adapters_on_cuda_match_the_cpu_without_a_host_sync(setup):
    """The same mixed batch on CUDA: tokens equal to the CPU's, and a step whose rows use two
    adapters and none runs under CUDA's sync debug mode."""
    from models.layers.attention_metadata import build_metadata
    from models.layers.lora import build_adapter_batch

    cases = [(p, a) for p in PROMPTS for a in ADAPTERS]
    prompts, sampling = [p for p, _ in cases], [params(a) for _, a in cases]
    cpu = [o.outputs[0].token_ids
           for o in engine(setup, device="cpu", dtype="float32").generate(prompts, sampling)]
    gpu = engine(setup, device="cuda", dtype="float32", max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in gpu.generate(prompts, sampling)] == cpu
    model, device = gpu.engine.runner.model, torch.device("cuda")
    lens = [5, 1, 4]
    meta = build_metadata([0, 7, 0], lens, [[0], [1], [2]], 16, device)
    meta.adapters = build_adapter_batch([1, 0, 2], lens, device)
    ids = torch.arange(10, device=device) % 50
    pos = torch.tensor([0, 1, 2, 3, 4, 7, 0, 1, 2, 3], device=device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, meta))
    finally:
        torch.cuda.set_sync_debug_mode("default")
