//! The flat path: `ctx.decode` / `ctx.sample` on the last decode's logits, and the raw KV
//! operations on sequences no branch holds.

use super::batches::BatchRow;
use super::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::grammar::Grammar;
use crate::metrics::{entropy, surprisal, Base};
use crate::sampler::Sampler;
use crate::sampling::SamplingParams;

impl ContextState {
    /// Decode `tokens` for `seq_id` starting at `pos`, chunked by n_batch; keeps the last
    /// token's logits. All-or-nothing: a failure removes the cells written by this call.
    pub fn decode(&mut self, tokens: &[i32], pos: i32, seq_id: i32) -> Result<()> {
        self.check_flat_seq(seq_id)?;
        self.model.check_tokens(tokens)?;
        if tokens.is_empty() {
            return Ok(());
        }
        self.check_fits_cache(tokens.len())?;
        if i64::from(pos) + tokens.len() as i64 > i64::from(crate::branch::ops::MAX_START) {
            return Err(LloyalError::invalid(format!(
                "decode at pos {pos} of {} tokens would go past position {}, the last a sequence may \
                 hold; start lower (positions count from 0)",
                tokens.len(),
                crate::branch::ops::MAX_START
            )));
        }
        let pos_max = self.seq_pos_max(seq_id)?;
        if pos < 0 || (pos_max >= 0 && pos != pos_max + 1) {
            return Err(LloyalError::invalid(format!(
                "decode at pos {pos} on seq {seq_id}: the sequence ends at position {pos_max}, so the next \
                 position must be {}; remove cells with kv_cache_remove to rewrite history",
                pos_max + 1
            )));
        }
        let rows: Vec<BatchRow> = (0..tokens.len())
            .map(|i| BatchRow {
                token: tokens[i],
                pos: pos + i as i32,
                seq: seq_id,
                output: i + 1 == tokens.len(),
            })
            .collect();
        self.decode_all(&rows, |s, chunk| {
            if chunk.last().is_some_and(|r| r.output) {
                s.logits = s.copy_logits_row(chunk.len() as i32 - 1)?;
            }
            Ok(())
        })
    }

    /// `KvCacheFull` for a run of `n` tokens longer than the whole cache (refused up front,
    /// not after the chunks that fit were decoded).
    pub(crate) fn check_fits_cache(&self, n: usize) -> Result<()> {
        if n > self.shape.n_ctx as usize {
            return Err(LloyalError::KvCacheFull {
                needed: n,
                n_ctx: self.shape.n_ctx,
                detail: "more tokens than the whole cache holds".into(),
            });
        }
        Ok(())
    }

    /// The flat path's last logits.
    pub fn logits(&self) -> Result<&[f32]> {
        if self.logits.is_empty() {
            return Err(LloyalError::NoLogits);
        }
        Ok(&self.logits)
    }

    /// Sample from the flat path's last logits with `params`, then accept the token into the
    /// flat sampler's history (penalties persist across calls, as in the original API).
    pub fn sample(&mut self, params: SamplingParams) -> Result<i32> {
        self.sample_from(params, None, None)
    }

    /// [`Self::sample`] from `logits` (caller-modified, length n_vocab) instead of the last
    /// decode's, and/or with every token `grammar` forbids masked out first. The grammar is
    /// not advanced: the caller accepts the token into it (as with `Grammar.apply`).
    pub fn sample_from(
        &mut self,
        params: SamplingParams,
        logits: Option<Vec<f32>>,
        grammar: Option<&mut Grammar>,
    ) -> Result<i32> {
        let n_vocab = self.shape.n_vocab as usize;
        if let Some(l) = &logits {
            crate::branch::logits::check_supplied(l, n_vocab, "logits")?;
        } else if self.logits.is_empty() {
            return Err(LloyalError::NoLogits);
        }
        let masked = match grammar {
            Some(g) => {
                let mut m = logits.as_deref().unwrap_or(&self.logits).to_vec();
                g.mask(&mut m)?;
                if m.iter().all(|&l| l == f32::NEG_INFINITY) {
                    return Err(LloyalError::Grammar(
                        "the grammar allows no token with these logits; check the grammar's \
                         state (accept each sampled token into it) or the logits passed"
                            .into(),
                    ));
                }
                Some(m)
            }
            None => logits,
        };
        let model = self.model();
        match &mut self.sampler {
            Some(s) => s.set_params(&model, params)?,
            None => self.sampler = Some(Sampler::new(&model, params)?),
        }
        let sampler = self.sampler.as_mut().ok_or(LloyalError::NoLogits)?;
        let token = sampler.sample(masked.as_deref().unwrap_or(&self.logits), &[]);
        sampler.accept(token);
        Ok(token)
    }

    /// Forget the flat sampler's history (penalties, DRY, RNG).
    pub fn reset_sampler(&mut self) {
        self.sampler = None;
    }

    /// Entropy of the flat path's last logits.
    pub fn model_entropy(&self, base: Base) -> Result<f64> {
        Ok(entropy(self.logits()?, base))
    }

    /// Surprisal of `token` under the flat path's last logits.
    pub fn model_surprisal(&self, token: i32, base: Base) -> Result<f64> {
        self.model.check_token(i64::from(token))?;
        Ok(surprisal(self.logits()?, token as usize, base))
    }

    /// `kv_cache_clear`: empty every sequence (refused while any branch holds one).
    pub fn kv_clear(&mut self) -> Result<()> {
        self.check_no_leases()?;
        self.raw.memory_clear();
        self.forget_parked();
        self.logits.clear();
        Ok(())
    }

    /// `kv_cache_remove(seq, start, end)`: drop positions `[start, end)`; `end = -1` = to the end.
    pub fn kv_remove(&mut self, seq_id: i32, start: i32, end: i32) -> Result<()> {
        self.check_flat_seq(seq_id)?;
        check_range(start, end)?;
        if !self.remove_cells(seq_id, start, end) {
            return Err(LloyalError::Backend(format!(
                "llama.cpp refused to remove positions [{start}, {end}) of seq {seq_id}"
            )));
        }
        Ok(())
    }

    /// `kv_seq_copy(src, dst, p0, p1)`: share `src`'s cells `[p0, p1)` with `dst` (no tensor copy).
    pub fn kv_copy(&mut self, src: i32, dst: i32, p0: i32, p1: i32) -> Result<()> {
        self.check_seq(src)?;
        self.check_flat_seq(dst)?;
        check_range(p0, p1)?;
        if src == dst {
            return Ok(());
        }
        // Unified KV makes partial copies legal.
        self.raw.seq_cp(src, dst, p0, p1);
        Ok(())
    }

    /// `kv_seq_keep(seq)`: drop every other sequence (refused if a branch holds another one).
    pub fn kv_keep(&mut self, seq_id: i32) -> Result<()> {
        self.check_flat_seq(seq_id)?;
        self.check_no_leases()?;
        self.raw.seq_keep(seq_id);
        self.forget_parked();
        Ok(())
    }
}

fn check_range(start: i32, end: i32) -> Result<()> {
    if start < 0 || (end != -1 && end < start) {
        return Err(LloyalError::invalid(format!(
            "invalid position range [{start}, {end}): need 0 <= start and end == -1 or end >= start"
        )));
    }
    Ok(())
}
