#!/usr/bin/env bash
# llama.cpp's llama-server built on the llama.cpp lloyal itself compiles (llama-cpp-sys-2's
# vendored copy), for the host's CPU with lloyal's build additions: a llama-server on the same
# ggml as lloyal, for benches/server_request_times.py --variant-server.
#
#   benches/cpu_peer_server.sh LLAMA_CPP PEER_LLAMA_CPP OUT
#
# LLAMA_CPP: ~/.cargo/registry/src/*/llama-cpp-sys-2-<version>/llama.cpp (the crate ships tools
# without sources); PEER_LLAMA_CPP: the llama.cpp of llama-cpp-python's sdist (`make
# bench-peers-cpp` unpacks it: target/peers/llama_cpp_python-*/vendor/llama.cpp), whose
# tools/server, tools/ui and scripts/ui-assets.cmake are taken. Builds OUT/build/bin/llama-server.
set -euo pipefail
src=${1:?usage: benches/cpu_peer_server.sh LLAMA_CPP PEER_LLAMA_CPP OUT}
peer=${2:?PEER_LLAMA_CPP}
out=${3:?OUT}
source "$(dirname "$0")/peer_source.sh"  # PEER_PROJECT_INCLUDE, peer_server_tools
mkdir -p "$out"
rm -rf "$out/llama.cpp" && cp -r "$src" "$out/llama.cpp"
peer_server_tools "$out/llama.cpp" "$peer"
cat > "$out/llama.cpp/tools/CMakeLists.txt" <<'CMAKE'
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(mtmd)
add_subdirectory(ui)
add_subdirectory(server)
CMAKE
cmake -S "$out/llama.cpp" -B "$out/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DCMAKE_PROJECT_INCLUDE="$PEER_PROJECT_INCLUDE" \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
cmake --build "$out/build" -j "$(nproc)" --target llama-server
echo "built $out/build/bin/llama-server"
