//! Spinning before sleeping, where a core is spare.
//!
//! Every engine call hops between threads twice: the caller hands its work to the engine
//! thread and sleeps; the engine decodes, answers, and sleeps until the next call. A thread
//! woken from a futex sleep runs some 20-50 us later (measured on the 2-vCPU Xeon: ~45 us a
//! step outside the engine's ticks with both sleeping, ~5 us with both spinning); on a GPU,
//! where a B = 1 step takes ~1 ms, that is several percent of it (llama.cpp's own loop has
//! no hop, and CUDA's synchronisation spins by default). So the engine thread, after a tick,
//! and a caller waiting for its answer or its next token spin for up to [`SPIN`] before they
//! sleep, but only where that costs the decode nothing: on a context whose layers are on a
//! GPU, or with a core beyond its decode threads (the engine thread is one of them; the caller
//! spins on the spare one), and at most [`MAX_SPINNERS`] threads of the process at once (16
//! generating threads do not all spin).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The longest spin: a GPU step at B = 1 (~1 ms) and its answer fit in it.
pub const SPIN: Duration = Duration::from_millis(2);

/// The most threads of the process spinning at once.
pub const MAX_SPINNERS: usize = 2;

static SPINNING: AtomicUsize = AtomicUsize::new(0);

/// How long the threads of a context with `n_threads` decode threads spin: `LLOYAL_SPIN_US`
/// (microseconds; 0 turns spinning off, for hosts shared with other busy processes) when set,
/// else [`budget`] for this host.
pub fn configured(n_threads: i32, offloaded: bool) -> Duration {
    match std::env::var("LLOYAL_SPIN_US").ok().and_then(|v| v.trim().parse::<u64>().ok()) {
        Some(us) => Duration::from_micros(us).min(Duration::from_secs(1)),
        None => budget(n_threads, offloaded, cpus()),
    }
}

/// How long the threads of a context with `n_threads` decode threads spin on a host with
/// `cpus` cores (`offloaded`: its layers are on a GPU, its decode threads mostly idle).
pub fn budget(n_threads: i32, offloaded: bool, cpus: usize) -> Duration {
    let threads = usize::try_from(n_threads.max(1)).unwrap_or(1);
    if offloaded || cpus > threads {
        SPIN
    } else {
        Duration::ZERO
    }
}

/// The cores this process may run on.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map(std::num::NonZeroUsize::get).unwrap_or(1)
}

/// Spin until `done()` or `budget` passes, if fewer than [`MAX_SPINNERS`] threads spin now;
/// whether `done()` held when it stopped (false at once without a spin).
pub fn until(budget: Duration, done: impl Fn() -> bool) -> bool {
    if budget.is_zero() {
        return false;
    }
    if SPINNING.fetch_add(1, Ordering::AcqRel) >= MAX_SPINNERS {
        SPINNING.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    let end = Instant::now() + budget;
    let mut hit = done();
    while !hit && Instant::now() < end {
        for _ in 0..32 {
            std::hint::spin_loop();
        }
        hit = done();
    }
    SPINNING.fetch_sub(1, Ordering::AcqRel);
    hit
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex};

    /// The spinner count is process-wide: the tests that spin take turns.
    static TURN: Mutex<()> = Mutex::new(());

    #[test]
    fn only_contexts_with_a_spare_core_or_on_a_gpu_spin() {
        assert_eq!(budget(2, false, 2), Duration::ZERO, "2 decode threads on 2 cores");
        assert_eq!(budget(1, false, 2), SPIN, "the caller spins on the second core");
        assert_eq!(budget(8, false, 16), SPIN);
        assert_eq!(budget(16, true, 16), SPIN, "a GPU decodes: the threads are idle");
        assert_eq!(budget(0, false, 1), Duration::ZERO);
    }

    #[test]
    fn a_spin_ends_when_its_condition_holds_or_its_budget_runs_out() {
        let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        assert!(!until(Duration::ZERO, || true), "no budget: no spin");
        assert!(until(SPIN, || true));
        let t0 = Instant::now();
        assert!(!until(Duration::from_millis(5), || false));
        assert!(t0.elapsed() >= Duration::from_millis(5));
        let flag = Arc::new(AtomicBool::new(false));
        let setter = {
            let flag = Arc::clone(&flag);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                flag.store(true, Ordering::Release);
            })
        };
        assert!(until(Duration::from_secs(5), || flag.load(Ordering::Acquire)));
        setter.join().unwrap();
    }

    #[test]
    fn no_more_than_max_spinners_spin_at_once() {
        let _turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
        let stop = Arc::new(AtomicBool::new(false));
        let spinners: Vec<_> = (0..MAX_SPINNERS)
            .map(|_| {
                let stop = Arc::clone(&stop);
                std::thread::spawn(move || until(Duration::from_secs(5), || stop.load(Ordering::Acquire)))
            })
            .collect();
        while SPINNING.load(Ordering::Acquire) < MAX_SPINNERS {
            std::thread::yield_now();
        }
        let t0 = Instant::now();
        assert!(!until(Duration::from_secs(5), || false), "a third spinner sleeps at once");
        assert!(t0.elapsed() < Duration::from_secs(1));
        stop.store(true, Ordering::Release);
        for s in spinners {
            assert!(s.join().unwrap());
        }
    }
}
