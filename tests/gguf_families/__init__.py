"""Tiny random-weight GGUF models of the common families (Llama 3, Mistral, Qwen 2/3, Phi-3).

Written with the ``gguf`` package into ``~/.cache/lloyal/gguf-families/<hash>/``, keyed by a
hash of this package's source, so a session generates them once (about a second) and reuses
them after. Output quality is irrelevant: the suite asserts lloyal's behaviour on each.
"""

from __future__ import annotations

from .generate import FAMILIES, Family, family_path, generate_all, token_id, vocab

__all__ = ["FAMILIES", "Family", "family_path", "generate_all", "token_id", "vocab"]
