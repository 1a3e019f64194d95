//! How many prefill tokens a tick may add while streams are running (the automatic
//! `engine_prefill_chunk`).
//!
//! A long prompt that arrives while other requests decode would, at a full `n_batch` chunk,
//! stretch their next steps many times over (a decode row of a 270M model costs about as much
//! as a few prefill rows, so 500 prefill rows next to 8 decode rows make a step 20x longer).
//! The pacer keeps every tick that carries prefill rows next to decode rows at about
//! [`STRETCH`] times the time of a decode-only tick, measured on this machine as it runs:
//!
//! - `base`: an average of the `llama_decode` time of recent ticks with decode rows only, one
//!   per number of decode rows (a decode tick is mostly a fixed pass over the weights: two
//!   rows cost little more than one, so one count's time scaled by rows misjudges another's);
//! - after a tick with `p` prefill rows took `t`, the extra cost per prefill row is
//!   `(t / base - 1) / p`, and the next cap is the `p` that gives `STRETCH - 1` of extra
//!   cost (moved at most 4x per tick, half way in log scale, so one noisy tick cannot swing it).
//!
//! Only streams that were already running when a prompt arrived are protected: a prompt that
//! waited before they started (a burst of requests arriving together, the first of which
//! already decodes) fills the batch, as it would have had it gone first. With no decode rows
//! there is nothing to protect either; a tick whose streams have not come back yet (a gap of
//! less than [`ACTIVE_GAP`] since the last tick with decode rows) is paced as if they had,
//! unless they cannot come back ([`Pacer::streams_gone`]: the branches committed by hand are
//! pruned, the generation requests have ended).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The longest a tick with prefill rows should take, relative to a decode-only tick.
pub const STRETCH: f64 = 1.5;

/// The first cap, before anything was measured, per decode row (and at least [`FIRST_MIN`]).
const FIRST_PER_ROW: usize = 1;
const FIRST_MIN: usize = 8;

/// Weight of the newest decode-only tick in `base`.
const BASE_WEIGHT: f64 = 0.2;

/// Most row counts whose decode-only time is kept.
const MAX_BASES: usize = 64;

/// Extra cost below this fraction is noise: the cap doubles.
const NOISE: f64 = 0.02;

/// Decode ticks closer together than this are one stretch of running streams.
pub const ACTIVE_GAP: Duration = Duration::from_millis(50);

/// The automatic prefill cap of one context's engine.
#[derive(Debug, Clone, Default)]
pub struct Pacer {
    /// When the current stretch of ticks with decode rows began.
    active_since: Option<Instant>,
    /// When the last tick with decode rows ended, and its decode rows.
    last_decode: Option<(Instant, usize)>,
    /// Average seconds of a decode-only tick, by its decode rows.
    bases: BTreeMap<usize, f64>,
    /// The current cap (prefill rows next to decode rows).
    cap: Option<f64>,
}

impl Pacer {
    /// The prefill cap of a tick planned at `now` with `decode_rows` commit rows while the
    /// oldest pending prompt arrived at `oldest_prompt` (0: fill the batch).
    pub fn plan(
        &mut self,
        now: Instant,
        decode_rows: usize,
        oldest_prompt: Option<Instant>,
        n_batch: usize,
    ) -> usize {
        let recent = self.last_decode.filter(|(at, _)| now.saturating_duration_since(*at) < ACTIVE_GAP);
        let rows = if decode_rows > 0 {
            if recent.is_none() {
                self.active_since = Some(now);
            }
            decode_rows
        } else if let Some((_, rows)) = recent {
            rows // the streams are between ticks: keep pacing
        } else {
            self.active_since = None;
            return 0;
        };
        match (oldest_prompt, self.active_since) {
            // The prompt waited before these streams started: it goes first.
            (Some(arrived), Some(since)) if arrived <= since => 0,
            _ => self.cap(rows, n_batch),
        }
    }

    /// Whether a prompt that arrived at `arrived` goes first (fills the batch): it waited
    /// before the running streams started, or none is running.
    pub fn goes_first(&self, arrived: Instant) -> bool {
        self.active_since.is_none_or(|since| arrived <= since)
    }

    /// The branches the last decode rows stepped are all gone (pruned): no stream will come
    /// back, so the next prompt need not wait for one.
    pub fn streams_gone(&mut self) {
        self.last_decode = None;
    }

    /// Note the end (`now`) of a tick with `decode_rows` commit rows.
    pub fn ticked(&mut self, now: Instant, decode_rows: usize) {
        if decode_rows > 0 {
            self.last_decode = Some((now, decode_rows));
        }
    }

    /// The prefill cap for a tick with `decode_rows` commit rows (0: none, fill the batch).
    pub fn cap(&self, decode_rows: usize, n_batch: usize) -> usize {
        if decode_rows == 0 {
            return 0;
        }
        let n_batch = n_batch.max(1);
        let first = (FIRST_PER_ROW * decode_rows).max(FIRST_MIN) as f64;
        (self.cap.unwrap_or(first).round() as usize).clamp(1, n_batch)
    }

    /// Learn from a tick that decoded `decode_rows` commit rows and `prefill_rows` prefill
    /// rows in `seconds` of `llama_decode`.
    pub fn observe(&mut self, decode_rows: usize, prefill_rows: usize, seconds: f64) {
        if decode_rows == 0 || seconds.is_nan() || seconds <= 0.0 {
            return;
        }
        if prefill_rows == 0 {
            if self.bases.len() >= MAX_BASES && !self.bases.contains_key(&decode_rows) {
                self.bases.clear(); // row counts long gone: measure afresh
            }
            self.bases
                .entry(decode_rows)
                .and_modify(|b| *b += BASE_WEIGHT * (seconds - *b))
                .or_insert(seconds);
            return;
        }
        let Some(base) = self.base(decode_rows) else {
            // Streams that never ran a decode-only tick (a burst whose prompts reached the
            // engine over several ticks) give nothing to compare with: double the cap each
            // tick, up to the batch, until a decode-only tick measures the base. Kept at the
            // first cap instead, the backlog went 8 rows a tick (a 16-request wave 1.5x longer).
            self.cap = Some(2.0 * prefill_rows as f64);
            return;
        };
        let p = prefill_rows as f64;
        let extra = seconds / base - 1.0;
        let wanted = if extra <= NOISE { 2.0 * p } else { p * (STRETCH - 1.0) / extra };
        let now = self.cap.unwrap_or(p);
        let next = (now * wanted).sqrt().clamp(now / 4.0, now * 4.0);
        self.cap = Some(next.max(1.0));
    }

    /// A decode-only tick's seconds at `decode_rows`: measured at that count, else at the
    /// nearest count measured, scaled by rows (a rough correction, replaced as soon as a
    /// decode-only tick of this size runs).
    fn base(&self, decode_rows: usize) -> Option<f64> {
        if let Some(b) = self.bases.get(&decode_rows) {
            return Some(*b);
        }
        let below = self.bases.range(..decode_rows).next_back();
        let above = self.bases.range(decode_rows..).next();
        let (rows, b) = match (below, above) {
            (Some(lo), Some(hi)) if hi.0 - decode_rows < decode_rows - lo.0 => hi,
            (Some(lo), _) => lo,
            (None, Some(hi)) => hi,
            (None, None) => return None,
        };
        Some(b * decode_rows as f64 / (*rows).max(1) as f64)
    }

    /// The cap learned so far (None until a tick with prefill rows was measured).
    pub fn current(&self) -> Option<f64> {
        self.cap
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A machine where a tick costs `fixed + per_decode * d + per_prefill * p` seconds.
    fn run(fixed: f64, per_decode: f64, per_prefill: f64, d: usize, ticks: usize) -> (Pacer, usize) {
        let mut pacer = Pacer::default();
        for _ in 0..5 {
            pacer.observe(d, 0, fixed + per_decode * d as f64);
        }
        let mut cap = 0;
        for _ in 0..ticks {
            cap = pacer.cap(d, 512);
            pacer.observe(d, cap, fixed + per_decode * d as f64 + per_prefill * cap as f64);
        }
        (pacer, cap)
    }

    #[test]
    fn nothing_running_fills_the_batch() {
        assert_eq!(Pacer::default().cap(0, 512), 0);
        let (pacer, _) = run(0.01, 0.002, 0.001, 8, 20);
        assert_eq!(pacer.cap(0, 512), 0);
    }

    #[test]
    fn the_cap_converges_to_the_stretch() {
        for (fixed, per_decode, per_prefill, d) in
            [(0.01, 0.002, 0.0008, 8), (0.002, 0.003, 0.001, 16), (0.02, 0.001, 0.0002, 1)]
        {
            let (_, cap) = run(fixed, per_decode, per_prefill, d, 30);
            let base = fixed + per_decode * d as f64;
            let stretch = (base + per_prefill * cap as f64) / base;
            assert!((stretch - STRETCH).abs() < 0.05, "{fixed} {per_decode} {per_prefill} {d}: {stretch}");
        }
    }

    #[test]
    fn the_first_cap_is_small_and_bounded_by_the_batch() {
        let p = Pacer::default();
        assert_eq!(p.cap(8, 512), 8);
        assert_eq!(p.cap(40, 512), 40);
        assert_eq!(p.cap(40, 16), 16);
        // A free prefill (no measurable cost) grows the cap, up to the batch.
        let (_, cap) = run(0.01, 0.001, 0.0, 8, 40);
        assert_eq!(cap, 512);
    }

    #[test]
    fn one_noisy_tick_moves_the_cap_at_most_4x() {
        let (mut pacer, cap) = run(0.01, 0.002, 0.0008, 8, 30);
        pacer.observe(8, cap, 100.0);
        assert!(pacer.cap(8, 512) * 4 >= cap - 1);
    }

    #[test]
    fn only_streams_that_ran_before_the_prompt_arrived_are_protected() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut p = Pacer::default();
        // A burst: prompts queued at t0, the first stream starts decoding at 100 ms.
        assert_eq!(p.plan(ms(0), 0, Some(t0), 512), 0);
        assert_eq!(p.plan(ms(100), 4, Some(t0), 512), 0, "the burst's prompts fill the batch");
        p.ticked(ms(120), 4);
        // A prompt that arrives while the streams run is paced.
        assert_eq!(p.plan(ms(130), 4, Some(ms(125)), 512), 8);
        p.ticked(ms(150), 4);
        // Between ticks (no decode rows yet, 10 ms later): still paced at the last row count.
        assert_eq!(p.plan(ms(160), 0, Some(ms(125)), 512), 8);
        // The streams stopped long ago: the batch.
        assert_eq!(p.plan(ms(1000), 0, Some(ms(125)), 512), 0);
        // They start again after the prompt arrived: the prompt goes first.
        assert_eq!(p.plan(ms(1100), 4, Some(ms(125)), 512), 0);
    }

    #[test]
    fn streams_whose_branches_are_gone_are_not_waited_for() {
        let t0 = Instant::now();
        let ms = |n: u64| t0 + Duration::from_millis(n);
        let mut p = Pacer::default();
        assert_eq!(p.plan(ms(0), 4, None, 512), 8);
        p.ticked(ms(20), 4);
        assert_eq!(p.plan(ms(30), 0, Some(ms(25)), 512), 8, "between ticks: paced");
        p.streams_gone();
        assert_eq!(p.plan(ms(30), 0, Some(ms(25)), 512), 0, "pruned: the prompt fills the batch");
    }

    #[test]
    fn without_a_decode_only_tick_the_cap_doubles_up_to_the_batch() {
        let mut p = Pacer::default();
        p.observe(0, 100, 1.0);
        assert_eq!(p.current(), None, "no decode rows: nothing to learn");
        let mut caps = Vec::new();
        for _ in 0..8 {
            let cap = p.cap(7, 512);
            caps.push(cap);
            p.observe(7, cap, 0.07);
        }
        assert_eq!(caps, [8, 16, 32, 64, 128, 256, 512, 512]);
        // The first decode-only tick gives a base; from the next mixed tick on the cap falls
        // (at most 4x a tick) to what keeps a tick at the stretch.
        p.observe(7, 0, 0.05);
        let mut cap = 512;
        for _ in 0..6 {
            p.observe(7, cap, 0.05 + 0.0009 * cap as f64);
            cap = p.cap(7, 512);
        }
        assert!((25..=31).contains(&cap), "{cap}");
    }

    #[test]
    fn each_stream_count_keeps_its_own_base() {
        // A tick costs 12 ms + 1.5 ms a row (decode or prefill): two streams' decode-only tick
        // is 15 ms, not twice one stream's 13.5.
        let tick = |rows: usize| 0.012 + 0.0015 * rows as f64;
        let mut p = Pacer::default();
        for _ in 0..5 {
            p.observe(1, 0, tick(1));
        }
        p.observe(2, 0, tick(2)); // a second stream came and went
        let mut cap = p.cap(1, 512);
        for _ in 0..30 {
            p.observe(1, cap, tick(1 + cap));
            cap = p.cap(1, 512);
        }
        // one stream's ticks stay at the stretch: 4-5 prompt rows, not 1
        assert!((4..=5).contains(&cap), "{cap}");
    }
}
