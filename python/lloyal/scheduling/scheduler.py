"""Generation requests on one context (the OpenAI server's and Ray Data's): every running
choice of every request advances in one decode per step.

Each choice runs as a generation request of the context's engine
(:meth:`lloyal.Branch.generate`): the engine samples, commits and applies stops, ``max_tokens``
and logprobs in Rust, all choices of all requests in one ``llama_decode`` per step, and runs up
to :data:`LOOKAHEAD` tokens ahead of the event loop, so the next step decodes while this one's
tokens are turned into events (no hand-off between steps). A request is admitted when a slot is
free: it forks the longest cached prefix of its prompt (:mod:`lloyal.scheduling.prefix_cache`),
prefills the rest once (one choice: in its generation request), and forks ``best_of > 1``
choices from that root (0 new cells for the prompt). A request whose prompt shares a prefix with
a running request's, neither cached yet, waits until that prompt is written and forks it there:
a burst of requests with a new system prompt prefills it once. Those decisions, the slots and
the leases and cells reserved for requests being admitted are the core's
(:class:`lloyal._lloyal.Admission`); this module awaits what they name. Finished
requests leave their first choice (and a ``best_of`` root) in the cache, within
:meth:`Scheduler.cache_budget`; everything else is pruned. Choices take a KV cell per token (no
reservation, unless the scheduler is made with ``reserve=True``: then each waits in the engine
for its ``max_tokens``); the engine evicts cached prefixes when a token or a prompt needs cells
that are not free, and a choice that still finds the cache full ends with ``"length"``.

Requests waiting for room queue in arrival order (:class:`~lloyal.scheduling.room_queue.RoomQueue`:
a wake-up tries them in order and stops where no later one can start).

Requests talk to the scheduler through :meth:`Scheduler.generate`, an async iterator of events.
Admission refuses a request when ``max_queue`` requests already wait (:class:`QueueFull`) and
after :meth:`Scheduler.drain` began (:class:`ShuttingDown`).
"""

from __future__ import annotations

import asyncio
import functools
import math
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field

import numpy as np

import lloyal
from lloyal import _lloyal

from .prefix_cache import PrefixCache
from .room_queue import SHORT, RoomQueue, Short

__all__ = [
    "LOOKAHEAD",
    "Done",
    "GenSpec",
    "PromptScores",
    "QueueFull",
    "Scheduler",
    "ShuttingDown",
    "TokenEvent",
    "TopLogprob",
]

LOOKAHEAD = 8
"""Tokens a choice's generation may run ahead of the event loop: the engine keeps decoding
while the loop turns tokens into events or waits for the context lock (a fork, a prune)."""


async def _within(work: Awaitable[None], deadline: float) -> None:
    """``await work`` in this task, cancelled at loop time ``deadline``, then raising
    ``asyncio.TimeoutError``: Python 3.10's form of ``asyncio.timeout_at``. Not
    ``asyncio.wait_for``, which runs ``work`` in a task of its own: on 3.10 it can return the
    result of work that ends as the caller is cancelled (a client gone), swallowing the
    cancellation."""
    task = asyncio.current_task()
    assert task is not None, "_within() runs in a task"
    expired = False

    def expire() -> None:
        nonlocal expired
        expired = True
        task.cancel()

    timer = asyncio.get_running_loop().call_at(deadline, expire)
    try:
        await work
    except asyncio.CancelledError:
        if expired:
            raise asyncio.TimeoutError from None
        raise
    finally:
        timer.cancel()


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
    min_tokens: int = 0  # tokens made before the end-of-generation/stop tokens and stop strings count
    include_stop_str: bool = False  # a matched stop string ends the text
    grammar: lloyal.Grammar | str | None = None  # a Grammar, or GBNF text
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and k alternatives
    # None: off; k: each prompt token's logprob and k alternatives (the prompt is then written
    # whole, forking nothing cached: Branch.score)
    prompt_logprobs: int | None = None
    seed: int | None = None
    rank: bool = False  # order the choices by perplexity (lowest first) even when best_of == n

    @property
    def commits_last(self) -> bool:
        """Whether each choice decodes the token that reaches ``max_tokens``: only when the
        choices are ranked by perplexity (over every token); otherwise the branch goes on only
        as a cached prefix, and the decode is saved."""
        return self.rank or self.best_of > self.n


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
    rank: int | None = None  # a scored prompt token's: 1 + the tokens more likely there


@dataclass
class PromptScores:
    """A request's prompt scored (:attr:`GenSpec.prompt_logprobs`), its first event: one
    :class:`TokenEvent` per prompt token (the first one's ``logprob`` is None)."""

    tokens: list[TokenEvent]


@dataclass
class Done:
    """The request finished: ``choices`` are the returned internal indices, best first for best_of."""

    choices: list[int]
    finish_reasons: list[str]  # per internal index
    texts: list[str]  # per internal index (stop strings removed unless GenSpec.include_stop_str)
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    lengths: list[int] = field(default_factory=list)  # tokens per internal index
    perplexities: list[float] = field(default_factory=list)  # per internal index, when ranked
    prompt: list[TokenEvent] = field(default_factory=list)  # the prompt scored, when asked


class _Choice:
    __slots__ = (
        "branch",
        "committed",
        "done",
        "generated",
        "index",
        "ppl",
        "prompt",
        "reason",
        "req",
        "task",
        "text",
    )

    def __init__(self, req: _Request, index: int, branch: lloyal.Branch) -> None:
        self.req, self.index, self.branch = req, index, branch
        self.prompt: list[int] = []  # tokens its generation request prefills, until its first token
        self.text = ""  # released text (stop strings removed)
        self.generated: list[int] = []
        self.done = False
        self.reason = ""
        self.ppl = math.inf  # its branch's perplexity as its generation request ended
        self.committed: int | None = None  # of ``generated``, the tokens its branch holds at the end
        self.task: asyncio.Task[None] | None = None


class _Request:
    def __init__(self, spec: GenSpec) -> None:
        self.spec = spec
        self.events: asyncio.Queue[TokenEvent | Done | BaseException] = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.root: lloyal.Branch | None = None
        self.root_is_entry = False
        self.plan: _lloyal.AdmissionPlan | None = None  # its admission, until it ends
        self.arrived = time.monotonic()
        self.cached_tokens = 0
        self.cancelled = False
        self.prompt_scored: list[TokenEvent] = []  # GenSpec.prompt_logprobs: the prompt's tokens


class Scheduler:
    """Admits generation requests and runs their choices as engine generation requests."""

    def __init__(
        self,
        ctx: lloyal.Context,
        *,
        max_running: int | None = None,
        max_queue: int | None = None,
        cache_cells: int | None = None,
        reserve: bool = False,
        host_cache_bytes: int = 0,
    ) -> None:
        self.ctx = ctx
        self.max_queue = max_queue  # None: unbounded
        self.store = lloyal.BranchStore(ctx)
        self.cache = PrefixCache(ctx)
        self.book = _lloyal.Admission(ctx, max_running or ctx.n_seq_max)
        self.cache_cells = cache_cells  # None: the budget follows the cache's reuse
        if cache_cells is None:
            self.cache.follow_reuse()
        else:
            self.cache.trim(cache_cells)
        # entries evicted for room kept in host memory, written back for a prompt that reuses them
        self.cache.keep_evicted(host_cache_bytes)
        # True: each choice waits in the engine for room for its max_tokens (a batch job's
        # choices all finish); False: a choice that finds the cache full ends with "length"
        self.reserve = reserve
        self._requests: list[_Request] = []
        self._room: RoomQueue[GenSpec, _lloyal.AdmissionPlan] = RoomQueue(
            self._attempt,
            slots=lambda: self.book.max_running - self.book.running - self.book.reserved[0],
            busy=lambda: self.book.running > 0 or self.book.reserved[0] > 0,
            release=self.book.release,
        )
        self._ticks0 = ctx.engine_stats().ticks
        self.waiting = 0  # requests waiting for leases or cells
        self._entering = 0  # requests between their check and their listing (waiting included)
        self.tokens_generated = 0
        self.prompt_tokens = 0
        self.closing = False  # drain() began: new requests are refused
        self._grace = 0.0
        self._closed = False  # the grace period ended: running requests are cancelled

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: each admitted choice runs as its own engine generation request
        (kept for the application's lifespan, which calls it)."""

    async def stop(self) -> None:
        """Cancel running choices, fail waiting requests and prune every branch."""
        self.closing = self._closed = True  # a request being admitted fails as it is listed
        self._room.close(lambda: ShuttingDown("the server stopped before this request started"))
        for req in self._requests:
            req.events.put_nowait(ShuttingDown("the server stopped before this request finished"))
        choices = [c for req in self._requests for c in req.choices]
        tasks = [c.task for c in choices if c.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in choices:
            if not c.branch.disposed:
                c.branch.prune_subtree()
        self.cache.clear()

    async def drain(self, grace: float) -> int:
        """Refuse new requests, wait up to ``grace`` seconds for admitted and queued ones to finish,
        then cancel the rest (they end with :class:`ShuttingDown`, their branches pruned).
        Returns how many requests were cancelled."""
        self.closing, self._grace = True, grace
        loop = asyncio.get_running_loop()
        end = loop.time() + grace
        while (self._requests or self._entering) and loop.time() < end:
            await asyncio.sleep(0.05)
        left = len(self._requests) + self._entering
        if left:
            self._closed = True
            for req in self._requests:
                req.events.put_nowait(ShuttingDown(self._cancelled_message()))
            self._room.close(lambda: ShuttingDown(self._cancelled_message()))  # the queued requests fail
            end = loop.time() + 5.0
            while (self._requests or self._entering) and loop.time() < end:
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
        return self.book.running

    @property
    def max_running(self) -> int:
        """The most choices decoding at once."""
        return self.book.max_running

    @property
    def steps(self) -> int:
        """Engine ticks that decoded something since the scheduler was made (every running
        choice advances one token per tick)."""
        return self.ctx.engine_stats().ticks - self._ticks0

    # -- requests -------------------------------------------------------------------------------
    def check(self, spec: GenSpec) -> None:
        """Raise what :meth:`generate` would refuse ``spec`` with, now, before anything runs
        (so a streamed request can still be answered with a status): ValueError when it can never
        run here, :class:`ShuttingDown` while draining, :class:`QueueFull` when the queue is full."""
        self.book.check(spec.best_of)
        if self.closing:
            raise ShuttingDown("the server is shutting down and accepts no new requests: retry later")
        full = self.max_queue is not None and self.waiting >= self.max_queue
        if full and self.book.must_wait(spec.best_of, self.waiting):
            raise QueueFull(
                f"the server is busy: {self.waiting} requests already wait for a slot (--max-queue "
                f"{self.max_queue}); retry after the Retry-After delay"
            )

    async def generate(
        self, spec: GenSpec, *, deadline: float | None = None
    ) -> AsyncGenerator[TokenEvent | PromptScores | Done, None]:
        """Run ``spec``; yields :class:`TokenEvent` as choices advance, then one :class:`Done`
        (first, with :attr:`GenSpec.prompt_logprobs`, the prompt's :class:`PromptScores`).
        At loop time ``deadline`` (waiting for a slot included) it raises ``asyncio.TimeoutError``
        instead of its next event, and the request is cancelled; one timer for the request, not
        one per event."""
        self.check(spec)
        req = _Request(spec)
        loop = asyncio.get_running_loop()
        self._entering += 1  # a drain waits for it from here, granted or not
        try:
            await self._admit_by(req, deadline)
            self._requests.append(req)
        finally:
            self._entering -= 1
        for c in req.choices:
            c.task = loop.create_task(self._run_choice(c))
            c.task.add_done_callback(functools.partial(self._task_done, c))
        timer = None
        if deadline is not None:
            timer = loop.call_at(deadline, req.events.put_nowait, asyncio.TimeoutError())
        try:
            if spec.prompt_logprobs is not None:
                yield PromptScores(req.prompt_scored)
            while True:
                ev = await req.events.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if isinstance(ev, Done):
                    return
        finally:
            if timer is not None:
                timer.cancel()
            req.cancelled = True  # choices still running stop, and the request's branches go
            for c in req.choices:
                if c.task is not None and not c.task.done():
                    c.task.cancel()

    async def _admit_by(self, req: _Request, deadline: float | None) -> None:
        """:meth:`_admit`, given up with ``asyncio.TimeoutError`` at loop time ``deadline``."""
        if deadline is None:
            await self._admit(req)
        elif sys.version_info >= (3, 11):
            async with asyncio.timeout_at(deadline):
                await self._admit(req)
        else:
            await _within(self._admit(req), deadline)

    async def _admit(self, req: _Request) -> None:
        spec = req.spec
        self.waiting += 1
        try:
            plan = await self._room.admit(spec, spec.best_of)
        finally:
            self.waiting -= 1
        req.plan, req.cached_tokens = plan, plan.reused
        made: list[lloyal.Branch] = []  # the new root, once made
        try:
            # a cached prefix evicted to host memory is written back first (an entry again)
            base = await self.book.arestore(plan) if plan.restores else plan.base
            if spec.best_of == 1:
                await self._admit_one(req, plan, base)
            else:
                await self._admit_forks(req, plan, base, made)
            if self._closed:
                raise ShuttingDown(self._cancelled_message())
            self.book.admitted(plan)
            self._wake_waiting()  # its reservation is gone: a request that found no room may fit now
        except BaseException:  # a bad grammar or bias, a full cache, a cancelled client: undo it all
            for c in req.choices:
                self._started(c)
            if made and made[0] is not req.root:  # its prompt is not written: it goes
                self.cache.release(made[0])
            self._end(req, keep_best=False)  # the choices go; a root whose prompt is written stays
            raise
        self.cache.record(req.cached_tokens, spec.prompt)
        self.prompt_tokens += len(spec.prompt)

    async def _admit_one(
        self, req: _Request, plan: _lloyal.AdmissionPlan, base: lloyal.Branch | None
    ) -> None:
        """One choice: its branch is a fork of the cached (or in-flight) prefix ``base``, or a
        new branch, and its generation request prefills the rest of the prompt in the engine and
        goes straight on to its tokens."""
        spec = req.spec
        b = await self._prefix_branch(plan, base, spec.params)
        req.choices.append(_Choice(req, 0, b))
        await self._setup(b, spec, 0, reseed=plan.exact)
        self.book.holds(plan, b)
        if spec.prompt_logprobs is not None:
            await self._score(req, b)
            self._written(req)
        else:
            req.choices[0].prompt = [] if plan.exact else spec.prompt[plan.reused :]

    async def _admit_forks(
        self,
        req: _Request,
        plan: _lloyal.AdmissionPlan,
        base: lloyal.Branch | None,
        made: list[lloyal.Branch],
    ) -> None:
        """``best_of`` choices: the prompt is prefilled once on a root (or is ``exact``ly a
        cached entry, ``base``), and each choice forks it."""
        spec = req.spec
        if plan.exact and base is not None:
            req.root, req.root_is_entry = base, True
        else:
            made.append(await self._prefix_branch(plan, base, spec.params))
            self.book.holds(plan, made[0])
            if spec.prompt_logprobs is not None:
                await self._score(req, made[0])
            else:
                await made[0].aprefill(spec.prompt[plan.reused :])
            req.root = made[0]
            self._written(req)
        if self._closed:
            raise ShuttingDown(self._cancelled_message())
        root = req.root

        # All forks queued together (made together when the engine's tick in progress ends),
        # then all setups: one tick's wait, however busy the event loop is meanwhile.
        forks = [asyncio.ensure_future(root.afork()) for _ in range(spec.best_of)]
        try:
            await asyncio.wait(forks)
        finally:
            # Every fork made is a choice, also when this request was cancelled as the forks
            # were made (its end releases them); one still being made withdraws itself.
            for f in forks:
                f.cancel()
            made_forks = [
                f.result() for f in forks if f.done() and not f.cancelled() and f.exception() is None
            ]
            req.choices.extend(_Choice(req, i, b) for i, b in enumerate(made_forks))
        setups = [self._setup(c.branch, spec, c.index, reseed=True) for c in req.choices]
        errors = [f.exception() for f in forks] + await asyncio.gather(*setups, return_exceptions=True)
        first = next((e for e in errors if isinstance(e, BaseException)), None)
        if first is not None:
            raise first

    async def _score(self, req: _Request, b: lloyal.Branch) -> None:
        """Write ``req``'s whole prompt on ``b``, each token scored (awaited in the engine)."""
        k = req.spec.prompt_logprobs or 0
        scored = await b.ascore(req.spec.prompt, k)
        text = self.ctx.token_to_text
        req.prompt_scored = [
            TokenEvent(0, t, text(t), lp, [TopLogprob(a, text(a), alp) for a, alp in top], rank)
            for t, (lp, top, rank) in zip(req.spec.prompt, scored, strict=True)
        ]

    async def _prefix_branch(
        self, plan: _lloyal.AdmissionPlan, base: lloyal.Branch | None, params: lloyal.SamplingParams
    ) -> lloyal.Branch:
        """A fork of the plan's ``base`` (whole, with its logits, when ``at`` is None; else its
        first ``at`` positions), or a new branch when nothing is shared. Awaited in the engine:
        made at once between its ticks, else when the tick in progress ends (the event loop
        keeps serving meanwhile)."""
        if base is None:
            return await lloyal.Branch.acreate(self.ctx, 0, params)
        return await base.afork(at=plan.at)

    def _written(self, req: _Request) -> None:
        """``req``'s prompt is in its branch's KV: requests waiting to fork it may go on."""
        if req.plan is not None and self.book.written(req.plan):
            self._wake_waiting()

    def _end(self, req: _Request, *, keep_best: bool) -> tuple[list[int], list[float]]:
        """``req`` ended (or failed): the core ranks its choices (``best_of``), keeps the best
        one's branch (``keep_best``) and a root holding its prompt in the prefix cache,
        releases the other branches, and frees its slots, reservation and prompt in flight.
        Returns the choices it returns, best first, and the perplexities it ranked by."""
        assert req.plan is not None
        root = req.root if req.root is not None and not req.root_is_entry else None
        spec = req.spec
        choices = [(c.branch, c.generated[: c.committed or 0], c.ppl) for c in req.choices]
        # a branch whose engine request did not say how many tokens it holds is not cached
        keep_best = keep_best and all(c.committed is not None for c in req.choices)
        kept, ppls = self.book.finish(req.plan, choices, root, n=spec.n, rank=spec.rank, keep_best=keep_best)
        self._wake_waiting()
        return kept, ppls

    @staticmethod
    async def _setup(b: lloyal.Branch, spec: GenSpec, i: int, *, reseed: bool) -> None:
        """Give choice ``i``'s branch the request's sampler, seed, bias and grammar, replacing
        what a cached parent had, in one call (``reseed``: a random seed when the request gives
        none, so forks of one parent differ); a fork of a cached prefix forgets the penalty
        history and perplexity of the request that left it (it samples as the request run cold)."""
        seed = None
        if spec.seed is not None:
            seed = (spec.seed + i) & 0xFFFFFFFF
        elif reseed:
            seed = int.from_bytes(np.random.bytes(4), "little")
        await b.aset_sampling(
            spec.params, seed=seed, logit_bias=spec.logit_bias, grammar=spec.grammar, fresh=True
        )

    # -- the choices ----------------------------------------------------------------------------
    async def _run_choice(self, c: _Choice) -> None:
        """Stream one choice's tokens from its engine generation request into its request's events."""
        spec = c.req.spec
        k = spec.logprobs
        it: lloyal.TokenIterator | None = None
        reason = "cancelled"
        try:
            it = c.branch.generate(
                spec.max_tokens,
                prompt=c.prompt or None,
                stop=list(spec.stop) or None,
                stop_tokens=list(spec.stop_tokens) or None,
                min_tokens=spec.min_tokens,
                include_stop_str=spec.include_stop_str,
                logprobs=k is not None,
                top_logprobs=k or 0,
                lookahead=LOOKAHEAD,
                reserve=self.reserve,
                # a request that waited (for a slot, or for a prefix to fork) is older than the
                # streams that started meanwhile: its prompt is not paced behind them
                waited=time.monotonic() - c.req.arrived,
                commit_last=spec.commits_last,
            )
            async for tok in it:
                if c.prompt:
                    self._started(c)
                    self._written(c.req)
                c.generated.append(tok.token)
                c.text += tok.text
                self.tokens_generated += 1
                ev = TokenEvent(c.index, tok.token, tok.text)
                if tok.logprob is not None:
                    ev.logprob = tok.logprob
                    top = tok.top_logprobs or ()
                    ev.top = [TopLogprob(t, self.ctx.token_to_text(t), lp) for t, lp in top]
                c.req.events.put_nowait(ev)
            reason = "length" if it.finish_reason == "length" else "stop"
        except lloyal.KvCacheFullError:  # the cache filled up with nothing left to evict
            self._out_of_room(c)
            reason = "length"
        except asyncio.CancelledError:
            if it is not None:
                it.close()
        except Exception as exc:  # the request fails with it; the other choices are cancelled
            c.req.events.put_nowait(exc)
        finally:
            self._choice_ended(c, reason, it)

    def _choice_ended(self, c: _Choice, reason: str, it: lloyal.TokenIterator | None) -> None:
        """Choice ``c`` ended with ``reason`` (``it``: its generation, None when it never
        started); the request finishes with its last choice."""
        ppl = None if it is None else it.perplexity
        c.ppl = ppl if ppl is not None and math.isfinite(ppl) else math.inf
        c.committed = None if it is None else it.committed
        self._started(c)
        c.done, c.reason = True, reason
        if all(x.done for x in c.req.choices) and c.req in self._requests:
            self._finish(c.req)

    def _task_done(self, c: _Choice, _task: asyncio.Task[None]) -> None:
        """A choice's task is done: a task cancelled before it first ran never reached
        :meth:`_run_choice`'s end, so the choice ends here (its slot and branch go)."""
        if not c.done:
            self._choice_ended(c, "cancelled", None)

    def _started(self, c: _Choice) -> None:
        """The choice's prompt is written (or never will be)."""
        c.prompt = []

    def cache_budget(self) -> int:
        """Most KV cells the prefix cache keeps of its own: ``cache_cells`` when given, else
        ``n_ctx`` times the share of recent prompts the cache served or, trimmed less, would
        have (``PrefixCache.stats()["reuse"]``), which the core recomputes and trims to at
        every tick's end.

        llama.cpp attends over every cell up to the highest in use, so every kept cell slows
        every decode (most of all prompt prefills). A cache that serves prompts (multi-turn
        chat, shared system prompts) keeps what it can; one whose prompts share nothing keeps
        little."""
        budget = self.cache.budget
        return self.ctx.n_ctx if budget is None else budget

    def _out_of_room(self, c: _Choice) -> None:
        """Release the text the engine held back from a choice whose next token found no free
        cell (text that might have begun a stop string: the engine's stop matcher never holds a
        whole one, so none is cut here)."""
        stream = self.ctx.text_stream()
        full = "".join(stream.push(t) for t in c.generated) + stream.flush()
        if full.startswith(c.text) and len(full) > len(c.text):
            c.req.events.put_nowait(TokenEvent(c.index, -1, full[len(c.text) :]))
            c.text = full

    def _finish(self, req: _Request) -> None:
        spec = req.spec
        self._requests.remove(req)
        # a released branch stays while a fork of it lives or a request about to fork it pins it
        keep, ppls = self._end(req, keep_best=not req.cancelled)
        done = Done(
            choices=keep,
            finish_reasons=[c.reason for c in req.choices],
            texts=[c.text for c in req.choices],
            prompt_tokens=len(spec.prompt),
            completion_tokens=sum(len(c.generated) for c in req.choices),
            cached_tokens=req.cached_tokens,
            lengths=[len(c.generated) for c in req.choices],
            perplexities=ppls,
            prompt=req.prompt_scored,
        )
        req.events.put_nowait(done)
        self._wake_waiting()

    def _wake_waiting(self) -> None:
        """Requests waiting for room try again, in arrival order (room was freed, or a prompt
        they fork is written): :class:`RoomQueue`."""
        self._room.wake()

    async def _attempt(self, spec: GenSpec) -> _lloyal.AdmissionPlan | Short | None:
        """Start a request for ``spec`` now: its plan, reserved; ``None`` when the core says it
        must wait (no free slot, or the prompt it forks is not written yet); :data:`SHORT` when
        the prefix cache could not free the leases and cells it needs."""
        # what it forks is pinned from here: a request finishing while this one awaits room
        # must not prune it
        plan = self.book.plan(spec.prompt, spec.best_of, spec.prompt_logprobs is None)
        if plan is None:
            return None
        fits = False
        try:
            fits = await self.cache.make_room(leases=plan.leases, cells=plan.cells)
        finally:
            if not fits:  # no room (or cancelled while awaiting it): the pins go
                self.book.release(plan)
        if not fits:
            return SHORT
        self.book.reserve(plan)
        return plan
