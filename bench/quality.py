"""Quality per precision on real weights: teacher-forced next-token KL divergence from our float32
model, top-1 agreement with it and perplexity, over a fixed English text every Debian machine
ships (the GPL, /usr/share/common-licenses/GPL-3, about 8 k tokens), for our bfloat16, int8 and
int4 at groups 32 / 64 / 128, transformers' bfloat16, and llama.cpp at f32 / bf16 / q8_0 / q4_0
/ q4_1 / q4_K_M, each with its bits per weight (the decoder layers' linears).

    python -m bench.quality --model smollm2            # or gemma3, or PATH.gguf
    MMSERVE_CPU_ISA=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        MKL_ENABLE_INSTRUCTIONS=AVX2 python -m bench.quality --model gemma3   # held to AVX2

Every row starts from the same weights: the model's GGUF written back by llama.cpp's quantizer
as f32 (each block dequantized: exactly the values the file stands for), from which our engine
loads each of its precisions, transformers loads its bfloat16, and llama.cpp's quantizer writes
its own types with its default rules (bench/gguf.py). A row for the shipped file run as stored
(SmolLM2's Q4_1 as our int4 at group 32 with bfloat16 scales, float32 activations) measures what
that rounding costs. The rows "ours float32, int8 rounding only, per channel / g64 / g32" round
the linears' weights to int8 with a scale per output channel or per 64 / 32 inputs and run them
dense in float32: what the weights' rounding alone costs, whichever kernels could run it.

The text is cut into windows of `--window` tokens (each starting afresh, the first token of
each unscored; a model whose tokenizer adds BOS gets it at every window's start), the same token
ids for everyone (llama.cpp's logits for all positions through llama-cpp-python). Our float32
log-probabilities are kept on disk as float16 while the other rows run one at a time. Needs
`llama-cpp-python` (never a runtime dependency) and the real-weight data packages. A quality
figure does not depend on load: this may run while others work.
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bench.common import machine
from bench.gguf import requantize

GPL = Path("/usr/share/common-licenses/GPL-3")
LLAMA_TYPES = ("f32", "bf16", "q8_0", "q4_0", "q4_1", "q4_K_M")
OURS = {  # row -> engine options (on the f32 GGUF)
    "ours bfloat16": dict(dtype="bfloat16"),
    "ours bfloat16, int8 g32": dict(dtype="bfloat16", quantization="int8",
                                    quantization_group_size=32),
    "ours bfloat16, int8 g64": dict(dtype="bfloat16", quantization="int8",
                                    quantization_group_size=64),
    "ours bfloat16, int4 g32": dict(dtype="bfloat16", quantization="int4",
                                    quantization_group_size=32),
    "ours bfloat16, int4 g64": dict(dtype="bfloat16", quantization="int4",
                                    quantization_group_size=64),
    "ours bfloat16, int4 g128": dict(dtype="bfloat16", quantization="int4",
                                     quantization_group_size=128),
}
LINEAR_PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

Logits = Callable[[list[int]], torch.Tensor]  # a window's ids -> logits [len, vocab]


@dataclass
class Row:
    name: str
    bits_per_weight: float
    kld: float = 0.0
    kld_p99: float = 0.0
    top1: float = 0.0
    ppl: float = 0.0
    seconds: float = 0.0


def model_file(name: str) -> Path:
    from testing.real_weights import gemma3_path, missing_reason, smollm2_path

    if name.endswith(".gguf"):
        return Path(name)
    path = {"smollm2": smollm2_path, "gemma3": gemma3_path}[name]()
    if path is None:
        raise SystemExit(missing_reason(name))
    return path


def windows(ids: list[int], size: int, bos: int | None) -> Iterator[list[int]]:
    """Consecutive windows of the text's ids; with a BOS, each starts with it."""
    step = size - (bos is not None)
    for start in range(0, len(ids) - 1, step):
        piece = ids[start:start + step]
        if len(piece) > 1:
            yield ([bos] if bos is not None else []) + piece


def ours(path: Path, window: int, decode: bool = False, int8_rounding: int | None = None,
         **options) -> tuple[Logits, float, Callable[[], None]]:
    """Our engine's teacher-forced logits for a window (one prefill, or with `decode` one decode
    step per token through the KV cache, as generation runs), its layers' bits per weight, and a
    closer. `int8_rounding` (a group size, 0 for one scale per output channel): the decoder's
    linears and the head rounded to int8 values times bfloat16 scales and run dense, so that
    the row measures that rounding alone (round_to_int8)."""
    from engine import LLM
    from models.layers.attention_metadata import build_metadata

    llm = LLM(path, max_model_len=window, max_num_seqs=1, **options)
    runner = llm.engine.runner
    model, size = runner.model, runner.layout.block_size
    if int8_rounding is not None:
        round_to_int8(model, int8_rounding)

    def step(ids: list[int], start: int, blocks: list[int]) -> torch.Tensor:
        meta = build_metadata([start], [len(ids)], [blocks], size, torch.device("cpu"),
                              llm.engine.dtype, windows=model.attention_windows(),
                              decode_kernel=runner.decode_kernel)
        positions = torch.arange(start, start + len(ids))
        return model.compute_logits(model(torch.tensor(ids), positions, meta))

    def run(ids: list[int]) -> torch.Tensor:
        blocks = list(range(-(-len(ids) // size)))
        with torch.inference_mode():
            if not decode:
                return step(ids, 0, blocks)
            return torch.cat([step(ids[t:t + 1], t, blocks) for t in range(len(ids))])

    def close() -> None:
        nonlocal llm, model
        del llm, model

    return run, layer_bits(model), close


@torch.no_grad()
def round_to_int8(model: torch.nn.Module, group: int) -> None:
    """Each dense linear of the decoder and the head, in place, as q * s: q int8 in [-127, 127],
    s = max|w| / 127 in bfloat16 per `group` inputs of each output channel (0: per channel). In
    place, so that the native decode step's pointers stay right; a oneDNN copy the plan made is
    made again. A tied head rounds the embedding too (as a q8_0 GGUF's shared tensor is). A
    linear whose inputs `group` does not divide is left as it is."""
    from models.kernels.int_formats import dequantize_int8, quantize_int8
    from models.kernels.quantization import quantized_linears

    for parent, name in quantized_linears(model):
        linear = getattr(parent, name)
        n, k = linear.weight.shape
        width = group or k
        if k % width:
            continue
        q, scales = quantize_int8(linear.weight, width)
        linear.weight.copy_(dequantize_int8(q, scales, torch.float32))
        if linear.packed is not None:
            linear.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)


def layer_bits(model: torch.nn.Module) -> float:
    """Bits per weight of the decoder layers' linears as the model holds them."""
    from models.kernels.linear import Linear
    from models.kernels.quantization import QuantizedLinear

    nbytes = count = 0
    for module in model.layers.modules():
        if isinstance(module, QuantizedLinear):
            nbytes += module.qweight.nbytes + module.scales.nbytes
            count += module.in_features * module.out_features
        elif isinstance(module, Linear):
            nbytes += module.weight.nbytes
            count += module.weight.numel()
    return 8 * nbytes / count


def transformers_bf16(path: Path, decode: bool = False
                      ) -> tuple[Logits, float, Callable[[], None]]:
    from transformers import AutoModelForCausalLM, DynamicCache

    from testing.gguf import one_parse_per_file

    with one_parse_per_file():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.bfloat16).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            if not decode:
                return hf(torch.tensor([ids])).logits[0].float()
            cache, out = DynamicCache(), []
            for token in ids:
                result = hf(torch.tensor([[token]]), past_key_values=cache, use_cache=True)
                cache = result.past_key_values
                out.append(result.logits[0].float())
            return torch.cat(out)

    return run, 16.0, lambda: None


def llama_cpp(path: Path, window: int, threads: int) -> tuple[Logits, float, Callable[[], None]]:
    from llama_cpp import Llama

    llm = Llama(str(path), n_ctx=window, n_batch=window, n_ubatch=window, logits_all=True,
                n_threads=threads, n_threads_batch=threads, verbose=False)

    def run(ids: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(ids)
        return torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))

    return run, gguf_bits(path), llm.close


def gguf_bits(path: Path) -> float:
    """Bits per weight of a GGUF's decoder-layer linears as stored."""
    from models.gguf.reader import GGUFFile

    nbytes = count = 0
    for info in GGUFFile(path).tensors:
        if info.name.startswith("blk.") and info.name.split(".")[-2] in LINEAR_PARTS:
            nbytes, count = nbytes + info.nbytes, count + info.numel
    return 8 * nbytes / count


class Reference:
    """Our float32 log-probabilities of every scored position, float16 on disk."""

    def __init__(self, run: Logits, texts: list[list[int]], vocab: int, folder: Path) -> None:
        self.texts = texts
        rows = sum(len(ids) - 1 for ids in texts)
        self.logprobs = np.lib.format.open_memmap(folder / "reference.npy", mode="w+",
                                                  dtype=np.float16, shape=(rows, vocab))
        self.top1 = np.empty(rows, dtype=np.int64)
        self.nll = 0.0
        row = 0
        for ids in texts:
            lp = run(ids)[:-1].float().log_softmax(-1)
            n = lp.shape[0]
            self.logprobs[row:row + n] = lp.clamp(min=-60).numpy().astype(np.float16)
            self.top1[row:row + n] = lp.argmax(-1).numpy()
            self.nll -= lp.gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
            row += n
        self.rows = rows

    def compare(self, run: Logits, row: Row) -> Row:
        start = time.perf_counter()
        klds, agree, nll, first = [], 0, 0.0, 0
        for ids in self.texts:
            logits = run(ids)[:-1]
            n = logits.shape[0]
            for a in range(0, n, 64):  # a block of rows at a time: a 262k vocabulary is wide
                lq = logits[a:a + 64].float().log_softmax(-1)
                lp = torch.from_numpy(self.logprobs[first + a:first + a + lq.shape[0]]).float()
                klds.append((lp.exp() * (lp - lq)).sum(-1))
                agree += (lq.argmax(-1).numpy() == self.top1[first + a:first + a + lq.shape[0]]
                          ).sum()
                nll -= lq.gather(1, torch.tensor(ids[1 + a:1 + a + lq.shape[0]])[:, None]
                                 ).sum().item()
            first += n
        kld = torch.cat(klds)
        row.kld, row.kld_p99 = kld.mean().item(), kld.quantile(0.99).item()
        row.top1, row.ppl = agree / self.rows, float(np.exp(nll / self.rows))
        row.seconds = time.perf_counter() - start
        return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, gemma3 or a GGUF path")
    parser.add_argument("--tokens", type=int, default=8192, help="of the GPL text, at most")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="all", help="comma-separated names of the rows to "
                        "run, a trailing * for a prefix (\"ours bfloat16,llama.cpp*\"; a comma "
                        "followed by a space belongs to a name); default all")
    parser.add_argument("--decode", action="store_true", help="our rows and transformers' "
                        "one decode step per token through the KV cache (as generation runs) "
                        "instead of one prefill per window; llama.cpp's stay batched")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # Row names hold ", " themselves: a comma followed by a space is part of a name.
    wanted = None if args.rows == "all" else re.split(r",(?! )", args.rows)

    source = model_file(args.model)
    f32 = requantize(source, "f32")
    from engine.checkpoint_setup import CheckpointSetup

    setup = CheckpointSetup.load(f32)
    tokenizer = setup.tokenizer
    ids = tokenizer(GPL.read_text(), add_special_tokens=False).input_ids[: args.tokens]
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    texts = list(windows(ids, args.window, bos))
    vocab = setup.hf_config.vocab_size
    print(f"{source.name}: {len(ids)} tokens of {GPL} in {len(texts)} windows of up to "
          f"{args.window}{', ours and transformers by decode steps' if args.decode else ''}; "
          f"{machine()}")

    rows: list[Row] = []
    with tempfile.TemporaryDirectory(dir=f32.parent) as tmp:
        run, bits, close = ours(f32, args.window, dtype="float32")
        reference = Reference(run, texts, vocab, Path(tmp))
        close()
        print(f"reference: ours float32 ({bits:.2f} bits/weight), perplexity "
              f"{np.exp(reference.nll / reference.rows):.3f}")
        plans: list[tuple[str, Callable[[], tuple[Logits, float, Callable[[], None]]]]] = [
            *[(name, lambda o=options: ours(f32, args.window, args.decode, **o))
              for name, options in OURS.items()],
            ("ours, the file as stored, float32",
             lambda: ours(source, args.window, args.decode, dtype="float32")),
            # llama.cpp's own q8_0 file, its blocks run as stored (our int8 at group 32)
            ("ours bfloat16, llama.cpp's q8_0 file as stored",
             lambda: ours(requantize(f32, "q8_0"), args.window, args.decode, dtype="bfloat16")),
            *[(f"ours float32, int8 rounding only, {'per channel' if g == 0 else f'g{g}'}",
               lambda g=g: ours(f32, args.window, args.decode, int8_rounding=g, dtype="float32"))
              for g in (0, 64, 32)],
            ("transformers bfloat16", lambda: transformers_bf16(f32, args.decode)),
            *[(f"llama.cpp {kind}", lambda k=kind: llama_cpp(
                requantize(f32, k), args.window, args.threads)) for kind in LLAMA_TYPES],
        ]
        for name, make in plans:
            if wanted is not None and not any(
                    name == part or (part.endswith("*") and name.startswith(part[:-1]))
                    for part in wanted):
                continue
            run, bits, close = make()
            rows.append(reference.compare(run, Row(name, bits)))
            close()
            gc.collect()
            r = rows[-1]
            print(f"{r.name:<36} {r.bits_per_weight:5.2f} bpw  KLD {r.kld:.3e}  "
                  f"p99 {r.kld_p99:.3e}  top-1 {100 * r.top1:6.2f}%  ppl {r.ppl:.3f}  "
                  f"({r.seconds:.0f} s)", flush=True)
    print("\n| row | bits/weight (layers) | KLD from ours float32 | KLD p99 | top-1 agreement "
          "| perplexity |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.name} | {r.bits_per_weight:.2f} | {r.kld:.2e} | {r.kld_p99:.2e} | "
              f"{100 * r.top1:.2f}% | {r.ppl:.3f} |")
    if args.json:
        args.json.write_text(json.dumps({"model": source.name, "tokens": len(ids),
                                         "window": args.window, "machine": machine(),
                                         "rows": [asdict(r) for r in rows]}, indent=2))


if __name__ == "__main__":
    main()
