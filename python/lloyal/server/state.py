"""The running server's state: the model, its context and scheduler, the embeddings context and
the metrics. Built when the app starts (its lifespan) and closed when it stops.

``app.state.lloyal`` is a :data:`StateHolder`: ``{"s": state}`` while the app runs, empty before.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import lloyal

from ..scheduling.scheduler import Scheduler
from . import metrics
from .config import ServerConfig

__all__ = ["ServerState", "StateGetter", "StateHolder", "load_weights"]

Adapters = list[tuple[lloyal.LoraAdapter, float]]


def load_weights(cfg: ServerConfig) -> tuple[lloyal.Model, Adapters]:
    """The model and the adapters every request runs under (``--lora`` order: their ids on
    ``/lora-adapters``), as the server loads them; ``lloyal serve`` loads them first, so a file
    that cannot serve fails as a command-line error (the server then finds them loaded).
    ``ModelLoadError`` for a file that does not load, ``ValueError`` for an adapter listed twice.
    """
    # batch-invariant contexts (--batch-invariant or the context options) read unrepacked weights
    invariant = cfg.batch_invariant or cfg.context_options.get("batch_invariant") is True
    # An invariant server runs on the CPU (GPU kernels are not batch-invariant), whatever
    # LLOYAL_N_GPU_LAYERS offloads by default; asked for both, its context refuses.
    ngl = 0 if invariant and cfg.n_gpu_layers is None else cfg.n_gpu_layers
    # Weights read into memory (not mapped) get huge pages: a faster decode (Model.huge_page_bytes).
    model = lloyal.Model(cfg.model, repack=not invariant, n_gpu_layers=ngl, use_mmap=cfg.use_mmap)
    lora = [(model.load_lora(path), float(scale)) for path, scale in cfg.lora]
    for i, (adapter, _) in enumerate(lora):
        if any(adapter == other for other, _ in lora[:i]):
            raise ValueError(f"lora: {adapter.path} is listed twice; list each adapter once, with one scale")
    return model, lora


class ServerState:
    """One app's model, contexts (generation and, with ``cfg.embeddings``, embeddings),
    scheduler and metrics, and the event loop it runs on."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        # Nothing the server answers reads a branch's sampling perplexity: not keeping it halves
        # the exponentials of every decoded row's summary (Context's sampling_perplexity).
        options = {"sampling_perplexity": False, **cfg.context_options}
        if cfg.batch_invariant:
            options["batch_invariant"] = True
        self.model, self.lora = load_weights(cfg)
        # The adapters every request runs under, embeddings' too (as llama-server's --lora).
        if self.lora:
            options["lora"] = self.lora
        # Per running choice: its own sequence, its request's prompt root, and the cached prefix
        # the root forked from (pinned while the request runs); +2 spare for admissions.
        n_seq_max = min(256, max(4, 3 * cfg.parallel + 2))
        self.ctx = lloyal.Context(
            self.model, n_ctx=cfg.n_ctx, n_seq_max=n_seq_max, n_threads=cfg.n_threads, **options
        )
        self.ctx.engine_prefill_chunk = cfg.prefill_chunk
        self.embed_ctx = (
            lloyal.Context(
                self.model, n_ctx=min(cfg.n_ctx, 2048), embeddings=True, n_seq_max=4, lora=self.lora or None
            )
            if cfg.embeddings
            else None
        )
        if cfg.warmup:
            self._warm_up()
        # the model's end-of-generation tokens (banned by a request's ignore_eos)
        self.eog_tokens = self.ctx.eog_tokens
        self.scheduler = Scheduler(
            self.ctx,
            max_running=cfg.parallel,
            max_queue=cfg.max_queue,
            cache_cells=cfg.cache_cells,
            host_cache_bytes=(1 << 62) if cfg.cache_ram < 0 else cfg.cache_ram << 20,
        )
        self.embed_lock = asyncio.Lock()
        self.metrics = metrics.Metrics(self)
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None  # the app's event loop, set at startup

    def _warm_up(self) -> None:
        """Decode a token and drop it (and embed a word), as llama-server warms up: what a
        backend does on first use (a GPU's libraries and kernels loaded, the decode threads
        started, buffers touched) is done before the first request, not during it. A commit,
        not a prompt: the engine's wait for a burst of prompts is not taught that this one came
        alone."""
        with lloyal.Branch.create(self.ctx, 0, lloyal.SamplingParams(temperature=0.0)) as b:
            b.commit(self.ctx.tokenize("Hello")[0])
        if self.embed_ctx is not None:
            self.embed_ctx.embed("Hello")

    def close(self) -> None:
        """Free the contexts (the scheduler is stopped first)."""
        self.ctx.close()
        if self.embed_ctx is not None:
            self.embed_ctx.close()


StateHolder = dict[str, ServerState]  # app.state.lloyal: {"s": the running state} once started
StateGetter = Callable[[], ServerState]  # what the routes call for the running state
