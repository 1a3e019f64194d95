//! `Branch.score(tokens)`: a prefill that also gives each token's log-probability under the
//! logits before it (a prompt's logprobs, as OpenAI's `echo` with `logprobs` reports them). The
//! engine runs it as a prefill ([`crate::engine`]) whose rows all have logits: each row is
//! summarised where llama.cpp wrote it (the next token's logprob, the best `top`) and dropped;
//! the last row becomes the branch's logits, as a prefill's does. The first token is scored
//! against the branch's logits before the call (none on an empty branch). A failure leaves the
//! branch as before, as a prefill's does.

use std::fmt;

use crate::context::state::ContextState;
use crate::engine::gen::logprobs;
use crate::engine::op::Answer;
use crate::error::{LloyalError, Result};
use crate::metrics::log_sum_exp;
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

/// `token`'s score under `logits` (its log-sum-exp `lse`).
fn score(logits: &[f32], lse: f64, token: i32, top: usize) -> Scored {
    let (lp, top) = logprobs(logits, lse, token, top);
    let own = logits.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
    let above = logits.iter().filter(|&&x| x > own).count();
    Scored { logprob: Some(lp), top, rank: Some(u32::try_from(above + 1).unwrap_or(u32::MAX)) }
}

impl ContextState {
    /// The first token's score, from `handle`'s logits (no logprob on a branch without any).
    pub(crate) fn score_first(&self, handle: Handle, token: i32, top: usize) -> Result<Scored> {
        let b = self.branch(handle)?;
        if b.logits.is_empty() {
            return Ok(Scored { logprob: None, top: Vec::new(), rank: None });
        }
        Ok(score(b.logits()?, b.logits.stats().lse, token, top))
    }

    /// Row `row` of the last decode scored against the token after it, `next`.
    pub(crate) fn score_row(&mut self, row: i32, next: i32, top: usize) -> Result<Scored> {
        let src = self.raw.logits_row(row);
        let src =
            src.ok_or_else(|| LloyalError::Backend(format!("llama.cpp has no logits for batch row {row}")))?;
        Ok(score(src, log_sum_exp(src), next, top))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_scores_its_log_softmax_with_the_best_alternatives() {
        let logits = [1.0f32, 3.0, 2.0, 0.5];
        let s = score(&logits, log_sum_exp(&logits), 2, 2);
        let z = logits.iter().map(|&x| f64::from(x).exp()).sum::<f64>().ln();
        assert!((s.logprob.unwrap_or(f64::NAN) - (2.0 - z)).abs() < 1e-6);
        assert_eq!(s.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((s.top[1].1 - s.logprob.unwrap_or(f64::NAN)).abs() < 1e-12, "the same lse for both");
        assert_eq!(s.rank, Some(2), "one token above it");
        let ties = [2.0f32, 1.0, 2.0, f32::NAN, 0.0];
        let ranks: Vec<_> = (0..5).map(|t| score(&ties, log_sum_exp(&ties), t, 0).rank).collect();
        assert_eq!(
            ranks,
            vec![Some(1), Some(3), Some(1), Some(1), Some(4)],
            "ties share a rank; NaN counts none"
        );
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
