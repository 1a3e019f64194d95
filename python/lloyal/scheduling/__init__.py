"""Generation requests on one context: admission, a radix prefix cache, prompts in flight
shared, ``n``/``best_of`` choices forked from one prefill.

:class:`Scheduler` runs each request's choices as engine generation requests
(:meth:`lloyal.Branch.generate`), all of them in one ``llama_decode`` per step. The OpenAI
server (:mod:`lloyal.server`) and Ray Data (:mod:`lloyal.ray`) are adapters over it. Needs no
extra.
"""

from .prefix_cache import CacheEntry, PrefixCache
from .radix import RadixTree
from .scheduler import LOOKAHEAD, Done, GenSpec, QueueFull, Scheduler, ShuttingDown, TokenEvent, TopLogprob

__all__ = [
    "LOOKAHEAD",
    "CacheEntry",
    "Done",
    "GenSpec",
    "PrefixCache",
    "QueueFull",
    "RadixTree",
    "Scheduler",
    "ShuttingDown",
    "TokenEvent",
    "TopLogprob",
]
