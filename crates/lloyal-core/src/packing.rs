//! The pure prefill planner: pack variable-length token runs into decode chunks of at most
//! `n_batch` rows.
//!
//! Chunks are filled first-fit in input order; a run that does not fit in the space left is
//! split at the chunk boundary (its tokens stay in order, and a sequence's positions stay
//! consecutive across chunks). That makes the number of dispatches exactly
//! `ceil(total / n_batch)`, which whole-item first-fit cannot promise (3 x 300 tokens with
//! n_batch 512 would need 3 dispatches instead of 2).

/// A piece of one input run inside one chunk: `item` index, token range `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub item: usize,
    pub start: usize,
    pub end: usize,
}

/// Plan chunks for runs of `lens[i]` tokens. Empty runs get no piece.
pub fn plan(lens: &[usize], n_batch: usize) -> Vec<Vec<Piece>> {
    let n_batch = n_batch.max(1);
    let mut chunks: Vec<Vec<Piece>> = Vec::new();
    let mut room = 0usize;
    for (item, &len) in lens.iter().enumerate() {
        let mut start = 0;
        while start < len {
            if room == 0 {
                chunks.push(Vec::new());
                room = n_batch;
            }
            let take = room.min(len - start);
            if let Some(chunk) = chunks.last_mut() {
                chunk.push(Piece { item, start, end: start + take });
            }
            start += take;
            room -= take;
        }
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_invariants(lens: &[usize], n_batch: usize) {
        let chunks = plan(lens, n_batch);
        let total: usize = lens.iter().sum();
        assert_eq!(chunks.len(), total.div_ceil(n_batch.max(1)), "dispatch count");
        let mut next = vec![0usize; lens.len()];
        for chunk in &chunks {
            let rows: usize = chunk.iter().map(|p| p.end - p.start).sum();
            assert!(rows <= n_batch && rows > 0);
            for p in chunk {
                assert_eq!(p.start, next[p.item], "order kept per item");
                assert!(p.end > p.start);
                next[p.item] = p.end;
            }
        }
        assert_eq!(next, lens.to_vec(), "every token placed exactly once");
    }

    #[test]
    fn packs_three_items_into_two_chunks() {
        let chunks = plan(&[300, 300, 300], 512);
        assert_eq!(chunks.len(), 2);
        assert_eq!(
            chunks[0],
            vec![Piece { item: 0, start: 0, end: 300 }, Piece { item: 1, start: 0, end: 212 }]
        );
    }

    #[test]
    fn oversized_and_empty_items() {
        check_invariants(&[1300, 0, 5, 512, 1], 512);
        assert!(plan(&[0, 0], 8).is_empty());
    }

    #[test]
    fn many_shapes() {
        for n_batch in [1, 7, 32, 512] {
            for lens in [vec![1; 50], vec![3, 9, 27, 81], vec![100], vec![513, 1, 511]] {
                check_invariants(&lens, n_batch);
            }
        }
    }
}
