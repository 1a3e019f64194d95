//! A row of logits with replacements put in (a logit bias, penalties, a banned end of
//! generation), read a span at a time without copying the row: the spans that hold a replaced
//! token are copied and patched, the others are read where they are.

use std::borrow::Cow;

use crate::metrics::max_f32_lanes;
use crate::scan::SPAN;

/// More replacements than this and the row is copied whole (a bias over much of the
/// vocabulary): patching spans one by one would cost more.
const MOST_PATCHED: usize = 256;

/// `logits` with replacements, span by span.
pub(super) struct Replaced<'a> {
    logits: Cow<'a, [f32]>,
    /// `(span, its values with the replacements in)`, by span.
    patched: Vec<(usize, [f32; SPAN])>,
}

impl<'a> Replaced<'a> {
    /// `logits` with `replace`'s `(token, value)` put in, in order (a later entry for the same
    /// token wins); tokens out of range are ignored.
    pub(super) fn new(logits: &'a [f32], replace: &[(usize, f32)]) -> Self {
        if replace.len() > MOST_PATCHED {
            let mut row = logits.to_vec();
            for &(i, v) in replace {
                if let Some(x) = row.get_mut(i) {
                    *x = v;
                }
            }
            return Replaced { logits: Cow::Owned(row), patched: Vec::new() };
        }
        let mut patched: Vec<(usize, [f32; SPAN])> = Vec::new();
        for &(i, v) in replace.iter().filter(|(i, _)| *i < logits.len()) {
            let s = i / SPAN;
            let at = patched.binary_search_by_key(&s, |p| p.0).unwrap_or_else(|at| {
                let mut span = [0.0; SPAN];
                let from = &logits[s * SPAN..((s + 1) * SPAN).min(logits.len())];
                span[..from.len()].copy_from_slice(from);
                patched.insert(at, (s, span));
                at
            });
            patched[at].1[i % SPAN] = v;
        }
        Replaced { logits: Cow::Borrowed(logits), patched }
    }

    /// Spans in the row (the last may be short).
    pub(super) fn n_spans(&self) -> usize {
        self.logits.len().div_ceil(SPAN)
    }

    /// Span `s`'s values.
    pub(super) fn span(&self, s: usize) -> &[f32] {
        let len = (self.logits.len() - s * SPAN).min(SPAN);
        match self.patched.binary_search_by_key(&s, |p| p.0) {
            Ok(at) => &self.patched[at].1[..len],
            Err(_) => &self.logits[s * SPAN..s * SPAN + len],
        }
    }

    /// Every span's values, in order.
    pub(super) fn spans(&self) -> impl Iterator<Item = &[f32]> + '_ {
        let mut next = 0; // the first patched span not passed yet
        self.logits.chunks(SPAN).enumerate().map(move |(s, values)| match self.patched.get(next) {
            Some((p, span)) if *p == s => {
                next += 1;
                &span[..values.len()]
            }
            _ => values,
        })
    }

    /// The span maxima of the row, from `maxima` (those of the row before its replacements;
    /// empty: not known) with each patched span read again. Every span is read when `maxima`
    /// are not known or the row was copied whole.
    pub(super) fn maxima<'m>(&self, maxima: &'m [f32]) -> Cow<'m, [f32]> {
        let span_max = |s: usize| max_f32_lanes::<16>(self.span(s));
        if maxima.len() != self.n_spans() || matches!(self.logits, Cow::Owned(_)) {
            return Cow::Owned((0..self.n_spans()).map(span_max).collect());
        }
        if self.patched.is_empty() {
            return Cow::Borrowed(maxima);
        }
        let mut own = maxima.to_vec();
        for &(s, _) in &self.patched {
            own[s] = span_max(s);
        }
        Cow::Owned(own)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spans, span maxima and values equal those of the row copied with its replacements put
    /// in: a replacement that raises, lowers, bans or NaNs a span's best value, two in one span,
    /// one token twice (the later wins), out-of-range entries, a short last span, no maxima
    /// known, and so many replacements that the row is copied.
    #[test]
    fn reads_as_the_replaced_row_copied() {
        let mut next = super::super::tests::xorshift(0x2545_f491_4f6c_dd1d);
        let logits: Vec<f32> = (0..10_000).map(|_| (next() % 1000) as f32 / 50.0 - 10.0).collect();
        let whole = |v: &[f32]| {
            v.chunks(SPAN).map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect::<Vec<_>>()
        };
        let maxima = whole(&logits);
        let best = (0..SPAN).max_by(|&a, &b| logits[a].total_cmp(&logits[b])).unwrap();
        let many: Vec<(usize, f32)> = (0..10_000).step_by(37).map(|i| (i, 3.0)).collect();
        let cases: Vec<Vec<(usize, f32)>> = vec![
            vec![],
            vec![(best, -50.0), (700, 99.0), (701, -2.0), (9_999, f32::NEG_INFINITY), (20_000, 5.0)],
            vec![(best, f32::NAN), (64, 11.0), (64, -11.0)],
            many,
        ];
        for repl in cases {
            let mut values = logits.clone();
            for &(i, v) in &repl {
                if let Some(x) = values.get_mut(i) {
                    *x = v;
                }
            }
            let row = Replaced::new(&logits, &repl);
            let spans: Vec<&[f32]> = row.spans().collect();
            assert_eq!(spans.len(), row.n_spans());
            for (s, want) in values.chunks(SPAN).enumerate() {
                let same = |a: &[f32]| {
                    a.iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == want.len()
                };
                assert!(same(spans[s]) && same(row.span(s)), "span {s} of {repl:?}");
            }
            let want = whole(&values);
            assert_eq!(row.maxima(&maxima).into_owned(), want, "{repl:?}");
            assert_eq!(row.maxima(&[]).into_owned(), want);
        }
    }
}
