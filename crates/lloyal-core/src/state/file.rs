//! State files: an atomic write, so a crash never leaves a half-written state under a path.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Numbers each write's temporary file: two threads writing one path do not share one.
static WRITES: AtomicU64 = AtomicU64::new(0);

/// Write `data` to `path` through a sibling temporary file and a rename, so a crash never
/// leaves a half-written state under `path`.
pub fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let mut tmp: PathBuf = path.to_path_buf();
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let n = WRITES.fetch_add(1, Ordering::Relaxed);
    tmp.set_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(data)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
