"""Shared benchmark helpers: timing, medians, memory bandwidth, table printing, cache dirs."""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn


def cache_dir(name: str) -> Path:
    root = Path(os.environ.get("MMSERVE_CACHE", Path.home() / ".cache" / "mmserve"))
    path = root / "bench" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def cached_checkpoint(name: str, what: str, build: Callable[[Path], object]) -> Path:
    """The checkpoint `build(path)` writes into the bench cache's `name`, built once (`what`
    says which, for the one line printed while building)."""
    path = cache_dir(name)
    if not (path / "config.json").exists():
        print(f"building a random {what} checkpoint in {path} (once)")
        build(path)
    return path


def timeit(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median(values: list[float]) -> float:
    return statistics.median(values)


def memory_bandwidth(gib: float = 1.0, repeats: int = 5, device: str = "cpu") -> float:
    """Read bandwidth in bytes/s of `device`'s memory (on CUDA: the median time of summing a
    `gib` GiB float32 tensor there, synchronized). On the CPU: the median time to sum a `gib`
    GiB float32 buffer, in huge pages as the engine's weights are (models.kernels.huge_pages),
    with our plain C read loop (models.kernels.native) where it builds, else torch's sum (which
    reads slower). The buffer is made once per process: a bench reading it between
    measurements then only reads memory (making it anew would fault in and free a GiB of pages
    each time, which the next measurement feels)."""
    if device != "cpu":
        return _device_bandwidth(torch.device(device), gib, repeats)
    from models.kernels import native

    x = _ruler_buffer(gib)
    kernels = native.load()
    read = (lambda: kernels.read_sum(x)) if kernels is not None else x.sum
    read()
    seconds = median([timeit(read) for _ in range(repeats)])
    return x.numel() * 4 / seconds


def _device_bandwidth(device: torch.device, gib: float, repeats: int) -> float:
    x = torch.ones(int(gib * (1 << 30)) // 4, device=device)

    def read() -> None:
        x.sum()
        torch.cuda.synchronize(device)

    read()
    seconds = median([timeit(read) for _ in range(repeats)])
    return x.numel() * 4 / seconds


@functools.cache
def _ruler_buffer(gib: float) -> torch.Tensor:
    from models.kernels import huge_pages

    holder = nn.Module()
    holder.register_buffer("x", torch.ones(int(gib * (1 << 30)) // 4))
    huge_pages.place_weights(holder)
    return holder.x


def matmul_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5) -> float:
    """Matmul throughput in FLOP/s for `dtype`: the median time of n x n products."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    return 2 * n**3 / median([timeit(lambda: a @ b) for _ in range(repeats)])


def machine(device: str = "cpu") -> str:
    """The CPU model, our kernels' variant, threads and torch; with a CUDA `device`, its name."""
    if device != "cpu":
        return (f"{torch.cuda.get_device_name(device)}, torch {torch.__version__} "
                f"(CUDA {torch.version.cuda})")
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from models.kernels import native

    kernels = native.load()
    variant = f"our kernels {kernels.variant}" if kernels else "no kernels of ours"
    return f"{cpu}, {variant}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def print_table(rows: list[tuple], header: tuple) -> None:
    cells = [tuple(str(c) for c in header)] + [tuple(_fmt(c) for c in row) for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """--model, --dtype and --quantization of the benches that decode one request."""
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default="none")


def decoding_checkpoint(args: argparse.Namespace) -> tuple[Path, str | None]:
    """(checkpoint, quantization or None) from those arguments; without --model,
    bench.generate's checkpoint (Qwen2-0.5B shapes, random weights)."""
    path = args.model or build_checkpoint()
    return path, None if args.quantization == "none" else args.quantization


def decoding_engine(path: Path, dtype: str, quantization: str | None, max_tokens: int,
                    max_model_len: int = 1024):
    """An engine (LLMEngine) on the CPU decoding one greedy request of a 128-token prompt, past
    its prefill and a few decode steps: each further `step()` is one single-stream decode."""
    from engine import LLM, SamplingParams

    llm = LLM(path, device="cpu", dtype=dtype, max_model_len=max_model_len,
              quantization=quantization, enable_prefix_caching=False)
    engine = llm.engine
    processor = engine.processor
    parsed = processor.parse(list(range(100, 228)))
    processed = processor.process(parsed, processor.load_media_sync(parsed))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.add_request(engine.make_request(processed, params))
    for _ in range(8):  # the prefill and a few decodes
        engine.step()
    return engine


QWEN2_05B = dict(
    hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2,
    vocab_size=151936, max_position_embeddings=4096, tie_word_embeddings=True, std=0.02,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
)


# Qwen3.5-0.8B's language model: 24 layers, three Gated DeltaNet layers to one gated attention.
QWEN3_5_08B = dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    vocab_size=248320, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
)
# Gemma 4 E4B's language model at 12 of its 42 layers (two of its seven 5:1 groups of sliding
# and global layers), every layer at E4B's shapes, the whole vocabulary and the per-layer table
# of those 12 layers. E4B's last 18 layers read the KV of the last layer of their type before
# them; here the last 6 do (the layer before them global, the one before that sliding, as in
# E4B and as llama.cpp's loader requires).
GEMMA4_E4B = dict(
    hidden_size=2560, intermediate_size=10240, num_hidden_layers=12, num_attention_heads=8,
    num_key_value_heads=2, head_dim=256, global_head_dim=512, vocab_size=262144,
    vocab_size_per_layer_input=262144, hidden_size_per_layer_input=256,
    num_kv_shared_layers=6, sliding_window=512, final_logit_softcapping=30.0,
    use_double_wide_mlp=False, attention_k_eq_v=False, max_position_embeddings=131072,
    layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2, rms_norm_eps=1e-6,
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                        "partial_rotary_factor": 0.25}},
)
SHAPES = ("qwen2-0.5b", "qwen3.5-0.8b", "gemma4-e4b")


def build_checkpoint(shapes: str = "qwen2-0.5b") -> Path:
    """The text benches' checkpoint (random weights), built once: Qwen2-0.5B's shapes,
    Qwen3.5-0.8B's language model (a text-only Qwen3_5ForCausalLM, saved in bfloat16), or
    Gemma 4 E4B's (`GEMMA4_E4B`: a Gemma4ForCausalLM, saved in bfloat16)."""
    if shapes not in SHAPES:
        raise ValueError(f"shapes must be one of {SHAPES}, got {shapes!r}")
    return cached_checkpoint(f"{shapes}-shapes", f"{shapes}-shaped",
                             lambda path: _build_text(shapes, path))


def _build_text(shapes: str, path: Path) -> None:
    from testing.tiny import build_text_model

    if shapes == "qwen2-0.5b":
        build_text_model(path, "qwen2", **QWEN2_05B)
        return
    if shapes == "gemma4-e4b":
        _build_gemma4(path)
        return
    import transformers

    from testing.tiny import qwen_tokenizer, save_checkpoint

    tok = qwen_tokenizer()
    config = transformers.Qwen3_5TextConfig(**QWEN3_5_08B, tie_word_embeddings=True,
                                            eos_token_id=tok.eos_token_id, bos_token_id=None)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    save_checkpoint(model, tok, path, [tok.eos_token_id])


def _build_gemma4(path: Path) -> Path:
    """GEMMA4_E4B as a Gemma4ForCausalLM with random weights, saved in bfloat16."""
    import transformers

    from testing.gemma4 import gemma4_tokenizer
    from testing.tiny import save_checkpoint

    tok = gemma4_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<pad>", "<eos>", "<bos>", "<turn|>")}
    config = transformers.Gemma4TextConfig(
        **GEMMA4_E4B, tie_word_embeddings=True, pad_token_id=ids["<pad>"],
        eos_token_id=ids["<eos>"], bos_token_id=ids["<bos>"])
    torch.manual_seed(0)
    model = transformers.Gemma4ForCausalLM(config).to(torch.bfloat16)
    return save_checkpoint(model, tok, path, [ids["<turn|>"], ids["<eos>"]])
