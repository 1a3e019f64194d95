"""Progress bars for long work: first-use model assembly (``lloyal.default_model_path``) and long prefills.

A small hand-written bar (no dependency). It draws on ``stream`` (stderr by default) only when that
stream is a terminal, so pipes, files and ``--jsonl`` consumers never see it.

Example:
    >>> import io
    >>> with Progress(3, "steps", stream=io.StringIO()) as bar:  # not a TTY: draws nothing
    ...     bar.update()
    >>> bar.done
    1
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TextIO

from lloyal._lloyal import Branch

__all__ = ["Progress", "mib", "prefill"]

_MIB = 1024 * 1024


def _is_tty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except (OSError, ValueError):  # a closed or detached stream
        return False


def mib(n: int) -> str:
    """``n`` bytes as MiB with one decimal (the bar's count format for byte totals)."""
    return f"{n / _MIB:.1f}"


class Progress:
    """A one-line ``label [#####.....] done/total unit  pct  rate`` bar redrawn with ``\\r``.

    Drawn only when ``stream`` is a TTY (``enabled``); otherwise every method only counts.
    ``leave=False`` erases the line when closed (for a bar that precedes streamed text).
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        stream: TextIO | None = None,
        unit: str = "",
        fmt: Callable[[int], str] = str,
        leave: bool = True,
        width: int = 30,
        min_interval: float = 0.05,
    ) -> None:
        self.total = max(int(total), 0)
        self.label = label
        self.stream: TextIO = sys.stderr if stream is None else stream
        self.enabled = _is_tty(self.stream)
        self.unit = unit
        self.fmt = fmt
        self.leave = leave
        self.width = width
        self.min_interval = min_interval
        self.done = 0
        self.note = ""
        self.closed = False
        self._start = time.perf_counter()
        self._last_draw = 0.0
        self._draw(force=True)

    def update(self, n: int = 1, note: str | None = None) -> None:
        """Advance by ``n``; ``note`` replaces the text shown after the rate."""
        self.set(self.done + n, note)

    def set(self, done: int, note: str | None = None) -> None:
        """Jump to ``done`` (clamped to ``total``)."""
        self.done = min(max(done, 0), self.total) if self.total else max(done, 0)
        if note is not None:
            self.note = note
        self._draw(force=self.done == self.total)

    def close(self) -> None:
        """Draw the final state and end the line (or erase it when ``leave`` is false). Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.enabled:
            return
        if self.leave:
            self._draw(force=True)
            self.stream.write("\n")
        else:
            self.stream.write("\r\x1b[K")
        self.stream.flush()

    def render(self) -> str:
        """The bar's current line (without the leading ``\\r``)."""
        frac = self.done / self.total if self.total else 1.0
        filled = int(self.width * frac)
        bar = "#" * filled + "." * (self.width - filled)
        unit = f" {self.unit}" if self.unit else ""
        elapsed = time.perf_counter() - self._start
        rate = f"  {self.fmt(int(self.done / elapsed))}{unit}/s" if elapsed > 0 and self.done else ""
        note = f"  {self.note}" if self.note else ""
        head = f"{self.label} " if self.label else ""
        return (
            f"{head}[{bar}] {self.fmt(self.done)}/{self.fmt(self.total)}{unit} {100 * frac:3.0f}%{rate}{note}"
        )

    def _draw(self, *, force: bool = False) -> None:
        if not self.enabled or self.closed:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < self.min_interval:
            return
        self._last_draw = now
        self.stream.write("\r" + self.render() + "\x1b[K")
        self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def prefill(
    branch: Branch, tokens: Sequence[int], *, stream: TextIO | None = None, label: str = "prefill"
) -> None:
    """``branch.prefill(tokens)`` in ``n_batch`` chunks, with a bar when the prompt spans several chunks.

    The result is the same as one ``prefill`` call: the native call chunks by ``n_batch`` too, and
    default contexts are batch-invariant.
    """
    toks = list(tokens)
    step = branch.context.n_batch
    if len(toks) <= step:
        branch.prefill(toks)
        return
    with Progress(len(toks), label, stream=stream, unit="tokens", leave=False) as bar:
        for i in range(0, len(toks), step):
            chunk = toks[i : i + step]
            branch.prefill(chunk)
            bar.update(len(chunk))
