//! Pure tick planning: which rows one engine tick decodes.
//!
//! Decode rows (one token per committing branch) always go first and are never deferred; the
//! prefill tokens of the operations in flight then fill the rest of the tick's token budget
//! in FIFO order (chunked prefill), so a long prompt delays running streams by at most one
//! chunk. The budget is the smallest multiple of `n_batch` that holds every decode row and,
//! while a prefill is pending, at least one of its tokens (so a prefill is never starved by
//! decode rows that fill whole batches); the tick's `llama_decode` count is
//! `ceil(rows / n_batch)`.

/// What one tick decodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TickPlan {
    /// Prefill tokens taken from each pending run, in the order given.
    pub prefill_take: Vec<usize>,
    /// `llama_decode` calls the tick needs (`ceil(rows / n_batch)`).
    pub n_decodes: usize,
}

impl TickPlan {
    /// Rows of the tick: decode rows plus the prefill tokens taken.
    pub fn rows(&self, decode_rows: usize) -> usize {
        decode_rows + self.prefill_take.iter().sum::<usize>()
    }
}

/// Plan one tick for `decode_rows` commit rows and prefill runs with `prefill_left[i]` tokens
/// still to write; `max_prefill > 0` caps the prefill tokens of one tick (a latency knob:
/// running streams then wait for at most that many prefill rows per step).
pub fn plan_tick(decode_rows: usize, prefill_left: &[usize], n_batch: usize, max_prefill: usize) -> TickPlan {
    let n_batch = n_batch.max(1);
    let pending = prefill_left.iter().any(|&l| l > 0);
    let budget = (decode_rows + usize::from(pending)).div_ceil(n_batch).max(1) * n_batch;
    let mut room = budget - decode_rows;
    if max_prefill > 0 {
        room = room.min(max_prefill);
    }
    let prefill_take: Vec<usize> = prefill_left
        .iter()
        .map(|&left| {
            let take = left.min(room);
            room -= take;
            take
        })
        .collect();
    let rows = decode_rows + prefill_take.iter().sum::<usize>();
    TickPlan { prefill_take, n_decodes: rows.div_ceil(n_batch) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_rows_first_then_prefill_fills_the_budget() {
        let p = plan_tick(8, &[1000, 50], 512, 0);
        assert_eq!(p.prefill_take, vec![504, 0]);
        assert_eq!(p.n_decodes, 1);
        assert_eq!(p.rows(8), 512);
    }

    #[test]
    fn prefill_alone_takes_one_chunk_per_tick() {
        let p = plan_tick(0, &[100, 300, 700], 256, 0);
        assert_eq!(p.prefill_take, vec![100, 156, 0]);
        assert_eq!(p.n_decodes, 1);
        assert_eq!(plan_tick(0, &[], 256, 0), TickPlan { prefill_take: vec![], n_decodes: 0 });
    }

    #[test]
    fn max_prefill_caps_the_prefill_rows_of_a_tick() {
        let p = plan_tick(8, &[1000, 50], 512, 24);
        assert_eq!((p.prefill_take, p.n_decodes), (vec![24, 0], 1));
        let p = plan_tick(0, &[10, 300], 64, 24);
        assert_eq!(p.prefill_take, vec![10, 14]);
        assert_eq!(plan_tick(3, &[100], 8, 24).prefill_take, vec![5], "never more than the batch");
    }

    #[test]
    fn decode_rows_are_never_cut() {
        // More committing branches than n_batch: every row still runs this tick.
        let p = plan_tick(20, &[30], 8, 0);
        assert_eq!(p.prefill_take, vec![4]);
        assert_eq!(p.n_decodes, 3);
        // Decode rows filling whole batches still leave a prefill one more chunk.
        let p = plan_tick(16, &[5], 8, 0);
        assert_eq!((p.prefill_take.clone(), p.n_decodes), (vec![5], 3));
        assert_eq!(plan_tick(16, &[], 8, 0).n_decodes, 2);
    }

    #[test]
    fn a_long_prefill_finishes_in_ceil_ticks_while_decode_rows_run_every_tick() {
        for (n_batch, decode, prompt) in [(32, 8, 1500), (512, 16, 1500), (7, 3, 100), (1, 0, 5)] {
            let mut left = prompt;
            let mut ticks = 0;
            while left > 0 {
                let p = plan_tick(decode, &[left], n_batch, 0);
                assert!(p.rows(decode) <= (decode / n_batch + 1) * n_batch);
                assert!(p.prefill_take[0] > 0, "progress every tick");
                left -= p.prefill_take[0];
                ticks += 1;
            }
            let per_tick = n_batch - decode % n_batch;
            assert_eq!(ticks, prompt.div_ceil(per_tick), "n_batch {n_batch} decode {decode}");
        }
    }
}
