"""A self-contained HTML picture of a branch tree (inline CSS and SVG; no scripts, no external files).

The input is plain data (:class:`TreeNode`, or nested dicts with the same keys), so the picture can be
drawn without a model. ``lloyal best-of-n --tree tree.html`` draws the prompt as the root and one
child per candidate, the winner highlighted in :data:`WINNER_COLOR` with a WINNER label; deeper trees
(children of children) are laid out the same way, depth by depth from left to right.

Example:
    >>> from lloyal.tree_html import TreeNode, render_tree_html
    >>> tree = TreeNode("prompt", "Once upon a time", 5, children=[
    ...     TreeNode("branch 0", " there was a <cat>", 6, perplexity=3.2, winner=True),
    ...     TreeNode("branch 1", " in a land", 4, perplexity=5.9),
    ... ])
    >>> page = render_tree_html(tree)
    >>> "&lt;cat&gt;" in page and "<cat>" not in page
    True
"""

from __future__ import annotations

import html
import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WINNER_COLOR", "TreeNode", "render_tree_html", "write_tree_html"]

WINNER_COLOR = "#16a34a"  # the winner's border, badge and path (RGB 22, 163, 74)
_ROOT_STROKE, _ROOT_FILL = "#4f46e5", "#eef2ff"
_NODE_STROKE, _NODE_FILL = "#94a3b8", "#f8fafc"
_WIN_FILL = "#dcfce7"

_MARGIN, _GAP_X, _GAP_Y = 24, 72, 18
_ROOT_W, _NODE_W = 300, 440
_PAD, _HEADER_H, _LINE_H, _CHAR_W = 12, 30, 17, 7.3  # 12px monospace: ~7.2px per character
_MAX_LINES = 14
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


@dataclass(frozen=True)
class TreeNode:
    """One node: a label (``"prompt"``, ``"branch 3"``), its text, token count and perplexity."""

    label: str
    text: str
    tokens: int
    perplexity: float | None = None
    winner: bool = False
    children: Sequence[TreeNode] = field(default_factory=tuple)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TreeNode:
        """Build a tree from nested dicts with the field names (``children`` a list of such dicts)."""
        return cls(
            label=str(data.get("label", "")),
            text=str(data.get("text", "")),
            tokens=int(data.get("tokens", 0)),
            perplexity=None if data.get("perplexity") is None else float(data["perplexity"]),
            winner=bool(data.get("winner", False)),
            children=tuple(cls.from_dict(c) for c in data.get("children", ())),
        )


@dataclass
class _Box:
    node: TreeNode
    depth: int
    lines: list[str]
    on_winner_path: bool
    x: float = 0.0
    y: float = 0.0
    w: float = 0.0
    h: float = 0.0
    children: list[_Box] = field(default_factory=list)
    subtree_h: float = 0.0


def _clean(text: str) -> str:
    """Text safe to put in markup once escaped: tabs as spaces, other control characters as U+FFFD."""
    return _CONTROL.sub("\ufffd", text.replace("\t", "    ").replace("\r\n", "\n"))


def _wrap(text: str, width_px: float) -> list[str]:
    cols = max(int((width_px - 2 * _PAD) / _CHAR_W), 8)
    paras = _clean(text).split("\n")
    lines: list[str] = []
    for i, para in enumerate(paras):
        wrapped = textwrap.wrap(para, cols - 1, break_on_hyphens=False) or [""]
        if i < len(paras) - 1:
            wrapped[-1] += "↵"
        lines.extend(wrapped)
    if len(lines) > _MAX_LINES:
        lines = [*lines[: _MAX_LINES - 1], lines[_MAX_LINES - 1][: cols - 2] + " …"]
    return lines


def _has_winner(node: TreeNode) -> bool:
    return node.winner or any(_has_winner(c) for c in node.children)


def _build(node: TreeNode, depth: int) -> _Box:
    w = _ROOT_W if depth == 0 else _NODE_W
    box = _Box(node, depth, _wrap(node.text, w), _has_winner(node), w=w)
    box.h = _HEADER_H + _LINE_H * len(box.lines) + _PAD
    box.children = [_build(c, depth + 1) for c in node.children]
    kids = sum(c.subtree_h for c in box.children) + _GAP_Y * max(len(box.children) - 1, 0)
    box.subtree_h = max(box.h, kids)
    return box


def _place(box: _Box, top: float) -> None:
    box.x = _MARGIN + (0 if box.depth == 0 else _ROOT_W + _GAP_X + (box.depth - 1) * (_NODE_W + _GAP_X))
    box.y = top + (box.subtree_h - box.h) / 2
    kids = sum(c.subtree_h for c in box.children) + _GAP_Y * max(len(box.children) - 1, 0)
    y = top + (box.subtree_h - kids) / 2
    for c in box.children:
        _place(c, y)
        y += c.subtree_h + _GAP_Y


def _walk(box: _Box) -> list[_Box]:
    out, stack = [], [box]
    while stack:
        b = stack.pop()
        out.append(b)
        stack.extend(reversed(b.children))
    return out


def _ppl(p: float | None) -> str:
    return "—" if p is None or not math.isfinite(p) else f"{p:.2f}"


def _stats(node: TreeNode) -> str:
    s = f"{node.tokens} token{'s' if node.tokens != 1 else ''}"
    return s if node.perplexity is None else f"{s} · ppl {_ppl(node.perplexity)}"


def _svg_node(box: _Box, idx: int) -> str:
    n, e = box.node, html.escape
    stroke, fill, sw = _NODE_STROKE, _NODE_FILL, 1.5
    if box.depth == 0:
        stroke, fill, sw = _ROOT_STROKE, _ROOT_FILL, 2.0
    if n.winner:
        stroke, fill, sw = WINNER_COLOR, _WIN_FILL, 3.5
    x, y = box.x, box.y
    rect = f'x="{x:.1f}" y="{y:.1f}" width="{box.w:.1f}" height="{box.h:.1f}"'
    parts = [
        f'<g class="node{" winner" if n.winner else ""}">',
        f"<title>{e(n.label)} ({e(_stats(n))}): {e(_clean(n.text))}</title>",
        f'<clipPath id="clip{idx}"><rect {rect}/></clipPath>',
        f'<rect {rect} rx="8" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"/>',
        f'<g clip-path="url(#clip{idx})">',
        f'<text class="label" x="{x + _PAD:.1f}" y="{y + 20:.1f}">{e(n.label)}'
        f'<tspan class="stats" dx="10">{e(_stats(n))}</tspan></text>',
    ]
    if n.winner:
        bw = 78
        bx = x + box.w - bw - 8
        parts.append(
            f'<rect x="{bx:.1f}" y="{y + 6:.1f}" width="{bw}" height="20" rx="4" fill="{WINNER_COLOR}"/>'
            f'<text class="badge" x="{bx + bw / 2:.1f}" y="{y + 20:.1f}" text-anchor="middle">★ WINNER</text>'
        )
    body = "".join(
        f'<tspan x="{x + _PAD:.1f}" y="{y + _HEADER_H + 12 + i * _LINE_H:.1f}">{e(line)}</tspan>'
        for i, line in enumerate(box.lines)
    )
    if not n.text:
        body = f'<tspan class="empty" x="{x + _PAD:.1f}" y="{y + _HEADER_H + 12:.1f}">(no text)</tspan>'
    parts.append(f'<text class="body">{body}</text></g></g>')
    return "".join(parts)


def _svg_edge(parent: _Box, child: _Box) -> str:
    x1, y1 = parent.x + parent.w, parent.y + parent.h / 2
    x2, y2 = child.x, child.y + child.h / 2
    mid = (x1 + x2) / 2
    win = child.on_winner_path
    colour, width = (WINNER_COLOR, 3.5) if win else (_NODE_STROKE, 1.5)
    return (
        f'<path d="M{x1:.1f},{y1:.1f} C{mid:.1f},{y1:.1f} {mid:.1f},{y2:.1f} {x2:.1f},{y2:.1f}" '
        f'fill="none" stroke="{colour}" stroke-width="{width}"/>'
    )


def _table(boxes: list[_Box]) -> str:
    e = html.escape
    rows = []
    for b in boxes:
        n = b.node
        cls = ' class="winner"' if n.winner else ""
        mark = " ★ winner" if n.winner else ""
        rows.append(
            f"<tr{cls}><td>{e(n.label)}{mark}</td><td>{b.depth}</td><td>{n.tokens}</td>"
            f"<td>{_ppl(n.perplexity)}</td><td class='text'>{e(_clean(n.text))}</td></tr>"
        )
    head = "<tr><th>node</th><th>depth</th><th>tokens</th><th>perplexity</th><th>text</th></tr>"
    return f"<table>{head}{''.join(rows)}</table>"


_CSS = f"""
body {{ font-family: system-ui, sans-serif; margin: 16px; color: #0f172a; background: #ffffff; }}
h1 {{ font-size: 20px; margin: 0 0 4px; }}
p.sub {{ margin: 0 0 12px; color: #475569; font-size: 13px; }}
.legend span {{ display: inline-block; width: 12px; height: 12px; border-radius: 3px; margin: 0 4px 0 12px;
  vertical-align: -1px; }}
svg {{ display: block; }}
svg text {{ font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; font-size: 12px; white-space: pre; }}
svg text.label {{ font-family: system-ui, sans-serif; font-size: 13px; font-weight: 600; fill: #0f172a; }}
svg tspan.stats {{ font-weight: 400; fill: #475569; }}
svg text.badge {{ font-family: system-ui, sans-serif; font-size: 11px; font-weight: 700; fill: #ffffff; }}
svg text.body {{ fill: #1e293b; }}
svg tspan.empty {{ fill: #94a3b8; font-style: italic; }}
table {{ border-collapse: collapse; margin-top: 16px; font-size: 13px; }}
th, td {{ border: 1px solid #cbd5e1; padding: 4px 8px; text-align: left; vertical-align: top; }}
td.text {{ font-family: "DejaVu Sans Mono", monospace; white-space: pre-wrap; max-width: 720px; }}
tr.winner td {{ background: {_WIN_FILL}; font-weight: 600; }}
"""


def render_tree_html(
    tree: TreeNode | Mapping[str, Any], *, title: str = "lloyal branch tree", subtitle: str = ""
) -> str:
    """The whole HTML document for ``tree`` (a :class:`TreeNode` or the equivalent nested dicts).

    All text is HTML-escaped; the page needs no network, scripts or other files.
    """
    root = tree if isinstance(tree, TreeNode) else TreeNode.from_dict(tree)
    top = _build(root, 0)
    _place(top, _MARGIN)
    boxes = _walk(top)
    width = max(b.x + b.w for b in boxes) + _MARGIN
    height = top.subtree_h + 2 * _MARGIN
    edges = [_svg_edge(b, c) for b in boxes for c in b.children]
    nodes = [_svg_node(b, i) for i, b in enumerate(boxes)]
    e = html.escape
    legend = f'<span style="background:{_ROOT_FILL};border:1px solid {_ROOT_STROKE}"></span>root'
    if top.on_winner_path:
        legend += f'<span style="background:{_WIN_FILL};border:2px solid {WINNER_COLOR}"></span>winner'
    legend = f'<p class="sub legend">{e(subtitle)}{legend}</p>'
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{e(title)}">'
        f"{''.join(edges)}{''.join(nodes)}</svg>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{e(title)}</title><style>{_CSS}</style></head>\n"
        f"<body><h1>{e(title)}</h1>{legend}\n{svg}\n{_table(boxes)}\n</body></html>\n"
    )


def write_tree_html(path: str | Path, tree: TreeNode | Mapping[str, Any], **options: str) -> Path:
    """Write :func:`render_tree_html` output to ``path`` (UTF-8); returns the path."""
    out = Path(path)
    out.write_text(render_tree_html(tree, **options), encoding="utf-8")
    return out
