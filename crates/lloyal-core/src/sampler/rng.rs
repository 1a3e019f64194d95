//! The random stream of a sampler's final draw, and the draw itself.

use llama_cpp_sys_2 as sys;

use crate::sampling::SamplingParams;

/// The random stream of the final draw: SplitMix64 (64 bits of state, so a branch's RNG can
/// be cloned on fork and written into a saved state exactly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rng(u64);

impl Rng {
    /// A stream determined by `seed`.
    pub fn seeded(seed: u32) -> Rng {
        Rng(u64::from(seed) ^ 0x5851_F42D_4C95_7F2D)
    }

    /// A stream from the OS-seeded hasher (no seed given).
    pub fn random() -> Rng {
        use std::hash::BuildHasher;
        Rng(std::collections::hash_map::RandomState::new().hash_one(std::time::SystemTime::now()))
    }

    /// Rebuild from [`Rng::state`].
    pub fn from_state(state: u64) -> Rng {
        Rng(state)
    }

    /// The whole state.
    pub fn state(self) -> u64 {
        self.0
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

pub(super) fn rng_for(params: &SamplingParams) -> Rng {
    params.seed.map(Rng::seeded).unwrap_or_else(Rng::random)
}

/// Draw from softmax(logit) over `cands` with `u` in [0, 1); `None` if nothing is finite.
pub(super) fn draw(cands: &[sys::llama_token_data], u: f64) -> Option<i32> {
    draw_index(cands, u).map(|i| cands[i].id)
}

/// [`draw`]'s position in `cands`.
pub(super) fn draw_index(cands: &[sys::llama_token_data], u: f64) -> Option<usize> {
    let max = cands.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return None;
    }
    let weight = |c: &sys::llama_token_data| f64::from(c.logit - max).exp();
    let total: f64 = cands.iter().map(weight).sum();
    let mut target = u * total;
    let mut last = None;
    for (i, c) in cands.iter().enumerate() {
        let w = weight(c);
        if w > 0.0 {
            last = Some(i);
            if target < w {
                return Some(i);
            }
            target -= w;
        }
    }
    last
}
