//! A branch's logits snapshot: the values of one decoded row, their [`RowStats`] and the
//! maxima top-k sampling reads instead of the row ([`crate::scan`]).

use std::ops::Deref;
use std::sync::OnceLock;

use crate::scan::{scan_row, RowStats};

/// What one pass over the values learned.
#[derive(Debug)]
struct Summary {
    stats: RowStats,
    /// The maximum of each `scan::SPAN` values.
    maxima: Vec<f32>,
}

/// One row of logits (empty before any decode) with its summary. A row copied out of a decode
/// is summarised in the same pass ([`Logits::fill_from`]); rows set otherwise are summarised on
/// first use. The values never change once set, so the summary stays theirs.
#[derive(Debug, Default)]
pub(crate) struct Logits {
    values: Vec<f32>,
    summary: OnceLock<Summary>,
}

impl Logits {
    /// A snapshot of `values` (summarised on first use).
    pub(crate) fn new(values: Vec<f32>) -> Self {
        Logits { values, summary: OnceLock::new() }
    }

    /// Replace the values with a copy of `src`, summarised in the same pass, with the
    /// log-sum-exp of `scale * src` too when `scale` is given (the buffers are reused).
    pub(crate) fn fill_from(&mut self, src: &[f32], scale: Option<f32>) {
        let mut maxima = self.summary.take().map(|s| s.maxima).unwrap_or_default();
        let stats = scan_row(src, Some(&mut self.values), &mut maxima, scale);
        self.summary = OnceLock::from(Summary { stats, maxima });
    }

    fn summary(&self) -> &Summary {
        self.summary.get_or_init(|| {
            let mut maxima = Vec::new();
            let stats = scan_row(&self.values, None, &mut maxima, None);
            Summary { stats, maxima }
        })
    }

    /// Maximum, first argmax and log-sum-exp of the values.
    pub(crate) fn stats(&self) -> RowStats {
        self.summary().stats
    }

    /// The maximum of each `scan::SPAN` values (the top-k prefilter).
    pub(crate) fn maxima(&self) -> &[f32] {
        &self.summary().maxima
    }

    /// `-log softmax(values)[token]` in nats (as [`crate::metrics::surprisal`]): `inf` for a
    /// banned or out-of-range token.
    pub(crate) fn surprisal(&self, token: usize) -> f64 {
        match self.values.get(token) {
            Some(&l) if l != f32::NEG_INFINITY => (self.stats().lse - f64::from(l)).max(0.0),
            _ => f64::INFINITY,
        }
    }
}

impl Deref for Logits {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.values
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{log_sum_exp, surprisal, Base};
    use crate::sampler::argmax;
    use crate::scan::SPAN;

    #[test]
    fn filled_and_lazy_summaries_agree_with_the_separate_passes() {
        // Several blocks, the maximum twice (the first wins), in a late block.
        let mut values: Vec<f32> = (0..10_000).map(|i| ((i * 7919) % 1000) as f32 / 100.0 - 5.0).collect();
        values[6000] = 9.5;
        values[9000] = 9.5;
        let mut filled = Logits::default();
        filled.fill_from(&values, Some(1.25));
        let lazy = Logits::new(values.clone());
        for stats in [filled.stats(), lazy.stats()] {
            assert_eq!(stats.argmax, 6000);
            assert_eq!(stats.argmax, argmax(&values));
            assert_eq!(stats.max, 9.5);
            assert_eq!(stats.lse, log_sum_exp(&values));
        }
        assert!(filled.stats().scaled_lse(1.25).is_some() && lazy.stats().scaled.is_none());
        assert_eq!(filled.maxima(), lazy.maxima());
        assert_eq!(filled.maxima().len(), values.len().div_ceil(SPAN));
        assert_eq!(&*filled, &values[..]);
        for t in [0, 6000, 9999] {
            assert_eq!(filled.surprisal(t), surprisal(&values, t, Base::Nats));
        }
        values[7] = f32::NEG_INFINITY;
        assert_eq!(Logits::new(values).surprisal(7), f64::INFINITY);
        assert_eq!(filled.surprisal(10_000), f64::INFINITY, "out of range");
    }

    #[test]
    fn refilling_replaces_values_and_summary() {
        let mut l = Logits::default();
        l.fill_from(&[1.0, 3.0, 2.0], None);
        assert_eq!(l.stats().argmax, 1);
        l.fill_from(&[f32::NEG_INFINITY, f32::NEG_INFINITY], None);
        let s = l.stats();
        assert_eq!((s.argmax, s.max, s.lse), (0, f32::NEG_INFINITY, f64::NEG_INFINITY));
        assert_eq!(&*l, &[f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert_eq!(l.maxima(), &[f32::NEG_INFINITY]);
    }
}
