"""The server's decode loop: every running completion of every request advances in one decode per step.

One asyncio task owns the loop. Each step samples every running choice in one native call
(:meth:`lloyal.BranchStore.produce_all`) and commits them all in one ``llama_decode``
(:meth:`lloyal.BranchStore.acommit`, off the event loop). A request is admitted between steps:
it forks the longest cached prefix of its prompt (:mod:`lloyal.server.prefix_cache`), prefills
the rest once, and forks ``best_of`` choices from that root (0 new cells for the prompt).
Finished requests leave their prompt and first choice in the cache; everything else is pruned.

Requests talk to the loop through :meth:`Scheduler.generate`, an async iterator of events.
Admission refuses a request when ``max_queue`` requests already wait (:class:`QueueFull`) and
after :meth:`Scheduler.drain` began (:class:`ShuttingDown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

import lloyal
from lloyal.aio import engine_start

from .prefix_cache import CacheEntry, PrefixCache

__all__ = ["Done", "GenSpec", "QueueFull", "Scheduler", "ShuttingDown", "TokenEvent", "TopLogprob"]


class QueueFull(Exception):
    """The admission queue holds ``max_queue`` requests already: answered 429 with ``Retry-After``."""


class ShuttingDown(Exception):
    """The server is shutting down: new requests are refused, and requests still running when the
    grace period ends are cancelled (answered 503)."""


@dataclass
class GenSpec:
    """One generation request: ``best_of`` choices from one prompt, ``n`` of them returned."""

    prompt: list[int]
    params: lloyal.SamplingParams
    max_tokens: int
    n: int = 1
    best_of: int = 1
    stop: Sequence[str] = ()
    stop_tokens: Sequence[int] = ()
    grammar: lloyal.Grammar | str | None = None  # a Grammar, or GBNF text
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and k alternatives
    seed: int | None = None


@dataclass
class TopLogprob:
    token: int
    text: str
    logprob: float


@dataclass
class TokenEvent:
    """Text a choice produced (``text`` may lag ``token`` while a stop string could be starting)."""

    index: int
    token: int
    text: str
    logprob: float | None = None
    top: list[TopLogprob] = field(default_factory=list)


@dataclass
class Done:
    """The request finished: ``choices`` are the returned internal indices, best first for best_of."""

    choices: list[int]
    finish_reasons: list[str]  # per internal index
    texts: list[str]  # per internal index (stop strings removed)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class _Choice:
    __slots__ = ("branch", "done", "emitted", "generated", "index", "reason", "req", "stream", "text")

    def __init__(self, req: _Request, index: int, branch: lloyal.Branch, ctx: lloyal.Context) -> None:
        self.req, self.index, self.branch = req, index, branch
        self.stream = ctx.text_stream()
        self.text = ""
        self.emitted = 0  # chars of text already sent
        self.generated: list[int] = []
        self.done = False
        self.reason = ""


class _Request:
    def __init__(self, spec: GenSpec) -> None:
        self.spec = spec
        self.events: asyncio.Queue[TokenEvent | Done | BaseException] = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.root: lloyal.Branch | None = None
        self.root_is_entry = False
        self.cached_tokens = 0
        self.cancelled = False


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Scheduler:
    """Admits generation requests and runs their choices in shared decode steps."""

    def __init__(
        self, ctx: lloyal.Context, *, max_running: int | None = None, max_queue: int | None = None
    ) -> None:
        self.ctx = ctx
        self.max_queue = max_queue  # None: unbounded
        self.store = lloyal.BranchStore(ctx)
        self.cache = PrefixCache(self.store)
        self.max_running = max_running or ctx.n_seq_max
        self._running: list[_Choice] = []
        self._requests: list[_Request] = []
        self._wake = asyncio.Event()
        self._room = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None
        self._reserved = (0, 0, 0)  # choices, leases, cells promised to requests being admitted
        self.waiting = 0  # requests waiting for leases or cells
        self.steps = 0
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.closing = False  # drain() began: new requests are refused
        self._grace = 0.0
        self._closed = False  # the grace period ended: running requests are cancelled

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the decode loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="lloyal-scheduler")

    async def stop(self) -> None:
        """Stop the loop, fail waiting requests and prune every branch."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for req in self._requests:
            req.events.put_nowait(ShuttingDown("the server stopped before this request finished"))
        for c in self._running:
            if not c.branch.disposed:
                c.branch.prune_subtree()
        self._running.clear()
        self.cache.clear()

    async def drain(self, grace: float) -> int:
        """Refuse new requests, wait up to ``grace`` seconds for admitted and queued ones to finish,
        then cancel the rest (they end with :class:`ShuttingDown`, their branches pruned at the next
        step). Returns how many requests were cancelled."""
        self.closing, self._grace = True, grace
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while (self._requests or self.waiting) and loop.time() < end:
            await asyncio.sleep(0.05)
        left = len(self._requests) + self.waiting
        if left:
            self._closed = True
            for req in self._requests:
                req.events.put_nowait(ShuttingDown(self._cancelled_message()))
            await self._notify_room()  # queued requests wake up and see _closed
            end = loop.time() + 5.0
            while (self._requests or self.waiting) and loop.time() < end:
                await asyncio.sleep(0.01)  # their generators raise, and mark them cancelled
        return left

    def _cancelled_message(self) -> str:
        return (
            f"the server shut down before this request finished (grace period {self._grace:g} s, "
            "--shutdown-grace): it was cancelled; retry it when the server is back"
        )

    @property
    def running(self) -> int:
        """Choices decoding now."""
        return len(self._running)

    # -- requests -------------------------------------------------------------------------------
    def check(self, spec: GenSpec) -> None:
        """Raise what :meth:`generate` would refuse ``spec`` with, now, before anything runs
        (so a streamed request can still be answered with a status): ValueError when it can never
        run here, :class:`ShuttingDown` while draining, :class:`QueueFull` when the queue is full."""
        if spec.best_of > self.max_running or spec.best_of + 1 > self.ctx.n_seq_max:
            raise ValueError(
                f"best_of/n = {spec.best_of} needs {spec.best_of + 1} sequences but the server runs "
                f"{min(self.max_running, self.ctx.n_seq_max - 1)} at most: lower n/best_of or start "
                "the server with a larger --parallel"
            )
        if self.closing:
            raise ShuttingDown("the server is shutting down and accepts no new requests: retry later")
        if self.max_queue is not None and self.waiting >= self.max_queue and self._must_wait(spec):
            raise QueueFull(
                f"the server is busy: {self.waiting} requests already wait for a slot (--max-queue "
                f"{self.max_queue}); retry after the Retry-After delay"
            )

    async def generate(self, spec: GenSpec) -> AsyncIterator[TokenEvent | Done]:
        """Run ``spec``; yields :class:`TokenEvent` as choices advance, then one :class:`Done`."""
        self.check(spec)
        req = _Request(spec)
        await self._admit(req)
        self._requests.append(req)
        self._wake.set()
        try:
            while True:
                ev = await req.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if isinstance(ev, Done):
                    return
        finally:
            req.cancelled = True  # the loop prunes a cancelled request's choices at the next step
            self._wake.set()

    def _must_wait(self, spec: GenSpec) -> bool:
        """Whether ``spec`` would queue behind others or for lack of a free slot."""
        return bool(self.waiting) or len(self._running) + self._reserved[0] + spec.best_of > self.max_running

    async def _admit(self, req: _Request) -> None:
        spec, ctx = req.spec, self.ctx
        entry: CacheEntry | None = None
        self.waiting += 1
        try:
            async with self._room:
                while True:
                    if self._closed:
                        raise ShuttingDown(self._cancelled_message())
                    entry, hit = self.cache.lookup(spec.prompt)
                    exact = entry is not None and hit == len(entry.tokens) == len(spec.prompt)
                    leases = spec.best_of + (0 if exact else 1)
                    cells = len(spec.prompt) - hit + 1
                    room = len(self._running) + self._reserved[0] + spec.best_of <= self.max_running
                    if room and self.cache.evict(
                        leases=leases + self._reserved[1], cells=cells + self._reserved[2]
                    ):
                        reserved = (spec.best_of, leases, cells)
                        self._reserve(reserved, +1)
                        break
                    if entry is not None:
                        entry.pins -= 1
                    await self._room.wait()
        finally:
            self.waiting -= 1
        root: lloyal.Branch | None = None
        made: list[lloyal.Branch] = []  # the new root, once the worker thread made it
        try:
            if entry is not None and exact:
                root, req.root_is_entry = entry.branch, True
            else:  # fork the cached prefix (hit tokens), or a new root (hit is 0)
                src = entry.branch if entry is not None else None
                whole = entry is not None and hit == len(entry.tokens)

                def make_root() -> None:
                    if src is None:
                        made.append(lloyal.Branch.create(ctx, 0, spec.params))
                    else:
                        made.append(src.fork() if whole else src.fork(at=hit))

                await _off_loop(make_root)
                root = made[0]
                await root.aprefill(spec.prompt[hit:])
            req.root = root
            if self._closed:
                raise ShuttingDown(self._cancelled_message())
            for i in range(spec.best_of):
                b = root.fork()
                req.choices.append(_Choice(req, i, b, ctx))
                b.set_sampler_params(spec.params)
                if spec.seed is not None:
                    b.reseed_sampler((spec.seed + i) & 0xFFFFFFFF)
                elif spec.best_of > 1 or req.root_is_entry:
                    b.reseed_sampler(int.from_bytes(np.random.bytes(4), "little"))
                b.set_logit_bias(spec.logit_bias)  # replaces what a cached parent had
                b.set_grammar(spec.grammar)
        except BaseException:  # a bad grammar or bias, a full cache, a cancelled client: undo it all
            for c in req.choices:
                c.branch.prune()
            root = root or (made[0] if made else None)
            if root is not None and not req.root_is_entry:
                if req.root is root:
                    self.cache.add(root, spec.prompt)  # the prompt is prefilled: keep it
                else:
                    root.prune()
            raise
        finally:
            self._reserve(reserved, -1)
            if entry is not None:
                entry.pins -= 1
        req.cached_tokens = hit if entry else 0
        self.cache.record(req.cached_tokens, len(spec.prompt))
        self.prompt_tokens += len(spec.prompt)
        self._running.extend(req.choices)

    def _reserve(self, r: tuple[int, int, int], sign: int) -> None:
        """Hold (or release) choices, leases and cells for a request between admission and its forks."""
        self._reserved = (
            self._reserved[0] + sign * r[0],
            self._reserved[1] + sign * r[1],
            self._reserved[2] + sign * r[2],
        )

    def _retire_root(self, req: _Request) -> None:
        if req.root is not None and not req.root_is_entry and not req.root.disposed:
            self.cache.add(req.root, req.spec.prompt)

    # -- the loop -------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._reap() or self._running:
                if self._running:
                    await self._step()
                await asyncio.sleep(0)  # let new requests in between steps

    def _reap(self) -> bool:
        """Prune cancelled requests' choices; finish requests whose choices are all done."""
        changed = False
        for req in list(self._requests):
            if req.cancelled and any(not c.done for c in req.choices):
                for c in req.choices:
                    c.done = True
                    c.reason = "cancelled"
            if req.choices and all(c.done for c in req.choices):
                self._finish(req)
                changed = True
        return changed

    def _finish(self, req: _Request) -> None:
        spec = req.spec
        self._requests.remove(req)
        self._running = [c for c in self._running if c.req is not req]
        order = list(range(len(req.choices)))
        if spec.best_of > spec.n:
            order.sort(key=lambda i: _ppl(req.choices[i].branch))
        keep = order[: spec.n]
        self._retire_root(req)
        first = req.choices[keep[0]]
        for c in req.choices:
            if c is first and not req.cancelled and not c.branch.disposed:
                self.cache.add(c.branch, spec.prompt + c.generated)
            elif not c.branch.disposed:
                c.branch.prune()
        done = Done(
            choices=keep,
            finish_reasons=[c.reason for c in req.choices],
            texts=[c.text for c in req.choices],
            prompt_tokens=len(spec.prompt),
            completion_tokens=sum(len(c.generated) for c in req.choices),
            cached_tokens=req.cached_tokens,
        )
        req.events.put_nowait(done)
        asyncio.get_running_loop().create_task(self._notify_room())

    async def _notify_room(self) -> None:
        async with self._room:
            self._room.notify_all()

    async def _step(self) -> None:
        running = [c for c in self._running if not c.done and not c.req.cancelled]
        if not running:
            self._running = [c for c in self._running if not c.done]
            return
        self.cache.evict(cells=len(running))
        produced = self.store.produce_all([c.branch for c in running])
        pairs: list[tuple[lloyal.Branch, int]] = []
        staged: list[tuple[_Choice, int, TokenEvent]] = []
        for c, p in zip(running, produced, strict=True):
            spec = c.req.spec
            if p.is_stop or p.token in spec.stop_tokens:
                self._end(c, "stop")
                continue
            ev = TokenEvent(c.index, p.token, "")
            if spec.logprobs is not None:  # read before the commit replaces the logits
                ev.logprob, ev.top = self._logprobs(c.branch, p.token, spec.logprobs)
            pairs.append((c.branch, p.token))
            staged.append((c, p.token, ev))
        # Queued now (not when first awaited), so the decode runs while the text work below
        # does: the engine waits only a moment (its gather window) for a step's commit.
        commit = engine_start(self.store._submit_commit, pairs) if pairs else None
        for c, token, ev in staged:
            spec = c.req.spec
            c.generated.append(token)
            c.text += c.stream.push(token)
            cut = _find_stop(c.text, spec.stop, c.emitted)
            if cut is not None:
                c.text = c.text[:cut]
                self._emit(c, ev, final=True)
                self._end(c, "stop")
            elif len(c.generated) >= spec.max_tokens:
                c.text += c.stream.flush()
                self._emit(c, ev, final=True)
                self._end(c, "length")
            else:
                self._emit(c, ev, final=False)
        if commit is not None:
            try:
                await commit
            except lloyal.KvCacheFullError:
                await self._commit_separately(pairs, [c for c, _, _ in staged])
            self.steps += 1
            self.tokens_generated += len(pairs)
        self._running = [c for c in self._running if not c.done]

    async def _commit_separately(
        self, pairs: list[tuple[lloyal.Branch, int]], commits: list[_Choice]
    ) -> None:
        """The cache is full: commit request by request; a request that does not fit ends with "length"."""
        by_req: dict[int, list[int]] = {}
        for k, c in enumerate(commits):
            by_req.setdefault(id(c.req), []).append(k)
        for ks in by_req.values():
            self.cache.evict(cells=len(ks))
            try:
                await self.store.acommit([pairs[k] for k in ks])
            except lloyal.KvCacheFullError:
                for k in ks:
                    c = commits[k]
                    c.generated.pop()
                    c.reason = "length"
                    c.done = True

    def _emit(self, c: _Choice, ev: TokenEvent, *, final: bool) -> None:
        end = len(c.text) if final else len(c.text) - _holdback(c.text, c.req.spec.stop)
        if end > c.emitted:
            ev.text = c.text[c.emitted : end]
            c.emitted = end
        c.req.events.put_nowait(ev)

    def _end(self, c: _Choice, reason: str) -> None:
        if not c.done:
            c.done, c.reason = True, reason
            if c.emitted < len(c.text):
                c.req.events.put_nowait(TokenEvent(c.index, -1, c.text[c.emitted :]))
                c.emitted = len(c.text)
            if all(x.done for x in c.req.choices):
                self._wake.set()

    def _logprobs(self, branch: lloyal.Branch, token: int, k: int) -> tuple[float, list[TopLogprob]]:
        if k <= 0:
            return -branch.model_surprisal(token), []
        logits = branch.logits  # one copy; the token's logprob and the top k from the same pass
        m = float(np.max(logits))
        lse = m + math.log(float(np.sum(np.exp(logits - m, dtype=np.float64))))
        top = np.argpartition(logits, -k)[-k:]
        ranked = sorted(top.tolist(), key=lambda t: -float(logits[t]))
        alts = [TopLogprob(t, self.ctx.token_to_text(t), float(logits[t]) - lse) for t in ranked]
        return float(logits[token]) - lse, alts


async def _off_loop(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a worker thread: a direct call waits for the engine's tick in progress
    (up to a prefill chunk's ~0.8 s), and the event loop keeps serving the other requests
    meanwhile. A cancelled caller still waits for ``fn`` to finish, so its cleanup sees
    everything ``fn`` made."""
    done = asyncio.get_running_loop().run_in_executor(None, fn)
    try:
        await asyncio.shield(done)
    except asyncio.CancelledError:
        await asyncio.wait([done])
        raise


def _ppl(branch: lloyal.Branch) -> float:
    p = branch.perplexity
    return p if math.isfinite(p) else math.inf


def _find_stop(text: str, stops: Sequence[str], emitted: int) -> int | None:
    """Index where the first stop string starts in ``text`` (searching from near ``emitted``)."""
    best: int | None = None
    for s in stops:
        i = text.find(s, max(0, emitted - len(s)))
        if i >= 0 and (best is None or i < best):
            best = i
    return best
