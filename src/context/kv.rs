//! `Context`'s raw KV cache operations and KV state files.

use crate::convert::clamp_i32;
use crate::detach::{detached_io_at, run};
use lloyal_core::write_atomic;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use std::path::PathBuf;

use super::{to_i32, PyContext};
use crate::convert::Tokens;

#[pymethods]
impl PyContext {
    // ----- raw KV ops -----

    /// Largest position stored for ``seq_id`` (-1 when empty).
    #[pyo3(signature = (seq_id=0))]
    fn kv_cache_size(&self, py: Python<'_>, seq_id: i64) -> PyResult<i32> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.seq_pos_max(seq_id))
    }

    /// Largest position stored for ``seq_id`` (-1 when empty).
    fn kv_seq_pos_max(&self, py: Python<'_>, seq_id: i64) -> PyResult<i32> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.seq_pos_max(seq_id))
    }

    /// Empty every sequence (refused while a branch holds one).
    fn kv_cache_clear(&self, py: Python<'_>) -> PyResult<()> {
        run(py, self.ctx(), |s| s.kv_clear())
    }

    /// Remove positions ``[start, end)`` of ``seq_id``; ``end=-1`` means to the end.
    #[pyo3(signature = (seq_id, start, end=-1), text_signature = "(self, seq_id, start, end=-1)")]
    fn kv_cache_remove(&self, py: Python<'_>, seq_id: i64, start: i64, end: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let start = clamp_i32(start);
        let end = clamp_i32(end);
        run(py, self.ctx(), move |s| s.kv_remove(seq_id, start, end))
    }

    /// Share ``src``'s cells ``[p0, p1)`` with ``dst`` (metadata only, no tensor copy).
    #[pyo3(signature = (src, dst, p0=0, p1=-1), text_signature = "(self, src, dst, p0=0, p1=-1)")]
    fn kv_seq_copy(&self, py: Python<'_>, src: i64, dst: i64, p0: i64, p1: i64) -> PyResult<()> {
        let src = clamp_i32(src);
        let dst = clamp_i32(dst);
        let p0 = clamp_i32(p0);
        let p1 = clamp_i32(p1);
        run(py, self.ctx(), move |s| s.kv_copy(src, dst, p0, p1))
    }

    /// Keep only ``seq_id``; drop every other sequence's cells.
    fn kv_seq_keep(&self, py: Python<'_>, seq_id: i64) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        run(py, self.ctx(), move |s| s.kv_keep(seq_id))
    }

    // ----- KV state -----

    /// ``seq_id``'s KV cells (via ``llama_state_seq_get_data``) in a verified envelope.
    ///
    /// Format (little-endian): magic ``LLOYALKV``, u32 version (1), the model's fingerprint
    /// (i32 n_vocab, i32 n_embd, u32 n_layer, u64 n_params, 32-byte NUL-padded
    /// architecture), i32 smallest and largest position, u32 token count, u64 payload
    /// length, the tokens (i32 each), llama.cpp's payload, and a trailing u64 FNV-1a 64 of
    /// every preceding byte. No logits are saved.
    ///
    /// Raises:
    ///     ValueError: ``seq_id`` outside ``[0, n_seq_max)``.
    #[pyo3(signature = (seq_id=0))]
    fn kv_cache_save<'py>(&self, py: Python<'py>, seq_id: i64) -> PyResult<Bound<'py, PyBytes>> {
        let seq_id = clamp_i32(seq_id);
        let data = run(py, self.ctx(), move |s| s.kv_save(seq_id))?;
        Ok(PyBytes::new(py, &data))
    }

    /// Replace ``seq_id``'s cells with bytes from :meth:`kv_cache_save`.
    ///
    /// The envelope is verified (magic, version, lengths, checksum, model fingerprint)
    /// before llama.cpp sees the payload. On any failure ``seq_id`` is left empty and no
    /// other sequence changes. No logits are restored: decode the next token to get some.
    ///
    /// Raises:
    ///     StateError: truncated, corrupt or foreign bytes, or llama.cpp refused the payload
    ///         (another cache type, too few free cells).
    ///     SeqLeasedError: a live branch holds ``seq_id`` (nothing is changed).
    fn kv_cache_load(&self, py: Python<'_>, seq_id: i64, data: &[u8]) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let data = data.to_vec();
        run(py, self.ctx(), move |s| s.kv_load(seq_id, &data).map(drop))
    }

    /// Save ``seq_id``'s cells with ``tokens`` (the text they came from) to ``path``.
    ///
    /// Same format as :meth:`kv_cache_save`; written to a temporary file and renamed, so
    /// ``path`` never holds a half-written state.
    fn kv_cache_write_file(
        &self,
        py: Python<'_>,
        seq_id: i64,
        path: PathBuf,
        tokens: Tokens,
    ) -> PyResult<()> {
        let seq_id = clamp_i32(seq_id);
        let tokens = to_i32(self.inner.model(), &tokens)?;
        let data = run(py, self.ctx(), move |s| s.kv_save_tokens(seq_id, &tokens))?;
        let at = path.clone();
        detached_io_at(py, &at, move || write_atomic(&path, &data))
    }

    /// Load a file from :meth:`kv_cache_write_file` into ``seq_id``; returns its tokens.
    ///
    /// Raises:
    ///     OSError: the file cannot be read (nothing is changed).
    ///     StateError: as :meth:`kv_cache_load` (``seq_id`` is left empty).
    ///     SeqLeasedError: a live branch holds ``seq_id``.
    fn kv_cache_read_file(&self, py: Python<'_>, seq_id: i64, path: PathBuf) -> PyResult<Vec<i32>> {
        let seq_id = clamp_i32(seq_id);
        self.check_open()?;
        let data = detached_io_at(py, &path, || std::fs::read(&path))?;
        run(py, self.ctx(), move |s| s.kv_load(seq_id, &data))
    }
}
