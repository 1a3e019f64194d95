//! Records the x86 CPU features this build's machine code may use unconditionally, so that
//! `import lloyal` can compare them with the host's before it loads the extension
//! (`python/lloyal/_cpu.py`) and raise an error naming the missing feature instead of dying
//! of `SIGILL`.
//!
//! Two compilers write that code: rustc (its `target_feature`s) and, for llama.cpp, the C
//! compiler with `-march=<the Rust flags' target-cpu>` plus the CFLAGS of `.cargo/config.toml`
//! (llama-cpp-sys-2 builds with `GGML_NATIVE=ON` for `target-cpu=native`, else with that
//! `-march`). The C side is read off the compiler's predefined macros for exactly those flags.
//! A portable build (feature `portable`, no target-cpu) is baseline x86-64 outside the CPU
//! modules ggml picks at run time.
//!
//! The result is the crate's `LLOYAL_BUILD_CPU` env, `<arch>;<native|portable>;<used>;<checked>`
//! (feature lists in `/proc/cpuinfo` names; `src/cpu.rs` embeds it in the binary).

use std::process::Command;

/// `(predefined C macro, rustc target feature, name in /proc/cpuinfo)` for the SIMD features
/// llama.cpp's kernels and lloyal's own use.
const FEATURES: &[(&str, &str, &str)] = &[
    ("__SSE3__", "sse3", "sse3"),
    ("__SSSE3__", "ssse3", "ssse3"),
    ("__SSE4_1__", "sse4.1", "sse4_1"),
    ("__SSE4_2__", "sse4.2", "sse4_2"),
    ("__AVX__", "avx", "avx"),
    ("__AVX2__", "avx2", "avx2"),
    ("__FMA__", "fma", "fma"),
    ("__F16C__", "f16c", "f16c"),
    ("__BMI2__", "bmi2", "bmi2"),
    ("__AVXVNNI__", "avxvnni", "avx_vnni"),
    ("__AVX512F__", "avx512f", "avx512f"),
    ("__AVX512CD__", "avx512cd", "avx512cd"),
    ("__AVX512BW__", "avx512bw", "avx512bw"),
    ("__AVX512DQ__", "avx512dq", "avx512dq"),
    ("__AVX512VL__", "avx512vl", "avx512vl"),
    ("__AVX512VBMI__", "avx512vbmi", "avx512vbmi"),
    ("__AVX512VNNI__", "avx512vnni", "avx512_vnni"),
    ("__AVX512BF16__", "avx512bf16", "avx512_bf16"),
    ("__AVX512FP16__", "avx512fp16", "avx512_fp16"),
    ("__AMX_TILE__", "amx-tile", "amx_tile"),
    ("__AMX_INT8__", "amx-int8", "amx_int8"),
    ("__AMX_BF16__", "amx-bf16", "amx_bf16"),
];

fn main() {
    for var in ["CC", "CFLAGS", "CFLAGS_x86_64_unknown_linux_gnu", "CARGO_ENCODED_RUSTFLAGS"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let arch = std::env::var("CARGO_CFG_TARGET_ARCH").unwrap_or_default();
    let rust: Vec<String> = std::env::var("CARGO_CFG_TARGET_FEATURE")
        .unwrap_or_default()
        .split(',')
        .map(str::to_string)
        .collect();
    let target_cpu = std::env::var("CARGO_ENCODED_RUSTFLAGS")
        .unwrap_or_default()
        .split('\x1f')
        .find_map(|f| f.split("target-cpu=").nth(1).map(str::to_string));
    let c_macros = match (&target_cpu, arch.as_str()) {
        (Some(cpu), "x86_64") => c_macros(cpu),
        _ => Vec::new(),
    };
    let used: Vec<&str> = FEATURES
        .iter()
        .filter(|(mac, feat, _)| rust.iter().any(|f| f == feat) || c_macros.iter().any(|m| m == mac))
        .map(|(_, _, name)| *name)
        .collect();
    let known: Vec<&str> = FEATURES.iter().map(|(_, _, name)| *name).collect();
    // native: -march=native; portable: baseline plus CPU modules picked at run time; else the
    // named -C target-cpu (or the target's baseline).
    let kind = if std::env::var_os("CARGO_FEATURE_PORTABLE").is_some() {
        "portable".to_string()
    } else {
        target_cpu.unwrap_or_else(|| "baseline".to_string())
    };
    println!("cargo:rustc-env=LLOYAL_BUILD_CPU={arch};{kind};{};{}", used.join(","), known.join(","));
}

/// The ISA macros the C compiler predefines for llama.cpp's flags, `-march=<cpu>` and the
/// CFLAGS (empty if it cannot run).
fn c_macros(cpu: &str) -> Vec<String> {
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let mut flags = vec![format!("-march={cpu}")];
    for var in ["CFLAGS", "CFLAGS_x86_64_unknown_linux_gnu"] {
        if let Ok(v) = std::env::var(var) {
            flags.extend(v.split_whitespace().map(str::to_string));
        }
    }
    let out = Command::new(&cc).args(&flags).args(["-dM", "-E", "-x", "c", "/dev/null"]).output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter_map(|l| l.strip_prefix("#define ").and_then(|r| r.split_whitespace().next()))
            .map(str::to_string)
            .collect(),
        _ => {
            println!("cargo:warning=could not ask {cc} for -march={cpu}'s features: lloyal's import check sees Rust's only");
            Vec::new()
        }
    }
}
