//! `Branch.score(tokens)`: a prefill that also gives each token's log-probability under the
//! logits before it (a prompt's logprobs, as OpenAI's `echo` with `logprobs` reports them). The
//! engine runs it as a prefill ([`crate::engine`]) whose rows all have logits: each row is
//! summarised where llama.cpp wrote it (the next token's logprob, the best `top`) and dropped;
//! the last row becomes the branch's logits, as a prefill's does. The first token is scored
//! against the branch's logits before the call (none on an empty branch). A failure leaves the
//! branch as before, as a prefill's does.

use std::fmt;
use std::sync::OnceLock;

use crate::context::state::ContextState;
use crate::engine::gen::logprobs;
use crate::engine::op::Answer;
use crate::error::{LloyalError, Result};
use crate::scan::{scan_row, SPAN};
use crate::tenancy::Handle;

/// Rows of a scored prefill decoded per tick. llama.cpp's output buffer holds a logits row
/// for each (1 MiB at Gemma 3's 262,144-token vocabulary) and keeps the size it grew to.
pub const SCORE_ROWS_PER_TICK: usize = 64;

/// The most alternatives a scored token reports (as `generate`'s `top_logprobs`).
pub const MAX_TOP: usize = 20;

/// One token's score.
#[derive(Debug, Clone, PartialEq)]
pub struct Scored {
    /// `log_softmax(logits)[token]` of the logits before it (`None`: there were none).
    pub logprob: Option<f64>,
    /// The `top` most likely `(token, logprob)` pairs there, best first.
    pub top: Vec<(i32, f64)>,
    /// 1 + the number of tokens more likely there (vLLM's `rank`; `None` with `logprob`).
    pub rank: Option<u32>,
}

/// A queued `score`: the branch, its tokens, how many alternatives, and the result slot.
pub struct ScoreWork {
    /// The branch to write to.
    pub handle: Handle,
    /// The tokens.
    pub tokens: Vec<i32>,
    /// Alternatives per token (0 to [`MAX_TOP`]).
    pub top: usize,
    /// Every token's score, once the prefill is written.
    pub result: Answer<Vec<Scored>>,
}

impl ScoreWork {
    /// A score of `tokens` on `handle` with `top` alternatives each; `InvalidArgument` for more
    /// than [`MAX_TOP`].
    pub fn new(handle: Handle, tokens: Vec<i32>, top: usize) -> Result<Self> {
        if top > MAX_TOP {
            return Err(LloyalError::invalid(format!("top_logprobs must be 0 to {MAX_TOP}, got {top}")));
        }
        Ok(ScoreWork { handle, tokens, top, result: Answer::default() })
    }
}

impl fmt::Debug for ScoreWork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ScoreWork").field("handle", &self.handle).field("tokens", &self.tokens.len()).finish()
    }
}

impl PartialEq for ScoreWork {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

/// `token`'s score under `logits`, given their log-sum-exp `lse` and span maxima `maxima`
/// ([`crate::scan::scan_row`]'s; empty: none known). With the maxima, the best `top` come from
/// the spans that reach them and the rank counts only in spans whose maximum is above the
/// token's value: a likely token's score reads a few spans besides the summary's one pass.
fn score(logits: &[f32], maxima: &[f32], lse: f64, token: i32, top: usize) -> Scored {
    let (lp, top) = logprobs(logits, maxima, lse, token, top);
    let own = logits.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let above = |span: &[f32]| span.iter().filter(|&&x| x > own).count();
    let above = if maxima.len() == logits.len().div_ceil(SPAN) {
        let spans = maxima.iter().zip(logits.chunks(SPAN));
        spans.filter(|(&m, _)| m > own).map(|(_, span)| above(span)).sum()
    } else {
        above(logits)
    };
    Scored { logprob: Some(lp), top, rank: Some(u32::try_from(above + 1).unwrap_or(u32::MAX)) }
}

/// `token`'s score under a decoded row: one pass for its log-sum-exp and span maxima, then
/// [`score`].
fn score_decoded(logits: &[f32], token: i32, top: usize) -> Scored {
    let mut maxima = Vec::new();
    let stats = scan_row(logits, None, &mut maxima, None);
    score(logits, &maxima, stats.lse, token, top)
}

impl ContextState {
    /// The first token's score, from `handle`'s logits (no logprob on a branch without any).
    pub(crate) fn score_first(&self, handle: Handle, token: i32, top: usize) -> Result<Scored> {
        let b = self.branch(handle)?;
        if b.logits.is_empty() {
            return Ok(Scored { logprob: None, top: Vec::new(), rank: None });
        }
        Ok(score(b.logits()?, b.logits.maxima(), b.logits.stats().lse, token, top))
    }

    /// Rows of the last decode scored against the tokens after them, one `(row, next, top)`
    /// each, in order: the rows shared among the decode's threads (on an engine thread:
    /// `omp::parallel_for`; each row one pass for its log-sum-exp and span maxima, then the
    /// spans that reach its best `top` and its rank), each row's score the same whichever thread
    /// took it.
    pub(crate) fn score_rows(&mut self, rows: &[(i32, i32, usize)]) -> Result<Vec<Scored>> {
        let ids: Vec<i32> = rows.iter().map(|r| r.0).collect();
        let srcs = self.raw.output_rows(&ids).ok_or_else(|| {
            LloyalError::Backend(format!("llama.cpp has no logits for one of the batch rows {ids:?}"))
        })?;
        let srcs: Vec<&[f32]> = srcs.iter().map(|r| r.get()).collect();
        let slots: Vec<OnceLock<Scored>> = rows.iter().map(|_| OnceLock::new()).collect();
        let job = |k: usize| {
            let (src, &(_, next, top)) = (srcs[k], &rows[k]);
            let _ = slots[k].set(score_decoded(src, next, top));
        };
        let threads = usize::try_from(self.shape().n_threads).unwrap_or(1);
        crate::omp::parallel_for(rows.len(), threads, &job);
        let scored = slots.into_iter().map(OnceLock::into_inner);
        scored
            .map(|s| s.ok_or_else(|| LloyalError::Backend("a scored row was left unscored".into())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::log_sum_exp;

    #[test]
    fn a_token_scores_its_log_softmax_with_the_best_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let s = score(&logits, &[], log_sum_exp(&logits), 2, 2);
        let z = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        assert!((s.logprob.unwrap_or(f64::NAN) - (2.0 - z)).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((s.top[1].1 - s.logprob.unwrap_or(f64::NAN)).abs() < 1e-12, "the same lse for both");
        assert_eq!(s.rank, Some(2), "one token above it");
        let ties = [2.0f32, 1.0, 2.0, f32::NAN, 0.0];
        let ranks: Vec<_> = (0..5).map(|t| score(&ties, &[], log_sum_exp(&ties), t, 0).rank).collect();
        assert_eq!(
            ranks,
            vec![Some(1), Some(3), Some(1), Some(1), Some(4)],
            "ties share a rank; NaN counts none"
        );
    }

    #[test]
    fn a_decoded_row_scores_as_a_pass_over_every_value_would() {
        // A vocabulary-sized row with ties, -inf and a few large values far apart.
        let n = 262_144 + 17;
        let mut logits: Vec<f32> = (0..n).map(|i| ((i * 7919) % 1013) as f32 / 97.0 - 5.0).collect();
        for (i, v) in [(3, 30.0), (200_000, 30.0), (99_999, 25.5), (n - 1, 28.0), (5, f32::NEG_INFINITY)] {
            logits[i] = v;
        }
        let lse = log_sum_exp(&logits);
        // A token just under most spans' maxima: its rank counts in nearly every span.
        let near_top = logits.iter().position(|&x| (5.0..5.2).contains(&x)).unwrap_or(0) as i32;
        let cases = [
            (3, 5),
            (200_000, 20),
            (99_999, 1),
            (n as i32 - 1, 0),
            (5, 3),
            (12_345, 20),
            (0, 7),
            (near_top, 2),
        ];
        for (token, top) in cases {
            let got = score_decoded(&logits, token, top);
            let own = logits[token as usize];
            let mut best: Vec<(i32, f32)> = logits.iter().enumerate().map(|(i, &x)| (i as i32, x)).collect();
            best.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let want: Vec<(i32, f64)> = best[..top].iter().map(|&(t, x)| (t, f64::from(x) - lse)).collect();
            let above = logits.iter().filter(|&&x| x > own).count();
            assert_eq!(got.top, want, "token {token}");
            assert_eq!(got.rank, Some(above as u32 + 1), "token {token}");
            assert_eq!(got.logprob, Some(f64::from(own) - lse), "token {token}");
        }
    }

    #[test]
    fn more_than_twenty_alternatives_are_refused() {
        assert!(ScoreWork::new(Handle::default(), vec![1], MAX_TOP).is_ok());
        assert!(matches!(
            ScoreWork::new(Handle::default(), vec![1], MAX_TOP + 1),
            Err(LloyalError::InvalidArgument(_))
        ));
    }
}
