"""The exception hierarchy of lloyal (docs/api.md, "Errors").

Every error a user can cause derives from :class:`LloyalError`; each message says what
was wrong and what to do. The Rust core raises these classes through one error map.

Example:
    >>> import lloyal
    >>> try:
    ...     lloyal.Model("/no/such/model.gguf")
    ... except lloyal.ModelLoadError as e:
    ...     print("cannot load:", e)  # doctest: +ELLIPSIS
    cannot load: ...
"""

from __future__ import annotations

__all__ = [
    "BranchDisposedError",
    "ChatTemplateError",
    "ContextClosedError",
    "DecodeError",
    "GrammarEngineWarning",
    "GrammarError",
    "InvalidTokenError",
    "KvCacheFullError",
    "LeaseExhaustedError",
    "LloyalError",
    "ModelLoadError",
    "OutOfMemoryError",
    "SeqLeasedError",
    "StateError",
    "TopologyError",
    "UnsupportedCpuError",
]


class LloyalError(Exception):
    """Base class of every error raised by lloyal."""


class ModelLoadError(LloyalError):
    """The model file is missing, not a GGUF file, truncated, or of an unsupported architecture."""


class ContextClosedError(LloyalError):
    """A context (or one of its branches) was used after ``close()``."""


class DecodeError(LloyalError):
    """``llama_decode`` failed; nothing was changed."""


class KvCacheFullError(DecodeError):
    """No room left in the KV cache for this call; nothing was changed."""


class BranchDisposedError(LloyalError):
    """The branch was pruned or retained away and can no longer be used."""


class LeaseExhaustedError(LloyalError):
    """Every sequence id (``n_seq_max``) is held by a live branch."""


class TopologyError(LloyalError):
    """A branch-tree rule was broken (e.g. ``prune()`` of a branch with live children)."""


class SeqLeasedError(LloyalError):
    """A flat-path call touched a sequence owned by a live branch."""


class InvalidTokenError(LloyalError, ValueError):
    """A token id outside ``[0, n_vocab)``."""


class GrammarError(LloyalError):
    """A grammar failed to parse, or a token it forbids was accepted."""


class StateError(LloyalError):
    """Saved state is corrupt, truncated or foreign; nothing was half-written."""


class ChatTemplateError(LloyalError):
    """A chat template could not be rendered."""


class OutOfMemoryError(LloyalError, MemoryError):
    """llama.cpp could not allocate a context's buffers (its KV cache grows with ``n_ctx``):
    raised by ``Context(...)`` instead of a bare failure; the message names the shape asked for."""


class UnsupportedCpuError(LloyalError, ImportError):
    """This build of lloyal uses a CPU feature (AVX-512, AMX...) the host lacks or its OS has not
    enabled: raised by ``import lloyal`` instead of dying of ``SIGILL`` (``lloyal._cpu``)."""


class GrammarEngineWarning(UserWarning):
    """A GBNF grammar runs on llama.cpp's grammar engine instead of llguidance, because it uses a
    construct llguidance cannot express (named in the message; ``Grammar.fallback`` keeps it)."""
