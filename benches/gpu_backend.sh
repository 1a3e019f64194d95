#!/usr/bin/env bash
# A CUDA backend for the portable wheel, and llama.cpp's llama-batched-bench on the same ggml.
#
#   benches/gpu_backend.sh LLAMA_CPP BATCHED_BENCH OUT [LLOYAL_NATIVE]
#
# LLAMA_CPP: the llama.cpp the wheel was built from (llama-cpp-sys-2's vendored copy, under
# ~/.cargo/registry/src/*/llama-cpp-sys-2-<version>/llama.cpp); BATCHED_BENCH: llama.cpp's
# tools/batched-bench (the crate ships tools without sources; take it from llama-cpp-python's
# sdist, as `make bench-peers-cpp` unpacks it). Builds, with nvcc and cmake, ggml's CUDA backend
# as a loadable module (GGML_BACKEND_DL, the wheel's layout) and the bench into OUT; copies
# libggml-cuda.so into LLOYAL_NATIVE (an installed wheel's lloyal/_native), where the wheel's
# ggml loads it next to its CPU modules: `lloyal.Model(path, n_gpu_layers=99)` then runs on the
# GPU. CUDA_ARCH (default 90: H100/H200) picks the GPU generation; CPU_VARIANTS=avx2 builds the
# peer one CPU module (AVX2 + FMA) instead of one per x86-64 level, which shortens the build (the
# wheel brings its own modules; with every layer on the GPU the CPU module does almost nothing;
# GGML_NATIVE cannot go with GGML_BACKEND_DL). PEER_SERVER=<llama-cpp-python's vendor/llama.cpp>
# builds llama-server as well.
set -euo pipefail
src=${1:?usage: benches/gpu_backend.sh LLAMA_CPP BATCHED_BENCH OUT [LLOYAL_NATIVE]}
bench=${2:?BATCHED_BENCH}
out=${3:?OUT}
native=${4:-}
source "$(dirname "$0")/peer_source.sh"
peer_source "$src" "$bench" "$out"
# lloyal's build additions too: its CPU variants include sapphirerapids (GCC's AMX fix, llama-build/).
targets=(ggml-cuda llama-batched-bench)
server=(-DLLAMA_BUILD_SERVER=OFF)
if [ -n "${PEER_SERVER:-}" ]; then
    # llama-server too, on this ggml (benches/cpu_peer_server.sh's sources): it loads the CUDA
    # module from its folder like the bench.
    peer_server_tools "$out/llama.cpp" "$PEER_SERVER"
    printf 'add_subdirectory(mtmd)\nadd_subdirectory(ui)\nadd_subdirectory(server)\n' >> "$out/llama.cpp/tools/CMakeLists.txt"
    server=(-DLLAMA_BUILD_SERVER=ON)
    targets+=(llama-server)
fi
if [ "${CPU_VARIANTS:-all}" = avx2 ]; then
    cpu=(-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
        -DGGML_F16C=ON -DGGML_BMI2=ON)
    targets+=(ggml-cpu)
else
    cpu=(-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=ON)
fi
cmake -S "$out/llama.cpp" -B "$out/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
    "${cpu[@]}" -DGGML_BACKEND_DL=ON -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    "${server[@]}" -DLLAMA_BUILD_APP=OFF -DCMAKE_PROJECT_INCLUDE="$PEER_PROJECT_INCLUDE"
cmake --build "$out/build" -j "$(nproc)" --target "${targets[@]}"
if [ -n "$native" ]; then
    cp "$out/build/bin/libggml-cuda.so" "$native/"
    echo "installed $native/libggml-cuda.so"
fi
echo "built $out/build/bin/llama-batched-bench"
