//! The candidates a draw chooses from: the top-k of a row (replacements substituted), the
//! best tokens a grammar allows, the greedy token.

use llama_cpp_sys_2 as sys;
use multiversion::multiversion;

use crate::metrics::{max_f32, max_f32_lanes};
use crate::scan::SPAN;

/// A candidate `(value, token)`, ordered as top-k ranks them.
#[derive(Clone, Copy, PartialEq)]
struct Cand(f32, i32);

impl Eq for Cand {}

impl PartialOrd for Cand {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Cand {
    /// By value, then lower id first (so ties prefer the lower token id, like argmax).
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0).then(other.1.cmp(&self.1))
    }
}

/// The `k` highest `(token, value)` pairs of `logits` with `replace` entries substituted,
/// best first. Exact: the true top-k is contained in the top-(k + |replace|) of the
/// unreplaced values plus the replaced entries. NaN values are never selected.
///
/// On a large vocabulary the maximum of every [`SPAN`] values is taken first; the `cap`-th
/// largest of them is a lower bound of the `cap`-th largest value (those `cap` spans each hold a
/// value at least that big), so only spans reaching it are scanned with the bounded heap. For
/// k = 40 over 262,144 logits that visits a few thousand values.
pub fn top_candidates(logits: &[f32], replace: &[(usize, f32)], k: usize) -> Vec<(i32, f32)> {
    top_candidates_in(logits, &[], replace, k)
}

/// [`top_candidates`] with the span maxima of `logits` given (a snapshot's summary: no pass
/// over the row to find them); empty `maxima` are computed when the row is large.
pub fn top_candidates_in(
    logits: &[f32],
    maxima: &[f32],
    replace: &[(usize, f32)],
    k: usize,
) -> Vec<(i32, f32)> {
    let cap = (k + replace.len()).min(logits.len()).max(1);
    let mut heap = TopHeap::new(cap);
    if logits.len() >= cap * SPAN * 4 {
        let owned: Vec<f32>;
        let maxima = if maxima.len() == logits.len().div_ceil(SPAN) {
            maxima
        } else {
            owned = logits.chunks(SPAN).map(max_f32_lanes::<16>).collect();
            &owned
        };
        offer_spans_reaching(&mut heap, logits, maxima, nth_largest(maxima, cap));
    } else {
        for (i, &x) in logits.iter().enumerate() {
            if !x.is_nan() {
                heap.offer(Cand(x, i as i32));
            }
        }
    }
    let mut out: Vec<Cand> = heap.into_vec();
    let replaced = ReplacedIds::new(replace);
    out.retain(|c| !replaced.contains(c.1));
    out.extend(replace.iter().filter(|(i, _)| *i < logits.len()).map(|&(i, v)| Cand(v, i as i32)));
    out.sort_unstable_by(|a, b| b.cmp(a));
    out.truncate(k);
    out.into_iter().map(|c| (c.1, c.0)).collect()
}

/// The tokens a replacement list names, for membership tests: a scan of a short list (the usual
/// few penalised tokens), a sorted copy bisected for a long one (a bias map of much of the
/// vocabulary, which a scan per candidate made quadratic).
enum ReplacedIds<'a> {
    Few(&'a [(usize, f32)]),
    Many(Vec<i32>),
}

impl<'a> ReplacedIds<'a> {
    fn new(replace: &'a [(usize, f32)]) -> Self {
        if replace.len() <= 32 {
            return ReplacedIds::Few(replace);
        }
        let mut ids: Vec<i32> = replace.iter().map(|&(i, _)| i as i32).collect();
        ids.sort_unstable();
        ReplacedIds::Many(ids)
    }

    fn contains(&self, id: i32) -> bool {
        match self {
            ReplacedIds::Few(r) => r.iter().any(|&(i, _)| i as i32 == id),
            ReplacedIds::Many(ids) => ids.binary_search(&id).is_ok(),
        }
    }
}

/// Offer `heap` every value of `logits` at least `bound`, visiting only the [`SPAN`]s whose
/// maximum (`maxima`) reaches it, a group of [`LANES`] values compared at once.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512dq+avx512vl", "x86_64+avx2+fma"))]
fn offer_spans_reaching(heap: &mut TopHeap, logits: &[f32], maxima: &[f32], bound: f32) {
    for (c, group) in maxima.chunks(LANES).enumerate() {
        for b in set_bits(at_least(group, bound)).map(|j| c * LANES + j) {
            let span = &logits[b * SPAN..((b + 1) * SPAN).min(logits.len())];
            for (d, part) in span.chunks(LANES).enumerate() {
                for j in set_bits(at_least(part, bound)).map(|j| d * LANES + j) {
                    heap.offer(Cand(span[j], (b * SPAN + j) as i32));
                }
            }
        }
    }
}

/// A candidate for llama.cpp's chain.
pub(super) fn token_data((id, logit): (i32, f32)) -> sys::llama_token_data {
    sys::llama_token_data { id, logit, p: 0.0 }
}

/// `(token, value)` of every token of `ids` whose value (`replace` substituted) is finite, best
/// first (the order of [`top_candidates`]).
pub(super) fn allowed_finite(logits: &[f32], replace: &[(usize, f32)], ids: &[i32]) -> Vec<(i32, f32)> {
    let mut sorted = replace.to_vec();
    sorted.sort_unstable_by_key(|&(i, _)| i);
    let value = |t: i32| match sorted.binary_search_by_key(&(t as usize), |&(i, _)| i) {
        Ok(at) => sorted[at].1,
        Err(_) => logits[t as usize],
    };
    let mut out: Vec<Cand> = ids
        .iter()
        .filter(|&&t| t >= 0 && (t as usize) < logits.len())
        .map(|&t| Cand(value(t), t))
        .filter(|c| c.0.is_finite())
        .collect();
    out.sort_unstable_by(|a, b| b.cmp(a));
    out.into_iter().map(|c| (c.1, c.0)).collect()
}

/// The `k` best tokens that `allowed` accepts with a finite value, from windows of the row's
/// best tokens growing ×4 (256 first, 16,384 at most): exact, since a token outside a window
/// ranks below every token in it. `None` when no window holds `k`.
pub(super) fn best_allowed_in_windows(
    logits: &[f32],
    maxima: &[f32],
    replace: &[(usize, f32)],
    k: usize,
    allowed: &dyn Fn(i32) -> bool,
) -> Option<Vec<(i32, f32)>> {
    let mut window = (4 * k).max(256);
    while window <= 16_384 {
        let w = window.min(logits.len());
        let top = top_candidates_in(logits, maxima, replace, w);
        let best: Vec<(i32, f32)> =
            top.iter().filter(|c| c.1.is_finite() && allowed(c.0)).take(k).copied().collect();
        if best.len() == k {
            return Some(best);
        }
        if w >= logits.len() || top.len() < w {
            return None;
        }
        window *= 4;
    }
    None
}

/// `best` (every finite candidate when there are fewer than `k`) cut or padded to `k`: the
/// padding is what top-k of the masked row adds, `-inf` tokens by lowest id.
pub(super) fn pad_to_k(mut best: Vec<(i32, f32)>, k: usize) -> Vec<(i32, f32)> {
    if best.len() >= k {
        best.truncate(k);
        return best;
    }
    let mut taken: Vec<i32> = best.iter().map(|c| c.0).collect();
    taken.sort_unstable();
    let mut id = 0;
    while best.len() < k {
        if taken.binary_search(&id).is_err() {
            best.push((id, f32::NEG_INFINITY));
        }
        id += 1;
    }
    best
}

/// Values a mask of [`at_least`] covers: one SIMD compare a group.
const LANES: usize = 16;

/// Bit `i` set where `values[i] >= t` (at most [`LANES`] values; NaN never), branch-free so
/// the compiler makes it a vector compare and a move-mask.
#[inline(always)]
fn at_least(values: &[f32], t: f32) -> u32 {
    if let Ok(group) = <&[f32; LANES]>::try_from(values) {
        let mut mask = 0;
        for (i, &x) in group.iter().enumerate() {
            mask |= u32::from(x >= t) << i;
        }
        return mask;
    }
    values.iter().enumerate().fold(0, |m, (i, &x)| m | (u32::from(x >= t) << i))
}

/// The positions of the set bits of `mask`, lowest first.
#[inline]
fn set_bits(mut mask: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let i = (mask != 0).then(|| mask.trailing_zeros() as usize)?;
        mask &= mask - 1;
        Some(i)
    })
}

/// The `n`-th largest number of `values` (`n >= 1`; NaN skipped; `-inf` when fewer than `n`
/// numbers), in two levels. The values fall into groups (lane `j` of each window of
/// `LANES x LANES`: a group's largest is a vertical maximum, one vector instruction a row of the
/// window), and the `n`-th largest of the groups' largest is a floor (`n` groups each hold a
/// value at least that big); the answer is the `n`-th largest of the values reaching it. On a
/// row's span maxima (4,096 at Gemma 3) that selects among 256 and then among a few hundred.
/// A floor taken from the first values seen rose slowly on a model's rows, whose low-valued
/// stretches of the vocabulary let most values through: on Gemma 3's rows this takes 2.3-3.0 us
/// where that took 3.1-4.5 (4.7-5.8 against 5.7-7.3 with the maxima out of cache).
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512dq+avx512vl", "x86_64+avx2+fma"))]
fn nth_largest(values: &[f32], n: usize) -> f32 {
    let n = n.max(1);
    let nth = |buf: &mut Vec<f32>| {
        if buf.len() < n {
            return f32::NEG_INFINITY;
        }
        *buf.select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a)).1
    };
    // A group is one lane of a window of LANES x LANES values: its maximum a vertical one.
    let mut tops: Vec<f32> = Vec::with_capacity(values.len().div_ceil(LANES));
    for window in values.chunks(LANES * LANES) {
        let mut top = [f32::NEG_INFINITY; LANES];
        for group in window.chunks(LANES) {
            for (t, &x) in top.iter_mut().zip(group) {
                *t = t.max(x); // NaN ignored
            }
        }
        tops.extend_from_slice(&top);
    }
    let floor = if tops.len() > n { nth(&mut tops) } else { f32::NEG_INFINITY };
    let mut buf: Vec<f32> = Vec::with_capacity(4 * n);
    for group in values.chunks(LANES) {
        buf.extend(set_bits(at_least(group, floor)).map(|i| group[i]));
    }
    nth(&mut buf)
}

/// The `cap` best candidates seen so far (a min-heap on [`Cand`] order).
struct TopHeap {
    heap: std::collections::BinaryHeap<std::cmp::Reverse<Cand>>,
    cap: usize,
}

impl TopHeap {
    fn new(cap: usize) -> Self {
        TopHeap { heap: std::collections::BinaryHeap::with_capacity(cap + 1), cap }
    }

    fn offer(&mut self, c: Cand) {
        if self.heap.len() < self.cap {
            self.heap.push(std::cmp::Reverse(c));
        } else if self.heap.peek().is_some_and(|floor| c > floor.0) {
            self.heap.pop();
            self.heap.push(std::cmp::Reverse(c));
        }
    }

    fn into_vec(self) -> Vec<Cand> {
        self.heap.into_iter().map(|r| r.0).collect()
    }
}

/// [`greedy_token`] with the span maxima of `logits` given (empty: not known).
pub fn greedy_token_in(logits: &[f32], maxima: &[f32], replace: &[(usize, f32)]) -> i32 {
    if replace.is_empty() {
        return argmax(logits);
    }
    top_candidates_in(logits, maxima, replace, 1).first().map(|c| c.0).unwrap_or(0)
}

/// The greedy choice: the highest value once `replace` entries are substituted, the lower id
/// on ties (as [`top_candidates`] with `k = 1`). Without replacements this is [`argmax`].
pub fn greedy_token(logits: &[f32], replace: &[(usize, f32)]) -> i32 {
    if replace.is_empty() {
        return argmax(logits);
    }
    top_candidates(logits, replace, 1).first().map(|c| c.0).unwrap_or(0)
}

/// Index of the largest value (first on ties); 0 for an empty slice, or when nothing beats
/// negative infinity (NaN never wins).
///
/// Two passes over the slice: a lane-wise maximum the compiler turns into SIMD `max`
/// instructions ([`max_f32`]), then the first position holding it. On a 262,144-token
/// vocabulary this is several times faster than a compare-and-branch scan (greedy decoding
/// runs it every step).
pub fn argmax(values: &[f32]) -> i32 {
    let best = max_f32(values);
    if best == f32::NEG_INFINITY {
        return 0;
    }
    values.iter().position(|&v| v == best).unwrap_or(0) as i32
}

#[cfg(test)]
mod tests {
    use super::{at_least, nth_largest, set_bits};

    /// The n-th largest number equals a sort's, with ties, `-inf` runs and NaN, at lengths on
    /// both sides of a whole number of groups, and `-inf` when fewer than n numbers.
    #[test]
    fn nth_largest_equals_a_sort() {
        let mut next = super::super::tests::xorshift(0x853c_49e6_748f_ea9b);
        for &len in &[1usize, 15, 16, 17, 100, 4096, 4099] {
            let mut v: Vec<f32> = (0..len).map(|_| (next() % 200) as f32 / 8.0 - 12.0).collect();
            for x in v.iter_mut().skip(3).step_by(7) {
                *x = f32::NEG_INFINITY;
            }
            if len > 20 {
                v[len / 2] = f32::NAN;
                v[5] = f32::NAN;
            }
            let mut sorted: Vec<f32> = v.iter().copied().filter(|x| !x.is_nan()).collect();
            sorted.sort_by(|a, b| b.total_cmp(a));
            for n in [1, 2, 5, 42, len] {
                let want = sorted.get(n - 1).copied().unwrap_or(f32::NEG_INFINITY);
                assert_eq!(nth_largest(&v, n), want, "len={len} n={n}");
            }
        }
        assert_eq!(nth_largest(&[f32::NAN, 1.0], 2), f32::NEG_INFINITY);
    }

    #[test]
    fn masks_and_their_bits() {
        let v = [3.0, f32::NAN, 5.0, -1.0, 5.0];
        assert_eq!(at_least(&v, 4.0), 0b10100);
        assert_eq!(at_least(&v, f32::NEG_INFINITY), 0b11101);
        assert_eq!(set_bits(0b10100).collect::<Vec<_>>(), vec![2, 4]);
        assert_eq!(set_bits(0).count(), 0);
        assert_eq!(set_bits(1 << 15).collect::<Vec<_>>(), vec![15]);
    }
}
