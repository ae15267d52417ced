"""LLMEngine: the synchronous core. `step()` = schedule -> run -> postprocess.

It is single-threaded by design: `LLM` calls it from the caller's thread, `AsyncLLM` from its one
engine thread. Prompt processing (`make_request`) only reads immutable state, so it may run in
any thread; everything else must be called from the thread that steps the engine.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.block_manager import BlockManager
from engine.budgets import check_bidirectional_budget, encoder_budget
from engine.checkpoint_setup import CheckpointSetup, checkpoint_settings
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.device import resolve_device, resolve_dtype
from engine.encoder_cache import EncoderCacheManager
from engine.engine_report import (
    cross_stats,
    kv_stats,
    ready_line,
    state_stats,
    weights_description,
)
from engine.fanout import FanOut
from engine.grammar import GrammarCompiler
from engine.hub import resolve_files
from engine.load_progress import ProgressListener, StartupProgress, TerminalProgress
from engine.model_runner import EncoderItemsFailed, ItemFailure, ModelRunner, StepResult
from engine.outputs import RequestOutput
from engine.processing import InputProcessor, ProcessedPrompt
from engine.reasoning import ReasoningSplitter
from engine.request import Request, RequestStatus
from engine.request_output import request_output, stop_status
from engine.sampling_params import SamplingParams, SamplingParamsError
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculative.speculator import build_speculator
from engine.state_cache import StateCacheManager
from models.interfaces import ProcessorContext
from models.kernels.native import FUSED_ROWS

log = logging.getLogger(__name__)


class LLMEngine:
    """Owns the scheduler, the block manager, the encoder cache and the model runner."""

    def __init__(
        self, model: str | Path, *, device: str = "auto", dtype: str = "auto",
        mmproj: str | Path | None = None, load_progress: ProgressListener | None = None,
        **options: Any
    ) -> None:
        """`model`: a checkpoint folder, a GGUF file (`mmproj`: its projector file, a vision or
        audio tower; a folder holding both finds it by name), `ollama:NAME:TAG`,
        `lmstudio:PUBLISHER/REPO` or a Hub id (engine/hub.py); `options`: EngineConfig's.
        Each start-up stage shows on the terminal (engine/load_progress.py) and is reported to
        `load_progress` too, if given (from this thread)."""
        self.config = EngineConfig.from_options(**options)
        progress = StartupProgress(
            [TerminalProgress(), *([load_progress] if load_progress is not None else [])])
        files = resolve_files(model, mmproj)
        self.model_path = files.path
        self.model_id = str(model)
        self.setup = setup = CheckpointSetup.load(files.path, files.mmproj, files.stored)
        hf_config, self.tokenizer, spec = setup.hf_config, setup.tokenizer, setup.spec
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, setup.dtype)

        def processor(vectors_per_embed: int):
            return spec.processor(ProcessorContext(
                hf_config, self.tokenizer, self.model_path, self.model_id,
                self.config.processed_cache_items,
                max_item_embeds=min(self.config.encoder_cache_size // vectors_per_embed,
                                    self.config.max_num_encoder_input_tokens),
                files=setup.files,
            ))

        # Built before the weights load, so that a checkpoint whose processor settings we do not
        # support is refused before its weights are read.
        mm_processor = processor(1) if spec.processor is not None else None
        self.runner = ModelRunner(
            self.model_path, hf_config, spec.model, self.config, self.device, self.dtype,
            mmproj=setup.mmproj, progress=progress,
        )
        layout = self.runner.layout
        self.max_model_len = layout.max_model_len
        budget = None
        vectors_per_embed = 1 + self.runner.deepstack_layers
        cross = self.runner.cross_layout  # cross-attention models cache keys and values
        if mm_processor is not None:
            if vectors_per_embed > 1:  # DeepStack items take more cache per embedding
                mm_processor = processor(vectors_per_embed)
            budget = encoder_budget(self.config, mm_processor, vectors_per_embed, cross)
            check_bidirectional_budget(self.config, mm_processor.max_bidirectional_span())
        # Prompt ids may reach past the LM head's vocabulary where the embeddings do (an image
        # token).
        self.processor = InputProcessor(
            self.tokenizer, self.runner.embedding_rows,
            self.max_model_len, mm_processor,
            encoder_budget=budget, message_starts=self.runner.state_layout is not None,
        )
        self.block_manager = BlockManager(
            layout.num_blocks, layout.block_size, self.config.enable_prefix_caching,
            # Token-granular tails copy KV; a hybrid model's recurrent state cannot follow.
            copy_kv=self.runner.copy_kv if self.runner.state_layout is None else None,
        )
        self.encoder_cache = EncoderCacheManager(
            self.config.encoder_cache_size if cross is None else cross.num_keys, vectors_per_embed)
        states = self.runner.state_layout
        self.state_cache = None if states is None else StateCacheManager(
            states.num_slots, states.num_snapshots, layout.block_size)
        self.scheduler = Scheduler(self.config, self.block_manager, self.encoder_cache,
                                   self.state_cache, verify_rows=FUSED_ROWS)
        self.speculator = build_speculator(self.config, self.runner, setup, self.block_manager)
        self.eos_token_ids = setup.eos_token_ids
        self.grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size,
                                        sorted(self.eos_token_ids), f"model {self.model_id!r}")
        self.fanout = FanOut()
        self.checkpoint_settings = checkpoint_settings(setup, mm_processor, self.runner.adapters)
        self._weights_text: str | None = None  # weights_description, once read
        self.num_steps = 0
        self.num_errors = 0
        log.info(ready_line(self.model_id, self.runner))

    # ---- requests ---------------------------------------------------------------------------

    def make_request(
        self,
        processed: ProcessedPrompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        thinking: bool | None = None,
    ) -> Request:
        """Build a Request from a processed prompt (safe to call from any thread): its
        structured-output grammar compiled (ValueError if refused), its text split into
        reasoning and answer when `thinking` is not None (a thinking model's chat; True: the
        prompt opened the thinking block)."""
        n = len(processed.token_ids)
        params.check_token_ids(self.runner.vocab_size)
        closes = self.processor.thinking.end if thinking and self.processor.thinking else None
        adapter = self.adapter_for(params, processed)
        req = Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=processed.token_ids,
            sampling_params=params,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            max_tokens=min(params.max_tokens, self.max_model_len - n),
            prompt=processed.text,
            mm_features=processed.mm_features,
            position_info=processed.position_info,
            message_starts=processed.message_starts,
            grammar=self.grammars.state(params.structured_outputs, closes),
            adapter=adapter,
            speculation=self._speculation(params),
        )
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        req.metrics.stages.update(processed.stages)
        # A thinking model whose markers are special tokens (Gemma 4): the splitter must see
        # them in the text.
        keeps = thinking is not None and self.processor.thinking_keeps_special
        req.detokenizer = IncrementalDetokenizer(
            self.tokenizer, params.stop, params.skip_special_tokens and not keeps
        )
        if thinking is not None and self.processor.thinking is not None:
            req.reasoning = ReasoningSplitter(self.processor.thinking, thinking)
        return req

    def _speculation(self, params: SamplingParams):
        """A new request's speculation state (None: it does not speculate)."""
        if self.speculator is None:
            if params.num_speculative_tokens or params.speculative_method:
                field = ("num_speculative_tokens" if params.num_speculative_tokens
                         else "speculative_method")
                raise SamplingParamsError(field, (
                    f"{field} needs an engine started with speculative decoding (the "
                    "`speculative` engine option, --speculative); this one has none"))
            return None
        return self.speculator.state_for(params)

    def _child(self, req: Request, index: int) -> Request:
        """Completion `index` of `req` (n > 1): the same prompt and media, its own state."""
        child = self.make_request(
            ProcessedPrompt(req.prompt, req.prompt_token_ids, [
                replace(f, cache_hit=None) for f in req.mm_features], req.position_info,
                dict(req.metrics.stages), req.message_starts),
            req.sampling_params, req.request_id if index == 0 else f"{req.request_id}#{index}",
            req.metrics.arrival_time, None if req.reasoning is None else req.reasoning.in_reasoning)
        child.index, child.parent_id = index, req.request_id
        return child

    def adapter_for(self, params: SamplingParams, processed: ProcessedPrompt) -> str | None:
        """The LoRA adapter a request computes with: the one it names, else the checkpoint's
        adapter for the first of its media's modalities that has one (Phi-4-MM), else none.
        A name the engine did not load is a ValueError naming the loaded ones."""
        adapters = self.runner.adapters
        if params.lora is not None:
            names = () if adapters is None else adapters.names
            if params.lora not in names:
                raise SamplingParamsError("lora", (
                    f"unknown LoRA adapter {params.lora!r} (loaded: "
                    f"{', '.join(names) if names else 'none'})"))
            return params.lora
        return self.runner.media_adapter({f.modality for f in processed.mm_features})

    def default_sampling_params(self) -> SamplingParams:
        """What a request that passes no SamplingParams gets: the checkpoint's
        generation_config.json sampling (greedy where it says do_sample false), else the
        defaults of SamplingParams."""
        return SamplingParams(**self.setup.sampling_defaults)

    def add_request(self, req: Request) -> None:
        if self.scheduler.find(req.request_id) is not None or self.fanout.family(
                req.request_id) is not None:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.sampling_params.n > 1 and req.parent_id is None:
            req = self.fanout.split(req, self._child)
        req.metrics.queued_time = time.monotonic()
        self.scheduler.add(req)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now (all its completions), freeing its KV blocks and cache
        references."""
        family = self.fanout.family(request_id)
        reqs = [self.scheduler.find(request_id)] if family is None else [
            c for c in family.children if not c.finished]
        reqs = [r for r in reqs if r is not None]
        for req in reqs:
            self._finish(req, RequestStatus.FINISHED_ABORTED)
        return request_output(self.fanout, reqs[-1]) if reqs else None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        """Finish `req` (and, for a first completion that never sampled, its siblings that
        are still waiting for it)."""
        self.scheduler.finish(req, status)
        if self.speculator is not None:
            self.speculator.forget(req)
        if not req.output_token_ids:
            for sibling in self.fanout.unstarted(req):
                sibling.error = req.error
                sibling.status = status

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if self.speculator is not None:
            for req in out.preempted:  # recomputed from the start: so are their drafters'
                self.speculator.forget(req)
        if not out.chunks:
            return self._refuse_unschedulable()
        t0 = time.monotonic()
        try:
            result = self.runner.execute(out)
        except EncoderItemsFailed as e:
            return self._fail_items(out, e.failures)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving
            log.exception("engine step failed")
            return self._fail(out, e)
        self.num_steps += 1
        seconds = time.monotonic() - t0
        if self.speculator is not None:
            self.speculator.timed(out, result, seconds)
        for chunk, tokens in zip(out.chunks, result.tokens, strict=True):
            if chunk.draft:  # the drafts kept: all tokens but the one sampled after them
                chunk.accepted = tuple(tokens[:-1])
                self.speculator.verified(chunk, seconds)
        self.scheduler.update_after_step(out)
        outputs = self._postprocess(out, result, seconds)
        if self.speculator is not None:
            self.speculator.after_step(out, result)
            self.speculator.propose(self.scheduler.running)
        return outputs

    def _postprocess(
        self, out: SchedulerOutput, result: StepResult, seconds: float
    ) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for chunk, tokens, logprobs in zip(out.chunks, result.tokens, result.logprobs,
                                           strict=True):
            req = chunk.req
            if chunk.start < req.num_prompt_tokens:
                req.metrics.prefill_chunks.append((chunk.num_tokens, seconds))
            if result.encoder_time and any(r is req for r, _ in out.encoder_inputs):
                req.metrics.encoder_time += result.encoder_time
                req.metrics.encoder_calls += 1
            if not tokens:
                continue
            for i, token in enumerate(tokens):  # a verification's accepted drafts, then one
                req.append_token(token)
                for sibling in self.fanout.ready(req):
                    self.scheduler.add(sibling)
                if logprobs is not None:
                    req.logprobs.append(logprobs[i])
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                status = stop_status(req, token)
                if status is not None:
                    self._finish(req, status)
                    break
            req.metrics.last_token_time = now
            outputs.append(request_output(self.fanout, req))
        return outputs

    def _refuse_unschedulable(self) -> list[RequestOutput]:
        """Nothing runs, yet the oldest waiting request got no tokens: it never will (its
        blocks or media cannot fit even an idle engine). Fail it instead of spinning."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        req = self.scheduler.waiting[0]
        req.error = (
            f"request needs more than the idle engine can give ({req.num_tokens} tokens, "
            f"{len(req.mm_features)} media items); raise kv_cache_bytes or encoder_cache_size"
        )
        self._finish(req, RequestStatus.FINISHED_ERROR)
        return [request_output(self.fanout, req)]

    def _fail(self, out: SchedulerOutput, error: Exception) -> list[RequestOutput]:
        """A failure not attributable to a media item (the decoder's forward, sampling): every
        request of the step fails."""
        self.num_errors += 1
        self.scheduler.abandon(out)
        outputs = []
        for chunk in out.chunks:
            chunk.req.error = f"{type(error).__name__}: {error}"
            self._finish(chunk.req, RequestStatus.FINISHED_ERROR)
            outputs.append(request_output(self.fanout, chunk.req))
        self._forget_unencoded(out)
        return outputs

    def _fail_items(self, out: SchedulerOutput, failures: list[ItemFailure]) -> list[RequestOutput]:
        """Fail the requests whose media items could not be encoded, and only those.

        A request fails if its item failed, or if its chunk needed a failed item's embeddings
        (the same content, a cache hit this step). Nothing of the step was computed, and
        `update_after_step` is not called: the other requests keep the KV blocks and encoder
        outputs scheduled for them with their counters unmoved, so the next step schedules their
        chunk again, and no block is registered in the prefix cache before its KV is written.
        """
        self.num_errors += 1
        self.scheduler.abandon(out)
        failed = {f.req.mm_features[f.index].identifier: f.message for f in failures}
        errors: dict[str, tuple[Request, str]] = {}
        for f in failures:
            errors.setdefault(f.req.request_id, (f.req, _item_error(f.req, f.index, f.message)))
        for chunk in out.chunks:
            req = chunk.req
            for idx, feature in enumerate(req.mm_features):
                span, message = feature.placeholder, failed.get(feature.identifier)
                if message is not None and span.offset < chunk.end and span.end > chunk.start:
                    errors.setdefault(req.request_id, (req, _item_error(req, idx, message)))
        outputs = []
        for req, error in errors.values():
            log.warning("request %s failed: %s", req.request_id, error)
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(request_output(self.fanout, req))
        self._forget_unencoded(out)
        return outputs

    def _forget_unencoded(self, out: SchedulerOutput) -> None:
        """Drop the encoder-cache entries planned this step whose output was never stored: a
        later hit on one would find no embeddings."""
        for req, idx in out.encoder_inputs:
            identifier = req.mm_features[idx].identifier
            if not self.runner.has_encoder_output(identifier):
                self.encoder_cache.discard(identifier)

    # ---- introspection ----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Engine-wide counters for the UI panels (plain numbers): `counters` and what takes
        longer to read (the pools' resident bytes, from the page tables)."""
        return {
            **self.counters(),
            "weights": self.weights_description(),
            "checkpoint": self.checkpoint_settings,
            **kv_stats(self.runner),
            **state_stats(self.runner, self.state_cache),
            **cross_stats(self.runner),
        }

    def counters(self) -> dict[str, Any]:
        """The part of `stats` that each step changes and that is cheap to read: requests,
        steps, blocks, encoder cache and speculation counters."""
        return {
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "steps": self.num_steps,
            "step_errors": self.num_errors,
            **self.block_manager.stats(),
            **self.encoder_cache.stats(),
            **({} if self.speculator is None else self.speculator.stats()),
        }

    def weights_description(self) -> str:
        """The weights' precision, device and kernels (engine.engine_report; the weights do
        not change after start-up: read once)."""
        if self._weights_text is None:
            self._weights_text = weights_description(self.runner)
        return self._weights_text

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()


def _item_error(req: Request, index: int, message: str) -> str:
    modality = req.mm_features[index].modality
    return f"{modality} item {index} of the request could not be encoded: {message}"
