"""Drafting with the target checkpoint's own multi-token-prediction layers (Qwen3.5's `mtp.*`
weights, models/layers/mtp.py), as vLLM drafts with them.

After every step the MTP layer catches up on the positions the target computed there and kept
(a prefill chunk's, a decode's, a verification's last token and accepted drafts): at each such
position i, the target's final hidden state h_i and the token after it. That one forward writes
the layer's keys and values at those positions, and for a request that decodes next its last
row guesses the token after the one just sampled: the first draft. Each further draft feeds
the layer its own output and the previous draft, one position on. The layer's keys and values
live in a cache of the target's block count, indexed by the target's block ids (no block
manager of its own); the drafts' slots past the request's blocks are reserved as the verify
step will need them. Positions a prefix-cache hit skipped have no MTP keys (their hidden
states were never computed): drafting reads whatever their slots hold there, which can only
make drafts worse, never the output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model_runner import ModelRunner, StepResult
from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.speculation_state import Proposal
from engine.speculative.drawing import draw, proposals
from engine.speculative.kept_rows import kept_rows
from models.kernels.linear import Linear
from models.kernels.linear_choice import choose_linear_kernels, pin_decode_rows
from models.kernels.quantization import quantize_linear
from models.layers.attention_metadata import build_metadata
from models.layers.decoder import Decoder
from models.layers.mtp import PREFIX, MultiTokenPredictor, mtp_layers
from models.layers.transfer import to_device
from models.loader import build_on_meta, iter_checkpoint, load_weights

log = logging.getLogger(__name__)


class MTPError(ValueError):
    """A target that has no multi-token-prediction layers to draft with."""


@dataclass
class MTPSequence:
    """A request's side of the MTP layer: the positions whose MTP keys and values come from
    the target's hidden states, and the layer's output at the last of them (None: the request
    did not run in the last step)."""

    computed: int = 0
    hidden: torch.Tensor | None = None  # [H]: the layer's output at position num_tokens - 2


class MTPProposer:
    """Drafts with the target's MTP layers."""

    name = "mtp"

    def __init__(self, target: ModelRunner, head: MultiTokenPredictor, blocks: BlockManager,
                 cost_per_token: float) -> None:
        self.target, self.head, self.blocks = target, head, blocks
        self.cost_per_token = cost_per_token
        self.seqs: dict[str, MTPSequence] = {}
        model = target.model
        # the rope table of the target's full-attention layers (the MTP layer's shape)
        first = next(layer for layer in model.layers if layer.mixer == "attention")
        self.rope = model.rotaries[first.rope_index]

    @classmethod
    def load(cls, target: ModelRunner, path: Path, hf_config, config: EngineConfig,
             blocks: BlockManager) -> MTPProposer:
        """The MTP layers of the target checkpoint at `path` (`mtp_num_hidden_layers` in its
        text config, their `mtp.*` tensors), in the target's dtype, planned and quantized as
        the target is."""
        model = target.model
        text = hf_config.get_text_config()
        n = mtp_layers(text)
        if not n or not isinstance(model, Decoder):
            raise MTPError(f"speculative=mtp: {path.name} declares no multi-token-prediction "
                           "layers (mtp_num_hidden_layers in its config); use ngram or "
                           "draft:PATH")
        if getattr(text, "mtp_use_dedicated_embeddings", False):
            raise MTPError("speculative=mtp: MTP layers with embeddings of their own "
                           "(mtp_use_dedicated_embeddings) are not implemented")
        if path.is_file():
            raise MTPError("speculative=mtp reads the MTP layers' mtp.* tensors from a "
                           "safetensors checkpoint; a GGUF file carries none here")
        head = build_on_meta(lambda: MultiTokenPredictor(model.cfg, n), target.device,
                             target.dtype)
        tensors = head.checkpoint_tensors(Decoder.checkpoint_tensors,
                                          iter_checkpoint(path, PREFIX))
        load_weights(head, tensors, head.checkpoint_map(Decoder.weight_map))
        head.eval()
        if config.quantization is not None:
            _quantize(head, config)
        lay = target.layout
        for attn in head.attention_layers():
            attn.kv_cache = torch.zeros((2, attn.num_kv_heads, lay.num_blocks, lay.block_size,
                                         attn.head_dim), dtype=target.dtype, device=target.device)
        if target.device.type == "cpu":
            choose_linear_kernels(head, target.dtype)
            pin_decode_rows(head, target.dtype)
        cost = sum(p.numel() for p in head.layers[0].parameters()) / max(
            sum(p.numel() for layer in model.layers for p in layer.parameters()), 1)
        log.info("MTP drafter: %d layer(s) from the checkpoint's mtp.* tensors, %.1f%% of a "
                 "decode step's layer weights per draft", n, 100 * cost)
        return cls(target, head, blocks, cost)

    # ---- catching up ------------------------------------------------------------------------

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """Run the MTP layer over the positions the step computed and kept, for the requests
        that draft with it (see the module docstring)."""
        if result.hidden is None:
            return
        rows, ids, starts, counts, reqs = [], [], [], [], []
        for chunk, first, kept in kept_rows(out, self.name):
            req = chunk.req
            seq = self.seqs.setdefault(req.request_id, MTPSequence())
            seq.hidden = None
            # a position's next token must be known: not the chunk's last when it ends a
            # sequence that sampled nothing (a prefill chunk mid-prompt knows its next token)
            kept = min(kept, req.num_tokens - 1 - chunk.start)
            if kept <= 0:
                continue
            rows.extend(range(first, first + kept))
            ids.extend(req.all_token_ids[chunk.start + 1 : chunk.start + 1 + kept])
            starts.append(chunk.start)
            counts.append(kept)
            reqs.append(req)
        if not reqs:
            return
        device = self.target.device
        index = to_device(torch.tensor(rows, dtype=torch.int64), device)
        hidden = self._forward(ids, result.hidden.index_select(0, index), reqs, starts, counts,
                               step=0)
        end = 0
        for req, start, n in zip(reqs, starts, counts, strict=True):
            end += n
            seq = self.seqs[req.request_id]
            seq.computed = start + n
            if start + n == req.num_tokens - 1:  # its last position: the first draft's
                seq.hidden = hidden[end - 1]

    @torch.inference_mode()
    def _forward(self, ids: list[int], hidden: torch.Tensor, reqs: list[Request],
                 starts: list[int], counts: list[int], step: int) -> torch.Tensor:
        """The MTP layer over chunks (request, first position, rows): ids [T] the tokens after
        the positions, hidden [T, H] the states at them -> the layer's output [T, H]."""
        target, device = self.target, self.target.device
        model = target.model
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), device)
        if model.position_rows > 1:
            positions = torch.cat([r.position_info.window(s, s + n)
                                   for r, s, n in zip(reqs, starts, counts, strict=True)], dim=1)
        else:
            positions = torch.tensor([p for s, n in zip(starts, counts, strict=True)
                                      for p in range(s, s + n)], dtype=torch.int64)
        positions = to_device(positions, device)
        meta = build_metadata(starts, counts, [r.block_ids for r in reqs],
                              target.layout.block_size, device, target.dtype,
                              decode_kernel=target.decode_kernel)
        rotary = model.rotary_cos_sin(self.rope, positions, hidden.dtype)
        return self.head(model.embed(input_ids), hidden, rotary, meta, step)

    # ---- proposing --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        live = []
        for req, k in zip(reqs, ks, strict=True):
            seq = self.seqs.get(req.request_id)
            k = self._room(req, k) if seq is not None and seq.hidden is not None else 0
            if k:
                live.append((req, k, seq))
        drafts = {req.request_id: [] for req, _, _ in live}
        probs = {req.request_id: [] for req, _, _ in live}
        going = live
        states = torch.stack([seq.hidden for _, _, seq in live]) if live else None
        step = 0
        while going:
            logits = self.target.model.compute_logits(states)
            picked = draw(logits, [r for r, _, _ in going],
                          [r.num_tokens + step for r, _, _ in going], self.target.vocab_size)
            for (req, _, _), (token, q) in zip(going, picked, strict=True):
                drafts[req.request_id].append(token)
                if q is not None:
                    probs[req.request_id].append(q)
            step += 1
            keep = [i for i, (_, k, _) in enumerate(going) if k > step]
            if not keep:
                break
            going = [going[i] for i in keep]
            reqs_now = [r for r, _, _ in going]
            # the layer at the position before each new draft, fed the draft before it
            states = self._forward([drafts[r.request_id][-1] for r in reqs_now], states[keep],
                                   reqs_now, [r.num_tokens - 2 + step for r in reqs_now],
                                   [1] * len(reqs_now), step)
        return proposals(reqs, drafts, probs)

    def _room(self, req: Request, k: int) -> int:
        """Drafts whose chain positions (up to num_tokens + k - 3) have slots: reserved in the
        target's blocks, a block left free per decode."""
        while k > 1:
            need = self.blocks.blocks_needed(req.num_tokens + k - 2) - len(req.block_ids)
            if need <= 0 or (need <= self.blocks.num_free_blocks - 1
                             and self.blocks.allocate(req, req.num_tokens + k - 2)):
                return k
            k -= 1
        return k

    def forget(self, req: Request) -> None:
        self.seqs.pop(req.request_id, None)


def _quantize(head: MultiTokenPredictor, config: EngineConfig) -> None:
    """The MTP layers' linears quantized as the target's decoder layers are (a router and a
    shared expert's gate stay in the model dtype, as there)."""
    for parent in list(head.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Linear) and child.quantizable:
                setattr(parent, name, quantize_linear(child, config.quantization,
                                                      config.quantization_group_size))
