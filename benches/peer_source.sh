# Sourced by benches/cpu_peer.sh and benches/gpu_backend.sh: llama.cpp's source with
# llama-batched-bench as its only tool, ready for cmake.
#
#   peer_source LLAMA_CPP BATCHED_BENCH OUT   (makes OUT/llama.cpp)
#
# LLAMA_CPP: llama-cpp-sys-2's vendored llama.cpp (the one lloyal compiles); BATCHED_BENCH:
# llama.cpp's tools/batched-bench (the crate ships tools without sources; take it from
# llama-cpp-python's sdist, as `make bench-peers-cpp` unpacks it). Both builds also take
# lloyal's additions to llama.cpp's build: -DCMAKE_PROJECT_INCLUDE="$PEER_PROJECT_INCLUDE".
PEER_PROJECT_INCLUDE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/llama-build/project_include.cmake"

peer_source() {
    local src=$1 bench=$2 out=$3
    mkdir -p "$out"
    rm -rf "$out/llama.cpp" && cp -r "$src" "$out/llama.cpp"
    rm -rf "$out/llama.cpp/tools/batched-bench" && cp -r "$bench" "$out/llama.cpp/tools/batched-bench"
    # Only the bench among the tools (the crate's other tool folders have no sources).
    cat > "$out/llama.cpp/tools/CMakeLists.txt" <<'CMAKE'
find_package(Threads REQUIRED)
llama_add_compile_flags()
add_subdirectory(batched-bench)
CMAKE
}

# From the repository root: the crate's llama-cpp-sys-2 version (llama_version), its vendored
# llama.cpp (llama_cpp) and llama-batched-bench's source from llama-cpp-python's sdist
# (batched_bench; `make bench-peers-cpp` unpacks it).
peer_inputs() {
    llama_version=$(sed -n 's/^llama-cpp-sys-2 = { version = "=\([0-9.]*\)".*/\1/p' Cargo.toml)
    llama_cpp=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"llama-cpp-sys-2-$llama_version"/llama.cpp | tail -n 1)
    batched_bench=$(ls -d target/peers/llama_cpp_python-*/vendor/llama.cpp/tools/batched-bench | tail -n 1)
}

# llama-server's sources from llama-cpp-python's sdist (PEER: its vendor/llama.cpp) into TREE, a
# copy of the crate's llama.cpp: tools/server, tools/ui and scripts/ui-assets.cmake, patched for
# the crate's older llama.cpp (llama-cpp-python 0.3.36's server is a little newer than
# llama-cpp-sys-2 0.1.160's: mtmd_get_memory_usage returns a struct holding the map, and common
# has no fs_open_ifstream). The caller's tools/CMakeLists.txt adds mtmd, ui and server.
peer_server_tools() {
    local tree=$1 peer=$2
    rm -rf "$tree/tools/server" "$tree/tools/ui"
    cp -r "$peer/tools/server" "$peer/tools/ui" "$tree/tools/"
    mkdir -p "$tree/scripts" && cp "$peer/scripts/ui-assets.cmake" "$tree/scripts/"
    sed -i 's|mtmd_get_memory_usage(mmproj_path.c_str(), mparams);|mtmd_get_memory_usage(mmproj_path.c_str(), mparams).backend_mem_usage;|' \
        "$tree/tools/server/server-context.cpp"
    sed -i 's|std::ifstream f = fs_open_ifstream(params.mcp_servers_config, std::ios::in);|std::ifstream f(params.mcp_servers_config, std::ios::in);|' \
        "$tree/tools/server/server-mcp.cpp"
}
