//! C++ array allocations (`operator new[]`) in the llama.cpp linked into lloyal, 64-byte aligned.
//!
//! ggml's CPU backend keeps its work buffer (the quantized activations every matmul of a
//! batch reads, ~2 MB for a 512-token batch of Gemma 3 270M) in `new uint8_t[work_size]`,
//! which glibc aligns to 16 bytes only; where in a cache line it starts then depends on what
//! the computing thread's malloc arena held before. Measured on the AMD EPYC (Zen 5) VM: a
//! 1014-token prompt decoded in 1.00 s with the buffer at a cache-line boundary and 1.08 s 48
//! bytes past one (its wide loads split across lines), per process, by the chance of the
//! heap (benches/RESULTS.md). Defining `operator new[]` here binds llama.cpp's array `new`s
//! in this library to a 64-byte aligned allocation; `delete[]` stays libstdc++'s, which
//! calls `free`, valid for it. The extension is loaded with `RTLD_LOCAL`, so no other library
//! in the process sees this definition.

use std::ffi::c_void;

/// Cache line: the alignment of every array `new` (ggml's buffers' own alignment is 64 too).
pub const ALIGN: usize = 64;

/// `operator new[](size_t)`: `size` bytes aligned to [`ALIGN`]; null when out of memory (its
/// callers in ggml check for null; C++ would throw `std::bad_alloc`).
#[cfg(target_os = "linux")]
#[no_mangle]
pub extern "C" fn _Znam(size: usize) -> *mut c_void {
    let mut out: *mut c_void = std::ptr::null_mut();
    // SAFETY: `out` is a valid place for the result; ALIGN is a power of two and a multiple of
    // `size_of::<*mut c_void>()`, as posix_memalign requires; a zero size gets a unique
    // pointer (like C++'s `new T[0]`) by asking for one byte.
    let rc = unsafe { libc::posix_memalign(&mut out, ALIGN, size.max(1)) };
    if rc == 0 {
        out
    } else {
        std::ptr::null_mut()
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn array_news_are_cache_line_aligned_and_freed_by_free() {
        for size in [0, 1, 17, 4096, 2_244_800] {
            let p = _Znam(size);
            assert!(!p.is_null());
            assert_eq!(p as usize % ALIGN, 0, "{size} bytes at {p:?}");
            // SAFETY: `p` came from posix_memalign above and is freed once.
            unsafe { libc::free(p) };
        }
    }
}
