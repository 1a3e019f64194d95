"""lloyal.system_info(): the CPU backend llama.cpp runs and the features it was built with."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lloyal
from lloyal import _cpu


def test_system_info_names_the_cpu_backend_and_its_features() -> None:
    info = lloyal.system_info()
    # Each backend in turn ("CUDA : ARCHS = 900 | ... | CPU : SSE3 = 1 | ..." in a GPU build).
    assert re.match(r"(\w+ : .*\| )?CPU : ", info), info
    features = dict(re.findall(r"(\w+) = (\w+)", info.split("CPU : ", 1)[1]))
    assert features.get("REPACK") == "1" and features.get("OPENMP") == "1", info
    assert lloyal.system_info() == info  # llama.cpp rebuilds one static string per call


@pytest.mark.skipif(lloyal._lloyal.PORTABLE, reason="a source build's test: this is the portable wheel")
def test_a_source_build_uses_what_this_cpu_has() -> None:
    """`make build` compiles for the host (-C target-cpu=native): each SIMD extension the CPU
    reports is on in llama.cpp's CPU backend, and the build is not the portable one. A build for
    an older CPU run here (`make test-avx2`: -C target-cpu=haswell) has exactly the extensions it
    was compiled with on: no AVX-512 on an AVX-512 host."""
    assert lloyal._lloyal.PORTABLE is False
    build = _cpu.build_cpu()
    host = set(Path("/proc/cpuinfo").read_text().split())
    info = lloyal.system_info()
    checked = 0
    for flag, feature in (
        ("avx2", "AVX2 = 1"),
        ("fma", "FMA = 1"),
        ("f16c", "F16C = 1"),
        ("avx512f", "AVX512 = 1"),
    ):
        if build.kind == "native" and flag in host:
            assert flag in build.features, f"the CPU has {flag} but the native build lacks it: {build}"
        assert (feature in info) == (flag in build.features), f"the build has {build.features} but {info!r}"
        checked += flag in build.features
    assert checked >= 1, "no SIMD feature in the build (this suite runs on x86-64 with AVX2)"
