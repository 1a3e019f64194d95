"""``GET /metrics``: the server's counters and gauges in Prometheus text format (prometheus_client).

Read at scrape time from the scheduler, the prefix cache and the KV cache, so nothing is
counted twice. Names start with ``lloyal_``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    import lloyal

    from ..scheduling.scheduler import Scheduler

__all__ = ["Metrics", "MetricsSource"]


class MetricsSource(Protocol):
    """What the metrics read at scrape time: the server's scheduler and its context."""

    @property
    def scheduler(self) -> Scheduler: ...

    @property
    def ctx(self) -> lloyal.Context: ...


class Metrics(Collector):
    """One server's metrics (its own registry, so several apps can live in one process)."""

    def __init__(self, state: MetricsSource) -> None:
        self._state = state
        self._requests: dict[tuple[str, int], int] = {}
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens generated so far)
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def count_request(self, path: str, status: int) -> None:
        """One HTTP request answered."""
        key = (path, status)
        self._requests[key] = self._requests.get(key, 0) + 1

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ~10 s of scrapes and steps."""
        now, total = time.monotonic(), self._state.scheduler.tokens_generated
        self._rate.append((now, total))
        while len(self._rate) > 2 and now - self._rate[0][0] > 10.0:
            self._rate.popleft()
        t0, n0 = self._rate[0]
        return (total - n0) / (now - t0) if now > t0 else 0.0

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Metric]:
        st = self._state
        sched, cache = st.scheduler, st.scheduler.cache.stats()
        req = CounterMetricFamily("lloyal_requests", "HTTP requests answered", labels=["path", "status"])
        for (path, status), n in sorted(self._requests.items()):
            req.add_metric([path, str(status)], n)
        yield req
        yield CounterMetricFamily("lloyal_prompt_tokens", "Prompt tokens admitted", value=sched.prompt_tokens)
        yield CounterMetricFamily(
            "lloyal_generation_tokens", "Tokens generated (committed)", value=sched.tokens_generated
        )
        yield CounterMetricFamily("lloyal_decode_steps", "Shared decode steps run", value=sched.steps)
        yield GaugeMetricFamily(
            "lloyal_generation_tokens_per_second",
            "Generated tokens per second (recent)",
            value=self.tokens_per_second(),
        )
        yield GaugeMetricFamily(
            "lloyal_queue_depth", "Requests waiting for leases or cells", value=sched.waiting
        )
        yield GaugeMetricFamily("lloyal_running_sequences", "Choices decoding now", value=sched.running)
        kv = st.scheduler.store.kv_pressure
        yield GaugeMetricFamily("lloyal_kv_cells_used", "KV cells used by branches", value=kv.cells_used)
        yield GaugeMetricFamily("lloyal_kv_cells_total", "KV cells in the context", value=kv.n_ctx)
        yield GaugeMetricFamily(
            "lloyal_kv_pressure", "Fraction of KV cells used", value=kv.cells_used / kv.n_ctx
        )
        leased = st.ctx.n_seq_max - sched.store.available
        yield GaugeMetricFamily(
            "lloyal_leases_used", "Sequences leased by branches (running, roots, cached)", value=leased
        )
        yield GaugeMetricFamily("lloyal_prefix_cache_entries", "Cached branches", value=cache["entries"])
        yield CounterMetricFamily(
            "lloyal_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache (or shared with a prompt being written)",
            value=cache["hit_tokens"],
        )
        yield CounterMetricFamily(
            "lloyal_prefix_cache_lookup_tokens",
            "Prompt tokens looked up in the prefix cache",
            value=cache["lookup_tokens"],
        )
        rate = cache["hit_tokens"] / cache["lookup_tokens"] if cache["lookup_tokens"] else 0.0
        yield GaugeMetricFamily("lloyal_prefix_cache_hit_rate", "Hit tokens / looked-up tokens", value=rate)
        yield CounterMetricFamily(
            "lloyal_prefix_cache_evictions", "Cached branches evicted", value=cache["evictions"]
        )
        yield GaugeMetricFamily(
            "lloyal_prefix_cache_host_bytes",
            "Bytes of host memory held by copies of evicted entries (--cache-ram)",
            value=cache["host_bytes"],
        )
        yield CounterMetricFamily(
            "lloyal_prefix_cache_host_restored_tokens",
            "Prompt tokens served by copies written back from host memory",
            value=cache["host_restored_tokens"],
        )
        eng = st.ctx.engine_stats()
        for name, doc, value in (
            ("ticks", "Engine ticks that decoded something", eng.ticks),
            ("decode_calls", "llama_decode calls made by the engine", eng.decode_calls),
            ("rows", "Rows (tokens) the engine decoded", eng.rows),
            ("tick_seconds", "Seconds spent in engine ticks", eng.tick_seconds),
            ("decode_seconds", "Seconds of engine ticks spent in llama_decode", eng.decode_seconds),
        ):
            yield CounterMetricFamily(f"lloyal_engine_{name}", doc, value=value)
