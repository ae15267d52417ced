"""The engine panels as pure functions: a RequestOutput, the engine's stats and its tokenizer in,
self-contained HTML (inline styles) or a DataFrame out. Used by the web UI and by notebooks.

For a remote engine they show what its server reported and, for the rest, say what is not
known and why (the output's `unreported` sentences) rather than showing a made-up value.
"""

from __future__ import annotations

import html
from collections.abc import Mapping
from itertools import pairwise
from typing import TYPE_CHECKING, Any

import pandas as pd

from ui.markup import BOX, CHIP, MUTED, ms, pct, section, unreported
from ui.timing import timing_html

if TYPE_CHECKING:
    from engine.interface import TokenizerLike
    from engine.outputs import PlaceholderInfo, RequestOutput

MODALITY_COLORS = {"image": "#2563eb", "video": "#9333ea", "audio": "#059669"}
# Glyphs every system font has (emoji fonts are missing on many Linux machines).
MODALITY_ICONS = {"image": "▣", "video": "▶", "audio": "♪"}
TABLE_COLUMNS = ["item", "modality", "offset", "length", "embeds", "hash", "cache"]

# Cache outcome of one media item, as shown in the table and the cache panel.
HIT, MISS, PREFIX, PENDING, UNKNOWN = "hit", "miss", "prefix cache", "pending", "not reported"
_STATUS_COLORS = {HIT: "#16a34a", MISS: "#dc2626", PREFIX: "#0891b2", PENDING: "#6b7280",
                  UNKNOWN: "#6b7280"}
_STATUS_HELP = {
    HIT: "embeddings reused from the encoder cache",
    MISS: "encoded by this request",
    PREFIX: "span's KV came from the prefix cache: encoder not needed",
    PENDING: "not scheduled yet",
    UNKNOWN: "the server does not report encoder-cache outcomes",
}
_NO_HASH = "—"

# ---- placeholders -----------------------------------------------------------------------------


def item_labels(output: RequestOutput) -> list[str]:
    """A short name per placeholder: "image 1", or "video 1 · t0" for the parts of one video.

    The placeholders of one media item share its `item` (or, without one, the identifier's part
    before ":"); a placeholder with neither is an item of its own. Items are numbered per
    modality in prompt order, by the modality of their first span in the prompt: a video heard
    with its sound is "video 1", its sound parts "video 1 · sound 0-2 s". A part is labelled by
    its `part`, else by the identifier's ":suffix"."""
    phs = output.multi_modal_placeholders
    keys, parts = [], []
    for i, ph in enumerate(phs):
        base, _, suffix = (ph.identifier or f"\0{i}").partition(":")
        keys.append(ph.item if ph.item is not None else base)
        parts.append(ph.part or suffix)
    counts: dict[str, int] = {}
    names: dict[str, str] = {}
    for i in sorted(range(len(phs)), key=lambda i: phs[i].offset):
        if keys[i] not in names:
            modality = phs[i].modality
            counts[modality] = counts.get(modality, 0) + 1
            names[keys[i]] = f"{modality} {counts[modality]}"
    return [f"{names[key]} · {part}" if part else names[key]
            for key, part in zip(keys, parts, strict=True)]


def cache_status(output: RequestOutput, ph: PlaceholderInfo) -> str:
    """HIT, MISS, PREFIX (the span lay in the reused prefix, so no lookup was needed),
    PENDING (not scheduled yet) or UNKNOWN (a server that does not report the outcome)."""
    if ph.cache_hit is not None:
        return HIT if ph.cache_hit else MISS
    cached = output.num_cached_tokens
    if cached is not None and cached >= ph.offset + ph.length:
        return PREFIX
    return UNKNOWN if "encoder_cache" in output.unreported else PENDING


def placeholder_table(output: RequestOutput) -> pd.DataFrame:
    """One row per media placeholder: its span, embed count, short hash and cache outcome."""
    rows = [
        [label, ph.modality, ph.offset, ph.length, ph.num_embeds, _short_hash(ph),
         cache_status(output, ph)]
        for label, ph in zip(item_labels(output), output.multi_modal_placeholders, strict=True)
    ]
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


def placeholder_html(
    output: RequestOutput, tokenizer: TokenizerLike | None, *, max_run: int = 160
) -> str:
    """The prompt as a strip of tokens with each media span collapsed into one coloured chip
    (modality, offset, length, embeds, short hash, cache outcome). Text runs longer than
    `max_run` tokens show their two ends around an elided middle; without a tokenizer (a
    remote engine) each text run is one chip that counts its tokens."""
    ids = output.prompt_token_ids
    special = set(tokenizer.all_special_ids) if tokenizer is not None else set()
    text = _text_offsets(output.multi_modal_placeholders)
    parts = []
    pos = 0
    spans = zip(item_labels(output), output.multi_modal_placeholders, text, strict=True)
    for label, ph, own_text in sorted(spans, key=lambda s: s[1].offset):
        # Spans may overlap (an audio window's span around the video tokens between its own):
        # text runs fill only the gaps no span covers.
        parts.append(_text_run(ids, pos, ph.offset, tokenizer, special, max_run))
        parts.append(
            _media_chip(label, ph, cache_status(output, ph), ids, tokenizer, own_text))
        pos = max(pos, ph.offset + ph.length)
    parts.append(_text_run(ids, pos, len(ids), tokenizer, special, max_run))
    legend = " ".join(
        f'<span style="{CHIP}background:{color};color:#fff">{MODALITY_ICONS[m]} {m}</span>'
        for m, color in MODALITY_COLORS.items()
    )
    n = output.num_prompt_tokens
    head = (
        f'<div style="{MUTED}margin-bottom:4px">{"?" if n is None else n} prompt tokens · '
        f"{len(output.multi_modal_placeholders)} media spans · {legend}</div>"
    )
    notes = "".join(
        f'<div style="{MUTED}margin-bottom:4px">{html.escape(output.unreported[key])}</div>'
        for key in ("prompt_token_ids", "placeholders") if key in output.unreported
    )
    if ids and tokenizer is None:
        notes += (f'<div style="{MUTED}margin-bottom:4px">Token texts are not shown: the '
                  "server does not send them and no tokenizer is loaded here.</div>")
    strip = (
        '<div style="font-family: ui-monospace, monospace; font-size: 12px; '
        f'white-space: pre-wrap; word-break: break-all">{"".join(parts)}</div>'
    )
    return f'<div class="mm-placeholders" style="{BOX}">{head}{notes}{strip}</div>'


def _text_offsets(phs: list[PlaceholderInfo]) -> list[tuple[int, ...]]:
    """Each span's offsets of the positions that keep their text embeddings: those its
    `is_embed` mask leaves out, less those another span embeds (when spans interleave, a
    span's mask also leaves out the other items' tokens inside it)."""
    spans = sorted((ph.offset, ph.offset + ph.length) for ph in phs)
    if all(a_end <= b_start for (_, a_end), (b_start, _) in pairwise(spans)):
        return [ph.text_offsets for ph in phs]  # disjoint spans: nothing to take out
    embedded: set[int] = set()
    for ph in phs:
        kept = set(ph.text_offsets)
        embedded.update(ph.offset + k for k in range(ph.length) if k not in kept)
    return [tuple(k for k in ph.text_offsets if ph.offset + k not in embedded) for ph in phs]


def _text_run(
    ids: list[int], start: int, end: int, tokenizer: TokenizerLike | None, special: set[int],
    max_run: int,
) -> str:
    if end <= start:
        return ""
    if tokenizer is None:
        return (f'<span title="tokens {start}–{end - 1}" style="{CHIP}background:#f3f4f6">'
                f"{end - start} text tokens</span>")
    if end - start <= max_run:
        return _tokens(ids, start, end, tokenizer, special)
    half = max_run // 2
    elided = end - start - 2 * half
    gap = f'<span style="{CHIP}{MUTED}border:1px dashed #9ca3af">… {elided} tokens …</span>'
    head = _tokens(ids, start, start + half, tokenizer, special)
    return head + gap + _tokens(ids, end - half, end, tokenizer, special)


def _tokens(
    ids: list[int], start: int, end: int, tokenizer: TokenizerLike, special: set[int]
) -> str:
    texts = tokenizer.batch_decode([[t] for t in ids[start:end]])
    out = []
    for pos, (tid, text) in enumerate(zip(ids[start:end], texts, strict=True), start):
        shade = "#d1d5db" if tid in special else ("#f3f4f6" if pos % 2 else "#e5e7eb")
        shown = html.escape(text.replace("\n", "↵")) or "∅"
        out.append(
            f'<span title="#{pos} id {tid}" style="{CHIP}margin:0;padding:0 1px;'
            f'background:{shade}">{shown}</span>'
        )
    return "".join(out)


def _structure_summary(
    ph: PlaceholderInfo, text: tuple[int, ...], ids: list[int], tokenizer: TokenizerLike
) -> str:
    """The span's text tokens (at offsets `text`), each distinct one with its count, in order
    of appearance."""
    counts: dict[int, int] = {}
    for k in text:
        if ph.offset + k < len(ids):
            tid = ids[ph.offset + k]
            counts[tid] = counts.get(tid, 0) + 1
    texts = tokenizer.batch_decode([[t] for t in counts])
    return ", ".join(
        text.replace("\n", "↵") + (f" ×{n}" if n > 1 else "")
        for text, n in zip(texts, counts.values(), strict=True)
    )


def _media_chip(
    label: str, ph: PlaceholderInfo, status: str, ids: list[int] | None = None,
    tokenizer: TokenizerLike | None = None, text: tuple[int, ...] | None = None,
) -> str:
    """One span as a chip; `text`: the offsets of its text tokens (default: those its mask
    leaves out)."""
    text = ph.text_offsets if text is None else text
    color = MODALITY_COLORS.get(ph.modality, "#374151")
    embeds = f"{ph.num_embeds} embeds"
    if text:  # structure tokens inside the span keep their text embeddings
        embeds += f" + {len(text)} text"
    if ph.num_embeds + len(text) != ph.length:  # other items' tokens, or not reported
        embeds += f" in {ph.length}"
    if ph.parts:  # e.g. an anyres image: its base image, then its tiles
        embeds += " · " + " + ".join(f"{name} {n}" for name, n in ph.parts)
    title = (
        f"{label}: tokens {ph.offset}–{ph.offset + ph.length - 1}, {embeds}, "
        f"hash {ph.identifier or 'not reported'}, {_STATUS_HELP[status]}"
    )
    if text and ids is not None and tokenizer is not None:
        title += "; text inside: " + _structure_summary(ph, text, ids, tokenizer)
    return (
        f'<span title="{html.escape(title)}" style="{CHIP}background:{color};color:#fff;'
        f'font-family: ui-sans-serif, system-ui, sans-serif;padding:1px 6px">'
        f"{MODALITY_ICONS.get(ph.modality, '')} {html.escape(label)} · "
        f"@{ph.offset} ×{ph.length} · {embeds} · {_short_hash(ph)} · {status}</span>"
    )


def _short_hash(ph: PlaceholderInfo) -> str:
    return ph.identifier.split(":")[0][:8] if ph.identifier else _NO_HASH


# ---- caches -----------------------------------------------------------------------------------


def cache_html(output: RequestOutput) -> str:
    """This request's cache use: prefix-cached prompt tokens and each item's encoder outcome."""
    n = output.num_prompt_tokens
    cached = output.num_cached_tokens
    m = output.metrics
    if cached is None:
        prefix = f"<b>Prefix cache</b>: {unreported(output, 'cached_tokens')}"
    else:
        share = f" ({pct(cached / n if n else 0.0)})" if n is not None else ""
        prefix = (f"<b>Prefix cache</b>: {cached} of {'?' if n is None else n} prompt tokens "
                  f"reused{share}")
    if "encoder_cache" in output.unreported:
        encoder = f"<b>Encoder</b>: {unreported(output, 'encoder_cache')}"
    else:
        encoder = (f"<b>Encoder</b>: {m.encoder_cache_hits} hits · {m.encoder_cache_misses} "
                   f"misses · {m.encoder_calls} calls, {ms(m.encoder_time)}")
    lines = [prefix, encoder]
    drafted = sum(c.num_draft_tokens for c in output.outputs)
    if drafted:  # speculative decoding
        accepted = sum(c.num_accepted_tokens for c in output.outputs)
        lines.append(f"<b>Speculative decoding</b>: {accepted} of {drafted} draft tokens "
                     f"accepted ({pct(accepted / drafted)}) in {m.verify_steps} verify steps")
    for label, ph in zip(item_labels(output), output.multi_modal_placeholders, strict=True):
        status = cache_status(output, ph)
        lines.append(
            f'<span style="{CHIP}background:{_STATUS_COLORS[status]};color:#fff">{status}</span> '
            f"{html.escape(label)} <code>{_short_hash(ph)}</code> "
            f'<span style="{MUTED}">{_STATUS_HELP[status]}</span>'
        )
    return section("This request", lines)


def engine_html(stats: Mapping[str, Any]) -> str:
    """Engine-wide counters: requests, KV blocks, prefix cache, encoder cache (a cross-attention
    model's: its layers' keys and values), a hybrid model's state slots and snapshots; for a
    remote engine (stats with a "backend"), this app's
    requests to its server."""
    if "backend" in stats:
        return _remote_engine_html(stats)
    lines = [
        f"<b>Requests</b>: {stats.get('requests_running', 0)} running · "
        f"{stats.get('requests_waiting', 0)} waiting · {stats.get('steps', 0)} steps",
        *([f"<b>Weights</b>: {html.escape(str(stats['weights']))}"] if "weights" in stats else []),
        _meter(
            "KV blocks in use", stats.get("kv_blocks_used", 0), stats.get("kv_blocks_total", 0),
            f"{stats.get('kv_blocks_cached', 0)} cached for prefix reuse"
            + (f"; {stats['kv_bytes_per_block'] / 1024:.0f} KiB per block over "
               f"{stats['kv_layers']}" if "kv_layers" in stats else "")
            + (f"; {stats['kv_cache_dtype']} keys and values: {stats['kv_capacity_gain']:.2f}x "
               f"the tokens of {stats['kv_model_dtype']}" if "kv_cache_dtype" in stats else ""),
        ),
        *([f"<b>Context</b>: {html.escape(str(stats['context_fit']))}"]
          if "context_fit" in stats else []),
        *([f"<b>KV memory resident</b>: {stats['kv_resident_bytes'] / 2**20:.1f} of "
           f"{stats['kv_reserved_bytes'] / 2**20:.0f} MiB reserved (pages are taken as blocks "
           "are first used)"] if "kv_resident_bytes" in stats else []),
        *([f"<b>Per-layer embeddings</b>: {stats['per_layer_table_bytes'] / 2**20:.0f} MiB, "
           "a few rows read per step"] if "per_layer_table_bytes" in stats else []),
        f"<b>Prefix cache hit rate</b>: {pct(stats.get('prefix_cache_hit_rate', 0.0))} of "
        f"{stats.get('prefix_cache_queried_tokens', 0)} queried tokens",
    ]
    per_key = stats.get("cross_attention_bytes_per_key")
    if per_key:  # a cross-attention model: the encoder cache holds those layers' keys and values
        mib = 1 << 20
        lines.append(_meter(
            "Cross-attention states (MiB)", round(stats["encoder_cache_used"] * per_key / mib, 2),
            round(stats["cross_attention_cache_bytes"] / mib, 2),
            f"{stats['encoder_cache_entries']} items, {stats['encoder_cache_referenced']} in "
            f"use; {stats['cross_attention_layers']} layers' keys and values, "
            f"{per_key / 1024:.1f} KiB per image position"))
    if "encoder_cache_capacity" in stats:
        lines += [
            *([] if per_key else [_meter(
                "Encoder cache", stats["encoder_cache_used"], stats["encoder_cache_capacity"],
                f"{stats['encoder_cache_entries']} items, "
                f"{stats['encoder_cache_referenced']} in use",
            )]),
            f"<b>Encoder cache hit rate</b>: {pct(stats['encoder_cache_hit_rate'])} "
            f"({stats['encoder_cache_hits']} hits, {stats['encoder_cache_misses']} misses)",
        ]
    if "state_slots_total" in stats:  # a hybrid model's linear-attention state
        mib = 1 << 20
        lines += [
            _meter(
                "State slots", stats["state_slots_used"], stats["state_slots_total"],
                f"{stats['state_bytes_per_request'] / mib:.1f} MiB per request, "
                f"{stats['state_slot_bytes'] / mib:.0f} MiB in all"
                + (f"; {stats['state_resident_bytes'] / mib:.1f} MiB of the state pools "
                   "resident" if "state_resident_bytes" in stats else ""),
            ),
            _meter(
                "State snapshots", stats["state_snapshots_used"], stats["state_snapshots_total"],
                f"{stats['state_snapshot_bytes'] / mib:.0f} MiB for prefix reuse; "
                f"{stats['state_snapshot_hits']} hits restored "
                f"{stats['state_snapshot_hit_tokens']} tokens",
            ),
        ]
    if "speculative" in stats:
        drafted = stats["draft_tokens"]
        rate = f" ({pct(stats['accepted_tokens'] / drafted)})" if drafted else ""
        lines.append(
            f"<b>Speculative decoding</b>: {html.escape(str(stats['speculative']))}, up to "
            f"{stats['speculative_max_tokens']} drafts per step; {stats['accepted_tokens']} of "
            f"{drafted} draft tokens accepted{rate}, {stats['draft_rounds']} drafting rounds "
            f"({ms(stats['draft_seconds'])})"
            + (f"; measured here, a step verifying 1 / 4 drafts costs "
               f"{stats['verify_1_cost']:.2f}x / {stats['verify_4_cost']:.2f}x a plain step"
               if "verify_1_cost" in stats else ""))
    if stats.get("checkpoint"):
        lines.append(_settings_html(stats["checkpoint"]))
    return section("Engine", lines, css_class="mm-engine")


def _settings_html(rows) -> str:
    """The checkpoint's settings, each with the file (or class default) it came from."""
    body = "".join(
        f"<tr><td>{html.escape(c)}</td><td>{html.escape(k)}</td>"
        f"<td><code>{html.escape(v)}</code></td><td style=\"{MUTED}\">{html.escape(src)}</td></tr>"
        for c, k, v, src in rows)
    return (f"<details><summary><b>Checkpoint settings</b> ({len(rows)}, where each came "
            f"from)</summary><table>{body}</table></details>")


def _remote_engine_html(stats: Mapping[str, Any]) -> str:
    lines = [
        f"<b>Server</b>: <code>{html.escape(str(stats['backend']))}</code>",
        f"<b>Requests from this app</b>: {stats.get('requests_running', 0)} running · "
        f"{stats.get('requests_finished', 0)} finished · "
        f"{stats.get('requests_failed', 0)} failed",
        f'<span style="{MUTED}">The server\'s KV cache, encoder cache and batch are not '
        "visible over the OpenAI API; each request's panels show what its response "
        "reported.</span>",
    ]
    return section("Engine (remote)", lines, css_class="mm-engine")


def _meter(label: str, used: float, total: float, note: str) -> str:
    frac = used / total if total else 0.0
    bar = (
        '<span style="display:inline-block;vertical-align:middle;width:120px;height:8px;'
        'background:#e5e7eb;border-radius:4px;overflow:hidden;margin:0 6px">'
        f'<span style="display:block;height:100%;width:{100 * frac:.1f}%;'
        'background:#2563eb"></span></span>'
    )
    return (
        f"<b>{label}</b>: {used} / {total}{bar}{pct(frac)} "
        f'<span style="{MUTED}">({note})</span>'
    )


# ---- all together -----------------------------------------------------------------------------


def result_html(
    output: RequestOutput, stats: Mapping[str, Any], tokenizer: TokenizerLike | None
) -> str:
    """Every panel for one result in one HTML block (what a notebook displays)."""
    table = placeholder_table(output)
    table_html = (
        table.to_html(index=False, border=0) if len(table) else f'<p style="{MUTED}">no media</p>'
    )
    reply = html.escape(output.outputs[0].text)
    return (
        f'<div style="{BOX}"><b>Output</b>: <span style="white-space:pre-wrap">{reply}</span>'
        f"</div>{placeholder_html(output, tokenizer)}<div style=\"{BOX}\">{table_html}</div>"
        f"{cache_html(output)}{engine_html(stats)}{timing_html(output)}"
    )


