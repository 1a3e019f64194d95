"""Helpers shared by the test modules (import as ``from helpers import ...``)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import platform
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

import lloyal

if TYPE_CHECKING:
    from lloyal import _lloyal
    from lloyal.scheduling.scheduler import Done, GenSpec, Scheduler, TokenEvent

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
GREEDY = lloyal.SamplingParams(temperature=0)
SERVER_KEY = "sk-test-key"  # the API key of the OpenAI server tests' servers (conftest's `client`)


def context_fixture(**options: Any) -> Any:
    """A fixture (function scope) giving a context on the session model made with ``options``,
    closed at teardown; a test module assigns it to the fixture's name:
    ``ctx4 = context_fixture(n_ctx=512, n_seq_max=4)``."""

    @pytest.fixture
    def context(make_context: Callable[..., lloyal.Context]) -> lloyal.Context:
        return make_context(**options)

    return context


def exact_model_fixture() -> Any:
    """The session ``model`` fixture of a module whose tests compare batched, crowded or resumed
    runs with single ones by ``==``: ``exact_model`` (batch-invariant, on the CPU on a GPU run too,
    since GPU kernels are not); a test module assigns it: ``model = exact_model_fixture()``."""

    @pytest.fixture(scope="session")
    def model(exact_model: lloyal.Model) -> lloyal.Model:
        return exact_model

    return model


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as module ``name`` (the scripts are not a package; their
    folder goes on ``sys.path``, as for a script, for their shared ``_args``)."""
    if str(EXAMPLES) not in sys.path:
        sys.path.append(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_example_jsonl(name: str, *args: str, stdin: str = "") -> list[dict[str, Any]]:
    """Run ``examples/<name>.py --jsonl *args``: it must exit 0 and print one JSON object a line."""
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--jsonl", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines, proc.stderr
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) for e in events)
    return events


STATE_EXAMPLES = int(os.environ.get("LLOYAL_STATE_EXAMPLES", "12"))
STATE_STEPS = int(os.environ.get("LLOYAL_STATE_STEPS", "25"))


def machine_settings() -> settings:
    """Hypothesis settings of the state-machine tests: ``LLOYAL_STATE_EXAMPLES`` programs of up
    to ``LLOYAL_STATE_STEPS`` steps (``make soak`` raises both)."""
    return settings(
        max_examples=STATE_EXAMPLES,
        stateful_step_count=STATE_STEPS,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def machine_report(name: str, checks: Mapping[str, int]) -> Any:
    """A module fixture that appends a state machine's figures (its ``checks`` counters) to the
    soak report once the module's tests ran: ``_report = machine_report("name", CHECKS)``."""

    @pytest.fixture(scope="module", autouse=True)
    def _report() -> Iterator[None]:
        yield
        soak_report(name, examples=STATE_EXAMPLES, max_steps=STATE_STEPS, **checks)

    return _report


def soak_report(name: str, **figures: object) -> None:
    """Append ``figures`` as one JSON line to ``$LLOYAL_SOAK_REPORT`` (set by ``make soak``)."""
    path = os.environ.get("LLOYAL_SOAK_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": name, **figures}) + "\n")


def produce_commit(branch: lloyal.Branch, n: int, *, forbid_stop: bool = False) -> list[int]:
    """``n`` produce/commit steps on one branch; the committed tokens.

    With ``forbid_stop`` a stop token fails the test (the prompt was meant to avoid one).
    """
    out = []
    for _ in range(n):
        p = branch.produce()
        assert not (forbid_stop and p.is_stop), "test prompt hit a stop token unexpectedly"
        branch.commit(p.token)
        out.append(p.token)
    return out


# Linux with transparent huge pages (whatever their setting): madvise(MADV_HUGEPAGE) is taken,
# so a model load marks its weight buffers (Model.huge_page_bytes).
THP = sys.platform == "linux" and Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()


def _collapses() -> bool:
    """Whether MADV_COLLAPSE can put written memory on huge pages: Linux 6.1 or later, THP not
    ``never``."""
    if not THP:
        return False
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return "[never]" not in enabled and (major, minor) >= (6, 1)


THP_COLLAPSE = _collapses()

# Whether models loaded without ``n_gpu_layers`` stay on the CPU in this run: not on a GPU run
# (``LLOYAL_N_GPU_LAYERS=99``, benches/gpu_suite.sh; ``make test-offloaded`` rehearses it here),
# where their weights and logits live in GPU or pinned memory instead of huge pages.
MODELS_ON_CPU = os.environ.get("LLOYAL_N_GPU_LAYERS", "").strip() in ("", "0")

# Whether ggml loaded a backend besides the CPU's (a CUDA module beside the wheel's CPU ones:
# ``system_info`` names each backend, "CPU : ... | CUDA : ..."). Models on the CPU then change
# too: llama.cpp keeps their weights in the GPU's pinned host memory, not on huge pages.
GPU_BACKEND = any(name != "CPU" for name in re.findall(r"(\w+) : ", lloyal.system_info()))


def wait_until(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll ``cond`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting for the engine"
        time.sleep(0.001)


def prefilled(
    ctx: lloyal.Context, prompt: str, params: lloyal.SamplingParams = GREEDY, **options: Any
) -> lloyal.Branch:
    """A new branch at position 0 (``Branch.create``'s ``options``, e.g. ``grammar``) with
    ``prompt`` prefilled."""
    branch = lloyal.Branch.create(ctx, 0, params, **options)
    branch.prefill(ctx.tokenize(prompt))
    return branch


def greedy_steps(
    branches: list[lloyal.Branch],
    out: list[list[int]],
    steps: int,
    batched: bool,
    *,
    forbid_stop: bool = False,
) -> None:
    """``steps`` greedy tokens for every branch, appended to ``out``: one batched commit per
    step, or one branch at a time. With ``forbid_stop`` a stop token fails the test."""
    store = lloyal.BranchStore(branches[0].context) if batched else None
    for _ in range(steps):
        if store is not None:
            produced = store.produce_all(branches)
            assert not (forbid_stop and any(p.is_stop for p in produced)), "test prompt hit a stop token"
            store.commit([(b, p.token) for b, p in zip(branches, produced, strict=True)])
            for o, p in zip(out, produced, strict=True):
                o.append(p.token)
        else:
            for o, b in zip(out, branches, strict=True):
                o.extend(produce_commit(b, 1, forbid_stop=forbid_stop))


def lockstep(branches: list[lloyal.Branch], max_steps: int) -> tuple[list[list[int]], list[int]]:
    """Step ``branches`` together (one ``produce_all`` and one commit per step) until each has
    produced a stop token or ``max_steps`` steps ran: the tokens each committed, and the indices
    of the branches still going."""
    store = lloyal.BranchStore(branches[0].context)
    out: list[list[int]] = [[] for _ in branches]
    live = list(range(len(branches)))
    for _ in range(max_steps):
        produced = store.produce_all([branches[i] for i in live])
        step = [(i, p) for i, p in zip(live, produced, strict=True) if not p.is_stop]
        live = [i for i, _ in step]
        if not live:
            break
        store.commit([(branches[i], p.token) for i, p in step])
        for i, p in step:
            out[i].append(p.token)
    return out, live


def assert_grammar_refuses(branch: lloyal.Branch, bad: int) -> None:
    """``branch``'s grammar forbids ``bad``: its commit, a BranchStore commit of it and its
    accept each raise GrammarError, and none changes the branch's position, logits or KV."""
    ctx = branch.context
    pos, logits = branch.position, branch.logits
    with pytest.raises(lloyal.GrammarError, match="not allowed"):
        branch.commit(bad)
    with pytest.raises(lloyal.GrammarError, match="not allowed"):
        lloyal.BranchStore(ctx).commit([(branch, bad)])
    with pytest.raises(lloyal.GrammarError):
        branch.accept(bad)
    assert branch.position == pos and np.array_equal(branch.logits, logits)
    assert ctx.kv_seq_pos_max(branch.seq_id) == pos - 1


def flat_constrained(
    ctx: lloyal.Context, grammar: lloyal.Grammar, prompt: str, max_tokens: int, pick: Callable[[], int]
) -> tuple[list[int], bool]:
    """The flat path under ``grammar``: decode ``prompt`` from position 0, then at most
    ``max_tokens`` times ``pick()`` a token; a stop token ends the loop, any other is accepted
    into the grammar and decoded. The tokens, and whether a stop token ended them."""
    tokens = ctx.tokenize(prompt)
    ctx.decode(tokens, 0)
    pos, out = len(tokens), []
    for _ in range(max_tokens):
        token = pick()
        if ctx.is_stop_token(token):
            return out, True
        grammar.accept(token)
        out.append(token)
        ctx.decode([token], pos)
        pos += 1
    return out, False


def cached(ctx: lloyal.Context, cache: _lloyal.PrefixCache, tokens: list[int]) -> lloyal.Branch:
    """A branch holding ``tokens`` (prefilled greedy), kept by the prefix ``cache``."""
    b = lloyal.Branch.create(ctx, 0, GREEDY)
    b.prefill(tokens)
    assert cache.add(b, tokens)
    return b


async def until_done(sched: Scheduler, spec: GenSpec) -> tuple[list[TokenEvent], Done]:
    """``spec`` run on the scheduler ``sched``: its token events and its ``Done``."""
    from lloyal.scheduling.scheduler import Done, TokenEvent

    evs: list[TokenEvent] = []
    async for ev in sched.generate(spec):
        if isinstance(ev, Done):
            return evs, ev
        assert isinstance(ev, TokenEvent)
        evs.append(ev)
    raise AssertionError("no Done")


def greedy_completion(
    ctx: lloyal.Context,
    prompt: list[int],
    n: int,
    stop: Iterable[int] = (),
    grammar: lloyal.Grammar | None = None,
) -> list[int]:
    """The greedy continuation of ``prompt`` by the library itself: at most ``n`` tokens, up to
    (without) a stop token or one of ``stop``, under ``grammar`` when given."""
    stops = frozenset(stop)
    with lloyal.Branch.create(ctx, 0, GREEDY, grammar=grammar) as b:
        b.prefill(prompt)
        out: list[int] = []
        for _ in range(n):
            p = b.produce()
            if p.is_stop or p.token in stops:
                break
            out.append(p.token)
            b.commit(p.token)
        return out


def stream_with_usage(create: Callable[..., Any], **request: Any) -> Any:
    """The stream of an OpenAI client's ``completions.create`` or ``chat.completions.create``
    for ``request``, its last chunk carrying the usage."""
    return create(stream=True, stream_options={"include_usage": True}, **request)


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` (an ASGI app) served by uvicorn in a thread on a free loopback port: its base URL.
    Stopped and joined on exit."""
    import uvicorn

    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert t.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    t.join(30)
    assert not t.is_alive()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def person_schema(
    *, max_name: int = 12, max_age: int = 150, cities: list[str] | None = None
) -> dict[str, Any]:
    """A JSON schema for ``{"name": str, "age": int}`` (and ``"city"``, one of ``cities``, when
    given), no other keys."""
    properties: dict[str, Any] = {
        "name": {"type": "string", "maxLength": max_name},
        "age": {"type": "integer", "minimum": 0, "maximum": max_age},
    }
    if cities is not None:
        properties["city"] = {"enum": cities}
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def in_threads(calls: list[Callable[[], object]]) -> tuple[list[threading.Thread], list[BaseException]]:
    """Start one thread per call: the threads, and the list the calls' exceptions go to."""
    errors: list[BaseException] = []

    def guard(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    return threads, errors


def run_in_order(ctx: lloyal.Context, calls: list[Callable[[], object]]) -> list[list[BaseException]]:
    """Pause ``ctx``'s engine, start ``calls`` in threads one by one, each once the one before
    queued its operation (so the queue holds them in this order), resume and join: each call's
    errors."""
    ctx.pause_engine()
    threads: list[threading.Thread] = []
    errors: list[list[BaseException]] = []
    for i, call in enumerate(calls):
        started, errs = in_threads([call])
        threads += started
        errors.append(errs)
        wait_until(lambda i=i: ctx.engine_stats().queue_depth == i + 1)
    ctx.resume_engine()
    for t in threads:
        t.join()
    return errors


def run_queued(
    ctx: lloyal.Context, calls: list[Callable[[], object]], queued: int
) -> tuple[lloyal.EngineStats, lloyal.EngineStats, list[BaseException]]:
    """Pause ``ctx``'s engine, run ``calls`` in threads, wait until they queued ``queued``
    operations, resume and join: the engine stats before and after, and the calls' errors."""
    ctx.pause_engine()
    before = ctx.engine_stats()
    threads, errors = in_threads(calls)
    wait_until(lambda: ctx.engine_stats().queue_depth == queued)
    ctx.resume_engine()
    for t in threads:
        t.join()
    return before, ctx.engine_stats(), errors
