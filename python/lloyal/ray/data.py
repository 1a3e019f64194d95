"""Batch generation on Ray Data: :func:`generate` expands every prompt of a dataset with
``n``/``best_of`` completions on a pool of actors, each holding one model and one engine.

Each actor runs the rows of a batch as requests of one :class:`lloyal.scheduling.Scheduler`
(the server's: the same admission and ``n``/``best_of``), so the engine decodes every running
candidate of every row in one ``llama_decode`` per step, and rows that share a prompt prefix
prefill it once. A row waits for leases and KV cells rather than failing; a row that
can never fit (prompt plus ``best_of * max_tokens`` beyond ``n_ctx``) or carries an invalid
grammar gets its message in the ``error`` column and empty outputs, and the job goes on. An
actor that dies is recreated by Ray and its batch retried on the new actor (``max_restarts``
and ``max_task_retries``, unlimited by default); a row never raises, so a retry cannot loop on
bad input.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import ray
import ray.data

import lloyal
from lloyal.scheduling import Done, GenSpec, Scheduler

__all__ = ["RowGenerator", "generate"]

OUTPUT_COLUMNS = ("completions", "completion_tokens", "perplexities", "error")

MAX_BEST_OF = 255  # llama.cpp's 256 sequences a context: a root and its candidates


def _grammar(ctx: lloyal.Context, spec: Any) -> lloyal.Grammar | None:
    """A grammar from a spec: None, a JSON schema (dict or JSON text), or one of
    ``{"json_schema": …}``, ``{"lark": …}``, ``{"regex": …}``, ``{"gbnf": …}``."""
    if spec is None or (isinstance(spec, float) and np.isnan(spec)):
        return None
    if isinstance(spec, str):
        spec = json.loads(spec)
    if not isinstance(spec, Mapping):
        raise ValueError(f"a grammar spec is a JSON schema or a one-key dict, not {type(spec).__name__}")
    if len(spec) == 1 and next(iter(spec)) in ("json_schema", "lark", "regex", "gbnf"):
        kind, value = next(iter(spec.items()))
        if kind == "json_schema":
            return lloyal.Grammar.from_json_schema(ctx, value)
        if kind == "lark":
            return lloyal.Grammar.from_lark(ctx, value)
        if kind == "regex":
            return lloyal.Grammar.from_regex(ctx, value)
        return lloyal.Grammar.from_gbnf(ctx, value)
    return lloyal.Grammar.from_json_schema(ctx, dict(spec))


class RowGenerator:
    """The actor behind :func:`generate` (one model and engine per actor)."""

    def __init__(
        self,
        model: str,
        prompt_column: str,
        n: int,
        best_of: int,
        sampling: lloyal.SamplingParams,
        grammar: Any,
        grammar_column: str | None,
        max_tokens: int,
        seed: int,
        rows_at_once: int,
        context_options: dict[str, Any],
    ) -> None:
        # Only the model perplexity picks the best of n: the sampling one would cost a second
        # exponential a vocabulary value each decoded row (Context's sampling_perplexity).
        opts = {"n_ctx": 4096, "sampling_perplexity": False, **context_options}
        opts["n_seq_max"] = min(MAX_BEST_OF + 1, max(opts.get("n_seq_max", 0), rows_at_once * (best_of + 1)))
        self.ctx = lloyal.Context(model, **opts)
        self.prompt_column, self.grammar_column = prompt_column, grammar_column
        self.n, self.best_of, self.max_tokens, self.seed = n, best_of, max_tokens, seed
        self.params = sampling
        self.grammar = grammar
        self.rows_at_once = rows_at_once

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        prompts = list(batch[self.prompt_column])
        grammars = list(batch[self.grammar_column]) if self.grammar_column else [self.grammar] * len(prompts)
        rows = asyncio.run(self._batch(prompts, grammars))
        out = dict(batch)
        for i, name in enumerate(OUTPUT_COLUMNS):
            col = np.empty(len(rows), dtype=object)
            for j, r in enumerate(rows):
                col[j] = r[i]
            out[name] = col
        return out

    async def _batch(self, prompts: Sequence[Any], grammars: Sequence[Any]) -> list[tuple[Any, ...]]:
        # One scheduler per batch (its asyncio primitives belong to this batch's event loop):
        # every choice reserves its max_tokens, so a row waits for room instead of being cut
        # short, and nothing is cached between rows (prompts in flight are still shared).
        self._sched = Scheduler(
            self.ctx, max_running=self.rows_at_once * self.best_of, cache_cells=0, reserve=True
        )
        try:
            return list(
                await asyncio.gather(*(self._row(p, g) for p, g in zip(prompts, grammars, strict=True)))
            )
        finally:
            await self._sched.stop()

    async def _row(self, prompt: Any, grammar_spec: Any) -> tuple[Any, ...]:
        ctx = self.ctx
        try:
            tokens = ctx.tokenize(prompt) if isinstance(prompt, str) else _token_ids(prompt)
            if not tokens:
                raise ValueError("the prompt is empty")
            need = len(tokens) + self.best_of * self.max_tokens
            if need > ctx.n_ctx:
                raise ValueError(
                    f"the prompt ({len(tokens)} tokens) plus best_of x max_tokens "
                    f"({self.best_of} x {self.max_tokens}) needs {need} KV cells but the context has "
                    f"{ctx.n_ctx}: shorten the prompt or raise n_ctx"
                )
            spec = GenSpec(
                prompt=tokens,
                params=self.params,
                max_tokens=self.max_tokens,
                n=self.n,
                best_of=self.best_of,
                grammar=_grammar(ctx, grammar_spec),
                seed=self.seed + 1,  # choice i samples with seed + 1 + i
                rank=True,
            )
            async for ev in self._sched.generate(spec):
                if isinstance(ev, Done):
                    return (
                        [ev.texts[i] for i in ev.choices],
                        [ev.lengths[i] for i in ev.choices],
                        [float(ev.perplexities[i]) for i in ev.choices],
                        None,
                    )
            raise RuntimeError("the scheduler ended a request without its result")  # pragma: no cover
        except Exception as e:  # a row never raises (a cancellation is no Exception: it does)
            return ([], [], [], f"{type(e).__name__}: {e}")


def _token_ids(prompt: Any) -> list[int]:
    """A row's prompt given as token ids (a list, or an array from a Parquet column)."""
    if prompt is None or isinstance(prompt, (float, bytes, dict)) or not hasattr(prompt, "__iter__"):
        kind = "null (a missing value)" if prompt is None or prompt != prompt else type(prompt).__name__
        raise ValueError(f"the prompt must be text or a list of token ids, got {kind}")
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise ValueError("the prompt must be text or a list of token ids (integers)") from None


def _dataset(source: Any) -> ray.data.Dataset:
    if isinstance(source, ray.data.Dataset):
        return source
    if isinstance(source, (str, Path)):
        path = str(source)
        if path.endswith(".parquet") or Path(path).is_dir():
            return ray.data.read_parquet(path)
        if path.endswith((".jsonl", ".json")):
            return ray.data.read_json(path)
        raise ValueError(f"{path}: give a .parquet file or directory, or a .jsonl file")
    if isinstance(source, Sequence):
        return ray.data.from_items(list(source))
    kind = type(source).__name__
    raise TypeError(f"dataset must be a ray.data.Dataset, a list of dicts or a path, not {kind}")


def generate(
    dataset: Any,
    model: str | Path,
    prompt_column: str = "prompt",
    *,
    n: int = 1,
    best_of: int | None = None,
    sampling: lloyal.SamplingParams | Mapping[str, Any] | None = None,
    grammar: Any = None,
    grammar_column: str | None = None,
    max_tokens: int = 64,
    seed: int = 1,
    concurrency: int = 1,
    batch_size: int = 16,
    rows_at_once: int = 4,
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_restarts: int = -1,
    max_task_retries: int = -1,
    **context_options: Any,
) -> ray.data.Dataset:
    """Add ``n`` completions per prompt to ``dataset`` (lazily: a ``ray.data.Dataset``).

    Args:
        dataset: A ``ray.data.Dataset``, a list of dicts, or a ``.parquet``/``.jsonl`` path.
        model: GGUF path (each actor loads it; it must exist on every node).
        prompt_column: The column of prompts (text, or token ids).
        n: Completions kept per prompt: the ``n`` of ``best_of`` with the lowest perplexity.
        best_of: Candidates sampled per prompt from one prefill (default ``n``).
        sampling: Sampling parameters (default greedy when ``best_of == 1``, else
            temperature 0.8, top-k 40, top-p 0.95); candidate ``i`` is reseeded ``seed + 1 + i``.
        grammar: One grammar for every row: a JSON schema, or ``{"lark"|"regex"|"gbnf"|"json_schema": …}``.
        grammar_column: Or a column holding each row's grammar spec, best as JSON text (Arrow
            cannot hold dicts of different shapes in one column); a bad one fails that row only.
        max_tokens: Most tokens per candidate.
        concurrency: Actors in the pool (each holds a model and an engine).
        batch_size: Rows per batch handed to an actor.
        rows_at_once: Rows of a batch running at once in an actor (sets the leases it needs).
        num_cpus, num_gpus: Resources per actor (``num_gpus=1`` puts each engine on a GPU).
        max_restarts, max_task_retries: Ray actor options: how often a dead actor is recreated
            and its batch retried on the new one (``-1``: without limit; ``0``: a dead actor
            fails the job).
        **context_options: Passed to each actor's :class:`lloyal.Context` (``n_ctx`` default 4096).

    Returns:
        The dataset with ``completions`` (list of str), ``completion_tokens`` (list of int),
        ``perplexities`` (list of float) and ``error`` (None, or why the row failed).
    """
    k = best_of if best_of is not None else n
    if n < 1 or k < n:
        raise ValueError(f"need 1 <= n <= best_of, got n={n}, best_of={best_of}")
    if k > MAX_BEST_OF:
        raise ValueError(
            f"best_of is {k}, but a context holds at most {MAX_BEST_OF + 1} sequences (a root and its "
            f"candidates): use best_of <= {MAX_BEST_OF}"
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(sampling, lloyal.SamplingParams):
        params = sampling
    elif sampling is not None:
        params = lloyal.SamplingParams(**dict(sampling))
    elif k == 1:
        params = lloyal.SamplingParams(temperature=0.0)
    else:
        params = lloyal.SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    # -1/-1 is what Ray Data's actor pool sets when given neither (and passing Ray remote args
    # to map_batches is deprecated in Ray 2.60), so only a non-default value is passed on.
    retries: dict[str, Any] = {}
    if max_restarts != -1:
        retries["max_restarts"] = max_restarts
    if max_task_retries != -1:
        retries["max_task_retries"] = max_task_retries
    return _dataset(dataset).map_batches(
        RowGenerator,
        fn_constructor_kwargs={
            "model": str(model),
            "prompt_column": prompt_column,
            "n": n,
            "best_of": k,
            "sampling": params,
            "grammar": grammar,
            "grammar_column": grammar_column,
            "max_tokens": max_tokens,
            "seed": seed,
            "rows_at_once": rows_at_once,
            "context_options": context_options,
        },
        batch_size=batch_size,
        compute=ray.data.ActorPoolStrategy(size=concurrency),  # `concurrency=` is deprecated (Ray 2.51)
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        batch_format="numpy",
        **retries,
    )
