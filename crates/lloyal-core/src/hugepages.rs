//! Transparent huge pages for the weights llama.cpp loads into anonymous memory.
//!
//! A decode streams every weight once per step, and on x86 hosts (most of all virtual ones,
//! whose page walks are two-level) 4 KiB pages cost it TLB misses. llama.cpp allocates the
//! weights it reads (`use_mmap=False`, and the repacked Q4 weights in every mode) with
//! `posix_memalign`, which gets huge pages only where the host's THP setting is `always`;
//! under the common `madvise` setting nothing asks for them. lloyal asks: llama.cpp calls its
//! load-progress callback once before it reads the first tensor, after the weight buffers are
//! allocated, and there [`Advisor`] marks the anonymous mappings the load created
//! `MADV_HUGEPAGE`, so the reads that fill them fault in 2 MiB pages (measured on an AMD EPYC
//! VM: 4-12% faster decode, `benches/RESULTS.md`). A mapping made meanwhile by another thread
//! may be marked too: the advice only changes which pages back it.
//!
//! Pure parts (the maps parser, the difference, the aligned span) are plain functions tested
//! here; the `madvise` call is Linux-only and best effort (a host with THP `never` ignores it).

/// 2 MiB: the huge page size `MADV_HUGEPAGE` works in on x86-64 and aarch64 (4 KiB base).
pub const HUGE_PAGE: usize = 2 << 20;

/// A mapping's address range `[start, end)`.
pub type Span = (usize, usize);

/// The private, writable, anonymous mappings in `/proc/<pid>/maps` text (no file, no
/// `[heap]`/`[stack]` name).
pub fn anonymous_spans(maps: &str) -> Vec<Span> {
    maps.lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let range = fields.next()?;
            let perms = fields.next()?;
            let (_offset, _dev, inode) = (fields.next()?, fields.next()?, fields.next()?);
            if fields.next().is_some() || inode != "0" || !perms.starts_with("rw") || !perms.ends_with('p') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((usize::from_str_radix(a, 16).ok()?, usize::from_str_radix(b, 16).ok()?))
        })
        .collect()
}

/// The spans of `now` that `before` lacks and that hold at least one whole huge page, each cut
/// to its huge-page-aligned interior.
pub fn new_huge_spans(before: &[Span], now: &[Span]) -> Vec<Span> {
    now.iter().filter(|s| !before.contains(s)).filter_map(|&(a, b)| huge_interior(a, b)).collect()
}

/// Marks the anonymous mappings a model load creates `MADV_HUGEPAGE`, once, from the load's
/// progress callback ([`Advisor::callback`]).
#[derive(Debug, Default)]
pub struct Advisor {
    before: Vec<Span>,
    done: bool,
    /// Bytes marked.
    pub advised: usize,
}

impl Advisor {
    /// An advisor that remembers the mappings that exist now (before the load).
    pub fn new() -> Self {
        Advisor { before: anonymous_spans(&read_maps()), done: false, advised: 0 }
    }

    /// Mark the mappings made since [`Advisor::new`] (the first call only).
    pub fn advise_new(&mut self) {
        if std::mem::replace(&mut self.done, true) {
            return;
        }
        for (start, end) in new_huge_spans(&self.before, &anonymous_spans(&read_maps())) {
            if advise_huge(start, end - start) {
                self.advised += end - start;
            }
        }
    }

    /// llama.cpp's `progress_callback`: `user_data` is the `Advisor` (see [`Advisor::new`]).
    ///
    /// # Safety
    /// `user_data` must point to a live `Advisor` that nothing else touches during the load.
    pub unsafe extern "C" fn callback(_progress: f32, user_data: *mut std::ffi::c_void) -> bool {
        // SAFETY: the caller passes the `Advisor` it owns for the load's duration (above).
        if let Some(advisor) = unsafe { user_data.cast::<Advisor>().as_mut() } {
            advisor.advise_new();
        }
        true
    }
}

#[cfg(target_os = "linux")]
fn read_maps() -> String {
    std::fs::read_to_string("/proc/self/maps").unwrap_or_default()
}

#[cfg(not(target_os = "linux"))]
fn read_maps() -> String {
    String::new()
}

/// Put the whole huge pages inside `[start, start + len)`, a buffer of this process that has
/// been written already (its 4 KiB pages exist, so `MADV_HUGEPAGE` alone would leave them to
/// `khugepaged`), on huge pages now: `MADV_HUGEPAGE`, then `MADV_COLLAPSE` (Linux 6.1) a huge
/// page at a time. Bytes on huge pages afterwards: 0 where THP is `never`, the kernel is older,
/// or no huge page was free; the buffer then stays on 4 KiB pages, working as before.
///
/// For llama.cpp's logits buffer: a decode's summary reads every row of it once, and on a
/// virtual x86 host a 1 MiB row read through 4 KiB pages costs 256 TLB misses (each a two-level
/// walk). The summary of 16 rows on 2 threads took 37-39 against 43-49 us a row in cache, and
/// 62-73 against 62-77 out of it (`benches/RESULTS.md`).
pub fn collapse_buffer(start: usize, len: usize) -> usize {
    let Some((a, b)) = huge_interior(start, start.saturating_add(len)) else {
        return 0;
    };
    if !advise_huge(a, b - a) {
        return 0;
    }
    (a..b).step_by(HUGE_PAGE).filter(|&page| collapse(page)).count() * HUGE_PAGE
}

/// `[a, b)` cut to whole huge pages, if it holds one.
fn huge_interior(a: usize, b: usize) -> Option<Span> {
    let start = a.checked_add(HUGE_PAGE - 1)? / HUGE_PAGE * HUGE_PAGE;
    let end = b / HUGE_PAGE * HUGE_PAGE;
    (end > start).then_some((start, end))
}

/// `MADV_COLLAPSE` (Linux 6.1; the `libc` crate names it for glibc only).
#[cfg(target_os = "linux")]
const MADV_COLLAPSE: libc::c_int = 25;

/// `madvise(MADV_COLLAPSE)` on the huge page at `page`: whether it is one now.
#[cfg(target_os = "linux")]
fn collapse(page: usize) -> bool {
    // SAFETY: like MADV_HUGEPAGE, MADV_COLLAPSE changes which pages back a range, never what it
    // holds (the kernel copies the small pages into the huge one, and a concurrent access waits
    // for it); on a range that is not (or no longer) a private anonymous mapping, or on pages
    // pinned for a device, it fails without effect.
    unsafe { libc::madvise(page as *mut libc::c_void, HUGE_PAGE, MADV_COLLAPSE) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn collapse(_page: usize) -> bool {
    false
}

/// `madvise(MADV_HUGEPAGE)` on `[start, start + len)`; whether the kernel took it.
#[cfg(target_os = "linux")]
fn advise_huge(start: usize, len: usize) -> bool {
    // SAFETY: MADV_HUGEPAGE changes only which pages back a range, never its contents, and
    // fails (without effect) on a range that is not mapped; callers pass ranges of this
    // process's mappings (read from /proc/self/maps, or a live buffer).
    unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge(_start: usize, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d0c0000000-55d0c0021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0010000000 rw-p 00000000 00:00 0 
7f0010000000-7f0010400000 ---p 00000000 00:00 0 
7f0020000000-7f002f000000 r--p 00000000 fd:01 1234                       /models/m.gguf
7f0030100000-7f0030500000 rw-p 00000000 00:00 0
7f0040000000-7f0040100000 rw-p 00000000 00:00 0
7f0050000000-7f0050200000 r--p 00000000 00:00 0
";

    #[test]
    fn anonymous_spans_are_the_unnamed_private_writable_mappings() {
        assert_eq!(
            anonymous_spans(MAPS),
            vec![
                (0x7f00_0000_0000, 0x7f00_1000_0000),
                (0x7f00_3010_0000, 0x7f00_3050_0000),
                (0x7f00_4000_0000, 0x7f00_4010_0000),
            ]
        );
        assert!(anonymous_spans("garbage\n\n1-2 rw-p").is_empty());
    }

    #[test]
    fn new_spans_are_cut_to_whole_huge_pages() {
        let now = anonymous_spans(MAPS);
        let before = vec![now[0]];
        // 0x7f0030100000..0x7f0030500000: 1 MiB in, so the 2 MiB pages at 0x...200000 and
        // 0x...400000 are whole only up to 0x...400000; the 1 MiB mapping holds none.
        assert_eq!(new_huge_spans(&before, &now), vec![(0x7f00_3020_0000, 0x7f00_3040_0000)]);
        assert!(new_huge_spans(&now, &now).is_empty());
    }

    /// The AnonHugePages of the mapping holding `address` (`/proc/self/smaps`), in bytes.
    #[cfg(target_os = "linux")]
    fn anon_huge_bytes(address: usize) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        for line in smaps.lines() {
            let first = line.split_whitespace().next().unwrap_or("");
            if let Some((lo, hi)) = first.split_once('-').filter(|_| !first.ends_with(':')) {
                let range = usize::from_str_radix(lo, 16).ok().zip(usize::from_str_radix(hi, 16).ok());
                inside = range.is_some_and(|(lo, hi)| lo <= address && address < hi);
            } else if inside && line.starts_with("AnonHugePages:") {
                return line.split_whitespace().nth(1).and_then(|kb| kb.parse::<usize>().ok()).unwrap_or(0)
                    << 10;
            }
        }
        0
    }

    /// A written buffer keeps its contents; what is collapsed is whole huge pages inside the
    /// range, and shows as AnonHugePages (where the kernel can: THP not `never`, Linux 6.1).
    #[cfg(target_os = "linux")]
    #[test]
    fn collapse_buffer_keeps_contents_and_collapses_whole_pages_inside() {
        let len = 6 * HUGE_PAGE;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: a fresh private anonymous mapping of `len` bytes, unmapped below.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
        assert_ne!(ptr, libc::MAP_FAILED);
        // SAFETY: the mapping above, readable and writable, `len` bytes.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<u8>(), len) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        let start = ptr as usize + 4096;
        let (a, b) = huge_interior(start, start + len - 8192).unwrap();
        let collapsed = collapse_buffer(start, len - 8192);
        assert!(collapsed <= b - a && collapsed.is_multiple_of(HUGE_PAGE), "{collapsed} of {}", b - a);
        assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8), "contents changed");
        if collapsed > 0 {
            assert!(anon_huge_bytes(a) >= collapsed, "smaps shows less than {collapsed}");
        }
        assert_eq!(collapse_buffer(start, HUGE_PAGE), 0, "no whole huge page inside");
        // SAFETY: the mapping made above, of `len` bytes.
        unsafe { libc::munmap(ptr, len) };
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn an_advisor_marks_a_mapping_made_after_it_once() {
        let mut advisor = Advisor::new();
        let len = 8 * HUGE_PAGE;
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS;
        // SAFETY: a fresh private anonymous mapping, unmapped below, never dereferenced.
        let ptr = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, flags, -1, 0) };
        assert_ne!(ptr, libc::MAP_FAILED);
        advisor.advise_new();
        let marked = advisor.advised;
        assert!(marked >= len - 2 * HUGE_PAGE, "marked {marked} bytes of a {len}-byte mapping");
        advisor.advise_new();
        assert_eq!(advisor.advised, marked, "the first call only");
        // SAFETY: the mapping made above, of `len` bytes.
        unsafe { libc::munmap(ptr, len) };
    }
}
