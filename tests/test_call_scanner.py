"""The server's reader of a forced ``"required"`` reply (``lloyal.server.call_scanner``): fed a
reply in any pieces, it reports each call's name once and arguments that join to the raw text of
the call's ``parameters`` value, the same as the whole reply's ``required_calls``."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="the server extra: pip install 'lloyal[server]'")
from hypothesis import given, settings
from hypothesis import strategies as st

from lloyal.server.call_scanner import CallScanner, required_calls

REPLY = (
    '[ {"name": "get_weather", "parameters": {"city": "Pa\\"r{is}", "unit": "celsius"}},\n'
    ' {"name": "get_time", "parameters": {}} ,{"name":"nest","parameters":{"a":[1,{"b":"]"}],"c":null}}]'
)
WANT = [
    ("get_weather", '{"city": "Pa\\"r{is}", "unit": "celsius"}'),
    ("get_time", "{}"),
    ("nest", '{"a":[1,{"b":"]"}],"c":null}'),
]


def streamed(pieces: list[str]) -> tuple[list[tuple[str, str]], list[list[tuple[int, str | None, str]]]]:
    """The calls a scanner reports over ``pieces``, joined, and what each feed reported."""
    s = CallScanner()
    reports = [s.feed(p) for p in pieces]
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for report in reports:
        for index, name, arguments in report:
            if name is not None:
                assert index not in names, "a name is reported once"
                names[index] = name
            assert index in names, "arguments come after the call's name"
            args[index] = args.get(index, "") + arguments
    return [(names[i], args[i]) for i in sorted(names)], reports


def test_a_whole_reply_gives_each_call_its_raw_parameters() -> None:
    assert required_calls(REPLY) == WANT
    for name, arguments in WANT:
        assert isinstance(json.loads(arguments), dict), name


def test_character_by_character_the_arguments_grow_as_they_are_written() -> None:
    calls, reports = streamed(list(REPLY))
    assert calls == WANT
    weather = [a for r in reports for i, _, a in r if i == 0]
    assert len(weather) > 10 and all(len(a) <= 1 for a in weather[1:])
    assert not any(r for r in reports[: REPLY.index("get_weather") + len("get_weather")])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(REPLY)), max_size=12))
def test_any_split_of_the_reply_gives_the_same_calls(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(REPLY)]
    calls, _ = streamed([REPLY[a:b] for a, b in itertools.pairwise(bounds)])
    assert calls == WANT


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.text(min_size=1, max_size=8), JSON), min_size=1, max_size=3),
    st.sampled_from([None, 0, 2]),
    st.integers(min_value=1, max_value=7),
)
def test_any_calls_and_any_formatting_read_back(
    calls: list[tuple[str, Any]], indent: int | None, piece: int
) -> None:
    reply = json.dumps([{"name": n, "parameters": p} for n, p in calls], indent=indent)
    got, _ = streamed([reply[i : i + piece] for i in range(0, len(reply), piece)])
    assert [(n, json.loads(a)) for n, a in got] == calls
    assert required_calls(reply) == got


def test_a_reply_cut_short_reports_what_was_written_and_parses_to_none() -> None:
    cut = REPLY[: REPLY.index("unit")]
    calls, _ = streamed([cut])
    assert calls == [("get_weather", '{"city": "Pa\\"r{is}", "')]
    assert required_calls(cut) is None
    assert required_calls('{"name": "f"}') is None  # not an array of calls
