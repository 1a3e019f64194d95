"""What runs before the extension loads: the CPU check (:mod:`lloyal._cpu`: a build for another
CPU raises ``UnsupportedCpuError`` instead of dying of ``SIGILL``), then the shared libraries a
portable wheel ships in ``lloyal/_native/``.

A portable wheel (Cargo feature ``portable``) links llama.cpp as shared libraries and carries one
CPU backend module per x86-64 level (``libggml-cpu-haswell.so`` ...). Loading the libraries here by
path, in dependency order, lets the extension's own links resolve to them without an rpath; the
folder is handed to the extension in ``LLOYAL_BACKENDS_DIR``, where llama.cpp picks the best
backend module this CPU runs. A source build has no such folder and this does nothing.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from lloyal import _cpu

NATIVE_DIR = Path(__file__).with_name("_native")

# Dependencies first: OpenMP, ggml's base, ggml, llama, llama.cpp's common helpers.
_ORDER = ("libgomp", "libggml-base", "libggml.", "libllama.", "libllama-common-base", "libllama-common")


def _rank(lib: Path) -> int:
    return next((i for i, prefix in enumerate(_ORDER) if lib.name.startswith(prefix)), len(_ORDER))


def preload() -> None:
    """Load ``_native``'s libraries (not the backend modules) and point llama.cpp at the modules."""
    if not NATIVE_DIR.is_dir():
        return
    libs = [p for p in NATIVE_DIR.iterdir() if ".so" in p.name and not p.name.startswith("libggml-cpu")]
    for lib in sorted(libs, key=lambda p: (_rank(p), p.name)):
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    os.environ.setdefault("LLOYAL_BACKENDS_DIR", str(NATIVE_DIR))


_cpu.check()
preload()
