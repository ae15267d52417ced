"""Executes one scheduled step on the model and caches set up at start-up (engine/runner_setup.py,
ModelRunner's base: the weights by engine/model_loading.py, the KV cache and state pools by
engine/memory_plan.py).

`execute` turns a SchedulerOutput into tensors built on the host (token ids, positions, attention
indices, sampling options), moves them to the device once, runs the batched encoders for the
media items scheduled this step, splices their embeddings into the chunk, runs the decoder over
the flat token batch and samples one token for every chunk that reached the end of its request,
and every row of a verification of draft tokens (speculative decoding: engine/speculative/,
whose drafts are kept while they match what the target produces at their rows).
The only host sync is reading the sampled tokens back at the end; a step that samples nothing
(all its chunks end mid-prompt) waits for the device instead, so that the step's time and its
encoder time, which the panels show, are the device's real times.

A media item whose encoder fails (found by encoding the step's items one by one when the batch
raises) does not fail the step's other requests: `execute` raises EncoderItemsFailed naming the
items, before the decoder runs, and the engine decides what becomes of each request.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from engine.cross_states import cross_items
from engine.device import DeviceTimer, to_device, wait_for_device
from engine.draft_verification import (
    SampleRows,
    accepted_count,
    resample_drafted,
    sample_rows,
)
from engine.kv_blocks_in_use import chunk_blocks
from engine.memory_plan import (
    CacheLayout,
    StateLayout,
)
from engine.request import Request
from engine.runner_setup import RunnerSetup
from engine.sampler import SamplingBatch, sample
from engine.scheduler import SchedulerOutput
from models.interfaces import MultiModalFeature
from models.kernels.quantization import QuantizedLinear
from models.layer_interfaces import KVCacheLayer, RecurrentStateLayer
from models.layers.attention_metadata import build_metadata
from models.layers.cross_metadata import build_cross_metadata
from models.layers.lora import build_adapter_batch
from models.layers.state_metadata import build_state_metadata

__all__ = ["CacheLayout", "EncoderItemsFailed", "ItemFailure", "ModelRunner", "StateLayout",
           "StepResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ItemFailure:
    """One media item whose encoder failed: `req.mm_features[index]`, and why."""

    req: Request
    index: int
    message: str


class EncoderItemsFailed(RuntimeError):
    """Some of a step's media items could not be encoded; nothing of the step was computed.

    The items that did encode are stored in `ModelRunner.encoder_outputs`; what becomes of the
    requests is the engine's call (the scheduler owns their state), not the runner's."""

    def __init__(self, failures: list[ItemFailure]) -> None:
        super().__init__("; ".join(f"{f.req.request_id} item {f.index}: {f.message}"
                                   for f in failures))
        self.failures = failures


@dataclass
class StepResult:
    """Per chunk of the step (aligned with `SchedulerOutput.chunks`): its new tokens (none for
    a chunk that ends mid-prompt; one for a sampling chunk; for a verification of drafts, the
    accepted drafts and the token after them), and their logprobs entries ({token id: logprob},
    the token first) when asked for."""

    tokens: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]
    encoder_time: float = 0.0  # seconds the batched encoders ran this step
    hidden: torch.Tensor | None = None  # [T, H] the decoder's output (drafters read it)
    logits: torch.Tensor | None = None  # [S, V] the sampled rows' (execute's keep_logits)


class ModelRunner(RunnerSetup):
    """Runs the engine's steps on what RunnerSetup set up (engine/runner_setup.py)."""

    # ---- what the engine reads of the model (through these, never through `model`) -----------

    @property
    def deepstack_layers(self) -> int:
        """K: each spliced encoder output is [1 + K, n, H] (DeepStack residuals) when K > 0."""
        return self.model.deepstack_layers

    @property
    def embedding_rows(self) -> int:
        """The token ids with embeddings (a prompt's ids are below it): past the LM head's
        vocabulary where the embeddings reach further (an image token)."""
        return self.model.cfg.embedding_rows or self.vocab_size

    @property
    def position_rows(self) -> int:
        """Rows of a token's position: 1, or 3 for mRoPE."""
        return self.model.position_rows

    def attention_layers(self) -> Sequence[KVCacheLayer]:
        """The model's attention layers, their caches bound."""
        return self.model.attention_layers()

    def state_layers(self) -> Sequence[RecurrentStateLayer]:
        """The model's recurrent-state layers (a hybrid model's), their pools bound."""
        return self.model.state_layers()

    def per_layer_table_bytes(self) -> int:
        """Bytes of a per-layer embedding table (weights a step reads a few rows of; 0: none)."""
        return self.model.per_layer_table_bytes()

    def media_adapter(self, modalities: Collection[str]) -> str | None:
        """The checkpoint's LoRA adapter a request without one of its own computes with, given
        its media's modalities: the first, in the model's order of precedence, loaded for one
        of them (Phi-4-MM: images the vision adapter, audio the speech adapter); else None."""
        for name, modality, _ in self.model.modality_adapters():
            if self._media_adapters.get(modality) == name and modality in modalities:
                return name
        return None

    def has_encoder_output(self, identifier: str) -> bool:
        """Whether the encoder output of the item with this content hash is held (stored by a
        step's encoders, dropped when the encoder cache frees it)."""
        return identifier in self.encoder_outputs

    def weight_bytes(self) -> int:
        """Bytes of the model's state (weights and buffers, as held)."""
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())

    def quantized_formats(self) -> dict[str, int]:
        """How many of the model's linears hold each quantized format ("int8g64", "int4g32"; "int8":
        a scale per channel)."""
        formats: dict[str, int] = {}
        for module in self.model.modules():
            if isinstance(module, QuantizedLinear):
                formats[module.format] = formats.get(module.format, 0) + 1
        return dict(sorted(formats.items()))

    # ---- the KV cache between steps -------------------------------------------------------

    @torch.inference_mode()
    def copy_kv(self, src: int, dst: int, tokens: int) -> None:
        """Copy the keys and values of the first `tokens` slots of block `src` into block `dst`
        in every layer's cache (a prefix-cache tail, engine/block_manager.py). Enqueued on the
        device's stream: it runs before the next step's forward, which reads it."""
        self.kv_blocks_in_use.mark([dst])
        for cache in self.kv_caches:
            cache[:, :, dst, :tokens] = cache[:, :, src, :tokens]

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, keep_logits: bool = False) -> StepResult:
        """Run one step. `keep_logits`: the sampled rows' logits come back too (a draft model's
        runner: its drafter samples from them)."""
        for identifier in out.freed_encoder_hashes:
            self.encoder_outputs.pop(identifier, None)
        encoder = self._run_encoders(out) if out.encoder_inputs else None

        chunks = out.chunks
        self.kv_blocks_in_use.mark(chunk_blocks(chunks, self.layout.block_size))
        ids: list[int] = []
        for c in chunks:
            ids.extend(c.token_ids)
        input_ids = to_device(torch.tensor(ids, dtype=torch.int64), self.device)
        positions = self._positions(chunks)
        verifies = [bool(c.draft) for c in chunks]  # chunks of drafts, attended as decodes
        meta = build_metadata(
            [c.start for c in chunks], [c.num_tokens for c in chunks],
            [c.req.block_ids for c in chunks], self.layout.block_size, self.device, self.dtype,
            windows=self.windows, bidirectional=[_bidirectional_spans(c) for c in chunks],
            decode_kernel=self.decode_kernel, backend=self.attention_backend,
            span_windows=self.span_windows, decode_chunks=verifies,
        )
        if self.state_layout is not None:
            meta.states = build_state_metadata(
                [c.start for c in chunks], [c.num_tokens for c in chunks],
                [c.state for c in chunks], self.device, verifies)
        if self.cross_layout is not None:
            meta.cross = build_cross_metadata(
                [c.start for c in chunks], [c.num_tokens for c in chunks],
                cross_items(chunks, self.encoder_outputs), self.device)
        if self.adapters is not None:
            meta.adapters = build_adapter_batch(
                [self.adapters.slot(c.req.adapter) for c in chunks],
                [c.num_tokens for c in chunks], self.device)
        embeds, residuals = self._splice_embeddings(input_ids, chunks)
        hidden = self.model(input_ids, positions, meta, embeds, residuals)

        sampled = sample_rows(chunks)
        if not sampled.rows:
            wait_for_device(self.device)
            step = StepResult([[] for _ in chunks], [None] * len(chunks))
        else:
            rows = to_device(torch.tensor(sampled.rows, dtype=torch.int64), self.device)
            logits = self.model.compute_logits(hidden[rows])
            batch = SamplingBatch.from_requests(sampled.reqs, self.vocab_size, self.device,
                                                sampled.ahead)
            drawn = any(c.draft_probs is not None for c in chunks)
            batch.keep_probs = drawn
            result = sample(logits, batch)
            if drawn:  # drafts drawn from a draft distribution: speculative sampling's rule
                resample_drafted(chunks, sampled, result, batch)
            step = self._collect(chunks, sampled, result)
            if any(verifies):
                self._keep_verified(chunks, step)
            if keep_logits:
                step.logits = logits
        step.hidden = hidden
        if encoder is not None:  # the device is past the encoders now: reading costs no sync
            step.encoder_time = encoder.seconds()
        return step

    def _keep_verified(self, chunks, step: StepResult) -> None:
        """Hybrid models: each verification's state slot keeps the state after its last
        accepted token (models/layers/gated_deltanet.py)."""
        if self.state_layout is None:
            return
        kept = [len(tokens) for c, tokens in zip(chunks, step.tokens, strict=True) if c.draft]
        for layer in self.state_layers():
            layer.keep_verified(kept)

    def _positions(self, chunks) -> torch.Tensor:
        """[T] positions, or [rows, T] for multi-row (mRoPE) models, from each request's
        position_info."""
        if self.position_rows > 1:
            rows = [c.req.position_info.window(c.start, c.end) for c in chunks]
            return to_device(torch.cat(rows, dim=1), self.device)
        pos: list[int] = []
        for c in chunks:
            pos.extend(range(c.start, c.end))
        return to_device(torch.tensor(pos, dtype=torch.int64), self.device)

    def _run_encoders(self, out: SchedulerOutput) -> DeviceTimer:
        """One batched encoder call for every item scheduled this step, across requests.

        If the batch raises, each item is encoded alone to find the culprits; the items that
        encode (in the batch or alone) are stored either way, and the failures are raised
        together as EncoderItemsFailed.
        """
        features = [req.mm_features[i] for req, i in out.encoder_inputs]
        timer = DeviceTimer(self.device).start()
        try:
            embeds = self.model.encode([(f.modality, f.data) for f in features])
        except Exception as e:  # noqa: BLE001 - find the item(s) to blame below
            if len(features) == 1:
                embeds = [e]
            else:
                log.warning("batched encoder failed (%s: %s); encoding its %d items one by one",
                            type(e).__name__, e, len(features))
                embeds = [self._encode_alone(f) for f in features]
        failures = []
        for (req, idx), f, emb in zip(out.encoder_inputs, features, embeds, strict=True):
            if isinstance(emb, Exception):
                failures.append(ItemFailure(req, idx, f"{type(emb).__name__}: {emb}"))
            elif f.cross is not None and emb.shape[-2] != f.cross.num_keys:  # [L, 2, Hkv, n, D]
                failures.append(ItemFailure(req, idx, (
                    f"the encoder returned {emb.shape[-2]} key positions but the item has "
                    f"{f.cross.num_keys}")))
            elif emb.shape[-2] != f.encoder_size:  # [n, H] or [1 + K, n, H]
                failures.append(ItemFailure(req, idx, (
                    f"the encoder returned {emb.shape[-2]} embeddings but its placeholder "
                    f"has {f.placeholder.num_embeds} embed positions")))
            else:
                self.encoder_outputs[f.identifier] = emb
        timer.stop()
        if failures:
            raise EncoderItemsFailed(failures)
        return timer

    @torch.inference_mode()
    def encoder_output(self, feature: MultiModalFeature) -> torch.Tensor:
        """An item's encoder output: the cached one, else encoded alone (not stored: the
        encoder cache's bookkeeping knows nothing of it). Called between steps."""
        found = self.encoder_outputs.get(feature.identifier)
        if found is not None:
            return found
        out = self._encode_alone(feature)
        if isinstance(out, Exception):
            raise out
        return out

    def _encode_alone(self, feature: MultiModalFeature) -> torch.Tensor | Exception:
        try:
            (emb,) = self.model.encode([(feature.modality, feature.data)])
        except Exception as e:  # noqa: BLE001 - returned: the caller blames this item
            return e
        return emb

    def _splice_embeddings(self, input_ids: torch.Tensor, chunks):
        """Token embeddings with each chunk's slice of its media embeddings written in place,
        and, for DeepStack models, the slices' per-layer residuals with their rows:
        (embeds [T, H] or None, (rows [R], residuals [K, R, H]) or None).

        Destination rows and source slices are worked out on the host; the device sees one
        `index_copy_` (integer indices: a boolean mask would force a sync).
        """
        rows: list[int] = []
        pieces: list[torch.Tensor] = []
        offset = 0
        for c in chunks:
            for f in c.req.mm_features:
                span = f.placeholder
                lo, hi = max(c.start, span.offset), min(c.end, span.end)
                if lo >= hi or f.cross is not None:  # cross-attended items are not spliced
                    continue
                emb = self.encoder_outputs.get(f.identifier)
                if emb is None:
                    raise RuntimeError(f"{f.modality} {f.identifier[:12]}: no encoder output")
                first, last = span.embeds_before(lo), span.embeds_before(hi)
                pieces.append(emb[..., first:last, :])
                if span.is_embed is None:
                    rows.extend(range(offset + lo - c.start, offset + hi - c.start))
                else:
                    rows.extend(offset + p - c.start for p in range(lo, hi)
                                if span.is_embed[p - span.offset])
            offset += c.num_tokens
        if not pieces:
            return None, None
        embeds = self.model.embed(input_ids)
        index = to_device(torch.tensor(rows, dtype=torch.int64), self.device)
        media = torch.cat(pieces, dim=-2).to(embeds.dtype)  # [R, H] or [1 + K, R, H]
        if media.dim() == 2:
            return embeds.index_copy_(0, index, media), None
        return embeds.index_copy_(0, index, media[0]), (index, media[1:])

    def _collect(self, chunks, sampled: SampleRows, result) -> StepResult:
        # The step's single host sync; everything below reads host copies.
        tokens = result.tokens.tolist()
        logprobs = None if result.logprobs is None else result.logprobs.tolist()
        top = None
        if result.top_ids is not None:
            top = (result.top_ids.tolist(), result.top_logprobs.tolist())
        out = StepResult([], [])
        for c, (first, count) in zip(chunks, sampled.spans, strict=True):
            # a verification keeps its accepted drafts and the token after them
            n = accepted_count(c.draft, tokens[first : first + count]) + 1 if count else 0
            out.tokens.append(tokens[first : first + n])
            k = c.req.sampling_params.logprobs
            if k is None or not n:
                out.logprobs.append(None)
                continue
            entries = []
            for row in range(first, first + n):
                entry = {tokens[row]: logprobs[row]}
                if k and top is not None:
                    for t, v in zip(top[0][row][:k], top[1][row][:k], strict=True):
                        entry.setdefault(t, v)
                entries.append(entry)
            out.logprobs.append(entries)
        return out


def _bidirectional_spans(chunk) -> list[tuple[int, int]]:
    """The chunk's bidirectional media spans, absolute [lo, hi); the scheduler keeps each whole
    inside one chunk, except for the part a prefix-cache hit already computed."""
    spans = []
    for f in chunk.req.mm_features:
        span = f.placeholder
        if span.bidirectional and span.offset < chunk.end and span.end > chunk.start:
            spans.append((max(span.offset, chunk.start), span.end))
    return spans
