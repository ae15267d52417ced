"""The timing panel: each measured stage of one request as a bar, and the headline numbers
(TTFT, decode tokens/s, prompt, cached and output tokens)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from ui.markup import MUTED, count, ms, section, unreported

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

_STAGE_COLORS = {  # by kind
    "media": "#64748b", "queue": "#d97706", "encoder": "#9333ea", "prefill": "#2563eb",
    "ttft": "#111827", "decode": "#16a34a", "draft": "#0d9488", "verify": "#65a30d",
}


def timing_rows(output: RequestOutput, *, max_chunks: int = 8) -> list[tuple[str, str, float]]:
    """(stage, kind, seconds) for each measured stage, in pipeline order. Prefill chunks past
    `max_chunks` are summed into one row. For a remote engine, TTFT and decode are measured
    at this app (network included) and the other stages are the server's, where reported."""
    m = output.metrics
    n_out = output.outputs[0].num_tokens
    queue = m.queue_time if m.queue_time is not None else m.stages.get("queue")
    rows: list[tuple[str, str, float | None]] = [
        ("encode request", "media", m.stages.get("encode_request")),
        ("media load", "media", m.stages.get("media_load")),
        ("preprocess", "media", m.stages.get("preprocess")),
        ("hashing", "media", m.stages.get("hashing")),
        ("queue", "queue", queue),
        ("encoder", "encoder", m.encoder_time if m.encoder_calls else None),
    ]
    chunks = m.prefill_chunks
    for i, (tokens, seconds) in enumerate(chunks[:max_chunks], 1):
        rows.append((f"prefill chunk {i} ({tokens} tok)", "prefill", seconds))
    if len(chunks) > max_chunks:
        rest = chunks[max_chunks:]
        rows.append((
            f"prefill chunks {max_chunks + 1}–{len(chunks)} ({sum(t for t, _ in rest)} tok)",
            "prefill", sum(s for _, s in rest),
        ))
    rows += [
        ("first token (TTFT)", "ttft", m.ttft),
        (f"decode ({'?' if n_out is None else max(n_out - 1, 0)} tok)", "decode",
         m.decode_time),
    ]
    drafted = m.draft_tokens  # speculative decoding: parts of the decode
    if drafted:
        rows += [(f"· drafting ({drafted} drafts)", "draft", m.draft_time),
                 (f"· verifying ({m.verify_steps} steps)", "verify", m.verify_time)]
    return [(label, kind, s) for label, kind, s in rows if s is not None]


def timing_summary(output: RequestOutput) -> dict[str, Any]:
    """Headline numbers: TTFT (s), decode tokens/s, prompt/cached/output tokens, finish."""
    m = output.metrics
    n_out = output.outputs[0].num_tokens
    decode = m.decode_time
    return {
        "ttft": m.ttft,
        "decode_tokens_per_s": (n_out - 1) / decode if decode and n_out and n_out > 1 else None,
        "prompt_tokens": output.num_prompt_tokens,
        "cached_tokens": output.num_cached_tokens,
        "output_tokens": n_out,
        "finish_reason": output.outputs[0].finish_reason,
        "preemptions": m.num_preemptions,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
    }


def timing_html(output: RequestOutput) -> str:
    """The headline numbers and a horizontal bar chart of the stages (durations, one scale)."""
    s = timing_summary(output)
    tps = s["decode_tokens_per_s"]
    cached = s["cached_tokens"]
    cached = "cached: not reported" if cached is None else f"{cached} cached"
    facts = [
        f"TTFT <b>{ms(s['ttft'])}</b>",
        f"decode <b>{'—' if tps is None else f'{tps:.1f} tok/s'}</b>",
        f"prompt <b>{count(s['prompt_tokens'])}</b> tok ({cached})",
        f"output <b>{count(s['output_tokens'])}</b> tok",
        f"finish <b>{s['finish_reason'] or 'running'}</b>",
    ]
    if s["preemptions"]:
        facts.append(f"preempted <b>{s['preemptions']}</b>×")
    if s["draft_tokens"]:
        facts.append(f"drafts <b>{s['accepted_tokens']}/{s['draft_tokens']}</b> accepted")
    rows = timing_rows(output)
    longest = max((sec for _, _, sec in rows), default=0.0) or 1.0
    bars = "".join(
        '<div style="display:flex;align-items:center;gap:6px;margin:2px 0">'
        f'<span style="width:170px;flex:none;text-align:right;{MUTED}">{html.escape(label)}'
        '</span><span style="flex:1;background:#f3f4f6;border-radius:3px;height:12px">'
        f'<span style="display:block;height:100%;border-radius:3px;min-width:1px;'
        f'width:{100 * sec / longest:.1f}%;background:{_STAGE_COLORS[kind]}"></span></span>'
        f'<span style="width:70px;flex:none;font-variant-numeric:tabular-nums">{ms(sec)}'
        "</span></div>"
        for label, kind, sec in rows
    )
    lines = [" · ".join(facts), bars]
    if "server_timing" in output.unreported:
        lines.append(unreported(output, "server_timing"))
    return section("Timing", lines, css_class="mm-timing")
