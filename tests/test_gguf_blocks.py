"""Weights run in a GGUF file's own ggml blocks (models/kernels/ggml_blocks.py, cpu/
ggml_blocks.c): every block type dequantized bit for bit as gguf-py (ggml's definitions) does,
on random blocks; the matrix-vector kernel (a decode step's rows: int8 activations, within the
bound their rounding allows) and the tiled GEMM (a prefill's) against a float64 product of
those values; and a tiny K-quant GGUF (Q4_K, Q5_K, Q6_K,
Q5_0, Q5_1, q / k and v of different types in one fused linear, biases) run as stored with the
same greedy tokens as the file dequantized to float32. Run again per lower kernel variant by
tests/test_cpu_variants.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from models.gguf.reader import GGUFFile
from models.kernels import ggml_blocks, native
from models.kernels.cpu_variants import chosen
from models.kernels.ggml_blocks import (
    BLOCK_TYPES,
    BlockEmbedding,
    BlockLinear,
    dequantize_channels,
)

# Byte offsets of each type's float16 scale (and minimum) inside a block.
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
N, K = 70, 512  # 70 rows: not a multiple of any tile


def random_blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random blocks [rows, row bytes] of `type_name`: random quants and sub-block scales, the
    float16 scales drawn around 0.02 (a few subnormal, a few zero)."""
    block = BLOCK_TYPES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // block.values, block.nbytes), dtype=np.uint8)
    for offset in HALVES[type_name]:
        half = (rng.standard_normal(raw.shape[:2]) * 0.02).astype(np.float16)
        half.reshape(-1)[:3] = [np.float16(3e-7), np.float16(-6e-8), np.float16(0)]
        raw[:, :, offset:offset + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.fixture(scope="module")
def weights():
    """Per type: (blocks uint8 [N, row bytes], gguf-py's float32 values [N, K])."""
    out = {}
    for i, name in enumerate(BLOCK_TYPES):
        raw = random_blocks(name, N, K, seed=i)
        values = dequantize(raw, GGMLQuantizationType[name]).reshape(N, K).astype(np.float32)
        out[name] = (torch.from_numpy(raw), torch.from_numpy(values))
    return out


def test_the_kernels_are_the_variant_chosen():
    kernels = native.load()
    assert kernels is not None, native.status().detail
    assert kernels.variant == chosen().name


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_dequantized_bit_for_bit_as_gguf_py(weights, name):
    blocks, values = weights[name]
    ours = dequantize_channels(blocks, name, K)
    assert torch.equal(ours.view(torch.int32), values.view(torch.int32))
    ids = torch.tensor([5, 0, 69, 5])  # an embedding's lookup: rows by index
    assert torch.equal(dequantize_channels(blocks, name, K, ids), values[ids])
    assert torch.equal(dequantize_channels(blocks, name, K, slice(30, 41)), values[30:41])


def digit_bound(x: torch.Tensor, values: torch.Tensor, digits: int = 2,
                group: int = 32) -> torch.Tensor:
    """What the matrix-vector kernel may be off from x . W^T, per output: x is written per group
    of inputs (a block of 32, or a super-block of 256 for the K types) in int8 digits,
    dx (h + l / 256) with dx = max|x| / 127 over the group, so each input within max|x| / 254
    (one digit) or max|x| / 32512 (two: l is clamped to 127), the group then contributing at
    most sum |w| times that; plus float32's rounding of the sums and scales."""
    m, k = x.shape
    top = x.abs().reshape(m, k // group, group).amax(-1).repeat_interleave(group, -1).double()
    w = values.abs().double().t()
    step = 1 / 254 if digits == 1 else 1 / 32512
    return top @ w * (step + 1e-5) + 1e-5 * (x.abs().double() @ w)


def assert_rows_as_alone(x: torch.Tensor, blocks: torch.Tensor, kind: str) -> None:
    """A verify's rows: each row of a 2-, 5- and 9-row call of the vector path is the one-row
    call's result, bit for bit, at one and two digits."""
    for digits in (1, 2):
        alone = torch.cat([ggml_blocks.block_linear(x[i:i + 1], blocks, kind, K, "vector",
                                                    digits) for i in range(9)])
        for rows in (2, 5, 9):
            together = ggml_blocks.block_linear(x[:rows], blocks, kind, K, "vector", digits)
            assert torch.equal(together, alone[:rows]), (rows, digits)


@pytest.mark.parametrize("type_name", ["Q4_K", "Q8_0"])
@pytest.mark.parametrize("digits", [1, 2])
def test_a_long_prefill_in_chunks(type_name, digits):
    """The integer kernel on more rows than the chunk it meets the whole weight with at once
    (512 KiB of digits: 256 rows of 1024 inputs at two digits, 512 at one): every row as it is
    alone, repacked (groups of 8) and as stored, float32 and bfloat16 x."""
    k = 1024
    blocks = torch.from_numpy(random_blocks(type_name, 24, k, seed=3))
    x = torch.randn(600, k, generator=torch.Generator().manual_seed(2))
    for part in (BlockLinear([(type_name, blocks)], k, None).parts[0],
                 BlockLinear([(type_name, blocks)], k, None, repack_blocks=False).parts[0]):
        def run(rows: torch.Tensor, part=part) -> torch.Tensor:
            return ggml_blocks.block_linear(rows, part.blocks, part.kernel_type, k,
                                            digits=digits)
        for rows in (x, x.bfloat16()):
            assert torch.equal(run(rows), torch.cat([run(rows[i:i + 1])
                                                     for i in range(len(rows))]))


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_decode_and_prefill_products(weights, name):
    blocks, values = weights[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, K, generator=gen)
    x[0, :32] *= 50  # one block of large inputs: its bound is its own
    want = x.double() @ values.double().t()
    layer = BlockLinear([(name, blocks)], K, None)
    for rows in (1, 5):  # the matrix-vector kernel: the variant's path and the plain one
        for path in ("vector", "plain"):
            for digits in (1, 2):
                got = ggml_blocks.block_linear(x[:rows], blocks, name, K, path, digits)
                assert got.dtype == torch.float32
                bound = digit_bound(x[:rows], values, digits, BLOCK_TYPES[name].values)
                assert ((got.double() - want[:rows]).abs() <= bound).all(), (rows, path, digits)
        assert torch.equal(layer(x[:rows]), ggml_blocks.block_linear(x[:rows], blocks, name, K))
    assert_rows_as_alone(x, blocks, name)
    got = layer(x)  # the tiled GEMM on the dequantized values
    bound = 1e-5 * (x.abs().double() @ values.abs().double().t()).max()  # float32 sums
    assert (got.double() - want).abs().max() <= bound
    # at one digit a prefill's rows take the integer kernel, each row as a decode step sums it
    for part in layer.parts:
        part.digits = 1
    got = layer(x)
    assert ((got.double() - want).abs() <= digit_bound(x, values, 1, BLOCK_TYPES[name].values)
            ).all()
    assert torch.equal(got, torch.cat([layer(x[i:i + 1]) for i in range(len(x))]))
    for part in layer.parts:
        part.digits = 2
    # bfloat16 activations: rounded once at the end
    got = layer(x[:2].bfloat16())
    assert got.dtype == torch.bfloat16
    want = x[:2].bfloat16().double() @ values.double().t()
    bound = digit_bound(x[:2].bfloat16().float(), values)
    assert ((got.double() - want).abs() <= 2**-8 * want.abs() + bound).all()


def _repacked(blocks: torch.Tensor, name: str) -> tuple[str, torch.Tensor]:
    """`blocks` in the x8 layout of `name` through the C repacking, in any build (the plain
    path and the dequantizer read it everywhere; the engine repacks only where a vector path
    runs it: ggml_blocks.repack)."""
    kernels = native.load()
    target = ggml_blocks.REPACKED[name]
    n = blocks.shape[0]
    out = torch.empty(n, ggml_blocks.row_bytes(ggml_blocks.KERNEL_TYPES[target], K),
                      dtype=torch.uint8)
    assert kernels.ggml_repack(blocks.data_ptr(), BLOCK_TYPES[name].code, n, K, out.data_ptr(),
                               2) == 0
    return target, out


@pytest.mark.parametrize("name", list(ggml_blocks.REPACKED))
def test_the_repacked_layouts_hold_the_files_values(name):
    """Every type in groups of 8 output channels: every value bit for bit as
    gguf-py reads the file's blocks (whole, by index, by slice), the decode products within
    the digits' bound on the vector and the plain paths (the plain path's to the bit the file
    layout's: it reads each block back as stored), a verify's rows each the one-row call's to
    the bit."""
    rows_n = 72  # nine groups
    raw = random_blocks(name, rows_n, K, seed=11)
    values = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(rows_n, K)
                              .astype(np.float32))
    stored = torch.from_numpy(raw)
    kind, held = _repacked(stored, name)
    values_per, per_channel = {"Q4_K": (256, 148), "Q5_K": (256, 180), "Q6_K": (256, 210),
                               "Q4_0": (32, 18),
                               "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
                               "Q8_0": (32, 34)}[name]  # Q4/5_K's scales as bytes: 4 more
    assert held.shape == (rows_n, K // values_per * per_channel)
    assert torch.equal(dequantize_channels(held, kind, K).view(torch.int32),
                       values.view(torch.int32))
    ids = torch.tensor([5, 0, 71, 5, 12])
    assert torch.equal(dequantize_channels(held, kind, K, ids), values[ids])
    assert torch.equal(dequantize_channels(held, kind, K, slice(13, 30)), values[13:30])
    x = torch.randn(9, K, generator=torch.Generator().manual_seed(2))
    x[0, :32] *= 50
    want = x.double() @ values.double().t()
    for rows in (1, 5):
        for digits in (1, 2):
            bound = digit_bound(x[:rows], values, digits, values_per)
            for path in ("vector", "plain"):
                got = ggml_blocks.block_linear(x[:rows], held, kind, K, path, digits)
                assert ((got.double() - want[:rows]).abs() <= bound).all(), (rows, path, digits)
            assert torch.equal(
                ggml_blocks.block_linear(x[:rows], held, kind, K, "plain", digits),
                ggml_blocks.block_linear(x[:rows], stored, name, K, "plain", digits))
    assert_rows_as_alone(x, held, kind)
    # the layer repacks where this build's vector path runs the layout, and computes the same
    layer = BlockLinear([(name, stored)], K, None)
    taken = bool(native.load().ggml_repack_takes(BLOCK_TYPES[name].code, rows_n, K))
    assert layer.parts[0].kernel_type == (kind if taken else name)
    assert layer.format == name and layer.nbytes == ggml_blocks.held_bytes(name, rows_n, K)
    assert torch.equal(layer(x[:3]), ggml_blocks.block_linear(x[:3], held, kind, K)
                       if taken else ggml_blocks.block_linear(x[:3], stored, name, K))
    assert torch.equal(layer.dequantize(), values)
    # not whole groups of 8: kept as stored; the kernel refuses such a layout
    odd = BlockLinear([(name, stored[:70])], K, None)
    assert odd.parts[0].kernel_type == name
    with pytest.raises(ValueError, match="does not take"):
        ggml_blocks.block_linear(x[:1], held[:70].contiguous(), kind, K)


# each type's quant bytes in a block (and Q5's fifth bits), and the byte that makes every quant
# its largest in magnitude (Q8_0's signed: -127)
LARGEST = {"Q4_0": (slice(2, 18), 0xFF), "Q4_1": (slice(4, 20), 0xFF),
           "Q5_0": (slice(2, 22), 0xFF), "Q5_1": (slice(4, 24), 0xFF),
           "Q8_0": (slice(2, 34), 0x81), "Q4_K": (slice(16, 144), 0xFF),
           "Q5_K": (slice(16, 176), 0xFF), "Q6_K": (slice(0, 192), 0xFF)}


@pytest.mark.parametrize("name", list(ggml_blocks.REPACKED))
def test_the_largest_sums_stay_exact(name):
    """Every quant at its largest and every input at the digits' top: the repacked kernels'
    narrow sums (AVX2's int16 runs: a run of Q5_K's steps is cut where 8 would overflow) hold
    them, the vector path within the digits' bound of x . W^T as the plain one."""
    rows_n = 16
    raw = random_blocks(name, rows_n, K, seed=5)
    quants, largest = LARGEST[name]
    raw.reshape(rows_n, -1, BLOCK_TYPES[name].nbytes)[:, :, quants] = largest
    values = torch.from_numpy(dequantize(raw, GGMLQuantizationType[name]).reshape(rows_n, K)
                              .astype(np.float32))
    kind, held = _repacked(torch.from_numpy(raw), name)
    x = torch.ones(2, K)
    x[1] = -1.0
    want = x.double() @ values.double().t()
    for digits in (1, 2):
        bound = digit_bound(x, values, digits, BLOCK_TYPES[name].values)
        for path in ("vector", "plain"):
            got = ggml_blocks.block_linear(x, held, kind, K, path, digits)
            assert ((got.double() - want).abs() <= bound).all(), (path, digits)


def test_parts_of_different_types_and_a_bias(weights):
    """A fused q / k / v whose tensors differ in type: each part in its own blocks."""
    (qb, qv), (vb, vv) = weights["Q4_K"], weights["Q6_K"]
    bias = torch.randn(2 * N)
    layer = BlockLinear([("Q4_K", qb), ("Q6_K", vb)], K, bias)
    assert layer.format == "Q4_K+Q6_K" and layer.out_features == 2 * N
    assert layer.nbytes == qb.nbytes + vb.nbytes
    x = torch.randn(3, K)
    want = x.double() @ torch.cat([qv, vv]).double().t() + bias.double()
    bound = digit_bound(x, torch.cat([qv, vv])) + 1e-6 * bias.abs().double()
    assert ((layer(x).double() - want).abs() <= bound).all()
    assert torch.equal(layer.dequantize(), torch.cat([qv, vv]))


@pytest.mark.parametrize("name", list(BLOCK_TYPES))
def test_embedding_rows_are_the_dequantized_tables(weights, name):
    """A table in its blocks looks up the rows of the table gguf-py dequantizes, rounded to the
    model dtype, bit for bit."""
    blocks, values = weights[name]
    ids = torch.tensor([[3, 0, N - 1], [3, 41, 7]])
    for dtype in (torch.float32, torch.bfloat16):
        table = BlockEmbedding(blocks, name, K, dtype)
        got = table(ids)
        assert got.dtype == dtype and got.shape == (2, 3, K) and table.weight.dtype == dtype
        assert torch.equal(got, values.to(dtype)[ids])
    with pytest.raises(IndexError, match="channel ids"):
        table(torch.tensor([N]))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="rows of 100"):
        BlockLinear([("Q4_K", torch.zeros(4, 144, dtype=torch.uint8))], 100, None)
    with pytest.raises(ValueError, match=r"\[N, 144\]"):
        BlockLinear([("Q4_K", torch.zeros(4, 140, dtype=torch.uint8))], 256, None)
    assert not ggml_blocks.takes("IQ4_XS", 256) and not ggml_blocks.takes("Q3_K", 256)


K_TYPES = {r"attn_[qk]$|ffn_down": GGMLQuantizationType.Q4_K,
           r"attn_v": GGMLQuantizationType.Q6_K, r"attn_output": GGMLQuantizationType.Q5_K,
           r"ffn_gate": GGMLQuantizationType.Q5_0, r"ffn_up": GGMLQuantizationType.Q5_1,
           r"token_embd": GGMLQuantizationType.Q6_K, r"^output$": GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module")
def k_quant_file(tmp_path_factory):
    """A tiny Qwen2 (q / k / v biases, an untied head) as a K-quant GGUF, every linear's rows a
    whole number of 256-value super-blocks."""
    from testing.gguf import write_gguf
    from testing.tiny import build_text_model

    root = tmp_path_factory.mktemp("kquant")
    checkpoint = build_text_model(root / "qwen2", "qwen2", hidden_size=256,
                                  intermediate_size=512, tie_word_embeddings=False)
    (root / "gguf").mkdir()
    return write_gguf(checkpoint, root / "gguf" / "tiny-k.gguf", types=K_TYPES)


def test_a_k_quant_file_runs_as_stored(k_quant_file):
    from engine import LLM
    from engine.inspect import inspect, render
    from engine.sampling_params import SamplingParams

    stored = LLM(k_quant_file, max_model_len=128)
    model = stored.engine.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, BlockLinear)
    assert layer.self_attn.qkv_proj.format == "Q4_K+Q6_K"
    assert layer.mlp.gate_up_proj.format == "Q5_0+Q5_1"
    assert isinstance(model.lm_head, BlockLinear) and model.lm_head.format == "Q8_0"
    summary = stored.engine.runner.gguf_summary
    assert summary.startswith("as stored: ") and "Q4_K" in summary and "Q5_K" in summary
    assert isinstance(model.embed_tokens, BlockEmbedding)  # its Q6_K blocks, untied
    assert model.embed_tokens.type_name == "Q6_K" and "the embedding table in its blocks" \
        in summary and "token embedding" not in summary
    # every block is a view of the file's one mapping, at the tensor's bytes in the file
    mapping, = model.mapped_files
    assert mapping.path == k_quant_file
    file, raw = GGUFFile(k_quant_file), k_quant_file.read_bytes()
    qkv = [file.tensor_by_name[f"blk.0.attn_{p}.weight"] for p in "qkv"]
    parts = layer.self_attn.qkv_proj.parts  # q + k one part where adjacent
    assert sum(p.blocks.nbytes for p in parts) == sum(
        ggml_blocks.held_bytes(i.type_name, *i.shape) for i in qkv)
    # a part the decode kernel runs repacked (in groups of 8 channels) is a copy holding the
    # file's values; the others view the file's bytes
    repacked = [p for p in parts if p.kernel_type != p.type_name]
    assert bool(repacked) == bool(native.load().ggml_repack_takes(
        BLOCK_TYPES["Q4_K"].code, 256, 256))
    def file_values(infos):
        return torch.from_numpy(np.concatenate([dequantize(
            np.frombuffer(raw, np.uint8, i.nbytes, i.offset).reshape(i.shape[0], -1),
            i.ggml_type).reshape(i.shape) for i in infos]).astype(np.float32))

    output = file.tensor_by_name["output.weight"]
    assert torch.equal(layer.self_attn.qkv_proj.dequantize(), file_values(qkv))
    assert torch.equal(model.lm_head.dequantize(), file_values([output]))
    views = [([i.offset for i in qkv], p.blocks) for p in parts if p not in repacked]
    views += [([file.tensor_by_name["token_embd.weight"].offset], model.embed_tokens.blocks)]
    views += [([output.offset], p.blocks) for p in model.lm_head.parts
              if p.kernel_type == p.type_name]
    for offsets, blocks in views:
        offset = blocks.data_ptr() - mapping.start
        assert blocks.untyped_storage().data_ptr() == mapping.start and offset in offsets
        assert blocks.numpy().tobytes() == raw[offset:offset + blocks.nbytes]
    dense = LLM(k_quant_file, max_model_len=128, dequantize_gguf=True)
    assert not any(isinstance(m, BlockLinear) for m in dense.engine.runner.model.modules())
    assert not getattr(dense.engine.runner.model, "mapped_files", ())
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = ["The quick brown fox", "Café 你好", "1, 2, 3,"]
    ours = [o.outputs[0].token_ids for o in stored.generate(prompts, params)]
    assert ours == [o.outputs[0].token_ids for o in dense.generate(prompts, params)]
    # the inspector holds the blocks at their bytes, the rest at the dtype
    held = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers()
                                                          if b.dtype == torch.uint8)
    report = inspect(k_quant_file)
    assert report.weight_bytes == held
    assert "as stored" in render(report)


def test_one_activation_digit_runs_every_row_through_the_integer_kernel(k_quant_file):
    """gguf_activation_digits=1 (llama.cpp's Q8 activations): every block linear's parts write
    x in one digit, the start-up line says so, the one-call decode step takes the digits from
    its descriptors (the modules' logits to the bit), and a prompt's rows go through the
    integer kernel, not the GEMM."""
    from engine import LLM
    from engine.config import EngineConfig
    from models.layers.attention_metadata import build_metadata
    from tests.model_fixtures import run_decode_steps

    with pytest.raises(ValueError, match="gguf_activation_digits must be 1 or 2"):
        EngineConfig(gguf_activation_digits=3)
    one = LLM(k_quant_file, max_model_len=128, gguf_activation_digits=1,
              enable_prefix_caching=False)
    model = one.engine.runner.model
    parts = [m for m in model.modules() if isinstance(m, ggml_blocks.BlockPart)]
    assert parts and {part.digits for part in parts} == {1}
    assert "one int8 digit" in one.engine.runner.gguf_summary
    one.engine.runner.decode_kernel = "native"
    model.prepare_decode()
    native_logits, native_tokens, taken = run_decode_steps(one, True)
    module_logits, module_tokens, _ = run_decode_steps(one, False)
    assert taken and native_tokens == module_tokens
    for a, b in zip(native_logits, module_logits, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()

    # a prompt's rows: each linear within one digit's bound of x . W^T, the logits not the
    # two-digit engine's (a random model moves far on such differences: no bound on them)
    ids = list(range(3, 43))
    checked: list[str] = []

    def within_one_digit(linear, inputs, out) -> None:
        x = inputs[0].reshape(-1, linear.in_features).float()
        values = linear.dequantize()
        got = out.reshape(x.shape[0], -1).double() - (
            0 if linear.bias is None else linear.bias.double())
        bound = digit_bound(x, values, 1, 256)  # a 32-value type's bound is within it
        assert ((got - x.double() @ values.double().t()).abs() <= bound).all(), linear.format
        checked.append(linear.format)

    def prompt_logits(llm, hook=None) -> torch.Tensor:
        stack = llm.engine.runner.model
        hooks = [m.register_forward_hook(hook) for m in stack.modules()
                 if hook is not None and isinstance(m, BlockLinear)]
        meta = build_metadata([0], [len(ids)], [list(range(3))], 16, torch.device("cpu"))
        try:
            with torch.inference_mode():
                return stack.compute_logits(stack(torch.tensor(ids), torch.arange(len(ids)),
                                                  meta))
        finally:
            for handle in hooks:
                handle.remove()

    got = prompt_logits(one, within_one_digit)
    assert len(checked) == 4 * len(model.layers) + 1  # the head too
    assert not torch.equal(got, prompt_logits(LLM(k_quant_file, max_model_len=128)))


def test_a_head_tied_to_a_k_quant_table_shares_its_repacked_blocks(tmp_path):
    """A tied head on a Q6_K table: the table is held in the decode kernel's layout (where this
    build runs it), the head reads the very same bytes, the lookups the same values: greedy
    tokens as the file dequantized to float32."""
    from engine import LLM
    from engine.sampling_params import SamplingParams
    from testing.gguf import write_gguf
    from testing.tiny import build_text_model

    checkpoint = build_text_model(tmp_path / "qwen2", "qwen2", hidden_size=256,
                                  intermediate_size=512, tie_word_embeddings=True)
    path = write_gguf(checkpoint, tmp_path / "tied.gguf",
                      types={r"token_embd": GGMLQuantizationType.Q6_K,
                             r"attn|ffn": GGMLQuantizationType.Q4_K})
    stored = LLM(path, max_model_len=128)
    model = stored.engine.runner.model
    table, head = model.embed_tokens, model.lm_head
    assert isinstance(table, BlockEmbedding) and isinstance(head, BlockLinear)
    taken = bool(native.load().ggml_repack_takes(BLOCK_TYPES["Q6_K"].code,
                                                 table.num_embeddings, 256))
    assert table.kernel_type == ("Q6_Kx8" if taken else "Q6_K") == head.parts[0].kernel_type
    assert head.parts[0].blocks.data_ptr() == table.blocks.data_ptr()
    dense = LLM(path, max_model_len=128, dequantize_gguf=True)
    params = SamplingParams(max_tokens=10, temperature=0)
    prompts = ["The quick brown fox", "1, 2, 3,"]
    assert [o.outputs[0].token_ids for o in stored.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in dense.generate(prompts, params)]


@pytest.mark.parametrize("threads", [1, 3])
def test_the_native_decode_step_takes_the_block_layers(k_quant_file, threads):
    """The one-call decode step (models.layers.native_decode) runs the layers' blocks as stored,
    q / k / v in two parts of different types and biases included: the modules' logits to the
    bit at every step, on one thread and on more threads than cores; a verify's rows past
    FEW_ROWS are left to the modules."""
    from engine import LLM
    from models.kernels.choice import BUCKETS
    from models.layers.native_decode import NativeDecode
    from tests.model_fixtures import NATIVE_DECODE_PROMPTS, run_decode_steps

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(k_quant_file, max_model_len=128, enable_prefix_caching=False, block_size=4)
        runner = llm.engine.runner
        runner.decode_kernel = "native"
        runner.model.prepare_decode()
        decode = runner.model.native_decode
        assert isinstance(decode, NativeDecode)
        assert decode.buckets == tuple(b in ("1", "2-8") for b in BUCKETS)
        native_logits, native_tokens, taken = run_decode_steps(llm, True)
        module_logits, module_tokens, none_taken = run_decode_steps(llm, False)
        assert taken and max(taken) == len(NATIVE_DECODE_PROMPTS) and not none_taken
        assert native_tokens == module_tokens
        for a, b in zip(native_logits, module_logits, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()
    finally:
        torch.set_num_threads(before)
