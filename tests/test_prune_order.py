"""A survivor's output does not depend on when its siblings were pruned (README: a token's
logits do not depend on where its cells sit).

Greedy-decode 40 tokens on one branch alone; then on one of four forks decoding in lockstep,
with two siblings pruned at steps 10 and 20 (by ``prune``, ``prune_subtree`` of a sibling that
has a child of its own, or ``retain_only`` at step 20): the survivor's tokens AND logits must
equal the lone branch's at every step. Before freed cells were parked, the survivor's new
cells landed in its pruned siblings' freed cells, ahead of its own, and it diverged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from helpers import exact_model_fixture

import lloyal

# Batch invariance is a CPU feature: this module runs on the CPU on a GPU run too.
pytestmark = pytest.mark.usefixtures("on_cpu")
model = exact_model_fixture()


GREEDY = lloyal.SamplingParams(temperature=0.0)
STEPS = 40
PROMPTS = [
    "The history of the printing press begins",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics are",
    "Q: What is the capital of Australia?\nA:",
    "A recipe for bread: first,",
]


@pytest.fixture(scope="module")
def ctx7(model: lloyal.Model) -> Iterator[lloyal.Context]:
    # One thread: on a loaded 2-core machine OpenMP's spinning threads slow decoding ~10x.
    with lloyal.Context(model, n_ctx=1024, n_batch=64, n_seq_max=7, n_threads=1) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def lone_runs(ctx7: lloyal.Context) -> dict[str, tuple[list[int], list[np.ndarray]]]:
    """Each prompt decoded on a branch that never had siblings (shared by the three cases)."""
    return {prompt: alone(ctx7, prompt) for prompt in PROMPTS[:3]}


def alone(ctx: lloyal.Context, prompt: str) -> tuple[list[int], list[np.ndarray]]:
    tokens, logits = [], []
    with lloyal.Branch.create(ctx, 0, GREEDY) as b:
        b.prefill(ctx.tokenize(prompt))
        for _ in range(STEPS):
            t = b.produce().token
            b.commit(t)
            tokens.append(t)
            logits.append(b.logits.copy())
    return tokens, logits


def with_pruned_siblings(ctx: lloyal.Context, prompt: str, how: str) -> tuple[list[int], list[np.ndarray]]:
    """Four greedy forks in lockstep; survivor = the first; siblings 1 and 2 go at steps 10 and 20."""
    store = lloyal.BranchStore(ctx)
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(prompt))
    live = [root.fork() for _ in range(4)]
    survivor, doomed = live[0], live[1:3]
    tokens, logits = [], []
    for step in range(STEPS):
        if how == "prune_subtree" and step == 5:
            live += [d.fork() for d in doomed]  # each doomed sibling gets a child of its own
        if step in (10, 20):
            victim = doomed[step // 10 - 1]
            if how == "retain_only" and step == 20:
                store.retain_only(survivor)
            elif how == "prune_subtree":
                victim.prune_subtree()
            else:
                victim.prune()
            live = [b for b in live if not b.disposed]
        produced = store.produce_all(live)
        store.commit([(b, p.token) for b, p in zip(live, produced, strict=True)])
        tokens.append(produced[0].token)
        logits.append(survivor.logits.copy())
    survivor.prune_subtree()
    root.prune_subtree()
    assert store.available == ctx.n_seq_max and store.kv_pressure.cells_used == 0
    return tokens, logits


@pytest.mark.parametrize("how", ["prune", "prune_subtree", "retain_only"])
def test_survivor_is_unchanged_by_pruning_its_siblings(
    ctx7: lloyal.Context, lone_runs: dict[str, tuple[list[int], list[np.ndarray]]], how: str
) -> None:
    for prompt, (want_tokens, want_logits) in lone_runs.items():
        tokens, logits = with_pruned_siblings(ctx7, prompt, how)
        assert tokens == want_tokens, prompt
        assert len(logits) == len(want_logits) == STEPS
        pairs = enumerate(zip(logits, want_logits, strict=True))
        first = next((i for i, (a, b) in pairs if not np.array_equal(a, b)), None)
        assert first is None, f"{prompt!r}: logits differ from step {first}"


@pytest.mark.parametrize("invariant", [True, False])
def test_only_batch_invariant_contexts_park_pruned_cells(
    make_context: Callable[..., lloyal.Context], invariant: bool
) -> None:
    """Parked cells stay in every later decode's attention span until the cache fills, so a
    fast context (where cell order cannot make logits exact anyway) frees them at once."""
    ctx = make_context(n_ctx=512, n_seq_max=3, batch_invariant=invariant)
    store = lloyal.BranchStore(ctx)
    root = lloyal.Branch.create(ctx, 0, GREEDY)
    root.prefill(ctx.tokenize(PROMPTS[0]))
    n = root.position
    child = root.fork()
    for _ in range(5):
        child.commit(child.sample())
    child.prune()
    assert store.kv_pressure.cells_used == n
    assert store.kv_pressure.cells_parked == (5 if invariant else 0)
    root.prune()
    assert store.kv_pressure.cells_parked == (5 + n if invariant else 0)
    assert store.kv_pressure.cells_used == 0 and store.available == 3
    # A prefill that needs the parked cells gets them: nothing is lost to parking.
    big = lloyal.Branch.create(ctx, 0, GREEDY)
    big.prefill((ctx.tokenize(PROMPTS[1]) * 100)[:510])
    assert store.kv_pressure.cells_used == big.position == 510
    assert store.kv_pressure.cells_parked == 0
