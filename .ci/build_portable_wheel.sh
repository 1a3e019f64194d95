#!/usr/bin/env bash
# Build the portable wheel (Cargo feature `portable`, `make wheel-portable`, wheels.yml): llama.cpp
# as shared libraries plus one CPU backend module per x86-64 level (GGML_CPU_ALL_VARIANTS), all in
# lloyal/_native/; at import lloyal loads them and llama.cpp picks the best module the CPU runs.
#
#   .ci/build_portable_wheel.sh OUT_DIR [maturin build args, e.g. --compatibility manylinux_2_28]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: .ci/build_portable_wheel.sh OUT_DIR [maturin build args]}
shift
maturin=${MATURIN:-maturin}
target=${CARGO_TARGET_DIR:-target}

# No -C target-cpu=native (set-but-empty RUSTFLAGS overrides .cargo/config.toml), so
# llama-cpp-sys-2 builds GGML_NATIVE=OFF; the parts outside the CPU modules (ggml-base, llama)
# keep the x86-64 baseline (llama-cpp-sys-2 forwards GGML_* variables to cmake).
export RUSTFLAGS=""
export GGML_SSE42=OFF GGML_AVX=OFF GGML_AVX2=OFF GGML_BMI2=OFF GGML_FMA=OFF GGML_F16C=OFF

native=python/lloyal/_native
scratch=$(mktemp -d)
cleanup() { rm -rf "$native" "$scratch"; }  # a source checkout must never keep them (see _native.py)
trap cleanup EXIT
rm -rf "$native"

# llama-cpp-sys-2 hard-links its libraries' symlinks (libllama.so -> libllama.so.0) into the
# target folder, where they dangle, and its next build (after a dependency change) fails on them
# with "File exists": drop them first.
for dir in "$target/release" "$target/release/examples" "$target/release/deps"; do
    [ -d "$dir" ] && find "$dir" -maxdepth 1 -xtype l -name 'lib*.so*' -delete
done

echo "== 1/3 compile (feature portable; the wheel of this pass lacks the libraries)"
"$maturin" build --release --features portable --auditwheel skip --out "$scratch" "$@"

echo "== 2/3 collect llama.cpp's shared libraries and CPU backend modules into $native"
backends=$(find "$target" -type d -path '*llama-cpp-sys-2-*/out/backends' -printf '%T@ %p\n' | sort -n | tail -1 | cut -d' ' -f2)
[ -n "$backends" ] || { echo "no llama-cpp-sys-2 backends folder under $target" >&2; exit 1; }
sys_out=$(dirname "$backends")
mkdir -p "$native"
cp "$backends"/*.so "$native"/
# Each installed library under its SONAME (the name the extension and the modules ask for).
for lib in "$sys_out"/lib*/lib*.so*; do
    [ -f "$lib" ] && [ ! -L "$lib" ] || continue
    soname=$(objdump -p "$lib" | awk '$1 == "SONAME" {print $2}')
    if [ -n "$soname" ] && [ ! -e "$native/$soname" ]; then
        cp "$lib" "$native/$soname"
    fi
done
# OpenMP's runtime, as auditwheel would graft it (not every system has libgomp).
gomp=$(gcc -print-file-name=libgomp.so.1)
if [ -f "$gomp" ]; then cp -L "$gomp" "$native/libgomp.so.1"; fi
ls -la "$native"
for lib in libllama.so libggml.so libggml-base.so; do
    ls "$native"/$lib* >/dev/null || { echo "missing $lib in $native" >&2; exit 1; }
done

echo "== 3/3 package (no recompile)"
"$maturin" build --release --features portable --auditwheel skip --out "$out" "$@"
wheel=$(ls -t "$out"/*.whl | head -1)
python3 - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
native = [n for n in names if n.startswith("lloyal/_native/")]
print("\n".join(native))
assert any("libllama" in n for n in native) and any("libggml-cpu-" in n for n in native), "lloyal/_native incomplete"
PY
echo "built $wheel"
