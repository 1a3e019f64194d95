"""``lloyal bench``: batched-decoding throughput table in the style of llama-batched-bench.

For each batch size B: prefill a ``pp``-token prompt once (S_PP = prompt tokens/s), fork B
branches and decode ``tg`` tokens for all of them in lockstep, one ``BranchStore.commit`` per
step (S_TG = B * tg / seconds).

Example:
    >>> import lloyal
    >>> from lloyal.bench import run_bench
    >>> rows = run_bench(lloyal.default_model_path(), batches=[1, 2], pp=16, tg=4)
    >>> [(r.batch, r.pp, r.tg) for r in rows]
    [(1, 16, 4), (2, 16, 4)]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

from lloyal._lloyal import Branch, BranchStore, Context
from lloyal.sampling import SamplingParams

__all__ = ["BenchRow", "format_table", "run_bench"]


@dataclass(frozen=True)
class BenchRow:
    """One batch size's timings."""

    batch: int
    pp: int
    tg: int
    t_pp: float
    s_pp: float
    t_tg: float
    s_tg: float

    def as_dict(self) -> dict[str, float]:
        """The row as a JSON-ready dict (the sizes as integers, the timings as floats)."""
        return dict(asdict(self))


def _progress(out: TextIO | None) -> Callable[[int, int, str], None]:
    """A progress bar on ``out``, drawn only when it is a terminal (a log gets none)."""

    def show(done: int, total: int, label: str) -> None:
        if out is None or not out.isatty():
            return
        width = 30
        filled = width * done // max(total, 1)
        out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label:<24}")
        if done == total:
            out.write("\n")
        out.flush()

    return show


def run_bench(
    model: str | Path,
    *,
    batches: Sequence[int] = (1, 2, 4, 8, 16),
    pp: int = 128,
    tg: int = 32,
    n_threads: int | None = None,
    progress: TextIO | None = None,
) -> list[BenchRow]:
    """Measure prompt and generation throughput for each batch size in ``batches``."""
    if not batches or min(batches) < 1 or pp < 1 or tg < 1:
        raise ValueError("batches must be positive integers, and pp and tg at least 1")
    show = _progress(progress)
    n_max = max(batches)
    rows: list[BenchRow] = []
    with Context(model, n_ctx=pp + tg * n_max + 64, n_seq_max=n_max + 1, n_threads=n_threads) as ctx:
        if pp + tg > ctx.model.n_ctx_train:
            raise ValueError(
                f"pp + tg = {pp + tg} positions a branch, beyond the model's training context of "
                f"{ctx.model.n_ctx_train}: lower --pp or --tg"
            )
        store = BranchStore(ctx)
        base = ctx.tokenize("The history of the harbour town began long ago. " * (pp // 8 + 2))
        prompt = (base * (pp // len(base) + 1))[:pp]
        params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1)
        for done, b in enumerate(batches):
            show(done, len(batches), f"B={b}")
            with Branch.create(ctx, 0, params) as root:
                t0 = time.perf_counter()
                root.prefill(prompt)
                t_pp = time.perf_counter() - t0
                kids = [root.fork() for _ in range(b)]
                for i, k in enumerate(kids):
                    k.reseed_sampler(i + 1)
                t0 = time.perf_counter()
                for _ in range(tg):
                    produced = store.produce_all(kids)
                    store.commit([(k, p.token) for k, p in zip(kids, produced, strict=True)])
                t_tg = time.perf_counter() - t0
            rows.append(BenchRow(b, pp, tg, t_pp, pp / t_pp, t_tg, b * tg / t_tg))
        show(len(batches), len(batches), "done")
    return rows


def format_table(rows: Sequence[BenchRow]) -> str:
    """A Markdown table: B, PP, TG, T_PP s, S_PP t/s, T_TG s, S_TG t/s."""
    lines = [
        "|    B |   PP |   TG |  T_PP s | S_PP t/s |  T_TG s | S_TG t/s |",
        "|------|------|------|---------|----------|---------|----------|",
    ]
    for r in rows:
        lines.append(
            f"| {r.batch:4d} | {r.pp:4d} | {r.tg:4d} | {r.t_pp:7.3f} | {r.s_pp:8.2f} "
            f"| {r.t_tg:7.3f} | {r.s_tg:8.2f} |"
        )
    return "\n".join(lines)


def main_bench(
    model: Path, batches: Sequence[int], pp: int, tg: int, threads: int | None, jsonl: bool
) -> int:
    """The CLI entry: progress on stderr, the table (or JSON lines) on stdout."""
    import json

    rows = run_bench(model, batches=batches, pp=pp, tg=tg, n_threads=threads, progress=sys.stderr)
    if jsonl:
        for r in rows:
            print(json.dumps(r.as_dict()))
    else:
        print(format_table(rows))
    return 0
