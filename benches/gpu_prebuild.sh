#!/usr/bin/env bash
# ggml's CUDA module, llama-batched-bench and llama-server built here, without a GPU, for the next GPU lease:
# the lease then installs them instead of spending ~200 s of its device time on the build.
#
#   benches/gpu_prebuild.sh            (~45 min on 2 cores; then benches/gpu_lease_prep.sh packs it)
#   benches/gpu_prebuild.sh server     (llama-server added to a build made before it had one)
#
# The toolchain is CUDA 13.0 from PyPI (nvcc 13.0.88, the lent H200's version; its runtime,
# cuBLAS, CCCL and NVVM), laid out as a toolkit under $CUDA_WHEELS (default ~/.cache/lloyal/cuda13),
# with a link-time stand-in for the driver's libcuda.so.1 (every cu* name cuda.h declares; the
# lent machine's driver provides the real one). The build is benches/gpu_backend.sh's, into
# /tmp/w/build, the path benches/gpu_lease.sh builds into there, so the binaries' RPATHs hold on
# the lent machine; at run time they load libcudart.so.13 and libcublas.so.13 from its
# /usr/local/cuda/lib64.
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${CUDA_WHEELS:-$HOME/.cache/lloyal/cuda13}
kit=$wheels/site/nvidia/cu13
if [ ! -x "$kit/bin/nvcc" ]; then
    rm -rf "$wheels" && mkdir -p "$wheels/dl"
    .venv/bin/python -m pip download -q --no-deps -d "$wheels/dl" "nvidia-cuda-nvcc==13.0.88" \
        "nvidia-cuda-runtime==13.0.*" "nvidia-cuda-crt==13.0.*" "nvidia-nvvm==13.0.*" \
        "nvidia-cuda-cccl==13.0.*" "nvidia-cublas==13.0.*" ninja
    for w in "$wheels"/dl/*.whl; do .venv/bin/python -m zipfile -e "$w" "$wheels/site/"; done
    chmod +x "$kit"/bin/* "$kit"/nvvm/bin/* "$wheels"/site/ninja-*.data/scripts/ninja
    # The toolkit layout nvcc and CMake look for: lib64, unversioned libraries, stubs/libcuda.so.
    ln -sfn lib "$kit/lib64"
    for lib in cudart cublas cublasLt; do ln -sf "lib$lib.so.13" "$kit/lib/lib$lib.so"; done
    mkdir -p "$kit/lib/stubs"
    echo '#include <cuda.h>' | gcc -E -I"$kit/include" -x c - | grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' |
        sed 's/\s*(//' | sort -u | awk '{print "void " $1 "(void) {}"}' > "$wheels/libcuda_stub.c"
    gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$kit/lib/stubs/libcuda.so" "$wheels/libcuda_stub.c"
fi
export PATH=$kit/bin:$(dirname "$(ls "$wheels"/site/ninja-*.data/scripts/ninja)"):$PATH
export CUDAToolkit_ROOT=$kit CUDACXX=$kit/bin/nvcc
source benches/peer_source.sh
peer_inputs
peer_server=$(ls -d target/peers/llama_cpp_python-*/vendor/llama.cpp | tail -n 1)
if [ "${1:-}" = server ]; then
    # llama-server added to the build already here (~10 min, its own sources only).
    tree=/tmp/w/build/llama.cpp
    grep -q "llama-cpp-sys-2 $llama_version" /tmp/w/build/build/bin/PREBUILT
    grep -q 'add_subdirectory(server)' "$tree/tools/CMakeLists.txt" ||
        printf 'add_subdirectory(mtmd)\nadd_subdirectory(ui)\nadd_subdirectory(server)\n' >> "$tree/tools/CMakeLists.txt"
    peer_server_tools "$tree" "$peer_server"
    cmake -S "$tree" -B /tmp/w/build/build -DLLAMA_BUILD_SERVER=ON
    nice -n 5 cmake --build /tmp/w/build/build -j "$(nproc)" --target llama-server
    exit 0
fi
rm -rf /tmp/w/build # a fresh configure: CMake keeps the toolkit it found first
CPU_VARIANTS=avx2 PEER_SERVER=$peer_server nice -n 5 bash benches/gpu_backend.sh "$llama_cpp" "$batched_bench" /tmp/w/build
echo "llama-cpp-sys-2 $llama_version" > /tmp/w/build/build/bin/PREBUILT
