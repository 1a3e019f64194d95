"""``ServerConfig``: what ``lloyal serve`` starts (the model, context sizes, concurrency, access)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ServerConfig"]


@dataclass
class ServerConfig:
    """What ``lloyal serve`` starts: the model, context sizes, concurrency and access."""

    model: Path
    n_ctx: int = 4096
    parallel: int = 8  # choices decoding at once (the sum of n/best_of over running requests)
    n_threads: int | None = None
    api_key: str | None = None
    embeddings: bool = False
    model_name: str | None = None  # the id /v1/models reports (default: the file's stem)
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    request_timeout: float | None = 600.0  # seconds from admission to the last token; then 408
    max_queue: int | None = 512  # requests waiting for a slot beyond this get 429
    shutdown_grace: float = 30.0  # seconds running requests get to finish after SIGTERM/SIGINT
    batch_invariant: bool = False  # per-row kernels: a choice's tokens do not depend on its batch
    n_gpu_layers: int | None = None  # layers on the GPU (None: $LLOYAL_N_GPU_LAYERS; invariant: CPU)
    prefill_chunk: int | None = None  # Context.engine_prefill_chunk: None paced, 0 the batch, N a cap
    cache_cells: int | None = None  # most KV cells the prefix cache keeps (None: see Scheduler)
    # MiB of host memory for copies of evicted prefix cache entries, written back for a prompt
    # that reuses them (0: none; -1: no limit), as llama-server's --cache-ram (same default)
    cache_ram: int = 8192
    use_mmap: bool = False  # map the weights file (True) or read it into huge-page memory
    warmup: bool = True  # decode a token at startup: the first request pays no first-use costs
    # CORS: the origins whose web pages may call the server ("*": any, as llama-server and
    # vLLM allow by default; empty: no CORS headers, browsers on other origins are refused)
    allowed_origins: tuple[str, ...] = ("*",)
    # LoRA adapters applied to every request, (path, scale), as llama-server's --lora/--lora-scaled
    lora: tuple[tuple[Path, float], ...] = ()
    context_options: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.model_name or self.model.stem
