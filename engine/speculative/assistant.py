"""Drafting with Gemma 4's assistant (`speculative="draft:PATH"` where PATH holds a
`Gemma4AssistantForCausalLM` checkpoint): models/gemma4/assistant.py's drafter, reading its
Gemma 4 target's keys and values in place and the target's final hidden states.

After every step the drafter keeps, per request that drafts with it, the target's final
hidden state at the position whose logits chose the request's newest token (a prefill's last
row, a decode's, a verification's last accepted row). Drafting k tokens then runs the
assistant k times, batched across requests, each a single query at the newest token's
position over the target's computed keys: no cache of its own, nothing to catch up on after a
rejection, nothing to give back. At temperature 0 a draft is the assistant's argmax; above, a
draw from its distribution, verified by speculative sampling's rule.

Loaded at start-up and checked against the target (a Gemma 4 decoder of the width the
assistant was made for, one vocabulary, and per layer type a target layer of the assistant's
KV heads, head size and window: models.gemma4.assistant.check_target), in the target's device
and dtype, its layers quantized as the target's are.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner, StepResult
from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.speculation_state import Proposal
from engine.speculative.drawing import draw, proposals
from engine.speculative.kept_rows import kept_rows
from models.gemma4.assistant import (
    ARCHITECTURE,
    ORDERING,
    AssistantError,
    Gemma4Assistant,
    check_assistant,
    check_target,
)
from models.gemma4.text import Gemma4Decoder
from models.kernels.linear import Linear
from models.kernels.linear_choice import choose_linear_kernels, pin_decode_rows
from models.kernels.quantization import quantize_linear
from models.layers.attention_metadata import AttentionMetadata, build_metadata
from models.layers.transfer import to_device
from models.loader import build_on_meta, iter_checkpoint, load_weights

log = logging.getLogger(__name__)


def is_assistant(path: Path) -> bool:
    """Whether the checkpoint folder at `path` holds Gemma 4's assistant drafter (read from its
    config.json's architectures, without building its config)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        archs = json.loads(config.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return False
    return ARCHITECTURE in archs


@dataclass
class AssistantSequence:
    """A request's side of the drafter: the target's final hidden state at the position
    before its newest token (None: the request did not run in the last step)."""

    hidden: torch.Tensor | None = None  # [H]


class AssistantProposer:
    """Drafts with Gemma 4's assistant (see the module docstring)."""

    name = "draft"

    def __init__(self, target: ModelRunner, model: Gemma4Assistant, stores: dict[str, int],
                 cost_per_token: float) -> None:
        self.target, self.model, self.stores = target, model, stores
        self.cost_per_token = cost_per_token
        self.windows = model.attention_windows()
        self.seqs: dict[str, AssistantSequence] = {}

    @classmethod
    def load(cls, path: Path, target: ModelRunner, target_config, tokenizer,
             config: EngineConfig) -> AssistantProposer:
        """The assistant checkpoint at `path` for `target` (whose transformers config is
        `target_config`), checked against it (AssistantError naming the mismatch)."""
        from transformers import AutoConfig, AutoTokenizer

        model = target.model
        if not isinstance(model, Gemma4Decoder):
            raise AssistantError(f"{path.name} holds Gemma 4's assistant drafter ({ARCHITECTURE}):"
                                 f" it drafts for a Gemma 4 target, not {type(model).__name__}")
        hf_config = AutoConfig.from_pretrained(path)
        text = target_config.get_text_config()
        check_assistant(hf_config)
        stores = check_target(hf_config, text, text.hidden_size, text.vocab_size)
        if any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
            from engine.speculative.draft_model import check_tokenizer

            check_tokenizer(tokenizer, AutoTokenizer.from_pretrained(path), path.name)
        assistant = build_on_meta(
            lambda: Gemma4Assistant(hf_config, target.layout.max_model_len, target.device),
            target.device, target.dtype)
        load_weights(assistant, _with_ordering(assistant, iter_checkpoint(path)),
                     assistant.checkpoint_map())
        if assistant.ordered and not assistant.ordering_is_a_permutation():
            raise AssistantError(f"{path.name} sets use_ordered_embeddings, but its {ORDERING} "
                                 "is missing or not a permutation of the vocabulary")
        assistant.eval()
        if config.quantization is not None:
            _quantize(assistant, config)
        if target.device.type == "cpu":
            choose_linear_kernels(assistant, target.dtype)
            pin_decode_rows(assistant, target.dtype)
        # a draft reads the assistant's weights once: their bytes against the target's (with
        # ordered embeddings a few of the head's rows only); measured once serving
        cost = sum(t.numel() * t.element_size() for t in assistant.state_dict().values()) / max(
            target.weight_bytes(), 1)
        log.info("Gemma 4 assistant drafter %s: %d layers reading target layers %s, %.1f%% of "
                 "the target's weight bytes per draft", path.name, len(assistant.layers),
                 stores, 100 * cost)
        return cls(target, assistant, stores, cost)

    # ---- after a step -----------------------------------------------------------------------

    def observe(self, out: SchedulerOutput, result: StepResult) -> None:
        """Keep each drafting request's hidden state at the position before its newest token,
        where this step computed it (the step's tokens are appended already)."""
        if result.hidden is None:
            return
        for chunk, first, kept in kept_rows(out, self.name):
            req = chunk.req
            seq = self.seqs.setdefault(req.request_id, AssistantSequence())
            seq.hidden = None
            if chunk.start + kept == req.num_tokens - 1:  # its last row chose the newest token
                seq.hidden = result.hidden[first + kept - 1].clone()  # not the step's rows

    # ---- proposing --------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, reqs: Sequence[Request], ks: Sequence[int]) -> list[Proposal | None]:
        live = [(req, k) for req, k in zip(reqs, ks, strict=True)
                if k > 0 and (seq := self.seqs.get(req.request_id)) is not None
                and seq.hidden is not None]
        drafts: dict[str, list[int]] = {req.request_id: [] for req, _ in live}
        probs: dict[str, list[torch.Tensor]] = {req.request_id: [] for req, _ in live}
        if live:
            self._draft(live, drafts, probs)
        return proposals(reqs, drafts, probs)

    def queries(self, reqs: Sequence[Request]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The attention metadata and positions of one query per request at its newest
        token's position q, over the target's keys 0 .. q - 1 (a decode's at q - 1)."""
        target = self.target
        meta = build_metadata([r.num_tokens - 2 for r in reqs], [1] * len(reqs),
                              [r.block_ids for r in reqs], target.layout.block_size,
                              target.device, target.dtype, windows=self.windows,
                              decode_kernel=target.decode_kernel)
        positions = torch.tensor([r.num_tokens - 1 for r in reqs], dtype=torch.int64)
        return meta, to_device(positions, target.device)

    def _draft(self, live: list[tuple[Request, int]], drafts, probs) -> None:
        target = self.target
        self.model.bind_target(target.model.layers, self.stores)
        going = [req for req, _ in live]
        wanted = {req.request_id: k for req, k in live}
        meta, positions = self.queries(going)
        last = [r.all_token_ids[-1] for r in going]
        hidden = torch.stack([self.seqs[r.request_id].hidden for r in going])
        for step in range(max(wanted.values())):
            ids = to_device(torch.tensor(last, dtype=torch.int64), target.device)
            logits, hidden = self.model.draft(target.model.embed(ids), hidden, positions, meta)
            picked = draw(logits, going, [r.num_tokens + step for r in going],
                          target.vocab_size)
            for req, (token, q) in zip(going, picked, strict=True):
                drafts[req.request_id].append(token)
                if q is not None:
                    probs[req.request_id].append(q)
            last = [token for token, _ in picked]
            keep = [j for j, r in enumerate(going) if wanted[r.request_id] > step + 1]
            if len(keep) < len(going):
                if not keep:
                    break
                going, last, hidden = ([going[j] for j in keep], [last[j] for j in keep],
                                       hidden[keep])
                meta, positions = self.queries(going)

    def forget(self, req: Request) -> None:
        self.seqs.pop(req.request_id, None)


def _with_ordering(model: Gemma4Assistant, tensors):
    """The checkpoint's tensors, its token ordering (an integer buffer) set on the way."""
    for name, tensor in tensors:
        if name == ORDERING:
            if model.ordered:
                model.token_ordering.copy_(tensor.to(torch.int64))
            continue
        yield name, tensor


def _quantize(model: Gemma4Assistant, config: EngineConfig) -> None:
    """The assistant's linears quantized as the target's decoder layers are (but for its
    `exact_linears`)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if parent is model and name in model.exact_linears:
                continue
            if isinstance(child, Linear) and child.quantizable:
                setattr(parent, name, quantize_linear(child, config.quantization,
                                                      config.quantization_group_size))
