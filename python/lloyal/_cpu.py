"""The x86 CPU features this build of lloyal uses, against the ones the host offers.

A native build (``make build``, an sdist install) is compiled for the CPU of the machine that
built it (``-march=native``); run on a CPU without one of those features, or where the OS has
not enabled it, its first such instruction kills the process with ``SIGILL``. The build records
the features in the extension (``build.rs``); :func:`check` reads them from the file, before
the extension is loaded, and raises :class:`~lloyal.errors.UnsupportedCpuError` naming what is
missing and how to get a build that runs. The host's features are those the kernel reports in
``/proc/cpuinfo``, which lists a feature only when the OS has enabled its registers.

Set ``LLOYAL_CPU_CHECK=0`` to skip the check (where ``/proc/cpuinfo`` is wrong or hidden).

Example:
    >>> from lloyal import _cpu
    >>> build = _cpu.build_cpu()
    >>> build.kind != "unknown"
    True
    >>> _cpu.missing(build, _cpu.host_features()) == []
    True
"""

from __future__ import annotations

import importlib.machinery
import mmap
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from lloyal.errors import UnsupportedCpuError

MARKER = b"LLOYAL_BUILD_CPU="

# /proc/cpuinfo names that differ from the names the build records.
_ALIASES = {"pni": "sse3"}


@dataclass(frozen=True)
class BuildCpu:
    """What a build of the extension was compiled for."""

    arch: str
    """Target architecture (``x86_64``, ``aarch64``...)."""
    kind: str
    """``native`` (the building machine's CPU, ``-march=native``), ``portable`` (baseline, CPU
    kernels picked at run time), or the ``-C target-cpu`` it was built for (``x86-64-v3``...)."""
    features: tuple[str, ...]
    """SIMD features its code uses unconditionally, in ``/proc/cpuinfo`` names."""
    checked: tuple[str, ...] = ()
    """Every feature the build knows to look for (``build.rs``'s list)."""


def extension_path() -> Path | None:
    """The file of ``lloyal._lloyal`` (not loaded), or None if there is none."""
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = here / f"_lloyal{suffix}"
        if candidate.is_file():
            return candidate
    return None


def build_cpu(path: Path | None = None) -> BuildCpu:
    """Read the build's record from the extension file ``path`` (default: this package's)."""
    path = path or extension_path()
    if path is None:
        return BuildCpu(platform.machine(), "unknown", ())
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        start = data.find(MARKER)
        if start < 0:
            return BuildCpu(platform.machine(), "unknown", ())
        end = data.find(b"\n", start)
        value = data[start + len(MARKER) : end].decode("ascii", "replace")
    arch, kind, used, checked = [*value.split(";"), "", "", "", ""][:4]
    return BuildCpu(arch, kind, _names(used), _names(checked))


def _names(csv: str) -> tuple[str, ...]:
    return tuple(f for f in csv.split(",") if f)


def host_features(cpuinfo: Path | None = None) -> frozenset[str] | None:
    """The CPU features the kernel reports as usable (None where it does not say: not Linux).

    ``cpuinfo`` defaults to ``$LLOYAL_CPUINFO`` if set (a file in ``/proc/cpuinfo``'s format,
    for containers that hide ``/proc`` and for tests), else ``/proc/cpuinfo``.
    """
    if cpuinfo is None:
        cpuinfo = Path(os.environ.get("LLOYAL_CPUINFO") or "/proc/cpuinfo")
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(_ALIASES.get(f, f) for f in value.split())
    return None


def missing(build: BuildCpu, host: frozenset[str] | None) -> list[str]:
    """The build's features the host lacks (none when the host's are unknown)."""
    if host is None or build.arch != platform.machine():
        return []
    return [f for f in build.features if f not in host]


def _advice(build: BuildCpu) -> str:
    if build.kind == "portable":
        return "Install the wheel built for this platform, or build from source on this host (`make build`)."
    made = "the CPU of the machine that built it" if build.kind == "native" else f"-march={build.kind}"
    return (
        f"This build was compiled for {made}. Rebuild on this host (`make build` in a checkout, or "
        "`pip install --no-binary lloyal --force-reinstall lloyal`), or install the portable x86-64 "
        "wheel, which picks its kernels for the CPU at run time."
    )


def check(build: BuildCpu | None = None, host: frozenset[str] | None = None) -> None:
    """Raise :class:`UnsupportedCpuError` if the build uses a feature the host lacks.

    ``build`` and ``host`` default to this package's extension and this machine.
    """
    if os.environ.get("LLOYAL_CPU_CHECK", "1") == "0":
        return
    build = build or build_cpu()
    host = host if host is not None else host_features()
    lacking = missing(build, host)
    if lacking:
        raise UnsupportedCpuError(
            f"this build of lloyal uses CPU features this host lacks or its OS has not enabled: "
            f"{', '.join(lacking)} (the host's /proc/cpuinfo does not list them); running it would "
            f"end in SIGILL. {_advice(build)} Set LLOYAL_CPU_CHECK=0 to skip this check."
        )
