//! Embeddings: encode one token run into pooled (or per-token) vectors, and pack many texts
//! into as few `llama_decode` calls as the batch and the free sequences allow.
//!
//! llama.cpp facts this module relies on (llama-context.cpp, b0.1.160): an embeddings context
//! outputs every token of a batch; pooled vectors (`llama_get_embeddings_seq`) exist only for
//! the sequences of the *last* decode and are pooled per ubatch, so a sequence split across
//! two decodes would be pooled over its last chunk only. Hence a pooled run must fit in one
//! decode (`n_batch` tokens, n_ubatch == n_batch here), and results are copied out right away.

use llama_cpp_sys_2 as sys;

use crate::context::batches::BatchRow;
use crate::context::state::ContextState;
use crate::error::{LloyalError, Result};
use crate::model::Model;
use crate::raw::model_n_embd_out;

pub mod vectors;

pub use vectors::{normalize_rows, plan_groups, Encoded};

/// Width of one embedding vector of `model` (its output embedding size, n_embd for Gemma).
pub fn embedding_dimension(model: &Model) -> usize {
    model_n_embd_out(model.llama())
}

impl ContextState {
    /// Width of one embedding vector (the model's output embedding size).
    pub fn embedding_dimension(&self) -> usize {
        embedding_dimension(&self.model())
    }

    /// The context's pooling as llama.cpp resolved it.
    fn pooling(&mut self) -> sys::llama_pooling_type {
        self.raw_mut().pooling_type()
    }

    /// Refuse embedding calls on a context created without `embeddings=True` (or with rank
    /// pooling, whose outputs are classifier scores rather than `n_embd` vectors).
    fn check_embeddings(&mut self, what: &str) -> Result<bool> {
        if !self.shape().embeddings {
            return Err(LloyalError::invalid(format!(
                "{what} needs an embeddings context: create the Context with embeddings=True \
                 (and pooling=\"mean\", \"cls\", \"last\" or \"none\")"
            )));
        }
        match self.pooling() {
            sys::LLAMA_POOLING_TYPE_NONE => Ok(false),
            sys::LLAMA_POOLING_TYPE_MEAN | sys::LLAMA_POOLING_TYPE_CLS | sys::LLAMA_POOLING_TYPE_LAST => {
                Ok(true)
            }
            _ => Err(LloyalError::invalid(format!(
                "{what} supports pooling \"mean\", \"cls\", \"last\" or \"none\"; this context uses \
                 \"rank\" (reranker scores, not embeddings)"
            ))),
        }
    }

    fn check_run(&self, tokens: &[i32], what: &str) -> Result<()> {
        if tokens.is_empty() {
            return Err(LloyalError::invalid(format!("{what}: the token list is empty")));
        }
        self.model().check_tokens(tokens)
    }

    /// `encode(tokens, seq_id)`: clear `seq_id`, decode `tokens` from position 0 for
    /// embeddings, keep the vectors for `embeddings()`, then clear the sequence again (an
    /// embeddings run leaves no cells behind). Pooled runs must fit in one decode (`n_batch`
    /// tokens); with pooling "none" longer runs are chunked and every token's row is kept.
    pub fn encode(&mut self, tokens: &[i32], seq_id: i32) -> Result<()> {
        let pooled = self.check_embeddings("encode()")?;
        self.check_seq(seq_id)?;
        if self.is_leased(seq_id) {
            return Err(LloyalError::SeqLeased { seq_id });
        }
        self.check_run(tokens, "encode()")?;
        let n_batch = self.shape().n_batch as usize;
        if pooled && tokens.len() > n_batch {
            return Err(too_long(tokens.len(), n_batch, "encode()"));
        }
        self.check_fits_cache(tokens.len())?;
        let dim = self.embedding_dimension();
        self.encoded.remove(&seq_id);
        self.remove_cells(seq_id, 0, -1);
        let result = self.encode_rows(tokens, seq_id, pooled, dim);
        self.remove_cells(seq_id, 0, -1);
        let values = result?;
        let rows = if pooled { 1 } else { tokens.len() };
        self.encoded.insert(seq_id, Encoded { rows, dim, values });
        Ok(())
    }

    fn encode_rows(&mut self, tokens: &[i32], seq_id: i32, pooled: bool, dim: usize) -> Result<Vec<f32>> {
        let mut values = Vec::with_capacity(if pooled { dim } else { dim * tokens.len() });
        let rows: Vec<BatchRow> = (0..tokens.len())
            .map(|i| BatchRow { token: tokens[i], pos: i as i32, seq: seq_id, output: true })
            .collect();
        let (result, _) = self.decode_batches(&rows, None, &mut 0.0, |s, chunk| {
            if pooled {
                values.extend_from_slice(&s.pooled_row(seq_id, dim)?);
            } else {
                for row in 0..chunk.len() {
                    values.extend_from_slice(&s.token_row(row as i32, dim)?);
                }
            }
            Ok(())
        });
        result.map(|()| values)
    }

    fn pooled_row(&mut self, seq_id: i32, dim: usize) -> Result<Vec<f32>> {
        match self.raw_mut().embeddings_seq(seq_id, dim) {
            Some(row) => Ok(row.to_vec()),
            None => Err(LloyalError::Backend(format!("llama.cpp has no pooled embedding for seq {seq_id}"))),
        }
    }

    fn token_row(&mut self, row: i32, dim: usize) -> Result<Vec<f32>> {
        match self.raw_mut().embeddings_row(row, dim) {
            Some(v) => Ok(v.to_vec()),
            None => Err(LloyalError::Backend(format!("llama.cpp has no embedding for batch row {row}"))),
        }
    }

    /// The vectors of the last `encode()` on `seq_id` (L2-normalised per row when asked).
    pub fn embeddings(&mut self, seq_id: i32, normalize: bool) -> Result<Encoded> {
        self.check_embeddings("get_embeddings()")?;
        self.check_seq(seq_id)?;
        let mut out = self.encoded.get(&seq_id).cloned().ok_or_else(|| {
            LloyalError::invalid(format!(
                "no embeddings for seq {seq_id}: call encode(tokens, seq_id={seq_id}) first"
            ))
        })?;
        if normalize {
            normalize_rows(&mut out.values, out.dim);
        }
        Ok(out)
    }

    /// `embed(texts)`: tokenize each text (with BOS), pack as many as fit into one decode
    /// across the free sequences (in range, not leased, empty), read each pooled vector,
    /// then clear those sequences. Returns `texts.len()` rows of `dim` floats.
    pub fn embed(&mut self, texts: &[String], normalize: bool) -> Result<Encoded> {
        if !self.check_embeddings("embed()")? {
            return Err(LloyalError::invalid(
                "embed() needs pooled embeddings: create the Context with pooling=\"mean\", \"cls\" or \
                 \"last\" (with pooling=\"none\" use encode() and get_embeddings() for per-token rows)",
            ));
        }
        let model = self.model();
        let runs: Vec<Vec<i32>> = texts.iter().map(|t| model.tokenize(t, true, false)).collect();
        let n_batch = self.shape().n_batch as usize;
        for (i, run) in runs.iter().enumerate() {
            self.check_run(run, &format!("embed(): text {i}"))?;
            if run.len() > n_batch {
                return Err(too_long(run.len(), n_batch, &format!("embed(): text {i}")));
            }
        }
        let dim = self.embedding_dimension();
        if runs.is_empty() {
            return Ok(Encoded { rows: 0, dim, values: Vec::new() });
        }
        let free = self.free_sequences()?;
        let lens: Vec<usize> = runs.iter().map(Vec::len).collect();
        let mut values = Vec::with_capacity(dim * runs.len());
        // A decode's texts fit the cells left too (branches and flat-path cells may hold some):
        // texts that fit one by one are not packed past the room.
        self.note_flat_cells();
        let cap = n_batch.min(self.room(0)).max(1);
        for (start, end) in plan_groups(&lens, cap, free.len()) {
            let used = &free[..end - start];
            let rows: Vec<BatchRow> = runs[start..end]
                .iter()
                .zip(used)
                .flat_map(|(run, &seq)| {
                    run.iter().enumerate().map(move |(p, &t)| BatchRow {
                        token: t,
                        pos: p as i32,
                        seq,
                        output: true,
                    })
                })
                .collect();
            let (result, _) = self.decode_batches(&rows, None, &mut 0.0, |s, _| {
                used.iter().try_for_each(|&seq| {
                    values.extend_from_slice(&s.pooled_row(seq, dim)?);
                    Ok(())
                })
            });
            for &seq in used {
                self.remove_cells(seq, 0, -1);
            }
            result?;
        }
        if normalize {
            normalize_rows(&mut values, dim);
        }
        Ok(Encoded { rows: runs.len(), dim, values })
    }

    /// Sequences `embed()` may borrow: not leased by a branch and holding no cells.
    fn free_sequences(&mut self) -> Result<Vec<i32>> {
        let mut free = Vec::new();
        let mut leased = None;
        for seq in 0..self.shape().n_seq_max as i32 {
            if self.is_leased(seq) {
                leased.get_or_insert(seq);
            } else if self.seq_pos_max(seq)? < 0 {
                free.push(seq);
            }
        }
        match (free.is_empty(), leased) {
            (false, _) => Ok(free),
            (true, Some(seq_id)) => Err(LloyalError::SeqLeased { seq_id }),
            (true, None) => Err(LloyalError::invalid(
                "embed() found no empty sequence: every sequence holds decoded tokens; free one \
                 with kv_cache_remove(seq_id, 0) or create the context with a larger n_seq_max",
            )),
        }
    }
}

fn too_long(len: usize, n_batch: usize, what: &str) -> LloyalError {
    LloyalError::invalid(format!(
        "{what}: {len} tokens do not fit in one decode (n_batch={n_batch}); pooled embeddings need \
         the whole text in one batch: shorten the text or create the Context with a larger n_batch"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_fill_batch_and_sequences() {
        assert_eq!(plan_groups(&[3, 4, 5], 512, 8), vec![(0, 3)], "one decode when all fit");
        assert_eq!(plan_groups(&[3, 4, 5], 512, 2), vec![(0, 2), (2, 3)], "sequence limit");
        assert_eq!(plan_groups(&[300, 300, 200], 512, 8), vec![(0, 1), (1, 3)], "token limit");
        assert_eq!(plan_groups(&[512, 1], 512, 8), vec![(0, 1), (1, 2)]);
        assert_eq!(plan_groups(&[5, 5], 10, 8), vec![(0, 2)], "exactly n_batch fits");
        assert!(plan_groups(&[], 512, 8).is_empty());
    }

    #[test]
    fn groups_respect_limits_for_many_shapes() {
        for n_seqs in [1, 2, 3, 7] {
            for lens in [vec![1; 20], vec![5, 9, 2, 8, 8, 1], vec![10; 4]] {
                let groups = plan_groups(&lens, 10, n_seqs);
                let mut next = 0;
                for &(s, e) in &groups {
                    assert_eq!(s, next);
                    assert!(e > s && e - s <= n_seqs);
                    assert!(lens[s..e].iter().sum::<usize>() <= 10);
                    next = e;
                }
                assert_eq!(next, lens.len());
            }
        }
    }

    #[test]
    fn normalize_makes_unit_rows() {
        let mut v = vec![3.0, 4.0, 0.0, 0.0, 1.0, 0.0];
        normalize_rows(&mut v, 2);
        assert_eq!(v, vec![0.6, 0.8, 0.0, 0.0, 1.0, 0.0]);
    }
}
