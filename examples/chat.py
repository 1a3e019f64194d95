"""Streaming chat with warm continuation: one branch lives across turns, only new tokens are prefilled.

API: ``Context.format_chat`` (the first turn, with BOS), ``Context.format_chat_turn`` +
``Context.turn_separator`` (every later turn), ``Branch.prefill``, ``Branch.produce``/``commit``
and ``Context.text_stream`` (UTF-8-safe streaming). The conversation's KV cells stay in the
branch, so turn N costs only its own tokens, never a re-prefill of the history; the result is
token for token what a cold ``format_chat`` of the whole conversation would give. A reply ends
at the turn's stop tokens or after ``--max-tokens`` (the default model is the *base* Gemma 3
270M, which rarely ends a turn by itself). ``/clear`` prunes the branch and starts over.

Run:
    python examples/chat.py                      # interactive; type /clear to reset, Ctrl-D to quit
    printf 'Hi!\\nWhat is 2+2?\\n' | python examples/chat.py --max-tokens 24
    python examples/chat.py --jsonl --model path/to/model.gguf < questions.txt

``--jsonl`` prints only ``{"event": "turn", "user", "reply", "prefilled", "position"}`` lines
(``prefilled``: tokens written for this turn; ``position``: the branch's next position),
``{"event": "clear", ...}`` after ``/clear`` and ``{"event": "reset", ...}`` when the context
fills up.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from _args import example_parser, run

import lloyal


@dataclass(frozen=True)
class Turn:
    """One exchange: what was prefilled for it and what the model replied."""

    user: str
    reply: str
    reply_tokens: int
    prefilled: int
    position: int
    reset: bool = False


class ChatSession:
    """A conversation held in one live branch (warm continuation across turns).

    Example:
        >>> with lloyal.create_context(n_ctx=1024) as ctx:  # doctest: +SKIP
        ...     chat = ChatSession(ctx, max_tokens=16)
        ...     print(chat.send("Hi!").reply)
    """

    def __init__(
        self,
        ctx: lloyal.Context,
        *,
        params: lloyal.SamplingParams | None = None,
        max_tokens: int = 64,
        system: str | None = None,
    ) -> None:
        self.ctx = ctx
        self.params = params if params is not None else lloyal.SamplingParams(temperature=0.7, seed=1)
        self.max_tokens = max_tokens
        self.system = system
        self.branch: lloyal.Branch | None = None

    def clear(self) -> None:
        """Forget the conversation: prune the branch (its KV cells and lease are freed)."""
        if self.branch is not None:
            self.branch.prune()
            self.branch = None

    def _turn_tokens(self, text: str) -> tuple[list[int], tuple[int, ...]]:
        """Tokens to prefill for a new user turn, and the turn's stop tokens."""
        message = {"role": "user", "content": text}
        if self.branch is None:  # first turn: the whole (short) conversation, BOS included
            messages = [{"role": "system", "content": self.system}] if self.system else []
            chat = self.ctx.format_chat([*messages, message])
            return self.ctx.tokenize(chat.prompt, add_special=False, parse_special=True), chat.stop_tokens
        # Later turns: close the previous reply, then only the new turn's markers and text.
        turn = self.ctx.format_chat_turn(message)
        new = self.ctx.tokenize(turn.prompt, add_special=False, parse_special=True)
        return [*self.ctx.turn_separator, *new], turn.stop_tokens

    def send(self, text: str, on_text: Callable[[str], None] | None = None) -> Turn:
        """Prefill the new turn, generate the reply and stream its text to ``on_text``.

        If the turn would not fit in the context (history + turn + ``max_tokens``), the
        conversation is cleared first and the turn starts a new one.
        """
        tokens, stop = self._turn_tokens(text)
        room = self.ctx.n_ctx - self.max_tokens - len(tokens)
        reset = self.branch is not None and self.branch.position > room
        if reset:
            self.clear()
            tokens, stop = self._turn_tokens(text)
        if self.branch is None:
            self.branch = lloyal.Branch.create(self.ctx, 0, self.params)
        branch = self.branch
        branch.prefill(tokens)
        stream = self.ctx.text_stream()
        pieces: list[str] = []
        n = 0
        while n < self.max_tokens:
            p = branch.produce()
            if p.is_stop or p.token in stop:  # the stop token is not written: the next turn closes it
                break
            branch.commit(p.token)
            n += 1
            piece = stream.push(p.token)
            if piece:
                pieces.append(piece)
                if on_text is not None:
                    on_text(piece)
        tail = stream.flush()
        if tail:
            pieces.append(tail)
            if on_text is not None:
                on_text(tail)
        return Turn(text, "".join(pieces), n, len(tokens), branch.position, reset)


def chat(
    ctx: lloyal.Context,
    lines: Iterable[str],
    *,
    max_tokens: int = 64,
    params: lloyal.SamplingParams | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Run a conversation over ``lines`` (user turns or ``/clear``); yield one event per line.

    Events: ``{"event": "turn", "user", "reply", "prefilled", "position", "reply_tokens"}``,
    ``{"event": "clear"}`` and ``{"event": "reset", "reason"}`` (context full). Blank lines are
    skipped. The branch is pruned when the lines run out.
    """
    session = ChatSession(ctx, params=params, max_tokens=max_tokens)
    try:
        for raw in lines:
            line = raw.strip()
            if not line:
                continue
            if line == "/clear":
                session.clear()
                yield {"event": "clear"}
                continue
            turn = session.send(line, on_text)
            if turn.reset:
                yield {"event": "reset", "reason": "context full: the conversation was cleared"}
            yield {
                "event": "turn",
                "user": turn.user,
                "reply": turn.reply,
                "prefilled": turn.prefilled,
                "position": turn.position,
                "reply_tokens": turn.reply_tokens,
            }
    finally:
        session.clear()


def _interactive_lines() -> Iterator[str]:
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return
        if line.strip() and line.strip() != "/clear":
            sys.stdout.write("model> ")
        yield line


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    parser = example_parser(
        __doc__,
        jsonl_help="one JSON event per line, nothing else",
        max_tokens=64,
        max_tokens_help="most tokens per reply",
    )
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--n-ctx", type=int, default=2048)
    args = parser.parse_args(argv)
    params = lloyal.SamplingParams(temperature=args.temperature, seed=args.seed)
    tty = sys.stdin.isatty() and not args.jsonl
    lines: Iterable[str] = _interactive_lines() if tty else sys.stdin

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with lloyal.Context(args.model or lloyal.default_model_path(), n_ctx=args.n_ctx) as ctx:
        events = chat(
            ctx, lines, max_tokens=args.max_tokens, params=params, on_text=None if args.jsonl else show
        )
        for event in events:
            if args.jsonl:
                print(json.dumps(event), flush=True)
            elif event["event"] == "turn":
                print(f"\n[{event['prefilled']} tokens prefilled, position {event['position']}]")
            else:
                print(f"[{event['event']}]")


if __name__ == "__main__":
    run(main)
