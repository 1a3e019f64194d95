//! The CPU features this build's code uses unconditionally (`build.rs`), kept in the binary as
//! a marker that `python/lloyal/_cpu.py` reads from the file before it loads the extension.

/// `LLOYAL_BUILD_CPU=<arch>;<native|portable>;<used,...>;<checked,...>` and a newline.
#[used]
static BUILD_CPU_MARKER: &str = concat!("LLOYAL_BUILD_CPU=", env!("LLOYAL_BUILD_CPU"), "\n");

/// The marker's value (`<arch>;<native|portable>;<used>;<checked>`).
pub fn build_cpu() -> &'static str {
    env!("LLOYAL_BUILD_CPU")
}
