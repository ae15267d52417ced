"""The engine panels as pure functions: a RequestOutput, the engine's stats and its tokenizer in,
self-contained HTML (inline styles) or a DataFrame out. Used by the web UI and by notebooks."""

from __future__ import annotations

import html
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from engine import PlaceholderInfo, RequestOutput

MODALITY_COLORS = {"image": "#2563eb", "video": "#9333ea", "audio": "#059669"}
# Glyphs every system font has (emoji fonts are missing on many Linux machines).
MODALITY_ICONS = {"image": "▣", "video": "▶", "audio": "♪"}
TABLE_COLUMNS = ["item", "modality", "offset", "length", "embeds", "hash", "cache"]

# Cache outcome of one media item, as shown in the table and the cache panel.
HIT, MISS, PREFIX, PENDING = "hit", "miss", "prefix cache", "pending"
_STATUS_COLORS = {HIT: "#16a34a", MISS: "#dc2626", PREFIX: "#0891b2", PENDING: "#6b7280"}
_STATUS_HELP = {
    HIT: "embeddings reused from the encoder cache",
    MISS: "encoded by this request",
    PREFIX: "span's KV came from the prefix cache: encoder not needed",
    PENDING: "not scheduled yet",
}

_BOX = (
    "font-family: ui-sans-serif, system-ui, sans-serif; font-size: 13px; line-height: 1.5; "
    "color: #111827; background: #ffffff; border: 1px solid #e5e7eb; border-radius: 8px; "
    "padding: 8px 10px; margin: 4px 0;"
)
_CHIP = "display: inline-block; border-radius: 4px; padding: 0 4px; margin: 1px; "
_MUTED = "color: #6b7280;"


# ---- placeholders -----------------------------------------------------------------------------


def item_labels(output: RequestOutput) -> list[str]:
    """A short name per placeholder: "image 1", or "video 1 · t0" for the parts of one video
    (an item identifier's ":suffix" marks a part of the same media item)."""
    counts: dict[str, int] = {}
    seen: dict[str, str] = {}
    labels = []
    for ph in output.multi_modal_placeholders:
        base, _, part = ph.identifier.partition(":")
        if base not in seen:
            counts[ph.modality] = counts.get(ph.modality, 0) + 1
            seen[base] = f"{ph.modality} {counts[ph.modality]}"
        labels.append(f"{seen[base]} · {part}" if part else seen[base])
    return labels


def cache_status(output: RequestOutput, ph: PlaceholderInfo) -> str:
    """HIT, MISS, PREFIX (the span lay in the reused prefix, so no lookup was needed) or
    PENDING (not scheduled yet)."""
    if ph.cache_hit is not None:
        return HIT if ph.cache_hit else MISS
    if output.num_cached_tokens >= ph.offset + ph.length:
        return PREFIX
    return PENDING


def placeholder_table(output: RequestOutput) -> pd.DataFrame:
    """One row per media placeholder: its span, embed count, short hash and cache outcome."""
    rows = [
        [label, ph.modality, ph.offset, ph.length, ph.num_embeds, ph.identifier.split(":")[0][:8],
         cache_status(output, ph)]
        for label, ph in zip(item_labels(output), output.multi_modal_placeholders, strict=True)
    ]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def placeholder_html(output: RequestOutput, tokenizer: Any, *, max_run: int = 160) -> str:
    """The prompt as a strip of tokens with each media span collapsed into one coloured chip
    (modality, offset, length, embeds, short hash, cache outcome). Text runs longer than
    `max_run` tokens show their two ends around an elided middle."""
    ids = output.prompt_token_ids
    special = set(getattr(tokenizer, "all_special_ids", ()))
    parts = []
    pos = 0
    spans = zip(item_labels(output), output.multi_modal_placeholders, strict=True)
    for label, ph in sorted(spans, key=lambda s: s[1].offset):
        parts.append(_text_run(ids, pos, ph.offset, tokenizer, special, max_run))
        parts.append(_media_chip(label, ph, cache_status(output, ph)))
        pos = ph.offset + ph.length
    parts.append(_text_run(ids, pos, len(ids), tokenizer, special, max_run))
    legend = " ".join(
        f'<span style="{_CHIP}background:{color};color:#fff">{MODALITY_ICONS[m]} {m}</span>'
        for m, color in MODALITY_COLORS.items()
    )
    head = (
        f'<div style="{_MUTED}margin-bottom:4px">{len(ids)} prompt tokens · '
        f"{len(output.multi_modal_placeholders)} media spans · {legend}</div>"
    )
    strip = (
        '<div style="font-family: ui-monospace, monospace; font-size: 12px; '
        f'white-space: pre-wrap; word-break: break-all">{"".join(parts)}</div>'
    )
    return f'<div class="mm-placeholders" style="{_BOX}">{head}{strip}</div>'


def _text_run(
    ids: list[int], start: int, end: int, tokenizer: Any, special: set[int], max_run: int
) -> str:
    if end <= start:
        return ""
    if end - start <= max_run:
        return _tokens(ids, start, end, tokenizer, special)
    half = max_run // 2
    elided = end - start - 2 * half
    gap = f'<span style="{_CHIP}{_MUTED}border:1px dashed #9ca3af">… {elided} tokens …</span>'
    head = _tokens(ids, start, start + half, tokenizer, special)
    return head + gap + _tokens(ids, end - half, end, tokenizer, special)


def _tokens(ids: list[int], start: int, end: int, tokenizer: Any, special: set[int]) -> str:
    texts = tokenizer.batch_decode([[t] for t in ids[start:end]])
    out = []
    for pos, (tid, text) in enumerate(zip(ids[start:end], texts, strict=True), start):
        shade = "#d1d5db" if tid in special else ("#f3f4f6" if pos % 2 else "#e5e7eb")
        shown = html.escape(text.replace("\n", "↵")) or "∅"
        out.append(
            f'<span title="#{pos} id {tid}" style="{_CHIP}margin:0;padding:0 1px;'
            f'background:{shade}">{shown}</span>'
        )
    return "".join(out)


def _media_chip(label: str, ph: PlaceholderInfo, status: str) -> str:
    color = MODALITY_COLORS.get(ph.modality, "#374151")
    embeds = (
        f"{ph.num_embeds} embeds"
        if ph.num_embeds == ph.length
        else f"{ph.num_embeds} embeds in {ph.length}"
    )
    title = (
        f"{label}: tokens {ph.offset}–{ph.offset + ph.length - 1}, {embeds}, "
        f"hash {ph.identifier}, {_STATUS_HELP[status]}"
    )
    return (
        f'<span title="{html.escape(title)}" style="{_CHIP}background:{color};color:#fff;'
        f'font-family: ui-sans-serif, system-ui, sans-serif;padding:1px 6px">'
        f"{MODALITY_ICONS.get(ph.modality, '')} {html.escape(label)} · "
        f"@{ph.offset} ×{ph.length} · {embeds} · {ph.identifier[:8]} · {status}</span>"
    )


# ---- caches -----------------------------------------------------------------------------------


def cache_html(output: RequestOutput) -> str:
    """This request's cache use: prefix-cached prompt tokens and each item's encoder outcome."""
    n = len(output.prompt_token_ids)
    cached = output.num_cached_tokens
    m = output.metrics
    lines = [
        f"<b>Prefix cache</b>: {cached} of {n} prompt tokens reused "
        f"({_pct(cached / n if n else 0.0)})",
        f"<b>Encoder</b>: {m.encoder_cache_hits} hits · {m.encoder_cache_misses} misses · "
        f"{m.encoder_calls} calls, {_ms(m.encoder_time)}",
    ]
    for label, ph in zip(item_labels(output), output.multi_modal_placeholders, strict=True):
        status = cache_status(output, ph)
        lines.append(
            f'<span style="{_CHIP}background:{_STATUS_COLORS[status]};color:#fff">{status}</span> '
            f"{html.escape(label)} <code>{ph.identifier[:8]}</code> "
            f'<span style="{_MUTED}">{_STATUS_HELP[status]}</span>'
        )
    return _section("This request", lines)


def engine_html(stats: Mapping[str, Any]) -> str:
    """Engine-wide counters: requests, KV blocks, prefix cache, encoder cache."""
    lines = [
        f"<b>Requests</b>: {stats.get('requests_running', 0)} running · "
        f"{stats.get('requests_waiting', 0)} waiting · {stats.get('steps', 0)} steps",
        _meter(
            "KV blocks in use", stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0),
            f"{stats.get('kv_blocks_cached', 0)} cached for prefix reuse",
        ),
        f"<b>Prefix cache hit rate</b>: {_pct(stats.get('prefix_cache_hit_rate', 0.0))} of "
        f"{stats.get('prefix_cache_queried_tokens', 0)} queried tokens",
    ]
    if "encoder_cache_capacity" in stats:
        lines += [
            _meter(
                "Encoder cache", stats["encoder_cache_used"], stats["encoder_cache_capacity"],
                f"{stats['encoder_cache_entries']} items, "
                f"{stats['encoder_cache_referenced']} in use",
            ),
            f"<b>Encoder cache hit rate</b>: {_pct(stats['encoder_cache_hit_rate'])} "
            f"({stats['encoder_cache_hits']} hits, {stats['encoder_cache_misses']} misses)",
        ]
    return _section("Engine", lines, css_class="mm-engine")


def _meter(label: str, used: float, total: float, note: str) -> str:
    frac = used / total if total else 0.0
    bar = (
        '<span style="display:inline-block;vertical-align:middle;width:120px;height:8px;'
        'background:#e5e7eb;border-radius:4px;overflow:hidden;margin:0 6px">'
        f'<span style="display:block;height:100%;width:{100 * frac:.1f}%;'
        'background:#2563eb"></span></span>'
    )
    return (
        f"<b>{label}</b>: {used} / {total}{bar}{_pct(frac)} "
        f'<span style="{_MUTED}">({note})</span>'
    )


# ---- timing -----------------------------------------------------------------------------------

_STAGE_COLORS = {
    "media": "#64748b", "queue": "#d97706", "encoder": "#9333ea", "prefill": "#2563eb",
    "ttft": "#111827", "decode": "#16a34a",
}


def timing_rows(output: RequestOutput, *, max_chunks: int = 8) -> list[tuple[str, str, float]]:
    """(stage, kind, seconds) for each measured stage, in pipeline order. Prefill chunks past
    `max_chunks` are summed into one row."""
    m = output.metrics
    n_out = len(output.outputs[0].token_ids)
    rows: list[tuple[str, str, float | None]] = [
        ("media load", "media", m.stages.get("media_load")),
        ("preprocess", "media", m.stages.get("preprocess")),
        ("hashing", "media", m.stages.get("hashing")),
        ("queue", "queue", m.queue_time),
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
        (f"decode ({max(n_out - 1, 0)} tok)", "decode", m.decode_time),
    ]
    return [(label, kind, s) for label, kind, s in rows if s is not None]


def timing_summary(output: RequestOutput) -> dict[str, Any]:
    """Headline numbers: TTFT (s), decode tokens/s, prompt/cached/output tokens, finish."""
    m = output.metrics
    n_out = len(output.outputs[0].token_ids)
    decode = m.decode_time
    return {
        "ttft": m.ttft,
        "decode_tokens_per_s": (n_out - 1) / decode if decode and n_out > 1 else None,
        "prompt_tokens": len(output.prompt_token_ids),
        "cached_tokens": output.num_cached_tokens,
        "output_tokens": n_out,
        "finish_reason": output.outputs[0].finish_reason,
        "preemptions": m.num_preemptions,
    }


def timing_html(output: RequestOutput) -> str:
    """The headline numbers and a horizontal bar chart of the stages (durations, one scale)."""
    s = timing_summary(output)
    tps = s["decode_tokens_per_s"]
    facts = [
        f"TTFT <b>{_ms(s['ttft'])}</b>",
        f"decode <b>{'—' if tps is None else f'{tps:.1f} tok/s'}</b>",
        f"prompt <b>{s['prompt_tokens']}</b> tok ({s['cached_tokens']} cached)",
        f"output <b>{s['output_tokens']}</b> tok",
        f"finish <b>{s['finish_reason'] or 'running'}</b>",
    ]
    if s["preemptions"]:
        facts.append(f"preempted <b>{s['preemptions']}</b>×")
    rows = timing_rows(output)
    longest = max((sec for _, _, sec in rows), default=0.0) or 1.0
    bars = "".join(
        '<div style="display:flex;align-items:center;gap:6px;margin:2px 0">'
        f'<span style="width:170px;flex:none;text-align:right;{_MUTED}">{html.escape(label)}'
        '</span><span style="flex:1;background:#f3f4f6;border-radius:3px;height:12px">'
        f'<span style="display:block;height:100%;border-radius:3px;min-width:1px;'
        f'width:{100 * sec / longest:.1f}%;background:{_STAGE_COLORS[kind]}"></span></span>'
        f'<span style="width:70px;flex:none;font-variant-numeric:tabular-nums">{_ms(sec)}'
        "</span></div>"
        for label, kind, sec in rows
    )
    return _section("Timing", [" · ".join(facts), bars], css_class="mm-timing")


# ---- all together -----------------------------------------------------------------------------


def result_html(output: RequestOutput, stats: Mapping[str, Any], tokenizer: Any) -> str:
    """Every panel for one result in one HTML block (what a notebook displays)."""
    table = placeholder_table(output)
    table_html = (
        table.to_html(index=False, border=0) if len(table) else f'<p style="{_MUTED}">no media</p>'
    )
    reply = html.escape(output.outputs[0].text)
    return (
        f'<div style="{_BOX}"><b>Output</b>: <span style="white-space:pre-wrap">{reply}</span>'
        f"</div>{placeholder_html(output, tokenizer)}<div style=\"{_BOX}\">{table_html}</div>"
        f"{cache_html(output)}{engine_html(stats)}{timing_html(output)}"
    )


def _section(title: str, lines: list[str], css_class: str = "mm-cache") -> str:
    body = "".join(f'<div style="margin:2px 0">{line}</div>' for line in lines)
    return (
        f'<div class="{css_class}" style="{_BOX}"><div style="font-weight:600;margin-bottom:2px">'
        f"{title}</div>{body}</div>"
    )


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _pct(frac: float) -> str:
    return f"{100 * frac:.0f}%"
