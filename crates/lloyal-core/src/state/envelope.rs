//! The versioned envelope around a sequence's KV state (pure: encode/decode, checksum).
//!
//! Corrupt, truncated or foreign bytes are rejected here, before llama.cpp sees them.
//! Layout, all integers little-endian:
//!
//! | offset | size | field                                                       |
//! |--------|------|-------------------------------------------------------------|
//! | 0      | 8    | magic `LLOYALKV`                                            |
//! | 8      | 4    | format version (u32, currently 1)                           |
//! | 12     | 4    | model n_vocab (i32)                                         |
//! | 16     | 4    | model n_embd (i32)                                          |
//! | 20     | 4    | model n_layer (u32)                                         |
//! | 24     | 8    | model parameter count (u64)                                 |
//! | 32     | 32   | model architecture, UTF-8, NUL-padded                       |
//! | 64     | 4    | smallest position in the sequence (i32, -1 when empty)      |
//! | 68     | 4    | largest position in the sequence (i32, -1 when empty)       |
//! | 72     | 4    | n_tokens stored after the header (u32; 0 from `save`)       |
//! | 76     | 8    | payload length in bytes (u64)                               |
//! | 84     | 4*n  | tokens (i32 each)                                           |
//! | ...    | len  | payload: `llama_state_seq_get_data` bytes                   |
//! | end-8  | 8    | FNV-1a 64 of every preceding byte (u64)                     |

use crate::error::{LloyalError, Result};

/// The 8 bytes every lloyal KV state starts with.
pub const MAGIC: &[u8; 8] = b"LLOYALKV";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Bytes before the tokens.
pub const HEADER_LEN: usize = 84;
/// Bytes of the trailing checksum.
pub const CHECKSUM_LEN: usize = 8;
const ARCH_LEN: usize = 32;

/// What identifies the model a state belongs to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint {
    pub n_vocab: i32,
    pub n_embd: i32,
    pub n_layer: u32,
    pub n_params: u64,
    pub architecture: String,
}

/// A decoded (or to-be-encoded) state: where the sequence's positions lie, the tokens that
/// produced it (files only) and llama.cpp's payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SavedState {
    pub pos_min: i32,
    pub pos_max: i32,
    pub tokens: Vec<i32>,
    pub payload: Vec<u8>,
}

/// FNV-1a, 64-bit.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn arch_field(arch: &str) -> [u8; ARCH_LEN] {
    let mut field = [0u8; ARCH_LEN];
    let bytes = arch.as_bytes();
    let n = bytes.len().min(ARCH_LEN);
    field[..n].copy_from_slice(&bytes[..n]);
    field
}

/// Serialise `state` for the model `fp`.
pub fn encode(fp: &Fingerprint, state: &SavedState) -> Vec<u8> {
    let len = HEADER_LEN + 4 * state.tokens.len() + state.payload.len() + CHECKSUM_LEN;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&fp.n_vocab.to_le_bytes());
    out.extend_from_slice(&fp.n_embd.to_le_bytes());
    out.extend_from_slice(&fp.n_layer.to_le_bytes());
    out.extend_from_slice(&fp.n_params.to_le_bytes());
    out.extend_from_slice(&arch_field(&fp.architecture));
    out.extend_from_slice(&state.pos_min.to_le_bytes());
    out.extend_from_slice(&state.pos_max.to_le_bytes());
    out.extend_from_slice(&(state.tokens.len() as u32).to_le_bytes());
    out.extend_from_slice(&(state.payload.len() as u64).to_le_bytes());
    for t in &state.tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&state.payload);
    let sum = fnv1a64(&out);
    out.extend_from_slice(&sum.to_le_bytes());
    out
}

fn bad(msg: impl std::fmt::Display) -> LloyalError {
    LloyalError::State(format!("cannot load KV state: {msg}; nothing was loaded"))
}

fn u32_at(d: &[u8], at: usize) -> u32 {
    let mut b = [0u8; 4];
    b.copy_from_slice(&d[at..at + 4]);
    u32::from_le_bytes(b)
}

fn u64_at(d: &[u8], at: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[at..at + 8]);
    u64::from_le_bytes(b)
}

fn i32_at(d: &[u8], at: usize) -> i32 {
    u32_at(d, at) as i32
}

/// Parse and verify `data` (magic, version, lengths, checksum, then model `expected`).
pub fn decode(expected: &Fingerprint, data: &[u8]) -> Result<SavedState> {
    let head = &data[..data.len().min(MAGIC.len())];
    if head != &MAGIC[..head.len()] {
        return Err(bad("not a lloyal KV state (the magic bytes LLOYALKV are missing)"));
    }
    if data.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(bad(format!(
            "truncated: {} bytes, shorter than the {HEADER_LEN}-byte header",
            data.len()
        )));
    }
    let version = u32_at(data, 8);
    if version != VERSION {
        return Err(bad(format!(
            "format version {version} is not supported (this build reads version {VERSION})"
        )));
    }
    let n_tokens = u32_at(data, 72) as u64;
    let payload_len = u64_at(data, 76);
    let want = (HEADER_LEN as u64 + CHECKSUM_LEN as u64)
        .checked_add(n_tokens * 4)
        .and_then(|n| n.checked_add(payload_len))
        .ok_or_else(|| bad("corrupt header (impossible payload length)"))?;
    if (data.len() as u64) < want {
        return Err(bad(format!("truncated: {} bytes, the header announces {want}", data.len())));
    }
    if (data.len() as u64) > want {
        return Err(bad(format!(
            "{} trailing bytes after the {want} the header announces",
            data.len() as u64 - want
        )));
    }
    let body = data.len() - CHECKSUM_LEN;
    if fnv1a64(&data[..body]) != u64_at(data, body) {
        return Err(bad("checksum mismatch (the bytes are corrupt)"));
    }
    let arch = &data[32..32 + ARCH_LEN];
    let arch_end = arch.iter().position(|&b| b == 0).unwrap_or(ARCH_LEN);
    let found = Fingerprint {
        n_vocab: i32_at(data, 12),
        n_embd: i32_at(data, 16),
        n_layer: u32_at(data, 20),
        n_params: u64_at(data, 24),
        architecture: String::from_utf8_lossy(&arch[..arch_end]).into_owned(),
    };
    let mut expected = expected.clone();
    expected.architecture =
        String::from_utf8_lossy(&arch_field(&expected.architecture)).trim_end_matches('\0').into();
    if found != expected {
        return Err(bad(format!(
            "saved from a different model ({} n_vocab={} n_embd={} n_layer={} n_params={}); this context \
             runs {} n_vocab={} n_embd={} n_layer={} n_params={}",
            found.architecture,
            found.n_vocab,
            found.n_embd,
            found.n_layer,
            found.n_params,
            expected.architecture,
            expected.n_vocab,
            expected.n_embd,
            expected.n_layer,
            expected.n_params
        )));
    }
    let pos_min = i32_at(data, 64);
    let pos_max = i32_at(data, 68);
    if pos_max < pos_min || (pos_min < 0 && (pos_min, pos_max) != (-1, -1)) {
        return Err(bad(format!("corrupt header (positions {pos_min}..={pos_max})")));
    }
    let tokens_end = HEADER_LEN + n_tokens as usize * 4;
    let tokens = (HEADER_LEN..tokens_end).step_by(4).map(|at| i32_at(data, at)).collect();
    Ok(SavedState { pos_min, pos_max, tokens, payload: data[tokens_end..body].to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp() -> Fingerprint {
        Fingerprint {
            n_vocab: 262144,
            n_embd: 640,
            n_layer: 18,
            n_params: 268_098_176,
            architecture: "gemma3".into(),
        }
    }

    fn sample() -> (SavedState, Vec<u8>) {
        let state =
            SavedState { pos_min: 0, pos_max: 4, tokens: vec![2, 651, 3823], payload: (0..200u8).collect() };
        let bytes = encode(&fp(), &state);
        (state, bytes)
    }

    fn is_state_error(r: Result<SavedState>) -> bool {
        matches!(r, Err(LloyalError::State(_)))
    }

    #[test]
    fn round_trip() {
        let (state, bytes) = sample();
        assert_eq!(bytes.len(), HEADER_LEN + 12 + 200 + CHECKSUM_LEN);
        assert_eq!(&bytes[..8], MAGIC);
        assert_eq!(decode(&fp(), &bytes).unwrap(), state);
        let empty = SavedState { pos_min: -1, pos_max: -1, tokens: vec![], payload: vec![] };
        assert_eq!(decode(&fp(), &encode(&fp(), &empty)).unwrap(), empty);
    }

    #[test]
    fn every_truncation_is_rejected() {
        let (_, bytes) = sample();
        for n in 0..bytes.len() {
            assert!(is_state_error(decode(&fp(), &bytes[..n])), "prefix of {n} bytes");
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(is_state_error(decode(&fp(), &longer)));
    }

    #[test]
    fn every_bit_flip_is_rejected() {
        let (_, bytes) = sample();
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut b = bytes.clone();
                b[i] ^= 1 << bit;
                assert!(is_state_error(decode(&fp(), &b)), "byte {i} bit {bit}");
            }
        }
    }

    fn reseal(mut bytes: Vec<u8>, edit: impl FnOnce(&mut [u8])) -> Vec<u8> {
        let body = bytes.len() - CHECKSUM_LEN;
        edit(&mut bytes[..body]);
        let sum = fnv1a64(&bytes[..body]);
        bytes[body..].copy_from_slice(&sum.to_le_bytes());
        bytes
    }

    #[test]
    fn wrong_magic_version_or_model() {
        let (_, bytes) = sample();
        let msg = |r: Result<SavedState>| match r {
            Err(LloyalError::State(m)) => m,
            other => panic!("expected a State error, got {other:?}"),
        };
        assert!(msg(decode(&fp(), &reseal(bytes.clone(), |b| b[0] = b'X'))).contains("magic"));
        assert!(msg(decode(&fp(), b"GGUF and more")).contains("magic"));
        assert!(msg(decode(&fp(), &reseal(bytes.clone(), |b| b[8] = 2))).contains("version 2"));
        assert!(msg(decode(&fp(), &reseal(bytes.clone(), |b| b[16] ^= 1))).contains("different model"));
        assert!(msg(decode(&fp(), &reseal(bytes.clone(), |b| b[32] = b'l'))).contains("different model"));
        let other = Fingerprint { n_layer: 26, ..fp() };
        assert!(msg(decode(&other, &bytes)).contains("n_layer=26"));
        assert!(msg(decode(&fp(), &reseal(bytes.clone(), |b| b[71] = 0xff))).contains("positions"));
    }

    #[test]
    fn long_architecture_names_are_truncated_consistently() {
        let long = Fingerprint { architecture: "x".repeat(40), ..fp() };
        let state = SavedState { pos_min: -1, pos_max: -1, tokens: vec![], payload: vec![1] };
        assert!(decode(&long, &encode(&long, &state)).is_ok());
    }

    #[test]
    fn fnv_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
