"""The draft forest of the latest DSBD iteration as an inline SVG: one column per layer, nodes by fate;
and the finished answer coloured by where each token came from (draft-accepted or drawn by the target).

Forest shape (from the decoder): {"gamma", "draft_beams" (W_S), "adaptive" (sizes chosen per iteration),
"layers": [{"width", "passed", "passed_by" ("acceptance" | "cache"), "nodes": [{"parent", "token", "status"}],
"lookups": [{"parent", "token", "source", "status" ("lookup" | "hit")}], "corrections": [token, ...]}]}.
A layer-1 node's parent is a live beam; a deeper draft's parent is an index into the previous layer's drafts, a
deeper lookup node's an index into the previous layer's drafts then lookup nodes (the column's rows).
Lookup nodes are forest nodes that no draft proposed, each from a source (the draft model's likeliest pairs, a
match in the text, a recycled prediction): a correction or fill landing on one (or on a rejected draft) is a hit,
and a layer whose every output is a node passes by the cache rule. Corrections that hit no node have no forest
node, so they are drawn unattached.
"""

from __future__ import annotations

from html import escape
from typing import Callable

COLOURS = {"accepted": "#2e7d32", "rejected": "#c62828", "auto-rejected": "#9e9e9e", "untested": "#bdbdbd",
           "hit": "#00838f", "lookup": "#6a1b9a", "correction": "#ef6c00", "beam": "#1565c0"}
_COL_W, _BOX_W, _BOX_H, _ROW_H, _TOP, _LEGEND_W = 118, 96, 20, 26, 34, 600
# Where a lookup node came from: a mark before its token, and the words in its tooltip and the caption.
SOURCES = {"draft": ("◇", "the draft model's likeliest pairs"), "match": ("⌕", "a match in the text"),
           "recycled": ("↻", "the model's recycled predictions")}


def token_label(tok: int, decode: Callable[[list[int]], bytes] | None) -> str:
    """Printable, short text of one token: spaces as ␣, newlines as ⏎; the id if there is no tokenizer."""
    if decode is None:
        return f"#{tok}"
    try:
        raw = decode([tok])
        text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    except Exception:
        return f"#{tok}"
    text = text.replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥") or "∅"
    return text if len(text) <= 9 else text[:8] + "…"


def _box(x: float, y: float, label: str, colour: str, title: str, dashed: bool = False) -> str:
    dash = ' stroke-dasharray="4 2"' if dashed else ""
    return (f'<g><title>{escape(title)}</title>'
            f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="5" fill="{colour}" '
            f'stroke="#222" stroke-width="0.6"{dash}/>'
            f'<text x="{x + _BOX_W / 2}" y="{y + 14}" text-anchor="middle" fill="#fff" '
            f'font-family="monospace" font-size="12">{escape(label)}</text></g>')


def forest_svg(forest: dict | None, decode: Callable[[list[int]], bytes] | None = None) -> str:
    """HTML with an SVG picture of `forest`, or a short note when there is none."""
    layers = (forest or {}).get("layers") or []
    if not layers and (forest or {}).get("adaptive") and forest.get("gamma") == 0:
        return ('<div class="dsbd-forest-empty">Latest iteration: no draft (adaptive forest: γ=0, one plain '
                'beam-sampling step was the fastest choice).</div>')
    if not layers:
        return ('<div class="dsbd-forest-empty">No draft forest yet: it appears while a dsbd / dsbd-mem '
                'answer runs.</div>')
    n_roots = 1 + max((n["parent"] for n in layers[0]["nodes"]), default=0)
    rows = max([n_roots] + [len(L["nodes"]) + len(L.get("lookups") or []) + len(L.get("corrections") or [])
                            for L in layers])
    width = max(16 + _COL_W * (len(layers) + 1), _LEGEND_W)
    height = _TOP + rows * _ROW_H + 52  # two legend rows: fates, then lookup sources
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'viewBox="0 0 {width} {height}" role="img" aria-label="draft forest">']

    def x_of(col: int) -> float:
        return 8 + col * _COL_W

    def y_of(row: int) -> float:
        return _TOP + row * _ROW_H

    parts.append(f'<text x="{x_of(0)}" y="20" font-size="12" font-family="sans-serif">beams</text>')
    for r in range(n_roots):
        parts.append(_box(x_of(0), y_of(r), f"beam {r}", COLOURS["beam"], f"live beam {r}"))
    for col, layer in enumerate(layers, start=1):
        mark = ("✓ cache" if layer.get("passed_by") == "cache" else "✓") if layer.get("passed") else "✗"
        parts.append(f'<text x="{x_of(col)}" y="20" font-size="12" font-family="sans-serif">'
                     f'L{col} · W={layer.get("width", "?")} {mark}</text>')
        for i, node in enumerate(layer["nodes"]):
            px, py = x_of(col - 1) + _BOX_W, y_of(node["parent"]) + _BOX_H / 2
            parts.append(f'<line x1="{px}" y1="{py}" x2="{x_of(col)}" y2="{y_of(i) + _BOX_H / 2}" '
                         f'stroke="#777" stroke-width="1"/>')
            label = token_label(node["token"], decode)
            status = node.get("status", "rejected")
            parts.append(_box(x_of(col), y_of(i), label, COLOURS.get(status, "#555"),
                              f"{status}: token {node['token']} (parent {node['parent']})"))
        lookups = layer.get("lookups") or []
        for j, node in enumerate(lookups):
            status, y = node.get("status", "lookup"), y_of(len(layer["nodes"]) + j)
            mark, origin = SOURCES.get(node.get("source", "draft"), ("·", node.get("source", "")))
            if node.get("parent", -1) >= 0:
                px, py = x_of(col - 1) + _BOX_W, y_of(node["parent"]) + _BOX_H / 2
                parts.append(f'<line x1="{px}" y1="{py}" x2="{x_of(col)}" y2="{y + _BOX_H / 2}" '
                             f'stroke="#b39ddb" stroke-width="1" stroke-dasharray="3 2"/>')
            parts.append(_box(x_of(col), y, mark + token_label(node["token"], decode), COLOURS.get(status, "#555"),
                              f"lookup node from {origin} ({'hit by an output' if status == 'hit' else 'not hit'}): "
                              f"token {node['token']}", dashed=True))
        for j, tok in enumerate(layer.get("corrections") or []):
            parts.append(_box(x_of(col), y_of(len(layer["nodes"]) + len(lookups) + j), "+" + token_label(tok, decode),
                              COLOURS["correction"], f"correction drawn from the residual: token {tok}", dashed=True))
    lx, ly = 8, height - 30
    for name in ("accepted", "hit", "rejected", "auto-rejected", "lookup", "correction"):
        parts.append(f'<rect x="{lx}" y="{ly - 10}" width="12" height="12" fill="{COLOURS[name]}"/>'
                     f'<text x="{lx + 16}" y="{ly}" font-size="12" font-family="sans-serif">{name}</text>')
        lx += 28 + 8 * len(name)
    lx, ly = 8, height - 10
    for mark, origin in SOURCES.values():
        parts.append(f'<text x="{lx}" y="{ly}" font-size="12" font-family="sans-serif">{mark} {escape(origin)}</text>')
        lx += 20 + 6 * len(origin)
    parts.append("</svg>")
    g = forest.get("gamma")
    ws, how = forest.get("draft_beams"), " (chosen adaptively)" if forest.get("adaptive") else ""
    sizes = f"γ={g}" + (f", W_S={ws}" if ws is not None else "") + how
    caption = f"Latest iteration: {sizes}, {len(layers)} layer(s) verified." if g is not None else ""
    by_source: dict[str, list[int]] = {}
    for layer in layers:
        for node in layer.get("lookups") or []:
            row = by_source.setdefault(node.get("source", "draft"), [0, 0])
            row[0] += 1
            row[1] += node.get("status") == "hit"
    if caption and by_source:
        caption += " Lookup nodes: " + ", ".join(f"{n} from {SOURCES.get(k, ('', k))[1]} ({h} hit)"
                                                 for k, (n, h) in by_source.items()) + "."
    if caption and forest.get("query_tokens") is not None:  # the engine adds the target pass's token counts
        caption += (f" Target pass: {forest['query_tokens']} query / {forest.get('distinct_tokens')} distinct "
                    "tokens.")
    return f'<div class="dsbd-forest">{"".join(parts)}<div class="dsbd-caption">{caption}</div></div>'


def origin_html(segments: list | None) -> str:
    """The answer as text runs marked by origin (Event.segments: [(text, drafted)]); '' when not drafted."""
    if not segments:
        return ""
    total = sum(len(t) for t, _ in segments) or 1
    share = sum(len(t) for t, d in segments if d) / total
    spans = "".join(f'<span class="dsbd-tok-{"draft" if d else "target"}">{escape(t)}</span>' for t, d in segments)
    return (f'<div class="dsbd-origins"><div class="dsbd-caption">Answer by origin: '
            f'<span class="dsbd-tok-draft">accepted from the draft</span> ({share:.0%} of the characters) · '
            f'<span class="dsbd-tok-target">drawn by the target</span></div>'
            f'<div class="dsbd-origin-text">{spans}</div></div>')
