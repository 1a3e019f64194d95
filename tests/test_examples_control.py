"""examples/streaming.py, entropy.py and grammar.py on the real model: their events, and their scripts."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers import load_example, run_example_jsonl

import lloyal


def _run_jsonl(name: str, model_path: Path, *flags: str) -> list[dict[str, Any]]:
    """Run ``examples/<name>.py --jsonl``; every stdout line must be one JSON event."""
    events = run_example_jsonl(name, "--model", str(model_path), *flags)
    assert all("event" in e for e in events)
    return events


def _ok_perplexity(x: float) -> bool:
    return math.isfinite(x) and x >= 1.0


# --------------------------------------------------------------------------- streaming (BlinkKV)


def test_streaming_runs_past_its_window_with_reseeds(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("streaming")
    ctx = make_context(n_ctx=256, n_seq_max=2)
    events = list(example.stream(ctx, "Once upon a time,", 52, window=48, tail=8, summary_tokens=4))
    done = events[-1]
    reseeds = [e for e in events if e["event"] == "reseed"]
    assert done["event"] == "done" and len(events) == len(reseeds) + 1
    assert done["n_ctx"] == 48 and done["tokens"] == 52 > done["n_ctx"]
    assert done["reseeds"] == len(reseeds) >= 1
    for r in reseeds:
        assert r["position_before"] <= 48
        assert r["tail"] == 8 and 1 <= r["sinks"] <= 1 + 4 + 4 + 1  # BOS, label, summary, newline
        assert r["position_after"] == r["sinks"] + r["tail"] < r["position_before"]
        assert r["kv_cells"] == r["position_after"]  # the sidecar's cells are gone
        assert _ok_perplexity(r["perplexity"])
    generated = [r["generated"] for r in reseeds]
    assert generated == sorted(set(generated))  # strictly increasing
    assert _ok_perplexity(done["perplexity"]) and done["text"].strip()
    assert lloyal.BranchStore(ctx).available == 2


def test_streaming_script_prints_jsonl(model_path: Path) -> None:
    events = _run_jsonl(
        "streaming", model_path, "--n-ctx", "48", "--max-tokens", "50", "--tail", "8",
        "--summary-tokens", "4", "--prompt", "Once upon a time,",
    )  # fmt: skip
    assert [e["event"] for e in events][-1] == "done"
    assert events[-1]["tokens"] == 50 and events[-1]["reseeds"] == len(events) - 1 >= 1
    assert all(e["position_after"] == e["sinks"] + e["tail"] for e in events[:-1])


# --------------------------------------------------------------------------- entropy control


def test_entropy_adapts_temperature_and_forks(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("entropy")
    ctx = make_context(n_ctx=512, n_seq_max=2)
    store = lloyal.BranchStore(ctx)
    assert store.available == 2
    events = list(example.entropy_steered(ctx, example.PROMPT, 12, threshold=0.5, lookahead=2, cooldown=2))
    done = events[-1]
    tokens = [e for e in events if e["event"] == "token"]
    forks = [e for e in events if e["event"] == "fork"]
    assert done["event"] == "done" and done["tokens"] == len(tokens) == 12
    assert done["forks"] == len(forks) >= 1
    positions = [t["position"] for t in tokens]
    assert positions == list(range(positions[0], positions[0] + 12))  # one kept line of text
    for t in tokens:
        assert 0.1 <= t["temperature"] <= 1.1 and t["entropy"] >= 0.0
        if not t["forked"]:
            assert t["temperature"] == example.temperature_for(t["entropy"])
    for f in forks:
        assert f["entropy"] > 0.5 and f["position"] in positions
        assert f["kept"] in (0, 1) and len(f["perplexities"]) == 2
        assert all(_ok_perplexity(p) for p in f["perplexities"])
        assert f["perplexities"][f["kept"]] == min(f["perplexities"])
    assert "".join(t["text"] for t in tokens) == done["text"]
    assert _ok_perplexity(done["perplexity"])
    assert store.available == 2  # both leases back


def test_entropy_temperature_map_is_monotone() -> None:
    example = load_example("entropy")
    temps = [example.temperature_for(e / 2) for e in range(14)]
    assert temps == sorted(temps) and temps[0] == 0.1 and temps[-1] == 1.1


def test_entropy_script_prints_jsonl(model_path: Path) -> None:
    events = _run_jsonl("entropy", model_path, "--max-tokens", "8", "--threshold", "0.5", "--lookahead", "2")
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "done" and kinds.count("token") == events[-1]["tokens"] == 8
    assert kinds.count("fork") == events[-1]["forks"] >= 1


# --------------------------------------------------------------------------- grammar fork


def _matches_product(doc: Any) -> bool:
    return (
        isinstance(doc, dict)
        and set(doc) == {"name", "category", "in_stock", "price"}
        and isinstance(doc["name"], str)
        and len(doc["name"]) <= 16
        and doc["category"] in ("book", "toy", "tool", "food")
        and isinstance(doc["in_stock"], bool)
        and type(doc["price"]) is int
        and 0 <= doc["price"] <= 1000
    )


def test_grammar_children_are_distinct_valid_documents(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("grammar")
    ctx = make_context(n_ctx=512, n_seq_max=4)
    events = list(example.grammar_fork(ctx, max_tokens=40))
    assert [e["event"] for e in events] == ["choice_point", "child", "child", "child", "done"]
    prefix = events[0]["prefix"]
    assert prefix.endswith('"category":')
    children = events[1:4]
    assert [c["index"] for c in children] == [0, 1, 2]
    for c in children:
        assert c["valid"] and c["errors"] == [] and c["text"].startswith(prefix)
        doc = json.loads(c["text"])
        assert _matches_product(doc), doc
        assert doc["category"] == c["choice"]
        assert _ok_perplexity(c["perplexity"])
    assert [c["choice"] for c in children] == ["book", "toy", "tool"]
    assert len({c["text"] for c in children}) == 3
    assert events[-1] == {"event": "done", "children": 3, "valid": 3, "distinct": 3}
    assert lloyal.BranchStore(ctx).available == 4


def test_grammar_schema_check_reports_each_violation() -> None:
    example = load_example("grammar")
    good = {"name": "pen", "category": "tool", "in_stock": False, "price": 3}
    assert example.schema_errors(good, example.PRODUCT) == []
    bad = {"name": "x" * 20, "category": "car", "in_stock": 1, "price": 5000, "extra": None}
    errors = example.schema_errors(bad, example.PRODUCT)
    assert len(errors) == 5, errors  # too long, not in enum, not a boolean, above maximum, unexpected key
    assert example.schema_errors({"name": "pen"}, example.PRODUCT) == [
        "$: missing 'category'", "$: missing 'in_stock'", "$: missing 'price'",
    ]  # fmt: skip


def test_grammar_script_prints_jsonl(model_path: Path) -> None:
    events = _run_jsonl("grammar", model_path, "--children", "2", "--max-tokens", "40")
    assert [e["event"] for e in events] == ["choice_point", "child", "child", "done"]
    for c in events[1:3]:
        assert c["valid"] and _matches_product(json.loads(c["text"]))
    assert events[-1]["valid"] == 2
