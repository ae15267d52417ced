"""A request after each step: what a sampled token ends (`stop_status`) and what the request
reports (`request_output`: the RequestOutput its caller streams)."""

from __future__ import annotations

import time

from engine.fanout import FanOut
from engine.outputs import CompletionOutput, PlaceholderInfo, RequestOutput
from engine.request import Request, RequestStatus


def stop_status(req: Request, token: int) -> RequestStatus | None:
    """What `token`, just appended to `req`'s output, ends: an error (the grammar's), a stop
    (EOS, a stop token or string, a grammar complete), the length limit; None: nothing."""
    complete = False
    if req.grammar is not None and token not in req.eos_token_ids:
        complete = req.grammar.accept(token, req.output_token_ids)
        if req.grammar.error is not None:
            req.error = req.grammar.error
            return RequestStatus.FINISHED_ERROR
    if token in req.eos_token_ids or token in req.sampling_params.stop_token_ids:
        # (not detokenized: its text, kept with skip_special_tokens false, is no output)
        req.stop_reason = None if token in req.eos_token_ids else token
        return RequestStatus.FINISHED_STOPPED
    stop_string = req.detokenizer.add(token)
    if stop_string is not None:
        req.stop_reason = stop_string
        return RequestStatus.FINISHED_STOPPED
    if complete:  # the grammar allows nothing more: the output is whole
        return RequestStatus.FINISHED_STOPPED
    if req.num_output_tokens >= req.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None


def request_output(fanout: FanOut, req: Request) -> RequestOutput:
    """What `req` reports now: its text and tokens since the last report, its metrics and
    placeholders (an n > 1 completion merged with its siblings' by `fanout`)."""
    finished = req.finished
    if finished and req.metrics.finished_time is None:
        req.metrics.finished_time = time.monotonic()
    delta_text = req.detokenizer.delta(finished)
    text, reasoning, delta_reasoning = req.detokenizer.streamed_text, None, ""
    if req.reasoning is not None:
        delta_reasoning, delta_text = req.reasoning.feed(delta_text, finished)
        text, reasoning = req.reasoning.content, req.reasoning.reasoning
    sent, req.num_streamed_tokens = req.num_streamed_tokens, req.num_output_tokens
    completion = CompletionOutput(
        index=req.index,
        text=text,
        token_ids=list(req.output_token_ids),
        finish_reason=req.status.value if finished else None,
        stop_reason=req.stop_reason,
        logprobs=list(req.logprobs) if req.sampling_params.logprobs is not None else None,
        delta_text=delta_text,
        delta_token_ids=req.output_token_ids[sent:],
        reasoning_content=reasoning,
        delta_reasoning_content=delta_reasoning,
        num_draft_tokens=req.metrics.draft_tokens,
        num_accepted_tokens=req.metrics.accepted_tokens,
    )
    single = RequestOutput(
        request_id=req.request_id,
        prompt=req.prompt,
        prompt_token_ids=req.prompt_token_ids,
        outputs=[completion],
        finished=finished,
        num_cached_tokens=max(req.num_cached_tokens, 0),
        metrics=req.metrics.snapshot(),
        multi_modal_placeholders=[
            PlaceholderInfo(
                f.modality, f.placeholder.offset, f.placeholder.length,
                f.placeholder.num_embeds, f.identifier, f.cache_hit, f.placeholder.parts,
                f.placeholder.text_offsets(), f.item, f.part,
            )
            for f in req.mm_features
        ],
        error=req.error,
    )
    return single if req.parent_id is None else fanout.merge(req, single)
