"""Admission in the core (``lloyal._lloyal.Admission``): the plan a request starts on, the pins
and reservations it holds, and a prompt in flight forked once written, on a real context."""

from __future__ import annotations

import pytest

import lloyal
from lloyal import _lloyal

GREEDY = lloyal.SamplingParams(temperature=0.0)


def test_a_plan_pins_what_it_forks_until_admitted_and_is_gone_once_released(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_seq_max=4) as ctx:
        cache, book = _lloyal.PrefixCache(ctx), _lloyal.Admission(ctx, 3)
        prompt = list(range(100, 120))
        entry = lloyal.Branch.create(ctx, 0, GREEDY)
        entry.prefill(prompt)
        assert cache.add(entry, prompt)
        plan = book.plan([*prompt, 7, 8, 9, 10, 11], 1)
        assert plan is not None and plan.base is not None and plan.base.handle == entry.handle
        assert (plan.at, plan.reused, plan.exact, plan.leases, plan.cells) == (None, 20, False, 1, 6)
        cache.budget = 0  # the entry is pinned by the plan: it stays
        assert len(cache) == 1 and not entry.disposed
        book.reserve(plan)
        assert book.reserved == (1, 1, 6) and book.must_wait(3, 0) and not book.must_wait(2, 0)
        fork = plan.base.fork()
        book.holds(plan, fork)
        book.admitted(plan)
        assert (book.running, book.reserved) == (1, (0, 0, 0))
        fork.prune()
        cache.budget = 0  # unpinned, a leaf again: evicted
        assert len(cache) == 0 and entry.disposed
        assert book.release(plan) and book.running == 0 and not book.release(plan)
        with pytest.raises(ValueError, match="released already"):
            book.reserve(plan)
        book.check(3)  # a root and 3 choices on 4 sequences
        with pytest.raises(ValueError, match="at most 3 decode at once"):
            book.check(4)
        with pytest.raises(ValueError, match="needs 5 sequences"):  # 4 may run, but 4 + 1 do not fit
            _lloyal.Admission(ctx, 4).check(4)


def test_a_prompt_in_flight_is_waited_for_then_forked_where_it_ends(model: lloyal.Model) -> None:
    with lloyal.Context(model, n_ctx=256, n_seq_max=4) as ctx:
        book = _lloyal.Admission(ctx, 3)
        system = list(range(200, 240))
        first = book.plan(system, 1)
        assert first is not None and first.base is None
        book.reserve(first)
        question = [*system, 5, 6, 7]
        assert book.plan(question, 1) is None  # the system prompt is being written: wait
        writer = lloyal.Branch.create(ctx, 0, GREEDY)
        book.holds(first, writer)
        writer.prefill(system)
        assert book.written(first) and not book.written(first)
        second = book.plan(question, 1)
        assert second is not None and second.base is not None and second.base.handle == writer.handle
        # its 3 new cells and one for its first token, and the 41 the first plan reserved
        assert (second.at, second.reused, second.cells) == (40, 40, 4 + 41)
        book.release(second)
        book.release(first)  # no longer in flight, never cached: nothing to fork
        third = book.plan(question, 1)
        assert third is not None and third.base is None and third.reused == 0
