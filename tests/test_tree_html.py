"""The HTML branch tree: escaping and structure, and real screenshots in headless Chromium.

The screenshots are decoded with zlib/struct/numpy (no imaging library) and checked for size,
content and the winner's highlight colour. Chromium is a test requirement (``make sysdeps``).
"""

from __future__ import annotations

import html
import json
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest

from lloyal.cli import main
from lloyal.tree_html import WINNER_COLOR, TreeNode, render_tree_html, write_tree_html

WIDTH, HEIGHT = 1200, 800
WINNER_RGB = tuple(int(WINNER_COLOR[i : i + 2], 16) for i in (1, 3, 5))

FIXED = TreeNode(
    "prompt",
    "The old lighthouse keeper opened the door and saw",
    11,
    children=(
        TreeNode("branch 0", ' a man <script>alert("x")</script> & a dog', 12, perplexity=7.25),
        TreeNode("branch 1", " the sea.\nIt had gone.", 6, perplexity=3.5, winner=True),
        TreeNode("branch 2", "", 0, perplexity=float("inf")),
    ),
)


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else (b if pb <= pc else c)


def read_png(path: Path) -> npt.NDArray[np.uint8]:
    """Decode an 8-bit RGB/RGBA, non-interlaced PNG into an ``(height, width, 3)`` array."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat = 8, []
    width = height = channels = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and colour in (2, 6) and interlace == 0, (depth, colour, interlace)
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
    raw = zlib.decompress(b"".join(idat))
    stride = width * channels
    out = np.zeros((height, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.uint8)
    for y in range(height):
        kind, row = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1)
        if kind == 0:
            cur = row.copy()
        elif kind == 1:  # Sub: a running sum per channel, mod 256
            cur = (np.cumsum(row.reshape(width, channels), axis=0, dtype=np.int64) % 256).astype(np.uint8)
            cur = cur.reshape(stride)
        elif kind == 2:  # Up
            cur = row + prev
        else:  # Average / Paeth: each byte depends on the reconstructed one to its left
            r, up, line = row.tolist(), prev.tolist(), [0] * stride
            for i in range(stride):
                left = line[i - channels] if i >= channels else 0
                ul = up[i - channels] if i >= channels else 0
                pred = (left + up[i]) // 2 if kind == 3 else _paeth(left, up[i], ul)
                line[i] = (r[i] + pred) & 0xFF
            cur = np.array(line, dtype=np.uint8)
        out[y], prev = cur, cur
    return out.reshape(height, width, channels)[:, :, :3]


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: run `make sysdeps` (apt-get install chromium)")
    return found


def screenshot(page: Path, tmp_path: Path) -> npt.NDArray[np.uint8]:
    png = tmp_path / f"{page.stem}.png"
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
        f"--screenshot={png}",
        f"--window-size={WIDTH},{HEIGHT}",
        page.resolve().as_uri(),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and png.exists(), done.stderr[-2000:]
    return read_png(png)


def winner_pixels(img: npt.NDArray[np.uint8]) -> int:
    diff = np.abs(img.astype(np.int16) - np.array(WINNER_RGB, dtype=np.int16))
    return int((diff.max(axis=2) <= 3).sum())


def assert_rendered(img: npt.NDArray[np.uint8]) -> None:
    assert img.shape == (HEIGHT, WIDTH, 3)
    non_white = int((img.min(axis=2) < 240).sum())
    assert non_white > 0.01 * WIDTH * HEIGHT, f"blank screenshot ({non_white} non-white pixels)"
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 20  # text, boxes, edges: not a flat fill


def test_render_escapes_text_and_marks_one_winner() -> None:
    page = render_tree_html(FIXED, title="best <of> n", subtitle="a & b")
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page and "alert(&quot;x&quot;)" in page
    assert "&lt;script&gt;" in page and "&amp; a dog" in page and "best &lt;of&gt; n" in page
    assert page.count('class="node winner"') == 1 and page.count('class="node"') == 3
    assert page.count('<tr class="winner">') == 1 and "★ WINNER" in page
    assert page.count("<path ") == 3  # one edge per child
    assert "It had gone." in page and "↵" in page  # a newline is shown, not lost
    # self-contained: no scripts, stylesheets, images or fonts fetched from anywhere
    assert not re.search(r"<(script|link|img|iframe)|src=|href=|url\((?!#)|@import", page)


def test_deeper_trees_from_plain_dicts() -> None:
    tree = {
        "label": "prompt",
        "text": "Once",
        "tokens": 2,
        "children": [
            {"label": "a", "text": " upon", "tokens": 1, "perplexity": 3.0, "children": [
                {"label": "a.0", "text": " a time", "tokens": 2, "perplexity": 2.0, "winner": True},
                {"label": "a.1", "text": " the\x01hill", "tokens": 2, "perplexity": 4.0},
            ]},
            {"label": "b", "text": " more", "tokens": 1, "perplexity": 9.0},
        ],
    }  # fmt: skip
    page = render_tree_html(tree)
    assert page == render_tree_html(TreeNode.from_dict(tree))
    assert page.count("<path ") == 4 and page.count('class="node') == 5
    assert "\x01" not in page and " the\ufffdhill" in page  # control characters are made visible
    # the path to the winner (prompt -> a -> a.0) is drawn in the winner's colour, the rest is not
    assert len(re.findall(rf'<path [^>]*stroke="{WINNER_COLOR}"', page)) == 2
    xs = {label: float(x) for x, label in re.findall(r'<text class="label" x="([\d.]+)"[^>]*>([^<]+)<', page)}
    assert xs["prompt"] < xs["a"] == xs["b"] < xs["a.0"] == xs["a.1"]  # one column per depth


def test_screenshot_shows_the_winner_highlight(tmp_path: Path) -> None:
    page = write_tree_html(tmp_path / "tree.html", FIXED, title="lloyal best-of-n")
    img = screenshot(page, tmp_path)
    assert_rendered(img)
    assert winner_pixels(img) > 500  # border, badge and edge
    # the control: the same tree without a winner has none of that colour
    plain = TreeNode(FIXED.label, FIXED.text, FIXED.tokens, children=[
        TreeNode(c.label, c.text, c.tokens, c.perplexity) for c in FIXED.children
    ])  # fmt: skip
    assert winner_pixels(screenshot(write_tree_html(tmp_path / "plain.html", plain), tmp_path)) == 0


def test_screenshot_of_a_real_best_of_n_tree(
    model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = tmp_path / "best.html"
    argv = ["--model", str(model_path), "best-of-n", "The lighthouse keeper saw", "-n", "2", "-t", "1"]
    assert main([*argv, "--max-tokens", "4", "--jsonl", "--tree", str(tree)]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    page = tree.read_text(encoding="utf-8")
    for c in events[:-1]:
        assert html.escape(c["text"]) in page
    assert page.count('class="node winner"') == 1
    img = screenshot(tree, tmp_path)
    assert_rendered(img)
    assert winner_pixels(img) > 500
