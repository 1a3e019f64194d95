"""What runs before the extension loads: the CPU check (:mod:`lloyal._cpu`: a build for another
CPU raises ``UnsupportedCpuError`` instead of dying of ``SIGILL``), then the shared libraries a
portable wheel ships in ``lloyal/_native/``.

A portable wheel (Cargo feature ``portable``) links llama.cpp as shared libraries and carries one
CPU backend module per x86-64 level (``libggml-cpu-haswell.so`` ...). Loading the libraries here by
path, in dependency order, lets the extension's own links resolve to them without an rpath; the
folder is handed to the extension in ``LLOYAL_BACKENDS_DIR``, where llama.cpp picks the best
backend module this CPU runs. A source build has no such folder and this does nothing.

llama.cpp scores the modules by CPUID alone, which also reports features the OS has not enabled
(llama.cpp issue 28328): a module using one would die of ``SIGILL``. The modules whose features
the kernel does not list in ``/proc/cpuinfo`` are therefore kept out of its choice: llama.cpp is
handed a private folder of links to the others (:func:`backends_dir`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

from lloyal import _cpu

NATIVE_DIR = Path(__file__).with_name("_native")

# Dependencies first: OpenMP, ggml's base, ggml, llama, llama.cpp's common helpers.
_ORDER = ("libgomp", "libggml-base", "libggml.", "libllama.", "libllama-common-base", "libllama-common")


# llama.cpp's x86 CPU module variants (ggml/src/CMakeLists.txt, GGML_CPU_ALL_VARIANTS) and the
# /proc/cpuinfo flags each one's code uses (GGML_AVX512 is -mavx512f/cd/vl/dq/bw).
_HASWELL = ("sse4_2", "avx", "f16c", "fma", "avx2", "bmi2")
_AVX512 = (*_HASWELL, "avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")
CPU_MODULE_FLAGS: dict[str, tuple[str, ...]] = {
    "x64": (),
    "sse42": ("sse4_2",),
    "sandybridge": ("sse4_2", "avx"),
    "ivybridge": ("sse4_2", "avx", "f16c"),
    "piledriver": ("sse4_2", "avx", "f16c", "fma"),
    "haswell": _HASWELL,
    "alderlake": (*_HASWELL, "avx_vnni"),
    "skylakex": _AVX512,
    "cannonlake": (*_AVX512, "avx512vbmi"),
    "cascadelake": (*_AVX512, "avx512_vnni"),
    "icelake": (*_AVX512, "avx512vbmi", "avx512_vnni"),
    "cooperlake": (*_AVX512, "avx512_vnni", "avx512_bf16"),
    "zen4": (*_AVX512, "avx512vbmi", "avx512_vnni", "avx512_bf16"),
    "sapphirerapids": (*_AVX512, "avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"),
}


def unusable_cpu_modules(names: Iterable[str], host: frozenset[str] | None) -> list[str]:
    """The CPU module files among ``names`` (``libggml-cpu-<variant>.so``) whose variant uses a
    feature ``host`` lacks (none when the host's features are unknown or the variant is not in
    :data:`CPU_MODULE_FLAGS`).

    Example:
        >>> unusable_cpu_modules(["libggml-cpu-x64.so", "libggml-cpu-skylakex.so"], frozenset({"sse4_2"}))
        ['libggml-cpu-skylakex.so']
    """
    if host is None:
        return []
    out = []
    for name in names:
        if not name.startswith("libggml-cpu-"):
            continue
        need = CPU_MODULE_FLAGS.get(name.removeprefix("libggml-cpu-").split(".so")[0])
        if need is not None and not set(need) <= host:
            out.append(name)
    return out


def backends_dir(native: Path, host: frozenset[str] | None) -> Path:
    """Where llama.cpp looks for backend modules: ``native`` itself, or, when some CPU module
    there uses a feature the host lacks, a private folder (removed at exit) of links to every
    other ``libggml-*`` module."""
    unusable = set(unusable_cpu_modules((p.name for p in native.iterdir()), host))
    if not unusable:
        return native
    private = Path(tempfile.mkdtemp(prefix="lloyal-backends-"))
    atexit.register(shutil.rmtree, private, ignore_errors=True)
    for lib in native.iterdir():
        if lib.name.startswith("libggml-") and lib.name not in unusable:
            (private / lib.name).symlink_to(lib)
    return private


def _rank(lib: Path) -> int:
    return next((i for i, prefix in enumerate(_ORDER) if lib.name.startswith(prefix)), len(_ORDER))


def preload() -> None:
    """Load ``_native``'s libraries (not the backend modules) and point llama.cpp at the modules."""
    if not NATIVE_DIR.is_dir():
        return
    libs = [p for p in NATIVE_DIR.iterdir() if ".so" in p.name and not p.name.startswith("libggml-cpu")]
    for lib in sorted(libs, key=lambda p: (_rank(p), p.name)):
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    global _set_here
    if "LLOYAL_BACKENDS_DIR" not in os.environ:
        os.environ["LLOYAL_BACKENDS_DIR"] = str(backends_dir(NATIVE_DIR, _cpu.host_features()))
        _set_here = True


def release_env() -> None:
    """Remove the ``LLOYAL_BACKENDS_DIR`` :func:`preload` set, once the extension has read it (at
    its import): a child process chooses its own modules for its own view of the CPU, and the
    private folder is this process's (removed at its exit)."""
    if _set_here:
        os.environ.pop("LLOYAL_BACKENDS_DIR", None)


_set_here = False


_cpu.check()
preload()
