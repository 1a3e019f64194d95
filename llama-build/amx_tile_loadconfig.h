/* lloyal: a correct `_tile_loadconfig` for GCC, force-included into every C/C++ file of
 * llama.cpp (project_include.cmake).
 *
 * GCC's <amxtileintrin.h> (GCC 12, Debian 12's compiler) declares `ldtilecfg`'s operand as
 * `*(const void **)config`: 8 bytes read, not the instruction's 64. The optimiser then drops
 * the stores that fill the rest of a tile config built on the stack (ggml's
 * `ggml_tile_config_init`), `ldtilecfg` loads palette 1 with every tile 0 rows by 0 bytes,
 * and the next tile instruction (`tilezero %tmm4`) raises #UD: SIGILL on every AMX Xeon.
 * This version names the whole 64-byte operand. Clang's intrinsic is a builtin and correct. */
#ifndef LLOYAL_AMX_TILE_LOADCONFIG_H
#define LLOYAL_AMX_TILE_LOADCONFIG_H
#if defined(__AMX_TILE__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
static inline void lloyal_tile_loadconfig(const void *config) {
    __asm__ volatile("ldtilecfg\t%0" : : "m"(*(const unsigned char(*)[64])config));
}
#undef _tile_loadconfig
#define _tile_loadconfig(config) lloyal_tile_loadconfig(config)
#endif
#endif
