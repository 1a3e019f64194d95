"""lloyal on Ray: prefix-affinity routing, Serve replicas through the openai client (affinity,
streaming, a killed replica), and batch generation on Ray Data — on one local cluster
(127.0.0.1, 2 CPUs) shared by the module."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import lloyal

ray = pytest.importorskip("ray", reason="the ray extra: pip install 'lloyal[ray]'")
openai = pytest.importorskip("openai", reason="the server extra: pip install 'lloyal[server]'")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")

from lloyal.ray.routing import HashRing, prefix_key  # noqa: E402

MAX_TOKENS = 4

# Ray Data 2.60 sets its own deprecated DataContext attributes when it copies the context to a
# worker, and swaps its per-dataset log file handler without closing the old file (a garbage
# collection in the middle of a test reports it, now and then); nothing lloyal can change.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.data.context"),
    pytest.mark.filterwarnings(r"ignore:unclosed file <_io.TextIOWrapper name='/tmp/ray/:ResourceWarning"),
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <_io.FileIO name='/tmp/ray/:pytest.PytestUnraisableExceptionWarning"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- routing (pure) ---------------------------------------------------------------------------


def test_prefix_key_is_the_system_prompt_or_opening_turn_of_a_chat() -> None:
    sys_a = {"role": "system", "content": "You are a pirate."}
    k1 = prefix_key("/v1/chat/completions", {"messages": [sys_a, {"role": "user", "content": "hi"}]})
    k2 = prefix_key("/v1/chat/completions", {"messages": [sys_a, {"role": "user", "content": "bye"}]})
    k3 = prefix_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."}]})
    assert k1 == k2 != k3
    assert prefix_key("/v1/completions", {"prompt": "Once upon a time"}) == "Once upon a time"
    assert prefix_key("/v1/completions", {"prompt": [[1, 2, 3]]}) == "[1, 2, 3]"
    assert prefix_key("/v1/models", None) is None
    assert prefix_key("/v1/chat/completions", {"messages": []}) is None


def test_hash_ring_is_stable_and_moves_only_the_lost_replicas_keys() -> None:
    keys = [f"system prompt {i}" for i in range(300)]
    three = HashRing(["r0", "r1", "r2"])
    owners = {k: three.choose(k, {}, overload=4) for k in keys}
    assert set(owners.values()) == {"r0", "r1", "r2"}
    assert owners == {k: HashRing(["r0", "r1", "r2"]).choose(k, {}, overload=4) for k in keys}
    # r2 down: its keys move, nobody else's does.
    for k, owner in owners.items():
        now = three.choose(k, {}, overload=4, down={"r2"})
        assert now == owner if owner != "r2" else now in ("r0", "r1")


def test_hash_ring_spills_an_overloaded_owner_to_the_next_replica() -> None:
    ring = HashRing(["r0", "r1", "r2"])
    key = "the same system prompt"
    order = ring.order(key)
    assert sorted(order) == ["r0", "r1", "r2"]
    assert ring.choose(key, {order[0]: 3}, overload=4) == order[0]
    assert ring.choose(key, {order[0]: 4}, overload=4) == order[1]
    busy = dict.fromkeys(order, 9)
    busy[order[2]] = 5
    assert ring.choose(key, busy, overload=4) == order[2]  # none fits: the least loaded
    assert ring.choose(None, {"r0": 2, "r1": 1, "r2": 2}, overload=4) == "r1"
    with pytest.raises(ValueError, match="at least one replica"):
        HashRing([])


# -- the cluster ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        yield
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def served(cluster: None, model_path: str) -> Iterator[str]:
    from lloyal.ray import serve_app

    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = serve_app(
        model_path,
        replicas=2,
        ray_actor_options={"num_cpus": 0},
        n_ctx=512,
        parallel=2,
        n_threads=1,
        batch_invariant=True,  # a replacement replica answers with the same greedy tokens
    )
    serve.run(app, name="lloyal", route_prefix="/")
    yield f"http://127.0.0.1:{port}/v1"
    serve.delete("lloyal")


@pytest.fixture(scope="module")
def client(served: str) -> Any:
    return openai.OpenAI(base_url=served, api_key="unused", timeout=120, max_retries=0)


def _chat(client: Any, system: str, user: str) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    reply = raw.parse()
    assert 1 <= reply.usage.completion_tokens <= MAX_TOKENS
    return raw.headers["x-lloyal-replica"], reply.choices[0].message.content


def test_same_prefix_lands_on_one_replica_different_prefixes_use_both(client: Any) -> None:
    systems = [f"You are assistant number {i}." for i in range(8)]
    ring = HashRing(["lloyal-0", "lloyal-1"])
    expected = {s: ring.choose(prefix_key("/v1/chat/completions", _body(s)), {}, overload=4) for s in systems}
    assert set(expected.values()) == {"lloyal-0", "lloyal-1"}  # both replicas own some prefixes
    for s in systems[:4]:
        landed = {_chat(client, s, f"question {q}")[0] for q in range(3)}
        assert landed == {expected[s]}


def _body(system: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "x"}]}


def test_streaming_and_errors_pass_through_the_router(client: Any) -> None:
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks)  # some text arrived
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)


def test_requests_succeed_while_a_killed_replica_is_replaced(client: Any) -> None:
    system = "You are the assistant whose replica dies."
    owner, before = _chat(client, system, "hello")
    prefix = f"SERVE_REPLICA::lloyal#{owner}#"

    def replicas() -> set[str]:
        actors = ray.util.list_named_actors(all_namespaces=True)
        return {a["name"] for a in actors if a["name"].startswith(prefix)}

    (victim,) = replicas()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    t0 = time.monotonic()
    while victim in replicas() and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    # Right after the kill: the router fails over to the other replica, or Serve has already
    # started the replacement; either way the request succeeds with the same greedy answer.
    for _ in range(3):
        landed, after = _chat(client, system, "hello")
        assert landed in ("lloyal-0", "lloyal-1")
        assert after == before
    while not (replicas() - {victim}) and time.monotonic() - t0 < 60:
        time.sleep(0.2)
    assert replicas() and victim not in replicas()  # Ray Serve started a new replica
    # The router skips the failed replica for DOWN_FOR_S, then the prefix goes home again.
    assert _chat(client, system, "hello")[1] == before


def test_preflights_big_bodies_and_the_servers_pages_pass_through_the_router(served: str) -> None:
    """Every method and path reaches an engine: a browser's CORS preflight is answered as
    ``lloyal serve`` answers it, a body over the server's limit gets its 413 (the router sends
    the body's length on), and ``/openapi.json`` is the server's, not the router's."""
    base = served.removesuffix("/v1")
    pre = httpx.options(
        served + "/chat/completions",
        headers={"origin": "http://example.com", "access-control-request-method": "POST"},
    )
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    big = httpx.post(
        served + "/completions", content=b"x" * ((8 << 20) + 1), headers={"content-type": "application/json"}
    )
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    doc = httpx.get(base + "/openapi.json")
    assert doc.status_code == 200 and "/v1/chat/completions" in doc.json()["paths"]
    assert doc.headers["x-lloyal-replica"] in ("lloyal-0", "lloyal-1")


def test_an_engine_whose_model_cannot_load_fails_the_deployment_with_the_reason(cluster: None) -> None:
    from lloyal.ray.serve import app_from_config
    from lloyal.server import ServerConfig

    app = app_from_config(ServerConfig(model=Path("/no/such/model.gguf"), n_ctx=256), 1)
    with pytest.raises(RuntimeError, match="Deploying application broken failed"):
        serve.run(app, name="broken", route_prefix="/broken")
    engine = serve.status().applications["broken"].deployments["lloyal-0"]
    assert "cannot load model" in engine.message and "/no/such/model.gguf" in engine.message
    serve.delete("broken")


# -- Ray Data ---------------------------------------------------------------------------------


def test_generate_best_of_four_over_fifty_prompts(cluster: None, model_path: str) -> None:
    from lloyal.ray import generate

    rows = [{"id": i, "prompt": f"Fact number {i}:"} for i in range(50)]
    out = generate(
        rows, model_path, n=1, best_of=4, max_tokens=MAX_TOKENS, n_ctx=512, n_threads=1, batch_size=25
    ).take_all()
    assert sorted(r["id"] for r in out) == list(range(50))
    for r in out:
        assert r["error"] is None
        assert len(r["completions"]) == 1 and isinstance(r["completions"][0], str)
        assert 1 <= r["completion_tokens"][0] <= MAX_TOKENS
        assert r["perplexities"][0] >= 1.0


def test_generate_bad_rows_get_an_error_and_greedy_equals_one_process(cluster: None, model_path: str) -> None:
    from lloyal.ray import generate

    prompts = ["The capital of France is", "Two plus two equals", "word " * 700, "Water is"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    # Grammar specs as JSON text: Arrow stores a column of differently shaped dicts badly.
    rows = [{"prompt": p, "schema": json.dumps(schema)} for p in prompts]
    rows.append({"prompt": "Hi", "schema": '{"type": 7}'})
    out = generate(
        rows, model_path, max_tokens=6, n_ctx=512, n_threads=1, grammar_column="schema", batch_size=8
    ).take_all()
    by_prompt = {r["prompt"]: r for r in out}
    assert "needs" in by_prompt["word " * 700]["error"] and by_prompt["word " * 700]["completions"] == []
    assert by_prompt["Hi"]["error"].startswith("GrammarError")
    plain = generate(
        [{"prompt": p} for p in prompts if len(p) < 100],
        model_path,
        max_tokens=6,
        n_ctx=512,
        n_threads=1,
        batch_invariant=True,  # batched rows equal one prompt at a time
    ).take_all()
    with lloyal.Context(model_path, n_ctx=512, n_threads=1, batch_invariant=True) as ctx:
        for r in plain:
            b = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
            b.prefill(ctx.tokenize(r["prompt"]))
            ids = [t.token for t in b.generate(6)]
            b.prune()
            assert r["error"] is None
            assert r["completions"] == [ctx.detokenize(ids)]
            assert r["completion_tokens"] == [len(ids)]
    for p in prompts:
        if len(p) < 100:
            assert by_prompt[p]["error"] is None
            assert by_prompt[p]["completions"][0].lstrip().startswith("{")


def test_generate_reads_jsonl_and_refuses_bad_arguments(
    cluster: None, model_path: str, tmp_path: Path
) -> None:
    from lloyal.ray import generate

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "Hello"}\n{"prompt": "Goodbye"}\n')
    out = generate(str(path), model_path, max_tokens=2, n_ctx=256, n_threads=1).take_all()
    assert sorted(r["prompt"] for r in out) == ["Goodbye", "Hello"]
    assert all(r["error"] is None and r["completion_tokens"][0] >= 1 for r in out)
    with pytest.raises(ValueError, match="n <= best_of"):
        generate([{"prompt": "x"}], model_path, n=3, best_of=2)
    with pytest.raises(ValueError, match=r"\.parquet"):
        generate("prompts.csv", model_path)


def _our_processes(title: str) -> set[int]:
    """Pids of this cluster's processes whose title starts with ``title`` (descendants of our raylet)."""
    node = ray._private.worker._global_node
    raylet = {p.process.pid for p in node.all_processes["raylet"]}
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if not (entry / "cmdline").read_bytes().startswith(title.encode()):
                continue
            pid = int(entry.name)
            while pid > 1 and pid not in raylet:
                stat = (Path("/proc") / str(pid) / "stat").read_text()
                pid = int(stat.rsplit(")", 1)[1].split()[1])
            if pid in raylet:
                found.add(int(entry.name))
        except (OSError, ValueError):
            continue
    return found


def test_generate_survives_a_killed_actor(cluster: None, model_path: str) -> None:
    from lloyal.ray import generate

    title = "ray::MapWorker(MapBatches(RowGenerator))"
    before = _our_processes(title)
    rows = [{"id": i, "prompt": f"Story {i}:"} for i in range(8)]
    ds = generate(rows, model_path, max_tokens=16, n_ctx=512, n_threads=1, batch_size=4, rows_at_once=4)
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.extend(ds.take_all()))
    worker.start()
    t0 = time.monotonic()
    while not (_our_processes(title) - before) and time.monotonic() - t0 < 60:
        time.sleep(0.05)
    (victim,) = _our_processes(title) - before
    time.sleep(1.0)  # the actor has loaded the model and taken a batch
    os.kill(victim, signal.SIGKILL)
    worker.join(timeout=120)
    assert not worker.is_alive()
    assert sorted(r["id"] for r in result) == list(range(8))
    assert all(r["error"] is None and 1 <= r["completion_tokens"][0] <= 16 for r in result)


def test_cli_serve_ray_refuses_zero_replicas(capsys: pytest.CaptureFixture[str]) -> None:
    from lloyal.cli import main

    assert main(["serve", "--ray", "--replicas", "0"]) == 1
    assert capsys.readouterr().err == "lloyal: error: --replicas must be >= 1\n"


def _row_generator(model_path: str, *, n_ctx: int = 512, **overrides: Any) -> Any:
    """The actor behind ``generate``, in process: greedy single candidates of ``MAX_TOKENS``
    tokens, four rows at once, unless ``overrides`` say otherwise."""
    from lloyal.ray.data import RowGenerator

    args: dict[str, Any] = {
        "prompt_column": "prompt",
        "n": 1,
        "best_of": 1,
        "sampling": lloyal.SamplingParams(temperature=0.0),
        "grammar": None,
        "grammar_column": None,
        "max_tokens": MAX_TOKENS,
        "seed": 1,
        "rows_at_once": 4,
    }
    return RowGenerator(
        model=model_path, context_options={"n_ctx": n_ctx, "n_threads": 1}, **(args | overrides)
    )


def test_row_generator_runs_rows_on_the_scheduler_sharing_a_prefix_and_ranking(model_path: str) -> None:
    """The actor behind ``generate``, in process: its rows are the server's generation requests
    (the same best_of and admission), so rows that share a long prompt prefix prefill it once,
    and each row's completions come best first with their perplexities."""
    import numpy as np

    gen = _row_generator(
        model_path, n=3, best_of=3, sampling=lloyal.SamplingParams(temperature=0.8), seed=7, n_ctx=2048
    )
    system = "A long shared instruction about colours, shapes and numbers. " * 20
    prompts = [system + q for q in ("Name a colour.", "Name a shape.", "Name a number.")]
    toks = [gen.ctx.tokenize(p) for p in prompts]
    rows0 = gen.ctx.engine_stats().rows
    out = gen({"prompt": np.array(prompts, dtype=object)})
    for i in range(3):
        assert out["error"][i] is None and len(out["completions"][i]) == 3
        ppl = out["perplexities"][i]
        assert ppl == sorted(ppl) and all(p >= 1.0 for p in ppl)
        assert all(1 <= t <= MAX_TOKENS for t in out["completion_tokens"][i])
    generated = sum(t for i in range(3) for t in out["completion_tokens"][i])
    # the first row wrote the shared part; the others forked it and wrote their own tails
    common = [next(k for k, (x, y) in enumerate(zip(toks[0], t, strict=False)) if x != y) for t in toks[1:]]
    tails = sum(len(t) - c for t, c in zip(toks[1:], common, strict=True))
    assert gen.ctx.engine_stats().rows - rows0 == len(toks[0]) + tails + generated
    assert lloyal.BranchStore(gen.ctx).kv_pressure.cells_used == 0  # nothing kept after the batch
    gen.ctx.close()  # its engine thread ends now, not when the garbage collector gets to it


def test_a_row_with_a_missing_prompt_or_a_malformed_grammar_fails_alone(model_path: str) -> None:
    """A null or NaN prompt (a Parquet/pandas gap), a number, or a grammar spec of the wrong type
    gives that row an ``error``; the batch's other rows complete (nothing raised)."""
    import numpy as np

    gen = _row_generator(model_path, grammar_column="grammar", max_tokens=2)
    prompts = [None, float("nan"), 7, "Water is", "Fire is"]
    grammars = [None, None, None, {"regex": 5}, None]
    out = gen({"prompt": np.array(prompts, dtype=object), "grammar": np.array(grammars, dtype=object)})
    errors = list(out["error"])
    assert (
        errors[0]
        == errors[1]
        == "ValueError: the prompt must be text or a list of token ids, got null (a missing value)"
    )
    assert errors[2] == "ValueError: the prompt must be text or a list of token ids, got int"
    assert errors[3] is not None and errors[3].startswith("TypeError")
    assert errors[4] is None and out["completion_tokens"][4] == [2]
    assert lloyal.BranchStore(gen.ctx).kv_pressure.cells_used == 0
    gen.ctx.close()


def test_serve_limits_sit_above_what_lloyal_runs_and_queues(model_path: str) -> None:
    """Serve's max_ongoing_requests (its default, 5, held the sixth request in the proxy
    whatever --parallel): each engine takes parallel + max_queue and a few more, the router
    that for every engine; and best_of beyond a context's sequences is refused up front."""
    from lloyal.ray import generate
    from lloyal.ray.serve import SPARE_ONGOING, UNBOUNDED_QUEUE, ongoing_limits
    from lloyal.server import ServerConfig

    assert ongoing_limits(ServerConfig(model=model_path, parallel=8, max_queue=512), 3) == (
        8 + 512 + SPARE_ONGOING,
        3 * (8 + 512 + SPARE_ONGOING),
    )
    unbounded = ongoing_limits(ServerConfig(model=model_path, parallel=2, max_queue=None), 1)
    assert unbounded[0] == 2 + UNBOUNDED_QUEUE + SPARE_ONGOING
    # the deployments carry them, and a stopped engine's grace is --shutdown-grace
    from lloyal.ray.serve import app_from_config

    app = app_from_config(ServerConfig(model=model_path, parallel=3, max_queue=10, shutdown_grace=7.0), 2)
    router = app._bound_deployment
    engines = [a._bound_deployment for a in router.init_args[2:]]
    assert router.max_ongoing_requests == 2 * (3 + 10 + SPARE_ONGOING)
    assert [e.max_ongoing_requests for e in engines] == [3 + 10 + SPARE_ONGOING] * 2
    assert [e._deployment_config.graceful_shutdown_timeout_s for e in engines] == [7.0, 7.0]
    with pytest.raises(ValueError, match="best_of <= 255"):
        generate([{"prompt": "x"}], model_path, n=1, best_of=256)
