"""Turn a pytest-benchmark JSON file into the Markdown tables of benches/RESULTS.md.

Usage:
    python benches/report.py results.json            # tables on stdout
    python benches/report.py results.json --plot best_of_n.png   # also a tokens/s plot (matplotlib)

Best-of-N runs generate ``STEPS`` tokens per branch, so aggregate tokens/s = N * STEPS / seconds.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

STEPS = 64
KINDS = {
    "test_best_of_n_batched": "lloyal batched (BranchStore.commit)",
    "test_best_of_n_invariant": "lloyal batched, batch-invariant kernels",
    "test_best_of_n_sequential": "lloyal sequential (one branch at a time)",
    "test_best_of_n_llama_cpp_python": "llama-cpp-python high-level, sequential",
    "test_best_of_n_raw_batched": "raw llama.cpp batched loop (C API)",
}


def _group(data: dict[str, Any], group: str) -> list[dict[str, Any]]:
    """The benchmarks of ``group``, in run order."""
    return [b for b in data["benchmarks"] if b["group"] == group]


def _table(columns: list[str], rows: list[list[str]], note: str = "") -> str:
    """A Markdown table, and ``note`` as a paragraph below it."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if note:
        lines.append("\n" + note)
    return "\n".join(lines)


def _secs(seconds: float) -> str:
    return f"{seconds:.3f}"


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x"


def _cells(info: dict[str, Any], keys: list[str]) -> list[str]:
    """``info``'s values at ``keys``: seconds (``*_s``) and ratios (``*_vs_*``) formatted."""
    return [
        _secs(info[k]) if k.endswith("_s") else _times(info[k]) if "_vs_" in k else str(info[k]) for k in keys
    ]


def grammar_table(data: dict[str, Any]) -> str:
    """Markdown table for the json-schema group: tokens/s from each run's token count."""
    rows = _group(data, "json-schema")
    if not rows:
        return ""
    lines = ["| run | tokens | mean s | tokens/s | grammar resamples |", "|---|---|---|---|---|"]
    speed: dict[str, float] = {}
    for b in rows:
        tokens = int(b["extra_info"].get("tokens", 0))
        mean = float(b["stats"]["mean"])
        speed[b["name"]] = tokens / mean if mean else 0.0
        resamples = b["extra_info"].get("grammar_resamples", "-")
        lines.append(f"| {b['name']} | {tokens} | {mean:.3f} | {speed[b['name']]:.1f} | {resamples} |")
    for impl in ("test_lloyal", "test_llama_cpp_python"):
        free, json_ = speed.get(f"{impl}[unconstrained]"), speed.get(f"{impl}[json_schema]")
        if free and json_:
            lines.append(f"| **{impl}: constrained / unconstrained** | | | **{json_ / free:.2f}x** | |")
    return "\n".join(lines)


def group_table(data: dict[str, Any], group: str) -> str:
    """Plain table (name, mean, ratio to the group's fastest, extra info) for one group."""
    rows = _group(data, group)
    if not rows:
        return ""
    best = min(float(b["stats"]["mean"]) for b in rows)
    cells = []
    for b in rows:
        mean = float(b["stats"]["mean"])
        unit = f"{mean * 1e6:.1f} us" if mean < 1e-2 else f"{mean:.3f} s"
        info = ", ".join(f"{k}={v}" for k, v in b.get("extra_info", {}).items())
        cells.append([b["name"], unit, f"{mean / best:.2f}", info])
    return _table(["benchmark", "mean", "x fastest", "info"], cells)


def _means(data: dict[str, Any]) -> dict[str, float]:
    return {b["name"]: float(b["stats"]["mean"]) for b in data["benchmarks"]}


def best_of_n_table(means: dict[str, float]) -> tuple[str, dict[str, dict[int, float]]]:
    """Markdown table: seconds and aggregate tokens/s per N for each implementation, and ratios."""
    series: dict[str, dict[int, float]] = {}
    for name, mean in means.items():
        m = re.fullmatch(r"(test_best_of_n_\w+?)\[(\d+)\]", name)
        if m and m.group(1) in KINDS:
            series.setdefault(m.group(1), {})[int(m.group(2))] = mean
    ns = sorted({n for s in series.values() for n in s})
    kinds = [k for k in KINDS if k in series]
    head = "| N | " + " | ".join(f"{KINDS[k]}: s (tok/s)" for k in kinds)
    head += " | batched vs sequential | batched vs llama-cpp-python | batched vs raw loop |"
    head += " invariant vs batched |"
    lines = [head, "|" + "---|" * (len(kinds) + 5)]
    for n in ns:
        cells = []
        for k in kinds:
            s = series[k].get(n)
            cells.append(f"{s:.2f} ({n * STEPS / s:.1f})" if s else "-")
        batched = series.get("test_best_of_n_batched", {}).get(n)
        seq = series.get("test_best_of_n_sequential", {}).get(n)
        peer = series.get("test_best_of_n_llama_cpp_python", {}).get(n)
        r1 = f"{seq / batched:.2f}x" if batched and seq else "-"
        r2 = f"{peer / batched:.2f}x" if batched and peer else "-"
        raw = series.get("test_best_of_n_raw_batched", {}).get(n)
        r3 = f"{raw / batched:.2f}x" if batched and raw else "-"
        inv = series.get("test_best_of_n_invariant", {}).get(n)
        r4 = f"{batched / inv:.2f}x" if batched and inv else "-"
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {r1} | {r2} | {r3} | {r4} |")
    return "\n".join(lines), series


def single_stream_table(means: dict[str, float]) -> str:
    """Markdown table for the single-stream decode group, relative to the raw C loop."""
    names = {
        "test_lloyal_flat": "lloyal flat path (Context.decode/sample)",
        "test_lloyal_branch": "lloyal Branch (produce/commit)",
        "test_lloyal_branch_invariant": "lloyal Branch, batch-invariant kernels",
        "test_llama_cpp_python_high_level": "llama-cpp-python high-level",
        "test_llama_cpp_raw_loop": "raw llama.cpp loop (C API via llama-cpp-python)",
    }
    raw = means.get("test_llama_cpp_raw_loop")
    rows = [
        [label, f"{means[key]:.3f}", f"{raw / means[key]:.2f}x" if raw else "-"]
        for key, label in names.items()
        if key in means
    ]
    return _table(["implementation", "mean s", "speed vs raw loop"], rows)


def paired_table(data: dict[str, Any]) -> str:
    """Markdown table for the interleaved single-stream comparison (medians of its rounds)."""
    rows = _group(data, "decode-single-stream-paired")
    if not rows:
        return ""
    info = rows[0]["extra_info"]
    return _table(
        ["implementation", "median s", "speed vs raw loop"],
        [
            ["lloyal Branch (produce/commit)", _secs(info["branch_median_s"]), _times(info["branch_vs_raw"])],
            [
                "lloyal flat path (Context.decode/sample)",
                _secs(info["flat_median_s"]),
                _times(info["flat_vs_raw"]),
            ],
            ["raw llama.cpp loop (C API via llama-cpp-python)", _secs(info["raw_median_s"]), "1.00x"],
        ],
        f"{info['rounds']} interleaved rounds of each (raw, flat, Branch, raw, ...); medians"
        " without the first (warm-up) round.",
    )


def _paired(
    data: dict[str, Any], group: str, columns: list[tuple[str, str]], order: str, key: str = ""
) -> str:
    """A table of interleaved rounds: a row per benchmark of ``group`` (sorted by the whole
    number at ``key``), a column per ``(header, value key)`` of ``columns``."""
    infos = [b["extra_info"] for b in _group(data, group)]
    if not infos:
        return ""
    infos.sort(key=lambda i: int(i[key]) if key else 0)
    return _table(
        [header for header, _ in columns],
        [_cells(i, [k for _, k in columns]) for i in infos],
        f"{infos[0]['rounds']} interleaved rounds of each ({order}); medians without the first.",
    )


def paired_best_of_n_table(data: dict[str, Any]) -> str:
    """Markdown table for the interleaved best-of-N rounds (lloyal batched vs both peers)."""
    peers = [("raw C-API batched loop", "raw"), ("llama-cpp-python sequential", "llama_cpp_python")]
    columns = [("N", "n"), ("lloyal batched: median s", "lloyal_median_s")]
    columns += [(f"{name}: median s", f"{k}_median_s") for name, k in peers]
    columns += [(f"lloyal vs {name.split(' ')[0]}", f"lloyal_vs_{k}") for name, k in peers]
    return _paired(data, "best-of-n-paired", columns, "raw, llama-cpp-python, lloyal, raw, ...", key="n")


def paired_prefill_table(data: dict[str, Any]) -> str:
    """One line for the interleaved packed-prefill rounds."""
    columns = [("tokens", "tokens"), ("lloyal store.prefill: median s", "lloyal_median_s")]
    columns += [("raw loop: median s", "raw_median_s"), ("lloyal vs raw", "lloyal_vs_raw")]
    return _paired(data, "prefill-mixed-paired", columns, "raw, lloyal, raw, ...")


def plot(series: dict[str, dict[int, float]], out: Path) -> None:
    """Aggregate tokens/s against N for each implementation (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for kind, points in series.items():
        ns = sorted(points)
        ax.plot(ns, [n * STEPS / points[n] for n in ns], marker="o", label=KINDS[kind])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (branches / completions)")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("best-of-N, Gemma 3 270M Q4_K_M, 2 CPU threads")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json_file", type=Path)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    data = json.loads(args.json_file.read_text())
    means = _means(data)
    table, series = best_of_n_table(means)
    print("## Single stream (128-token prompt + 64 greedy tokens)\n")
    print(single_stream_table(means))
    paired = paired_table(data)
    if paired:
        print("\n## Single stream, interleaved rounds (target 2)\n")
        print(paired)
    print("\n## Best-of-N (128-token shared prompt, 64 tokens per branch)\n")
    print(table)
    paired_bon = paired_best_of_n_table(data)
    if paired_bon:
        print("\n## Best-of-N, interleaved rounds (target 1 against the raw loop)\n")
        print(paired_bon)
    grammar = grammar_table(data)
    if grammar:
        print("\n## JSON-schema constrained generation (prefill + up to 64 tokens, temperature 0.8)\n")
        print(grammar)
    for group, title in (
        ("fork-vs-prefix", "Fork + prune against prefix length"),
        ("prefill-mixed", "Packed prefill of 6 mixed-length prompts (726 tokens, n_batch 256)"),
        ("sampling-vs-step", "Sampling overhead at N = 8: produce_all vs one batched commit"),
    ):
        table_text = group_table(data, group)
        if table_text:
            print(f"\n## {title}\n")
            print(table_text)
        if group == "prefill-mixed" and paired_prefill_table(data):
            print("\nInterleaved rounds (target 5):\n")
            print(paired_prefill_table(data))
    if args.plot:
        plot(series, args.plot)


if __name__ == "__main__":
    main()
