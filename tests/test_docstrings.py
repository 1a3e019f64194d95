"""One source per docstring: every docstring in the stub ``_lloyal.pyi`` (what IDEs show) equals
the runtime one from the Rust ``///`` comments (what ``help()`` shows), and every example in the
native module's docstrings runs on the real model."""

from __future__ import annotations

import ast
import doctest
import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest

import lloyal
from lloyal import _lloyal as native

STUB = Path(lloyal.__file__).with_name("_lloyal.pyi")


def stub_entries() -> Iterator[tuple[str, ast.FunctionDef | ast.ClassDef]]:
    """``(qualified name, node)`` for each function, class and class member in the stub."""
    for node in ast.parse(STUB.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, ast.FunctionDef):
                        yield f"{node.name}.{member.name}", member


def is_dunder(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return last.startswith("__") and last.endswith("__")


# Dunders the stub leaves undocumented keep Python's own slot text (``Implement iter(self).``).
ENTRIES = [
    (name, node) for name, node in stub_entries() if not (is_dunder(name) and ast.get_docstring(node) is None)
]


def runtime_object(name: str) -> object:
    obj: object = native
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_stub_covers_the_documented_api() -> None:
    names = {name for name, _ in ENTRIES}
    assert len(names) >= 140, f"expected the whole stub, found {len(names)} entries"
    assert {"Context.format_chat", "Branch.fork", "BranchStore.commit", "KvPressure.remaining"} <= names


@pytest.mark.parametrize(("name", "node"), ENTRIES, ids=[name for name, _ in ENTRIES])
def test_stub_docstring_equals_runtime(name: str, node: ast.FunctionDef | ast.ClassDef) -> None:
    stub_doc = ast.get_docstring(node, clean=True)
    runtime_doc = inspect.getdoc(runtime_object(name))
    assert stub_doc is not None, f"{name} has no docstring in _lloyal.pyi (copy its Rust /// text)"
    assert stub_doc == runtime_doc, (
        f"{name}: the stub's docstring differs from the Rust /// text; write it once in Rust and "
        "copy it verbatim into python/lloyal/_lloyal.pyi"
    )


NATIVE_EXAMPLES = [t for t in doctest.DocTestFinder().find(native) if t.examples]


def test_native_examples_found() -> None:
    names = {t.name.removeprefix("lloyal._lloyal.") for t in NATIVE_EXAMPLES}
    assert {"Model", "Context", "Branch", "Grammar", "Branch.reseed"} <= names


@pytest.mark.parametrize("test", NATIVE_EXAMPLES, ids=[t.name for t in NATIVE_EXAMPLES])
def test_native_example_runs(test: doctest.DocTest, model: lloyal.Model) -> None:
    """Runs the example with ``lloyal``'s names plus ``ctx`` (a context whose seq 1 holds a flat
    decode of ``tokens``) and ``branch`` (a greedy branch prefilled with ``tokens``)."""
    with lloyal.Context(model, n_ctx=512, n_seq_max=2) as ctx:
        tokens = ctx.tokenize("The quick brown fox jumps over the lazy dog")
        branch = lloyal.Branch.create(ctx, 0, lloyal.SamplingParams(temperature=0))
        branch.prefill(tokens)
        ctx.decode(tokens, 0, seq_id=1)
        test.globs = {**vars(lloyal), "ctx": ctx, "branch": branch, "tokens": tokens}
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
        result = runner.run(test, out=lambda text: pytest.fail(text, pytrace=False))
        assert result.attempted == len(test.examples) and result.failed == 0
