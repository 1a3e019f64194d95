"""Prefix-affinity routing for ``lloyal.ray.serve_app``: which replica serves a request.

Requests that share a prompt prefix (the same system prompt, the same conversation) should
land on the replica whose radix prefix cache already holds that prefix. The key of a request
is the beginning of its prompt:

- chat completions: the first ``PREFIX_MESSAGES`` message(s) (role and content), serialised:
  the system prompt when there is one (every conversation under it shares its KV), else the
  opening user turn (which identifies a conversation across its later requests);
- completions: the prompt text, or its token ids;
- anything else (``/v1/models``, ``/health``, embeddings, tokenize): no key, least loaded.

The key's first ``PREFIX_CHARS`` characters are hashed onto a consistent-hash ring of the
replicas (``VNODES`` points per replica), so adding or losing a replica moves only the keys
next to it. A replica is skipped while it is overloaded (``in_flight >= overload``) or down;
then the next replica on the ring takes the request, and with none left the least-loaded.

Example:
    >>> ring = HashRing(["r0", "r1"])
    >>> a = prefix_key("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."}]})
    >>> ring.choose(a, {"r0": 0, "r1": 0}, overload=4) == ring.choose(a, {"r0": 0, "r1": 0}, overload=4)
    True
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["PREFIX_CHARS", "PREFIX_MESSAGES", "VNODES", "HashRing", "prefix_key"]

PREFIX_CHARS = 512
PREFIX_MESSAGES = 1
VNODES = 64


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def prefix_key(path: str, body: Any) -> str | None:
    """The affinity key of a request to ``path`` with JSON ``body`` (None: no affinity)."""
    if not isinstance(body, dict):
        return None
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        head = [
            {"role": m.get("role"), "content": m.get("content")} if isinstance(m, dict) else m
            for m in messages[:PREFIX_MESSAGES]
        ]
        return json.dumps(head, sort_keys=True, default=str)[:PREFIX_CHARS]
    if path.endswith("/completions"):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of prompts: route by the first
        if isinstance(prompt, str):
            return prompt[:PREFIX_CHARS]
        if isinstance(prompt, list):
            return json.dumps(prompt)[:PREFIX_CHARS]
    return None


class HashRing:
    """A consistent-hash ring over replica names."""

    def __init__(self, replicas: Iterable[str], vnodes: int = VNODES) -> None:
        self.replicas = list(replicas)
        if not self.replicas:
            raise ValueError("a hash ring needs at least one replica")
        points = sorted((_hash(f"{r}#{i}"), r) for r in self.replicas for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]

    def order(self, key: str) -> list[str]:
        """Every replica, in ring order from ``key``'s point (its owner first)."""
        start = bisect.bisect(self._hashes, _hash(key)) % len(self._hashes)
        seen: list[str] = []
        for i in range(len(self._owners)):
            r = self._owners[(start + i) % len(self._owners)]
            if r not in seen:
                seen.append(r)
                if len(seen) == len(self.replicas):
                    break
        return seen

    def choose(
        self,
        key: str | None,
        in_flight: Mapping[str, int],
        overload: int,
        down: Iterable[str] = (),
    ) -> str:
        """The replica for ``key``: its owner on the ring unless overloaded or down, then the
        next one on the ring; with no key, or none fit, the least loaded replica that is up."""
        skip = set(down)
        up = [r for r in self.replicas if r not in skip] or self.replicas
        if key is not None:
            for r in self.order(key):
                if r not in skip and in_flight.get(r, 0) < overload:
                    return r
        return min(up, key=lambda r: (in_flight.get(r, 0), self.replicas.index(r)))
