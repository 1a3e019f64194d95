//! How long an idle engine waits for the rest of a burst before a prompt's first tick.
//!
//! Requests that arrive together (a server's concurrent clients) reach the engine a few
//! milliseconds apart. A tick that starts with the first prompt alone makes the others wait
//! for the whole tick, so an idle engine given a prompt waits a moment for company first. That
//! moment is pure latency for a caller who has none (a library user's prefill, a server at
//! concurrency 1), so it is a share ([`SHARE`]) of the tick it may spare the others, and at
//! most [`MAX_WAIT`]: the estimate is the `llama_decode` time a prompt row took in the fastest
//! of the last [`REMEMBERED`] ticks that wrote only prompt rows, times the rows the waiting
//! prompts will write in their first tick (at most `n_batch`). Before any such tick the wait
//! is [`MAX_WAIT`]. The fastest, not the last: one slow tick (another process on the cores, a
//! GPU's graph rebuilt) would otherwise stretch the next wait. A context's first decode is slow
//! too (OpenMP's team started, the weights first read: 8-28 ms for 2 tokens of a small model on
//! a CPU whose 512-token tick takes 4), and, nothing faster known yet, still sets the wait of
//! the second prompt that has company.
//!
//! On a CPU a prompt tick takes tens of milliseconds to a second: the wait is [`MAX_WAIT`]. On
//! a GPU a 512-token prompt takes ~9 ms: the wait is ~0.5 ms, not 5.
//!
//! Only a caller with company gains from the wait: after a wait that ended with one caller's
//! prompt alone (a library's prefills one after another, a server at concurrency 1) the next
//! prompt starts at once, as in llama-server and vLLM, and the engine watches for the company
//! that prompt may have missed: a prompt that arrives within the wait it skipped while its tick
//! runs (the caller's own next prompt comes after the tick), or two callers' prompts queued
//! together, bring the wait back for the next burst. So after a lone stretch a burst splits
//! once (its first prompt alone), and a lone caller waits once, not at every prompt.

use std::time::{Duration, Instant};

/// The longest wait (a CPU's, where a prompt's tick is long).
pub const MAX_WAIT: Duration = Duration::from_millis(5);

/// The wait as a share of the tick it would spare the rest of a burst.
pub const SHARE: f64 = 0.05;

/// Prompt-only ticks the estimate is taken from (the fastest of them): one slow tick is
/// forgotten as soon as a faster one is seen, a lasting slow-down after this many.
pub const REMEMBERED: usize = 8;

/// What the burst wait knows: the recent prompt-only ticks.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BurstWait {
    /// `llama_decode` seconds per prompt row of the last [`REMEMBERED`] ticks that wrote prompt
    /// rows only, oldest first.
    recent: std::collections::VecDeque<f64>,
    /// The most rows a tick decodes (`n_batch`), as last seen.
    n_batch: usize,
    /// The last wait ended with one caller's prompt, and no other came since within the wait a
    /// prompt skipped: the next prompt starts at once.
    alone: bool,
    /// The last prompt that started at once: when, and the end of the window in which another
    /// prompt's arrival says it had company (the wait it skipped, cut at the end of its tick).
    skipped: Option<(Instant, Instant)>,
}

impl BurstWait {
    /// The wait before the first tick of an idle engine given `prompts` callers' prompts
    /// writing `prompt_rows` tokens in all, starting `now`: [`BurstWait::estimate`], or none
    /// for a caller alone since the last wait (the wait it skips is then watched:
    /// [`BurstWait::arrived`]). Two callers' prompts queued together are company.
    pub fn begin(&mut self, now: Instant, prompts: usize, prompt_rows: usize) -> Duration {
        let wait = self.estimate(prompt_rows);
        self.alone &= prompts <= 1;
        if self.alone {
            self.skipped = Some((now, now + wait));
            return Duration::ZERO;
        }
        wait
    }

    /// A wait taken has ended with `prompts` callers' prompts queued: one alone starts the
    /// next burst at once.
    pub fn ended(&mut self, prompts: usize) {
        self.alone = prompts <= 1;
    }

    /// The tick that started the last prompt at once ended `at`: a prompt arriving later, even
    /// within the wait it skipped, is no company (a lone caller's next prompt, sent once the
    /// tick answered it, when the tick was shorter than the wait estimated).
    pub fn tick_ended(&mut self, at: Instant) {
        if let Some((_, end)) = &mut self.skipped {
            *end = (*end).min(at);
        }
    }

    /// The prompts now queued arrived at `arrivals`: one that came after the last prompt that
    /// started at once, within the wait it skipped and during its tick, would have shared that
    /// tick: the next burst waits again.
    pub fn arrived(&mut self, now: Instant, arrivals: impl IntoIterator<Item = Instant>) {
        let Some((start, end)) = self.skipped else {
            return;
        };
        if arrivals.into_iter().any(|at| at > start && at <= end) {
            self.alone = false;
            self.skipped = None;
        } else if now > end {
            self.skipped = None; // nothing arriving later was in the window
        }
    }

    /// The wait before the first tick of prompts writing `prompt_rows` tokens in all, for a
    /// caller with company.
    pub fn estimate(&self, prompt_rows: usize) -> Duration {
        let Some(per_row) = self.recent.iter().copied().reduce(f64::min) else {
            return MAX_WAIT;
        };
        let rows_now = if self.n_batch > 0 { prompt_rows.min(self.n_batch) } else { prompt_rows };
        let tick = per_row * rows_now as f64;
        Duration::from_secs_f64((tick * SHARE).clamp(0.0, MAX_WAIT.as_secs_f64()))
    }

    /// Learn from a tick that decoded `decode_rows` commit rows and `prefill_rows` prompt rows
    /// in `seconds` of `llama_decode`, on a context of `n_batch`.
    pub fn observe(&mut self, decode_rows: usize, prefill_rows: usize, seconds: f64, n_batch: usize) {
        self.n_batch = n_batch;
        if decode_rows == 0 && prefill_rows > 0 && seconds.is_finite() && seconds >= 0.0 {
            if self.recent.len() == REMEMBERED {
                self.recent.pop_front();
            }
            self.recent.push_back(seconds / prefill_rows as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn before_any_prompt_tick_the_wait_is_the_longest() {
        assert_eq!(BurstWait::default().estimate(512), MAX_WAIT);
    }

    #[test]
    fn a_short_prompt_tick_makes_a_short_wait_and_a_long_one_the_longest() {
        let mut gpu = BurstWait::default();
        gpu.observe(0, 512, 0.009, 512); // a GPU's 512-token prompt
        assert!((gpu.estimate(512).as_secs_f64() - 0.009 * SHARE).abs() < 1e-9);
        let mut cpu = BurstWait::default();
        cpu.observe(0, 512, 0.5, 512); // a CPU's
        assert_eq!(cpu.estimate(512), MAX_WAIT);
    }

    #[test]
    fn a_slow_first_tick_is_forgotten_once_a_faster_one_is_seen() {
        let mut w = BurstWait::default();
        w.observe(0, 512, 0.040, 512); // a context's first decode: buffers, pages, graphs
        assert!((w.estimate(512).as_secs_f64() - 0.040 * SHARE).abs() < 1e-9);
        w.observe(0, 512, 0.004, 512);
        assert!((w.estimate(512).as_secs_f64() - 0.004 * SHARE).abs() < 1e-9);
        w.observe(0, 256, 0.003, 512); // slower a row than the 512-token tick: not the estimate
        assert!((w.estimate(512).as_secs_f64() - 0.004 * SHARE).abs() < 1e-9);
    }

    #[test]
    fn a_lasting_slow_down_is_learned_after_the_remembered_ticks() {
        let mut w = BurstWait::default();
        w.observe(0, 512, 0.004, 512);
        for _ in 0..REMEMBERED - 1 {
            w.observe(0, 512, 0.020, 512);
        }
        assert!((w.estimate(512).as_secs_f64() - 0.004 * SHARE).abs() < 1e-9);
        w.observe(0, 512, 0.020, 512);
        assert!((w.estimate(512).as_secs_f64() - 0.020 * SHARE).abs() < 1e-9);
    }

    #[test]
    fn the_estimate_scales_with_rows_up_to_a_batch() {
        let mut w = BurstWait::default();
        w.observe(0, 64, 0.004, 512);
        let at = |rows| w.estimate(rows).as_secs_f64();
        assert!((at(16) - 0.001 * SHARE).abs() < 1e-9);
        assert!((at(256) - 0.016 * SHARE).abs() < 1e-9);
        assert!((at(4096) - 0.032 * SHARE).abs() < 1e-9, "one tick decodes n_batch rows at most");
    }

    #[test]
    fn ticks_with_decode_rows_or_without_prompt_rows_teach_nothing() {
        let mut w = BurstWait::default();
        w.observe(8, 64, 0.001, 512);
        w.observe(16, 0, 0.001, 512);
        assert_eq!(w.estimate(64), MAX_WAIT);
    }

    #[test]
    fn a_wait_nobody_joined_lets_the_next_prompt_start_at_once() {
        let t0 = Instant::now();
        let mut w = BurstWait::default();
        assert_eq!(w.begin(t0, 1, 512), MAX_WAIT, "a first prompt waits: a server's burst may follow");
        w.ended(1);
        assert_eq!(w.begin(t0, 1, 512), Duration::ZERO);
        w.arrived(t0 + MAX_WAIT * 2, []); // the window passed with nothing in it
        assert_eq!(w.begin(t0 + MAX_WAIT * 3, 1, 512), Duration::ZERO, "a lone caller stays unheld");
    }

    #[test]
    fn a_wait_another_prompt_joined_is_kept() {
        let t0 = Instant::now();
        let mut w = BurstWait::default();
        w.begin(t0, 1, 512);
        w.ended(2);
        assert_eq!(w.begin(t0, 1, 512), MAX_WAIT);
    }

    #[test]
    fn prompts_queued_together_are_company() {
        let t0 = Instant::now();
        let mut w = BurstWait::default();
        w.begin(t0, 1, 512);
        w.ended(1);
        assert_eq!(w.begin(t0, 2, 512), MAX_WAIT, "a burst that came whole: more may follow");
        w.ended(2);
        assert_eq!(w.begin(t0, 1, 512), MAX_WAIT);
    }

    #[test]
    fn a_prompt_within_the_skipped_wait_brings_the_wait_back() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut w = BurstWait::default();
        w.begin(t0, 1, 512);
        w.ended(1);
        assert_eq!(w.begin(t0 + ms(100), 1, 512), Duration::ZERO); // skipped 5 ms from 100 ms
        w.arrived(t0 + ms(300), [t0 + ms(90)]); // queued before that prompt started: its own burst
        assert_eq!(w.begin(t0 + ms(300), 1, 512), Duration::ZERO, "an earlier prompt is no company");
        w.arrived(t0 + ms(600), [t0 + ms(300) + MAX_WAIT + ms(1)]); // after the window
        assert_eq!(w.begin(t0 + ms(600), 1, 512), Duration::ZERO, "a later prompt is no company");
        w.arrived(t0 + ms(700), [t0 + ms(603)]); // 3 ms into the 5 ms it skipped
        assert_eq!(w.begin(t0 + ms(700), 1, 512), MAX_WAIT, "company missed: the next burst waits");
    }

    #[test]
    fn the_window_is_the_wait_skipped_and_stays_open_until_it_ends() {
        let t0 = Instant::now();
        let us = Duration::from_micros;
        let mut w = BurstWait::default();
        w.observe(0, 512, 0.004, 512); // a GPU-like tick: 200 us waits
        w.begin(t0, 1, 512);
        w.ended(1);
        assert_eq!(w.begin(t0, 1, 512), Duration::ZERO);
        w.arrived(t0 + us(100), []); // a tick faster than the window: it is still open
        w.arrived(t0 + us(250), [t0 + us(150)]);
        assert!((w.begin(t0 + us(300), 1, 512).as_secs_f64() - 0.004 * SHARE).abs() < 1e-9);
        w.ended(1);
        w.begin(t0 + us(400), 1, 512);
        w.arrived(t0 + us(700), [t0 + us(650)]); // 250 us after: outside the 200 us
        assert_eq!(w.begin(t0 + us(800), 1, 512), Duration::ZERO);
    }

    #[test]
    fn a_prompt_after_the_skipping_tick_ended_is_no_company() {
        // A context's cold first decode made the estimate long; the next lone prompt's tick is
        // shorter than the wait it skipped, and its caller sends the next prompt once answered.
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut w = BurstWait::default();
        w.begin(t0, 1, 512);
        w.ended(1);
        assert_eq!(w.begin(t0 + ms(10), 1, 512), Duration::ZERO); // the window: 10-15 ms
        w.tick_ended(t0 + ms(11));
        w.arrived(t0 + ms(12), [t0 + ms(12)]); // within the 5 ms, after the tick
        assert_eq!(w.begin(t0 + ms(12), 1, 512), Duration::ZERO, "the caller itself, answered");
        w.arrived(t0 + ms(13), [t0 + ms(12) + Duration::from_micros(500)]); // during this tick
        assert_eq!(w.begin(t0 + ms(13), 1, 512), MAX_WAIT, "another caller, during the tick");
    }
}
