//! Checks a model path before llama.cpp parses it, so bad files fail with a clear error.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use crate::error::{LloyalError, Result};

/// Smallest plausible GGUF: magic + version + tensor count + kv count.
const GGUF_HEADER_LEN: u64 = 4 + 4 + 8 + 8;
const GGUF_MAGIC: &[u8; 4] = b"GGUF";

fn load_error(path: &Path, reason: impl Into<String>) -> LloyalError {
    LloyalError::ModelLoad { path: path.display().to_string(), reason: reason.into() }
}

/// What a GGUF file is opened as: its check's messages name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufRole {
    Model,
    LoraAdapter,
}

impl GgufRole {
    fn noun(self) -> &'static str {
        match self {
            GgufRole::Model => "model",
            GgufRole::LoraAdapter => "LoRA adapter",
        }
    }
}

/// Verify that `path` names a readable GGUF file (v2 or v3) with a plausible header.
///
/// This catches missing files, directories, empty or truncated files and foreign
/// formats before llama.cpp sees them; deeper corruption is left to llama.cpp, which
/// reports it as a load failure (not an abort).
pub fn check_gguf_file(path: &Path) -> Result<()> {
    check_gguf_as(path, GgufRole::Model)
}

/// [`check_gguf_file`] for a file opened as `role` (the messages' words and hints are its).
pub fn check_gguf_as(path: &Path, role: GgufRole) -> Result<()> {
    let hint = if role == GgufRole::Model { " (or set LLOYAL_MODEL)" } else { "" };
    let meta = std::fs::metadata(path).map_err(|e| load_error(path, format!("{e}; check the path{hint}")))?;
    if meta.is_dir() {
        return Err(load_error(path, "it is a directory, not a .gguf file"));
    }
    if meta.len() < GGUF_HEADER_LEN {
        return Err(load_error(
            path,
            format!(
                "the file is {} bytes, too small to be a GGUF {} (truncated or empty?)",
                meta.len(),
                role.noun()
            ),
        ));
    }
    let mut header = [0u8; GGUF_HEADER_LEN as usize];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(|e| load_error(path, format!("cannot read the file header: {e}")))?;
    check_gguf_header(&header).map_err(|reason| load_error(path, reason))
}

/// Pure header check (unit-tested): magic and a supported version.
pub fn check_gguf_header(header: &[u8]) -> std::result::Result<(), String> {
    if header.len() < GGUF_HEADER_LEN as usize || &header[..4] != GGUF_MAGIC {
        return Err("not a GGUF file (wrong magic bytes); lloyal loads llama.cpp .gguf models".into());
    }
    let version = u32::from_le_bytes([header[4], header[5], header[6], header[7]]);
    if !(2..=3).contains(&version) {
        return Err(format!("unsupported GGUF version {version} (expected 2 or 3)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(magic: &[u8; 4], version: u32) -> Vec<u8> {
        let mut h = magic.to_vec();
        h.extend_from_slice(&version.to_le_bytes());
        h.extend_from_slice(&[0u8; 16]);
        h
    }

    #[test]
    fn accepts_v3() {
        assert!(check_gguf_header(&header(b"GGUF", 3)).is_ok());
    }

    #[test]
    fn rejects_wrong_magic_and_version() {
        assert!(check_gguf_header(&header(b"GGML", 3)).unwrap_err().contains("magic"));
        assert!(check_gguf_header(&header(b"GGUF", 9)).unwrap_err().contains("version 9"));
        assert!(check_gguf_header(b"GG").is_err());
    }

    #[test]
    fn file_checks() {
        let dir = std::env::temp_dir().join(format!("lloyal-mf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = check_gguf_file(&dir).unwrap_err().to_string();
        assert!(err.contains("directory"), "{err}");
        let empty = dir.join("empty.gguf");
        std::fs::write(&empty, b"").unwrap();
        assert!(check_gguf_file(&empty).unwrap_err().to_string().contains("0 bytes"));
        let missing = dir.join("missing.gguf");
        assert!(check_gguf_file(&missing).unwrap_err().to_string().contains("missing.gguf"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
