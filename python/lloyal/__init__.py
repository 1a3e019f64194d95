"""lloyal: forkable, branch-parallel LLM inference over llama.cpp.

Example:
    >>> import lloyal
    >>> ctx = lloyal.Context(lloyal.default_model_path(), n_ctx=512)
    >>> tokens = ctx.tokenize("The capital of France is")
    >>> ctx.decode(tokens, 0)
    >>> ctx.get_logits().shape == (ctx.n_vocab,)
    True
    >>> ctx.close()
"""

from __future__ import annotations

import atexit
import os
from typing import Any

# isort: off
from lloyal import _native  # first: the CPU check, a portable wheel's shared llama.cpp

# isort: on
from lloyal import strategies
from lloyal._lloyal import (
    Branch,
    BranchStore,
    Context,
    EngineStats,
    Grammar,
    KvPressure,
    LoraAdapter,
    Model,
    PerplexityTracker,
    Produced,
    TextStream,
    Token,
    TokenIterator,
    __version__,
    system_info,
)
from lloyal._lloyal import quiesce_callbacks as _quiesce_callbacks
from lloyal._model_path import default_model_path
from lloyal.chat import ChatOutput, FormattedChat, ToolCall, parse_chat_output
from lloyal.errors import (
    BranchDisposedError,
    ChatTemplateError,
    ContextClosedError,
    DecodeError,
    GrammarEngineWarning,
    GrammarError,
    InvalidTokenError,
    KvCacheFullError,
    LeaseExhaustedError,
    LloyalError,
    ModelLoadError,
    OutOfMemoryError,
    SeqLeasedError,
    StateError,
    TopologyError,
    UnsupportedCpuError,
)
from lloyal.grammar import json_schema_to_grammar
from lloyal.sampling import Dry, Mirostat, SamplingParams, Xtc
from lloyal.scored import ScoredToken

_native.release_env()  # the extension read its backend folder when it was imported above

# The engine thread answers awaits through the event loop; it must stop calling into Python
# before the interpreter finalizes (CPython would end it with pthread_exit: an abort).
atexit.register(_quiesce_callbacks)

__all__ = [
    "Branch",
    "BranchDisposedError",
    "BranchStore",
    "ChatOutput",
    "ChatTemplateError",
    "Context",
    "ContextClosedError",
    "DecodeError",
    "Dry",
    "EngineStats",
    "FormattedChat",
    "Grammar",
    "GrammarEngineWarning",
    "GrammarError",
    "InvalidTokenError",
    "KvCacheFullError",
    "KvPressure",
    "LeaseExhaustedError",
    "LloyalError",
    "LoraAdapter",
    "Mirostat",
    "Model",
    "ModelLoadError",
    "OutOfMemoryError",
    "PerplexityTracker",
    "Produced",
    "SamplingParams",
    "ScoredToken",
    "SeqLeasedError",
    "StateError",
    "TextStream",
    "Token",
    "TokenIterator",
    "ToolCall",
    "TopologyError",
    "UnsupportedCpuError",
    "Xtc",
    "__version__",
    "create_context",
    "default_model_path",
    "json_schema_to_grammar",
    "parse_chat_output",
    "strategies",
    "system_info",
]


def create_context(model_path: str | os.PathLike[str] | None = None, **options: Any) -> Context:
    """Open ``model_path`` (default: :func:`default_model_path`) and create a context.

    ``options`` are those of :class:`Context` (``n_ctx``, ``n_batch``, ``n_seq_max``...).

    Example:
        >>> import lloyal
        >>> with lloyal.create_context(n_ctx=256) as ctx:
        ...     ctx.n_ctx
        256
    """
    path = default_model_path() if model_path is None else model_path
    return Context(path, **options)
