//! Streaming UTF-8: joins token pieces so multi-byte characters split across tokens come out whole.

/// Accumulates bytes and releases only complete UTF-8 text.
#[derive(Debug, Clone, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// An empty stream.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add bytes; return the text that is now complete. Invalid bytes become U+FFFD;
    /// an incomplete trailing sequence (at most 3 bytes) waits for the next push.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // The prefix up to valid_up_to is valid UTF-8 by definition.
                    out.push_str(std::str::from_utf8(&self.pending[..valid]).unwrap_or_default());
                    match e.error_len() {
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + bad);
                        }
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// Release whatever is pending (an incomplete tail becomes U+FFFD).
    pub fn flush(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes waiting for completion.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_multibyte_across_pushes() {
        let euro = "€".as_bytes(); // 3 bytes
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&euro[..1]), "");
        assert_eq!(s.push(&euro[1..2]), "");
        assert_eq!(s.push(&[euro[2], b'!']), "€!");
        assert!(s.pending().is_empty());
    }

    #[test]
    fn invalid_bytes_become_replacement() {
        let mut s = Utf8Stream::new();
        assert_eq!(s.push(&[b'a', 0xFF, b'b']), "a\u{FFFD}b");
        assert_eq!(s.push(&[0xE2, 0x82]), "");
        assert_eq!(s.flush(), "\u{FFFD}");
    }
}
