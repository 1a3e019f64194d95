"""examples/chat.py, embed.py, beam_search.py and best_of_n.py --jsonl on the real model."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from helpers import load_example, run_example_jsonl

import lloyal

GREEDY = lloyal.SamplingParams(temperature=0)


def _encode(ctx: lloyal.Context, prompt: str) -> list[int]:
    return ctx.tokenize(prompt, add_special=False, parse_special=True)


def test_chat_prefills_only_the_new_turn(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("chat")
    ctx = make_context(n_ctx=512)
    lines = ["Hi!", "What is 2+2?", "", "/clear", "Name a colour."]
    streamed: list[str] = []
    events = list(example.chat(ctx, lines, max_tokens=3, params=GREEDY, on_text=streamed.append))
    assert [e["event"] for e in events] == ["turn", "turn", "clear", "turn"]
    first, second, _, third = events
    hi, q = {"role": "user", "content": "Hi!"}, {"role": "user", "content": "What is 2+2?"}

    assert first["prefilled"] == len(_encode(ctx, ctx.format_chat([hi]).prompt))
    assert first["position"] == first["prefilled"] + first["reply_tokens"]
    assert 1 <= first["reply_tokens"] <= 3
    # Turn 2 writes the separator and the new turn only, never the history again...
    delta = len(ctx.turn_separator) + len(_encode(ctx, ctx.format_chat_turn(q).prompt))
    assert second["prefilled"] == delta
    assert second["position"] == first["position"] + delta + second["reply_tokens"]
    # ...which is exactly what a cold prefill of the whole conversation would hold.
    history = [hi, {"role": "assistant", "content": first["reply"]}, q]
    cold = _encode(ctx, ctx.format_chat(history).prompt)
    assert len(cold) == first["position"] + delta > second["prefilled"]
    # /clear starts over: the next turn is a first turn again.
    colour = {"role": "user", "content": "Name a colour."}
    assert third["prefilled"] == len(_encode(ctx, ctx.format_chat([colour]).prompt))
    assert third["position"] == third["prefilled"] + third["reply_tokens"]
    assert "".join(streamed) == first["reply"] + second["reply"] + third["reply"]
    assert lloyal.BranchStore(ctx).available == ctx.n_seq_max  # the branch was pruned at the end


def test_chat_session_resets_when_the_context_is_full(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("chat")
    ctx = make_context(n_ctx=256)  # the smallest context llama.cpp makes
    session = example.ChatSession(ctx, params=GREEDY, max_tokens=2)
    text = "Tell me a long story about a dragon, a knight and a castle by the sea, please. " * 4
    turns = [session.send(text) for _ in range(3)]
    assert not turns[0].reset
    reset = next(t for t in turns[1:] if t.reset)  # ~110 tokens a turn: three do not fit in 256
    assert reset.position == reset.prefilled + reset.reply_tokens  # a fresh conversation
    assert all(t.position <= ctx.n_ctx for t in turns)
    session.clear()
    assert session.branch is None


def test_chat_cli_jsonl_reads_stdin() -> None:
    events = run_example_jsonl("chat", "--max-tokens", "4", stdin="Hi!\nWhat is 2+2?\n")
    assert [e["event"] for e in events] == ["turn", "turn"]
    first, second = events
    assert (first["user"], second["user"]) == ("Hi!", "What is 2+2?")
    assert all(isinstance(e["reply"], str) and 1 <= e["reply_tokens"] <= 4 for e in events)
    assert second["position"] == first["position"] + second["prefilled"] + second["reply_tokens"]
    assert 0 < second["prefilled"] < second["position"] - second["reply_tokens"]  # not the history


def test_embed_matrix_and_neighbours(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("embed")
    ctx = make_context(n_ctx=1024, n_seq_max=4, embeddings=True)
    sentences, queries = list(example.SENTENCES), list(example.QUERIES)
    matrix, found = example.neighbours(ctx, sentences, queries)
    n = len(sentences)
    assert matrix.shape == (n, n)
    assert np.allclose(matrix, matrix.T, atol=1e-5)
    assert np.allclose(np.diag(matrix), 1.0, atol=1e-4)
    assert np.allclose(example.similarity_matrix(ctx, sentences), matrix, atol=1e-5)
    assert len(found) == n + len(queries)
    for i, nb in enumerate(found[:n]):
        assert not nb.query and nb.index == i ^ 1, f"{nb.text!r} should pair with {sentences[i ^ 1]!r}"
        assert nb.similarity == float(matrix[i, nb.index])
    assert [(nb.query, nb.index) for nb in found[n:]] == [(True, 0), (True, 3)]  # cat, investors


def test_beam_search_cli_jsonl() -> None:
    events = run_example_jsonl("beam_search", "--width", "2", "--max-tokens", "3")
    assert [e["event"] for e in events] == ["result", "result", "summary"]
    assert [e["method"] for e in events[:2]] == ["greedy", "beam"]
    for e in events[:2]:
        assert 1 <= e["tokens"] <= 3 and e["perplexity"] >= 1.0 and e["score"] <= 0
    summary = events[2]
    assert summary["width"] == 2
    assert summary["greedy_perplexity"] == events[0]["perplexity"]
    assert summary["beam_not_worse"] == (events[1]["perplexity"] <= events[0]["perplexity"])


def test_beam_search_compare(make_context: Callable[..., lloyal.Context]) -> None:
    example = load_example("beam_search")
    ctx = make_context(n_ctx=512, n_seq_max=2)
    base, beam = example.compare(ctx, "The capital of France is", 1, 4)
    assert (base.method, beam.method) == ("greedy", "beam")
    assert beam.text == base.text  # width 1 is greedy
    assert abs(beam.perplexity - base.perplexity) < 1e-4
    assert lloyal.BranchStore(ctx).available == 2


def test_best_of_n_cli_jsonl_defaults() -> None:
    events = run_example_jsonl("best_of_n", "-n", "2", "--max-tokens", "3")
    assert [e["event"] for e in events] == ["candidate", "candidate", "summary"]
    winners = [e["index"] for e in events[:2] if e["winner"]]
    assert winners == [events[2]["winner"]]
    assert events[2]["text"] == events[winners[0]]["text"]
    assert events[2]["prompt"]  # the default prompt was used
