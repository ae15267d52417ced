"""Model-side helpers several test modules share: a tiny decoder built in memory, a shrunk
Gemma 3 1B shape for tiny checkpoints, and a recorder of the ops that force a host-device sync.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# The ATen ops that force a sync: reading a scalar back, nonzero, boolean-mask selection.
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "item", "equal", "is_nonzero"}

GEMMA3_1B_SHAPE = {  # Gemma 3 1B's proportions, shrunk: 6 layers, 5 local : 1 global
    "head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 6,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "hidden_activation": "gelu_pytorch_tanh",
}


class SyncRecorder(TorchDispatchMode):
    """Records, in `seen`, the sync-forcing ops (and boolean indexing) run while it is on."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in SYNC_OPS:
            self.seen.append(name)
        if name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else [])
        ):
            self.seen.append("boolean index")
        return func(*args, **(kwargs or {}))


def tiny_tied_model():
    """Two layers, hidden 64, a head tied to the embedding table (random init, on the CPU)."""
    from models.layers.attention import LayerAttention
    from models.layers.decoder import CausalLM, DecoderConfig

    cfg = DecoderConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=64,
        tie_word_embeddings=True, hidden_act="silu", layer_rope=({"rope_type": "default"},) * 2,
        layer_attention=(LayerAttention(None, None),) * 2,
    )
    return CausalLM(cfg, 64, torch.device("cpu"))


NATIVE_DECODE_PROMPTS = [[5, 9, 200, 17, 3], list(range(40, 61)), [7, 7, 7]]


def run_decode_steps(llm, native_on: bool, prompts: list[list[int]] = NATIVE_DECODE_PROMPTS
                     ) -> tuple[list[torch.Tensor], list[list[int]], list[int]]:
    """Ten greedy tokens of each prompt with the one-call native decode step on or off: (logits
    of every step, greedy tokens per prompt, rows of the steps the native call took)."""
    from engine import SamplingParams

    model = llm.engine.runner.model
    decode = model.native_decode
    logits, taken = [], []
    original_logits, original_run = model.compute_logits, decode.run

    def record_logits(hidden):
        out = original_logits(hidden)
        logits.append(out.clone())
        return out

    def record_run(h, rotary, meta):
        out = original_run(h, rotary, meta)
        if out is not None:
            taken.append(h.shape[0])
        return out

    model.compute_logits, decode.run = record_logits, record_run
    model.native_decode = decode if native_on else None
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0,
                                                    ignore_eos=True))
    finally:
        model.compute_logits, model.native_decode = original_logits, decode
        del decode.run
    return logits, [o.outputs[0].token_ids for o in outs], taken
