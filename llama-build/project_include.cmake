# lloyal's additions to llama.cpp's CMake build, run after each project() of it:
# .cargo/config.toml sets CMAKE_PROJECT_INCLUDE to this file and llama-cpp-sys-2 passes every
# CMAKE_* variable on to cmake.
#
# AMX: force-include a correct _tile_loadconfig into every C/C++ file (see the header: GCC's
# own makes ggml's AMX kernels die of SIGILL). Only GCC needs it; the header is empty unless
# the file is compiled with AMX-TILE (-march=native on an AMX host, the portable build's
# sapphirerapids module).
if(CMAKE_C_COMPILER_ID STREQUAL "GNU" AND NOT LLOYAL_AMX_FIX_ADDED)
    set(LLOYAL_AMX_FIX_ADDED ON)
    add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:SHELL:-include ${CMAKE_CURRENT_LIST_DIR}/amx_tile_loadconfig.h>")
endif()
