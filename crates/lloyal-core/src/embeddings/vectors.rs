//! Embedding vectors as plain data: an `encode()`'s rows, their packing into decodes, and
//! their normalisation.

/// The vectors of the last `encode()` of one sequence: `rows` x `dim` floats, row-major
/// (one row when pooled, one per token with pooling "none").
#[derive(Debug, Clone, PartialEq)]
pub struct Encoded {
    pub rows: usize,
    pub dim: usize,
    pub values: Vec<f32>,
}

/// Group consecutive runs of `lens` tokens into decodes of at most `n_batch` tokens and
/// `n_seqs` sequences each (input order kept; every run must already fit in `n_batch`).
/// Returns the `[start, end)` index range of each group.
pub fn plan_groups(lens: &[usize], n_batch: usize, n_seqs: usize) -> Vec<(usize, usize)> {
    let mut groups = Vec::new();
    let (mut start, mut tokens) = (0usize, 0usize);
    for (i, &len) in lens.iter().enumerate() {
        let full = i - start == n_seqs.max(1) || tokens + len > n_batch;
        if i > start && full {
            groups.push((start, i));
            start = i;
            tokens = 0;
        }
        tokens += len;
    }
    if start < lens.len() {
        groups.push((start, lens.len()));
    }
    groups
}

/// Scale each `dim`-wide row of `values` to unit L2 norm (all-zero rows stay zero).
pub fn normalize_rows(values: &mut [f32], dim: usize) {
    for row in values.chunks_mut(dim.max(1)) {
        let norm = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>().sqrt();
        if norm > 0.0 {
            for v in row.iter_mut() {
                *v = (f64::from(*v) / norm) as f32;
            }
        }
    }
}
