#!/usr/bin/env bash
# llama.cpp's llama-batched-bench built from the llama.cpp lloyal itself compiles (llama-cpp-sys-2's
# vendored copy), for the host's CPU with lloyal's build additions: the same ggml and flags on both
# sides of benches/batched_side_by_side.py (`make bench-peer-same-ggml`, which also builds a
# llama-server on it: benches/cpu_peer_server.sh).
#
#   benches/cpu_peer.sh LLAMA_CPP BATCHED_BENCH OUT
#
# LLAMA_CPP: ~/.cargo/registry/src/*/llama-cpp-sys-2-<version>/llama.cpp; BATCHED_BENCH: llama.cpp's
# tools/batched-bench (the crate ships tools without sources; take it from llama-cpp-python's
# sdist, as `make bench-peers-cpp` unpacks it). Builds OUT/build/bin/llama-batched-bench.
set -euo pipefail
src=${1:?usage: benches/cpu_peer.sh LLAMA_CPP BATCHED_BENCH OUT}
bench=${2:?BATCHED_BENCH}
out=${3:?OUT}
source "$(dirname "$0")/peer_source.sh"
peer_source "$src" "$bench" "$out"
cpu=(-DGGML_NATIVE=ON)
if [ -n "${PEER_MARCH:-}" ]; then
    [ "$PEER_MARCH" = haswell ] || { echo "PEER_MARCH: only haswell is known" >&2; exit 2; }
    cpu=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
        -DGGML_BMI2=ON -DCMAKE_C_FLAGS=-march=haswell -DCMAKE_CXX_FLAGS=-march=haswell)
fi
cmake -S "$out/llama.cpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release "${cpu[@]}" \
    -DCMAKE_PROJECT_INCLUDE="$PEER_PROJECT_INCLUDE" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF
cmake --build "$out/build" -j "$(nproc)" --target llama-batched-bench
echo "built $out/build/bin/llama-batched-bench"
