//! ggml's tiled K-quant matmul: on for llama.cpp's speed, off (process-wide) for batch invariance.
//!
//! ggml takes its tiled K-quant matmul only for batches of 8+ rows, so with it a token's
//! result depends on how many rows share its decode. It is one switch for the whole process,
//! the environment variable `GGML_CPU_TILED_MM`, which ggml reads once, at its first matmul.
//! lloyal leaves it on (llama.cpp's default) unless a batch-invariant context is created
//! before the process's first decode: that context turns it off for the whole process.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// The environment switch ggml reads.
pub const TILED_MATMUL: &str = "GGML_CPU_TILED_MM";

static DECODED: AtomicBool = AtomicBool::new(false);
/// Orders the first decode against [`keep_off`]: the switch is set before ggml can read it.
static SWITCH: Mutex<()> = Mutex::new(());

/// Record that a decode is about to run (ggml may read the switch from now on).
pub fn note_decode() {
    if !DECODED.load(Ordering::Acquire) {
        let _guard = SWITCH.lock().unwrap_or_else(PoisonError::into_inner);
        DECODED.store(true, Ordering::Release);
    }
}

/// Whether the variable's value turns the tiled matmul off (ggml: set and `atoi(value) == 0`).
fn value_is_off(v: &str) -> bool {
    let v = v.trim_start();
    let digits: String =
        v.strip_prefix(['+', '-']).unwrap_or(v).chars().take_while(char::is_ascii_digit).collect();
    digits.chars().all(|c| c == '0')
}

/// Whether the tiled matmul is off in this process, or can still be turned off.
fn can_be_off() -> Result<(), String> {
    check(std::env::var(TILED_MATMUL).ok().as_deref(), DECODED.load(Ordering::Acquire))
}

fn check(value: Option<&str>, decoded: bool) -> Result<(), String> {
    match value {
        Some(v) if value_is_off(v) => Ok(()),
        Some(_) => Err(format!(
            "{TILED_MATMUL} is set to a non-zero value, which turns on ggml's tiled K-quant matmul \
             for batches of 8+ rows; unset it or set it to 0"
        )),
        None if decoded => Err(format!(
            "ggml's tiled K-quant matmul (batches of 8+ rows) is a process-wide switch that is on \
             once this process has decoded; create batch-invariant contexts before decoding on \
             other contexts, or start the process with {TILED_MATMUL}=0"
        )),
        None => Ok(()),
    }
}

/// Turn the tiled matmul off for the whole process (a batch-invariant context is being made):
/// `Err` says why it cannot be (already on).
pub fn keep_off() -> Result<(), String> {
    let _guard = SWITCH.lock().unwrap_or_else(PoisonError::into_inner);
    can_be_off()?;
    if std::env::var_os(TILED_MATMUL).is_none() {
        std::env::set_var(TILED_MATMUL, "0");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_can_be_turned_off_until_the_first_decode() {
        assert!(check(None, false).is_ok());
        assert!(check(Some("0"), true).is_ok());
        assert!(check(Some(" 00"), true).is_ok());
        assert!(check(Some("abc"), true).is_ok()); // atoi("abc") == 0
        let on = check(Some("1"), false).unwrap_err();
        assert!(on.contains("non-zero"), "{on}");
        let late = check(None, true).unwrap_err();
        assert!(late.contains("before decoding") && late.contains("GGML_CPU_TILED_MM=0"), "{late}");
    }
}
