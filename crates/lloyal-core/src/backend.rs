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
        // The only caller of init() is this OnceLock, so it cannot be initialised twice.
        // If another library already initialised llama.cpp in this process, the backend
        // is usable all the same; the value is only a proof token.
        LlamaBackend::init().unwrap_or(LlamaBackend {})
    })
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
