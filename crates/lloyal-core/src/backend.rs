//! The process-wide llama.cpp backend and its log routing.

use std::collections::VecDeque;
use std::ffi::{c_char, c_void, CStr};
use std::sync::{Mutex, OnceLock};

use llama_cpp_2::llama_backend::LlamaBackend;

static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();
static RECENT_ERRORS: Mutex<VecDeque<String>> = Mutex::new(VecDeque::new());
const KEEP_LINES: usize = 8;

/// The initialised backend (initialised on first use; llama.cpp allows one per process).
pub fn backend() -> &'static LlamaBackend {
    BACKEND.get_or_init(|| {
        install_log_router();
        load_cpu_backends();
        // The only caller of init() is this OnceLock, so it cannot be initialised twice.
        // If another library already initialised llama.cpp in this process, the backend
        // is usable all the same; the value is only a proof token.
        LlamaBackend::init().unwrap_or(LlamaBackend {})
    })
}

/// Where a portable build finds its backend modules (`libggml-cpu-<level>.so`): the Python
/// package sets this to the folder its wheel ships them in, before it imports the extension.
pub const BACKENDS_DIR_VAR: &str = "LLOYAL_BACKENDS_DIR";

static BACKENDS_DIR: OnceLock<Option<String>> = OnceLock::new();

/// [`BACKENDS_DIR_VAR`] as it was at the first call, which the extension's module init makes:
/// the folder the package chose for this process holds after the package removes the variable
/// again (so that child processes choose their own folder for their own CPU).
pub fn backends_dir() -> Option<&'static str> {
    BACKENDS_DIR.get_or_init(|| std::env::var(BACKENDS_DIR_VAR).ok()).as_deref()
}

/// Portable builds (feature `portable`) ship llama.cpp's CPU backend once per x86-64 level (or
/// Arm version) as a module and load here the best one this CPU runs: ggml scores each module by
/// the CPU features it was built for. Native builds link one CPU backend and load nothing.
#[cfg(feature = "portable")]
fn load_cpu_backends() {
    let dir = backends_dir().map(String::from).or(llama_cpp_sys_2::BACKENDS_DIR.map(String::from));
    let Some(dir) = dir.and_then(|d| std::ffi::CString::new(d).ok()) else {
        return;
    };
    // SAFETY: a NUL-terminated path valid for the call; ggml copies what it keeps. Called once,
    // from the backend's OnceLock, before any model or context exists.
    unsafe { llama_cpp_sys_2::ggml_backend_load_all_from_path(dir.as_ptr()) };
}

#[cfg(not(feature = "portable"))]
fn load_cpu_backends() {}

/// What llama.cpp was built with and runs on: one `NAME : FEATURE = 1 | ...` group per backend
/// (for a portable build, the CPU level it picked at run time).
pub fn system_info() -> String {
    static LOCK: Mutex<()> = Mutex::new(());
    backend();
    // llama.cpp builds the answer in one static string: one caller at a time.
    let _guard = LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // SAFETY: llama_print_system_info returns a pointer to its static NUL-terminated string,
    // valid until the next call, which the lock above keeps out until the copy is made.
    let text = unsafe { llama_cpp_sys_2::llama_print_system_info() };
    if text.is_null() {
        return String::new();
    }
    // SAFETY: non-null and NUL-terminated (above).
    unsafe { CStr::from_ptr(text) }.to_string_lossy().trim().to_string()
}

/// Whether llama.cpp's own log lines go to stderr (`LLOYAL_LOG=1`).
fn verbose() -> bool {
    std::env::var_os("LLOYAL_LOG").is_some_and(|v| v != "0" && !v.is_empty())
}

unsafe extern "C" fn route_log(level: llama_cpp_sys_2::ggml_log_level, text: *const c_char, _: *mut c_void) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string valid for the duration of the call.
    let line = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    if verbose() {
        eprint!("{line}");
    }
    if level == llama_cpp_sys_2::GGML_LOG_LEVEL_ERROR || level == llama_cpp_sys_2::GGML_LOG_LEVEL_WARN {
        if let Ok(mut q) = RECENT_ERRORS.lock() {
            if q.len() == KEEP_LINES {
                q.pop_front();
            }
            q.push_back(line.trim().to_string());
        }
    }
}

fn install_log_router() {
    // SAFETY: the callback is a plain function valid for the process lifetime; null user data.
    unsafe { llama_cpp_sys_2::llama_log_set(Some(route_log), std::ptr::null_mut()) };
}

/// Forget buffered llama.cpp warnings/errors (call before an operation whose failure you explain).
pub fn clear_recent_errors() {
    if let Ok(mut q) = RECENT_ERRORS.lock() {
        q.clear();
    }
}

/// The warnings/errors llama.cpp logged since the last [`clear_recent_errors`], joined.
pub fn recent_errors() -> String {
    RECENT_ERRORS
        .lock()
        .map(|q| q.iter().filter(|l| !l.is_empty()).cloned().collect::<Vec<_>>().join("; "))
        .unwrap_or_default()
}

/// [`recent_errors`], or `fallback` when llama.cpp logged none (an error message's detail).
pub fn recent_errors_or(fallback: &str) -> String {
    match recent_errors() {
        d if d.is_empty() => fallback.to_string(),
        d => d,
    }
}
