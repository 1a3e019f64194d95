"""Branch.fork(at=): a child that shares only a prefix of its parent's KV (what the prefix cache reuses)."""

from __future__ import annotations

import pytest

import lloyal

GREEDY = lloyal.SamplingParams(temperature=0)


def _greedy(b: lloyal.Branch, n: int) -> list[int]:
    out = []
    for _ in range(n):
        t = b.produce().token
        b.commit(t)
        out.append(t)
    return out


def test_fork_at_shares_the_prefix_and_matches_a_cold_prefill(make_context) -> None:  # type: ignore[no-untyped-def]
    ctx = make_context(n_ctx=512, n_seq_max=4)
    store = lloyal.BranchStore(ctx)
    a = ctx.tokenize("The weather in Paris today is")
    b_tail = ctx.tokenize(" and in London it was", add_special=False)
    parent = lloyal.Branch.create(ctx, 0, GREEDY)
    parent.prefill(a + ctx.tokenize(" sunny and warm", add_special=False))
    used = store.kv_pressure.cells_used
    child = parent.fork(at=len(a))
    assert (child.position, child.fork_head) == (len(a), len(a))
    assert store.kv_pressure.cells_used == used  # nothing copied
    with pytest.raises(lloyal.LloyalError):
        child.produce()  # no logits until a prefill
    child.prefill(b_tail)
    assert store.kv_pressure.cells_used == used + len(b_tail)
    got = _greedy(child, 8)
    with lloyal.Branch.create(ctx, 0, GREEDY) as cold:
        cold.prefill(a + b_tail)
        assert _greedy(cold, 8) == got
    child.prune()
    assert store.kv_pressure.cells_used == used
    assert parent.fork(at=parent.position).position == parent.position  # at == position: a plain fork


@pytest.mark.parametrize("at", [0, -1, 10_000])
def test_fork_at_out_of_range_changes_nothing(make_context, at: int) -> None:  # type: ignore[no-untyped-def]
    ctx = make_context(n_ctx=256, n_seq_max=2)
    store = lloyal.BranchStore(ctx)
    parent = lloyal.Branch.create(ctx, 0, GREEDY)
    parent.prefill(ctx.tokenize("Hello there"))
    with pytest.raises(ValueError, match=r"at must be in \[1, "):
        parent.fork(at=at)
    assert store.available == 1 and parent.children == []
