"""Sampling parameters (docs/api.md, "Sampling"): frozen, keyword-only, validated on construction.

Example:
    >>> from lloyal import SamplingParams
    >>> p = SamplingParams(temperature=0.0)
    >>> p.is_greedy
    True
    >>> p.replace(top_k=1).top_k
    1
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from lloyal import _lloyal

__all__ = ["Dry", "Mirostat", "SamplingParams", "Xtc"]


@dataclass(frozen=True, kw_only=True)
class Mirostat:
    """Mirostat sampling (replaces top-k/top-p/min-p). ``version`` is 1 or 2."""

    version: int = 2
    tau: float = 5.0
    eta: float = 0.1


@dataclass(frozen=True, kw_only=True)
class Dry:
    """DRY repetition penalty: penalises extending sequences already seen."""

    multiplier: float = 0.8
    base: float = 1.75
    allowed_length: int = 2
    penalty_last_n: int = -1
    sequence_breakers: tuple[str, ...] = ("\n", ":", '"', "*")


@dataclass(frozen=True, kw_only=True)
class Xtc:
    """XTC: with ``probability``, removes every top choice above ``threshold`` but the least likely."""

    probability: float = 0.5
    threshold: float = 0.1
    min_keep: int = 1


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """The sampler chain of a branch or of the flat path.

    ``temperature <= 0`` is greedy. ``seed=None`` draws a random seed. Penalties use the
    last ``penalty_last_n`` accepted tokens (-1: all). Invalid values raise ``ValueError``.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    mirostat: Mirostat | None = None
    dry: Dry | None = None
    xtc: Xtc | None = field(default=None)

    def __post_init__(self) -> None:
        _lloyal.validate_sampling_params(self)

    @property
    def is_greedy(self) -> bool:
        """Whether this picks the most likely token (temperature <= 0, no mirostat)."""
        return self.temperature <= 0 and self.mirostat is None

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)
