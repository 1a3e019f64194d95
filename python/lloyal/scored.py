"""``Branch.score``'s result for one token: :class:`ScoredToken`."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ScoredToken"]


class ScoredToken(NamedTuple):
    """One token of ``Branch.score``: the tuple ``(logprob, top, rank)``, its fields named.

    Attributes:
        logprob: The token's ``log_softmax`` under the logits before it (``None`` for the first
            token of a branch that had no logits).
        top: The ``top_logprobs`` most likely ``(token, logprob)`` pairs there, best first.
        rank: 1 + the tokens with a higher logit there, as vLLM counts it (``None`` with
            ``logprob``).

    Example:
        >>> t = ScoredToken(-1.5, [(7, -0.25)], 3)
        >>> t.rank, t.top[0][0], t == (-1.5, [(7, -0.25)], 3)
        (3, 7, True)
    """

    logprob: float | None
    top: list[tuple[int, float]]
    rank: int | None
