//! LoRA adapters: low-rank weight deltas loaded for a model and applied by a context to every
//! token it decodes (llama.cpp's `llama_adapter_lora`, as llama-cpp-python's `lora_path` and
//! llama-server's `--lora`).
//!
//! An adapter is loaded once per (model, file): a path loaded twice for the same weights
//! returns the same adapter, as a model path opened twice loads once, unless the file changed
//! in between (its size or modification time: a training loop writing checkpoints to one
//! path gets the new weights). The adapters of a
//! context are fixed when it is created (`ContextOptions::lora`), so every KV cell it holds
//! was computed under the same weights.

pub mod ffi;

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};

use crate::backend::{backend, clear_recent_errors, recent_errors_or};
use crate::error::{LloyalError, Result};
use crate::model::Model;
use crate::model_file::{check_gguf_as, GgufRole};
use ffi::RawLora;

/// A LoRA adapter loaded for one model.
pub struct LoraAdapter {
    raw: Arc<RawLora>,
    path: PathBuf,
    model: Arc<Model>,
    /// The file's size and modification time when it was loaded.
    stamp: Option<FileStamp>,
}

/// A file's size and modification time: a file rewritten in place differs in one of them.
type FileStamp = (u64, std::time::SystemTime);

/// `path`'s [`FileStamp`] now (`None` where the file system keeps no modification time).
fn stamp(path: &Path) -> Option<FileStamp> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.len(), meta.modified().ok()?))
}

impl std::fmt::Debug for LoraAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraAdapter").field("path", &self.path).finish()
    }
}

/// Adapters loaded and still held somewhere, for [`LoraAdapter::load`]'s reuse.
static LOADED: Mutex<Vec<Weak<LoraAdapter>>> = Mutex::new(Vec::new());

impl LoraAdapter {
    /// Load the adapter at `path` for `model`, or return the one already loaded for both.
    ///
    /// `LoraLoad` (naming the path; `ModelLoadError` in Python) when the file is missing, not a GGUF, not a LoRA adapter,
    /// made for another architecture or with tensors of the wrong shape for `model`, or an
    /// activated LoRA (aLoRA, which applies only after its invocation tokens).
    pub fn load(model: &Arc<Model>, path: &Path) -> Result<Arc<LoraAdapter>> {
        check_gguf_as(path, GgufRole::LoraAdapter).map_err(|e| match e {
            LloyalError::ModelLoad { path, reason } => LloyalError::LoraLoad { path, reason },
            other => other,
        })?;
        let canonical = path.canonicalize().unwrap_or_else(|_| path.to_path_buf());
        let now = stamp(&canonical);
        let mut loaded = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        loaded.retain(|w| w.strong_count() > 0);
        let same = |a: &Arc<LoraAdapter>| {
            Arc::ptr_eq(&a.model, model) && a.path == canonical && a.stamp.is_some() && a.stamp == now
        };
        if let Some(adapter) = loaded.iter().filter_map(Weak::upgrade).find(same) {
            return Ok(adapter);
        }
        let adapter = Arc::new(Self::load_uncached(model, canonical, now)?);
        loaded.push(Arc::downgrade(&adapter));
        Ok(adapter)
    }

    fn load_uncached(model: &Arc<Model>, path: PathBuf, stamp: Option<FileStamp>) -> Result<LoraAdapter> {
        let fail = |reason: String| LloyalError::LoraLoad { path: path.display().to_string(), reason };
        let text = path.to_str().ok_or_else(|| fail("the path is not valid UTF-8".into()))?;
        let cpath = CString::new(text).map_err(|_| fail("the path contains a NUL byte".into()))?;
        backend();
        clear_recent_errors();
        let raw = RawLora::load(model.clone(), &cpath).ok_or_else(|| {
            fail(format!(
                "llama.cpp could not load it as a LoRA adapter for {} ({})",
                model.path().display(),
                recent_errors_or("no reason given")
            ))
        })?;
        if raw.alora_invocation_tokens() > 0 {
            return Err(fail(
                "it is an activated LoRA (aLoRA), which applies only after its invocation tokens; \
                 lloyal applies an adapter to every token, so use a plain LoRA adapter"
                    .into(),
            ));
        }
        Ok(LoraAdapter { raw: Arc::new(raw), path, model: model.clone(), stamp })
    }

    /// The adapter file (canonicalised).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model it was loaded for.
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// `adapter.lora.alpha` from the file (0 when absent: llama.cpp then scales by the
    /// user's scale alone, else by `scale * alpha / rank`).
    pub fn alpha(&self) -> f32 {
        self.meta("adapter.lora.alpha").and_then(|v| v.trim().parse().ok()).unwrap_or(0.0)
    }

    /// The adapter file's metadata value for `key`, as text.
    pub fn meta(&self, key: &str) -> Option<String> {
        self.raw.meta(key)
    }

    pub(crate) fn raw(&self) -> &Arc<RawLora> {
        &self.raw
    }
}

/// An adapter and the scale a context applies it with.
#[derive(Debug, Clone)]
pub struct LoraUse {
    pub adapter: Arc<LoraAdapter>,
    pub scale: f32,
}

impl PartialEq for LoraUse {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.adapter, &other.adapter) && self.scale.to_bits() == other.scale.to_bits()
    }
}

/// Check a context's adapters against its model: finite scales, each adapter loaded for
/// `model`, none twice. `Invalid` with the reason otherwise.
pub fn check(loras: &[LoraUse], model: &Arc<Model>) -> Result<()> {
    for (i, l) in loras.iter().enumerate() {
        if !l.scale.is_finite() {
            return Err(LloyalError::invalid(format!(
                "lora[{i}]: the scale of {} must be a finite number, got {}",
                l.adapter.path.display(),
                l.scale
            )));
        }
        if !Arc::ptr_eq(&l.adapter.model, model) {
            return Err(LloyalError::invalid(format!(
                "lora[{i}]: {} was loaded for the model {} (loaded with other options or from \
                 another file), not for this context's {}; load it with this context's model \
                 (model.load_lora(path))",
                l.adapter.path.display(),
                l.adapter.model.path().display(),
                model.path().display()
            )));
        }
        if loras[..i].iter().any(|o| Arc::ptr_eq(&o.adapter, &l.adapter)) {
            return Err(LloyalError::invalid(format!(
                "lora[{i}]: {} is listed twice; give it once, with the sum of the scales",
                l.adapter.path.display()
            )));
        }
    }
    Ok(())
}
