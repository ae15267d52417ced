"""Bench-only: a random-weight mixture-of-experts checkpoint with a real model's layer shapes,
written tensor by tensor into safetensors shards, so that a checkpoint larger than memory is made
without ever holding it (transformers' classes would build the whole model first).

    python -m bench.moe_checkpoint --out DIR [--shapes qwen3-30b-a3b] [--layers 12]
        [--shard-gib 4]

`qwen3-30b-a3b`: Qwen3-30B-A3B's (Qwen3-VL-30B-A3B's language model has the same shapes):
hidden 2048, 32 query heads and 4 KV heads of 128, 128 experts of 768 with 8 per token, a
151936-token vocabulary, untied head; bfloat16, per-expert tensors as transformers writes them.
`--layers` keeps that many of its 48 layers (12: a quarter, about 15 GB). `small`: the same
layer shapes with 32 experts and 4 layers (about 2.5 GB), small enough for transformers'
reference in bfloat16 beside the engine. Weights are N(0, 0.02) from a fixed seed (norms 1);
the tokenizer is the tests' locally trained one (prompts are token ids). Never commit the
output: build it outside the repository.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

QWEN3_30B_A3B = dict(
    hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    intermediate_size=6144, vocab_size=151936, max_position_embeddings=40960,
    rms_norm_eps=1e-6, norm_topk_prob=True, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
SHAPES = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "small": {**QWEN3_30B_A3B, "num_experts": 32, "num_hidden_layers": 4},
}


def layer_tensors(cfg: dict, i: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of layer i's tensors, per expert, in transformers' names."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    inter = cfg["moe_intermediate_size"]
    p = f"model.layers.{i}."
    out = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
           (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
           (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q)),
           (p + "self_attn.q_norm.weight", (d,)), (p + "self_attn.k_norm.weight", (d,)),
           (p + "mlp.gate.weight", (cfg["num_experts"], h))]
    for e in range(cfg["num_experts"]):
        x = f"{p}mlp.experts.{e}."
        out += [(x + "gate_proj.weight", (inter, h)), (x + "up_proj.weight", (inter, h)),
                (x + "down_proj.weight", (h, inter))]
    return out


def all_tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    out = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        out += layer_tensors(cfg, i)
    return out + [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]


def write(out: Path, shapes: str, layers: int | None, shard_gib: float, seed: int = 0) -> Path:
    """Write the checkpoint to `out` (config, tokenizer, sharded weights); returns `out`."""
    import transformers
    from safetensors.torch import save_file

    from testing.tiny import qwen_tokenizer

    cfg = dict(SHAPES[shapes])
    if layers is not None:
        cfg["num_hidden_layers"] = layers
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = qwen_tokenizer()
    config = transformers.Qwen3MoeConfig(**cfg, eos_token_id=tokenizer.eos_token_id,
                                         bos_token_id=None, dtype="bfloat16",
                                         architectures=["Qwen3MoeForCausalLM"])
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tokenizer.eos_token_id], "do_sample": False}))
    gen = torch.Generator().manual_seed(seed)
    limit = int(shard_gib * (1 << 30))
    current: dict[str, torch.Tensor] = {}  # the shard being filled; written when full
    names: list[list[str]] = []
    total = 0
    filled = 0  # bytes in `current`

    def flush() -> None:
        names.append(list(current))
        save_file(current, out / f"part-{len(names):05d}.safetensors",
                  metadata={"format": "pt"})
        print(f"  shard {len(names)}: {filled / 2**30:.2f} GiB", flush=True)
        current.clear()

    for name, shape in all_tensors(cfg):
        if name.endswith("norm.weight"):
            tensor = torch.ones(shape, dtype=torch.bfloat16)
        else:
            tensor = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        nbytes = tensor.numel() * 2
        if current and filled + nbytes > limit:
            flush()
            filled = 0
        current[name] = tensor
        filled += nbytes
        total += nbytes
    flush()
    weight_map = {}
    for index, group in enumerate(names, start=1):
        final = f"model-{index:05d}-of-{len(names):05d}.safetensors"
        (out / f"part-{index:05d}.safetensors").rename(out / final)
        weight_map |= {n: final for n in group}
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--shard-gib", type=float, default=4.0)
    args = parser.parse_args()
    if (args.out / "config.json").exists():
        raise SystemExit(f"{args.out} already holds a checkpoint")
    print(f"writing {args.shapes} ({args.layers or 'all'} layers) to {args.out}")
    write(args.out, args.shapes, args.layers, args.shard_gib)


if __name__ == "__main__":
    main()
