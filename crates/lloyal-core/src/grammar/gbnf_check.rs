//! A pre-flight scan of GBNF text for the inputs that llama.cpp's recursive-descent grammar
//! parser cannot survive: groups nested so deep that parsing overflows the thread's stack
//! (a crash), and a repetition `{m,n}` with `m > n` (llama.cpp loops forever on it).
//!
//! It only tokenises what it must (string literals, character classes, comments, groups,
//! repetition braces); every other syntax error is left to llama.cpp's own parser.

use crate::error::{LloyalError, Result};

/// Deepest `(`…`)` nesting accepted. llama.cpp recurses a few frames per level; this keeps
/// the parse far inside a Python worker thread's stack while allowing any realistic grammar
/// (JSON-schema grammars nest a handful of levels).
pub const MAX_GROUP_DEPTH: usize = 256;

/// Largest repetition bound accepted (llama.cpp expands repetitions into rules).
pub const MAX_REPETITION: u64 = 100_000;

/// Check `gbnf` for the inputs llama.cpp cannot parse safely.
///
/// ```
/// use lloyal_core::grammar::gbnf_check::check_gbnf;
/// assert!(check_gbnf(r#"root ::= "a"{2,3}"#).is_ok());
/// assert!(check_gbnf(r#"root ::= "a"{3,2}"#).is_err());
/// ```
pub fn check_gbnf(gbnf: &str) -> Result<()> {
    let bytes = gbnf.as_bytes();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => i = skip_quoted(bytes, i + 1, b'"'),
            b'[' => i = skip_quoted(bytes, i + 1, b']'),
            b'#' => {
                while i < bytes.len() && bytes[i] != b'\n' && bytes[i] != b'\r' {
                    i += 1;
                }
            }
            b'(' => {
                depth += 1;
                if depth > MAX_GROUP_DEPTH {
                    return Err(LloyalError::Grammar(format!(
                        "the grammar nests groups more than {MAX_GROUP_DEPTH} deep (at byte {i}); \
                         flatten it with named rules"
                    )));
                }
                i += 1;
            }
            b')' => {
                depth = depth.saturating_sub(1);
                i += 1;
            }
            b'{' => i = check_repetition(bytes, i)?,
            _ => i += 1,
        }
    }
    Ok(())
}

/// Index just past the closing `close` of a literal/class opened before `i` (escapes honoured).
fn skip_quoted(bytes: &[u8], mut i: usize, close: u8) -> usize {
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            c if c == close => return i + 1,
            _ => i += 1,
        }
    }
    i
}

/// Validate `{m}`, `{m,}`, `{,n}`, `{m,n}` starting at `open`; index past the `}`.
fn check_repetition(bytes: &[u8], open: usize) -> Result<usize> {
    let Some(len) = bytes[open..].iter().position(|&c| c == b'}') else {
        return Ok(open + 1); // unterminated: llama.cpp reports it
    };
    let close = open + len;
    let inner = String::from_utf8_lossy(&bytes[open + 1..close]);
    let bound = |part: &str| -> Result<Option<u64>> {
        let part = part.trim();
        if part.is_empty() {
            return Ok(None);
        }
        match part.parse::<u64>() {
            Ok(n) if n <= MAX_REPETITION => Ok(Some(n)),
            _ => Err(LloyalError::Grammar(format!(
                "repetition {{{inner}}} at byte {open}: each bound must be a whole number up to {MAX_REPETITION}"
            ))),
        }
    };
    let (min, max) = match inner.split_once(',') {
        Some((lo, hi)) => (bound(lo)?, bound(hi)?),
        None => {
            let n = bound(&inner)?;
            (n, n)
        }
    };
    if let (Some(lo), Some(hi)) = (min, max) {
        if lo > hi {
            return Err(LloyalError::Grammar(format!(
                "repetition {{{inner}}} at byte {open} has a minimum above its maximum; write {{{hi},{lo}}}?"
            )));
        }
    }
    Ok(close + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_grammars() {
        for g in [
            r#"root ::= "a" | "b""#,
            r#"root ::= [a-z]{1,5} "x"{3} "y"{2,} "z"{,4}"#,
            "root ::= (\"(\" [)(] ( \"{3,1}\" ))  # {9,1} in a comment\n",
            r#"root ::= "\"(" [\]{(] "{""#,
        ] {
            assert!(check_gbnf(g).is_ok(), "{g}");
        }
    }

    #[test]
    fn rejects_inverted_and_huge_repetitions() {
        assert!(check_gbnf(r#"root ::= "a"{2,1}"#).unwrap_err().to_string().contains("minimum above"));
        assert!(check_gbnf(r#"root ::= "a"{1000000}"#).unwrap_err().to_string().contains("up to"));
        assert!(check_gbnf(r#"root ::= "a"{x}"#).is_err());
    }

    #[test]
    fn rejects_deep_nesting_but_not_deep_text_in_literals() {
        let deep = format!("root ::= {}\"a\"{}", "(".repeat(300), ")".repeat(300));
        assert!(check_gbnf(&deep).unwrap_err().to_string().contains("256 deep"));
        let ok = format!("root ::= {}\"a\"{}", "(".repeat(256), ")".repeat(256));
        assert!(check_gbnf(&ok).is_ok());
        let literal = format!("root ::= \"{}\"", "(".repeat(10_000));
        assert!(check_gbnf(&literal).is_ok());
    }

    #[test]
    fn tolerates_truncated_input() {
        for g in ["root ::= \"abc", "root ::= [abc", "root ::= \"a\"{2,", "root ::= \"\\"] {
            let _ = check_gbnf(g);
        }
    }
}
