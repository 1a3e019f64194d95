"""The build's CPU features against the host's (``lloyal._cpu``): the record matches what
llama.cpp was compiled with, this host runs this build, and a build for a CPU the host does not
have raises ``UnsupportedCpuError`` at import, naming the feature, instead of dying of SIGILL."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import lloyal
from lloyal import _cpu
from lloyal._lloyal import BUILD_CPU, PORTABLE

# system_info() names (what ggml was compiled with) of features the build records.
GGML_NAMES = {
    "avx2": "AVX2",
    "fma": "FMA",
    "f16c": "F16C",
    "bmi2": "BMI2",
    "avx_vnni": "AVX_VNNI",
    "avx512f": "AVX512",
    "avx512vbmi": "AVX512_VBMI",
    "avx512_vnni": "AVX512_VNNI",
    "avx512_bf16": "AVX512_BF16",
    "amx_int8": "AMX_INT8",
}


def test_the_record_in_the_file_is_the_extensions_own() -> None:
    build = _cpu.build_cpu()
    record = ";".join([build.arch, build.kind, ",".join(build.features), ",".join(build.checked)])
    assert record == BUILD_CPU
    assert (build.kind == "portable") == PORTABLE and build.kind != "unknown"
    assert set(build.features) <= set(build.checked) and "amx_int8" in build.checked


@pytest.mark.skipif(PORTABLE, reason="a portable build's CPU module is picked at run time")
def test_the_record_says_what_llama_cpp_was_compiled_with() -> None:
    """build.rs reads the C compiler's -march=native macros; ggml reports its own compile flags."""
    build = _cpu.build_cpu()
    info = lloyal.system_info()
    for feature, ggml in GGML_NAMES.items():
        assert (feature in build.features) == (f" {ggml} = 1 " in f" {info} "), (feature, info)


def test_this_host_runs_this_build() -> None:
    host = _cpu.host_features()
    assert host is not None, "Linux reports its CPU features in /proc/cpuinfo"
    build = _cpu.build_cpu()
    assert _cpu.missing(build, host) == []
    if build.kind == "native":
        assert "avx2" in build.features, "the test hosts have AVX2, so a native build uses it"


AMX_SCRIPT = """
import sys, numpy as np, lloyal
path = lloyal.default_model_path()
rows = {}
for repack in (True, False):  # AMX's repacked weights, then the plain per-row kernels
    with lloyal.Context(lloyal.Model(path, repack=repack), n_ctx=256, n_batch=64) as ctx:
        tokens = ctx.tokenize("The three laws of thermodynamics state that energy")
        ctx.decode(tokens, 0)
        rows[repack] = np.array(ctx.get_logits(), dtype=np.float64)
a, b = rows[True], rows[False]
print("argmax", int(a.argmax()), int(b.argmax()))
print("spread", float(np.max(np.abs(a - b)) / (b.max() - b.min())))
"""


def test_amx_kernels_run_where_built_and_agree_with_the_plain_ones() -> None:
    """A native build on an AMX host compiles llama.cpp's AMX kernels in (the header in
    llama-build/ makes them correct under GCC); loading repacked weights puts them in the AMX
    buffer, and a prompt's logits match the per-row kernels' to the quantisation's noise."""
    build = _cpu.build_cpu()
    host = _cpu.host_features() or frozenset()
    if not {"amx_tile", "amx_int8"} <= host or build.kind != "native":
        pytest.skip("needs a native build on an AMX host (Sapphire Rapids or later)")
    assert "amx_int8" in build.features and "AMX_INT8 = 1" in lloyal.system_info()
    env = {**os.environ, "LLOYAL_LOG": "1"}
    done = subprocess.run(
        [sys.executable, "-c", AMX_SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "AMX model buffer size" in done.stderr, "repacked weights go to llama.cpp's AMX buffer"
    got = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    amx, plain = got["argmax"].split()
    assert amx == plain
    assert float(got["spread"]) < 0.05, got


def test_check_names_the_missing_features_and_the_way_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    native = _cpu.BuildCpu(_arch(), "native", ("avx2", "avx512f", "amx_int8"))
    with pytest.raises(lloyal.UnsupportedCpuError) as e:
        _cpu.check(native, frozenset({"avx2", "sse3"}))
    msg = str(e.value)
    assert "avx512f, amx_int8" in msg and "make build" in msg and "portable" in msg and "SIGILL" in msg
    assert isinstance(e.value, ImportError) and isinstance(e.value, lloyal.LloyalError)
    _cpu.check(native, frozenset({"avx2", "avx512f", "amx_int8"}))  # all there: no error
    # The host does not say (not Linux, or a container that hides /proc): no error, whatever
    # this machine's own CPU has (None means "read this machine's", so hide it).
    monkeypatch.setenv("LLOYAL_CPUINFO", str(tmp_path / "absent"))
    _cpu.check(native, None)
    other = _cpu.BuildCpu("riscv64" if _arch() != "riscv64" else "x86_64", "native", ("avx512f",))
    _cpu.check(other, frozenset())  # a record of another architecture is not compared


def test_the_check_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLOYAL_CPU_CHECK", "0")
    _cpu.check(_cpu.BuildCpu(_arch(), "native", ("avx512f",)), frozenset())


def test_host_features_reads_the_flags_line(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu pni avx2 amx_tile\nbugs\t\t: spectre_v1\n")
    assert _cpu.host_features(cpuinfo) == frozenset({"fpu", "sse3", "avx2", "amx_tile"})
    assert _cpu.host_features(tmp_path / "absent") is None
    (tmp_path / "noflags").write_text("processor\t: 0\n")
    assert _cpu.host_features(tmp_path / "noflags") is None


@pytest.mark.skipif(PORTABLE, reason="a portable build records no features (picked at run time)")
def test_import_of_a_build_for_another_cpu_raises_before_loading_it(tmp_path: Path) -> None:
    """A copy of the package whose extension records a feature no CPU has: `import lloyal` raises
    UnsupportedCpuError naming it (and the extension is never loaded)."""
    package = Path(lloyal.__file__).parent
    copy = tmp_path / "lloyal"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    ext = _cpu.extension_path()
    assert ext is not None
    data = ext.read_bytes()
    build = _cpu.build_cpu()
    assert build.features, "a build with no recorded features cannot be altered in place"
    first = build.features[0]
    fake = "q" * len(first)  # same length: the marker keeps its size inside the binary
    marker = _cpu.MARKER + BUILD_CPU.encode()
    altered = marker.replace(f";{first}".encode(), f";{fake}".encode(), 1)
    assert altered != marker and data.count(marker) == 1
    (copy / ext.name).write_bytes(data.replace(marker, altered))
    script = (
        "import sys\n"
        "try:\n"
        "    import lloyal\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
        "    print('loaded' if 'lloyal._lloyal' in sys.modules else 'not loaded')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("LLOYAL_CPU_CHECK", None)
    run = [sys.executable, "-c", script]
    done = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 2, done.stdout + done.stderr
    assert lines[0].startswith("UnsupportedCpuError ") and fake in lines[0], lines[0]
    assert lines[1] == "not loaded"


def _arch() -> str:
    return platform.machine()


HASWELL_HOST = frozenset({"sse4_2", "avx", "f16c", "fma", "avx2", "bmi2"})
MODULES = [f"libggml-cpu-{v}.so" for v in ("x64", "haswell", "skylakex", "icelake", "sapphirerapids", "zen4")]


def test_cpu_modules_a_host_lacks_the_features_of_are_left_out() -> None:
    """llama.cpp scores the portable wheel's CPU modules by CPUID, which also reports features
    the OS has not enabled; lloyal keeps out every module using a flag /proc/cpuinfo lacks."""
    from lloyal._native import unusable_cpu_modules

    assert unusable_cpu_modules(MODULES, HASWELL_HOST) == MODULES[2:]
    avx512 = HASWELL_HOST | {"avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"}
    assert unusable_cpu_modules(MODULES, avx512) == MODULES[3:]
    full = avx512 | {"avx512vbmi", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}
    assert unusable_cpu_modules(MODULES, full) == []
    assert (
        unusable_cpu_modules([*MODULES, "libggml-cpu-future.so", "libggml-cuda.so"], frozenset())
        == MODULES[1:]
    )
    assert unusable_cpu_modules(MODULES, None) == []  # features unknown: llama.cpp decides


def test_backends_dir_links_only_the_usable_modules(tmp_path: Path) -> None:
    from lloyal._native import backends_dir

    for name in [*MODULES, "libggml-cuda.so", "libggml-base.so", "libllama.so"]:
        (tmp_path / name).write_bytes(b"")
    assert backends_dir(tmp_path, None) == tmp_path
    private = backends_dir(tmp_path, HASWELL_HOST)
    assert private != tmp_path
    links = sorted(p.name for p in private.iterdir())
    assert links == sorted(
        ["libggml-cpu-x64.so", "libggml-cpu-haswell.so", "libggml-cuda.so", "libggml-base.so"]
    )
    assert all((private / n).resolve() == tmp_path / n for n in links)


def test_host_features_read_from_lloyal_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 pni avx2\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    monkeypatch.setenv("LLOYAL_CPUINFO", str(fake))
    assert _cpu.host_features() == frozenset({"fpu", "sse4_2", "sse3", "avx2"})
    monkeypatch.setenv("LLOYAL_CPUINFO", str(tmp_path / "absent"))
    assert _cpu.host_features() is None


def test_the_backend_folder_lloyal_chose_does_not_reach_child_processes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A portable wheel's ``LLOYAL_BACKENDS_DIR`` is read by the extension at its import, then
    removed (a child process picks modules for its own view of the CPU); one the user set stays."""
    from lloyal import _native

    monkeypatch.setenv("LLOYAL_BACKENDS_DIR", "/somewhere")
    monkeypatch.setattr(_native, "_set_here", False)
    _native.release_env()
    assert os.environ["LLOYAL_BACKENDS_DIR"] == "/somewhere"
    monkeypatch.setattr(_native, "_set_here", True)
    _native.release_env()
    assert "LLOYAL_BACKENDS_DIR" not in os.environ
