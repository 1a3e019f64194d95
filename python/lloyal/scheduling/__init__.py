"""Generation requests on one context: admission, a radix prefix cache, prompts in flight
shared, ``n``/``best_of`` choices forked from one prefill (the cache and admission's decisions
are the core's: :class:`lloyal._lloyal.PrefixCache`, :class:`lloyal._lloyal.Admission`).

:class:`Scheduler` runs each request's choices as engine generation requests
(:meth:`lloyal.Branch.generate`), all of them in one ``llama_decode`` per step. The OpenAI
server (:mod:`lloyal.server`) and Ray Data (:mod:`lloyal.ray`) are adapters over it. Needs no
extra.
"""

from .prefix_cache import CacheEntry, PrefixCache
from .scheduler import (
    LOOKAHEAD,
    Done,
    GenSpec,
    PromptScores,
    QueueFull,
    Scheduler,
    ShuttingDown,
    TokenEvent,
    TopLogprob,
)

__all__ = [
    "LOOKAHEAD",
    "CacheEntry",
    "Done",
    "GenSpec",
    "PrefixCache",
    "PromptScores",
    "QueueFull",
    "Scheduler",
    "ShuttingDown",
    "TokenEvent",
    "TopLogprob",
]
