//! Entropy, surprisal and perplexity from logits, numerically stable (log-sum-exp).

use crate::error::{LloyalError, Result};

/// Logarithm base for information measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Base {
    Nats,
    Bits,
}

impl Base {
    /// Parse "nats" / "bits".
    pub fn parse(s: &str) -> Result<Base> {
        match s {
            "nats" => Ok(Base::Nats),
            "bits" => Ok(Base::Bits),
            other => Err(LloyalError::invalid(format!(
                "base must be \"nats\" or \"bits\", got {other:?}"
            ))),
        }
    }

    fn scale(self, nats: f64) -> f64 {
        match self {
            Base::Nats => nats,
            Base::Bits => nats / std::f64::consts::LN_2,
        }
    }
}

/// log(sum(exp(logits))) computed stably; `-inf` when every logit is `-inf`.
pub fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return f64::from(max);
    }
    let m = f64::from(max);
    let sum: f64 = logits.iter().map(|&l| (f64::from(l) - m).exp()).sum();
    m + sum.ln()
}

/// Shannon entropy of softmax(logits).
pub fn entropy(logits: &[f32], base: Base) -> f64 {
    let lse = log_sum_exp(logits);
    if !lse.is_finite() {
        return 0.0;
    }
    let mut h = 0.0;
    for &l in logits {
        if l == f32::NEG_INFINITY {
            continue;
        }
        let logp = f64::from(l) - lse;
        h -= logp.exp() * logp;
    }
    base.scale(h.max(0.0))
}

/// Surprisal `-log p(token)` under softmax(logits); `inf` for a banned token.
pub fn surprisal(logits: &[f32], token: usize, base: Base) -> f64 {
    let Some(&l) = logits.get(token) else {
        return f64::INFINITY;
    };
    let lse = log_sum_exp(logits);
    base.scale((lse - f64::from(l)).max(0.0))
}

/// Running perplexity: exp(mean surprisal in nats); `inf` before any observation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PerplexityTracker {
    sum_nats: f64,
    count: u64,
}

impl PerplexityTracker {
    /// A fresh tracker.
    pub fn new() -> Self {
        Self::default()
    }

    /// Record one token's surprisal in nats.
    pub fn add(&mut self, surprisal_nats: f64) {
        self.sum_nats += surprisal_nats;
        self.count += 1;
    }

    /// exp(mean surprisal); `inf` when empty.
    pub fn perplexity(&self) -> f64 {
        if self.count == 0 {
            f64::INFINITY
        } else {
            (self.sum_nats / self.count as f64).exp()
        }
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Sum of surprisals in nats.
    pub fn sum_nats(&self) -> f64 {
        self.sum_nats
    }

    /// Rebuild from saved parts.
    pub fn from_parts(sum_nats: f64, count: u64) -> Self {
        PerplexityTracker { sum_nats, count }
    }

    /// Forget everything.
    pub fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_entropy_is_log_n() {
        let logits = vec![3.0f32; 8];
        assert!((entropy(&logits, Base::Bits) - 3.0).abs() < 1e-9);
        assert!((entropy(&logits, Base::Nats) - 8f64.ln()).abs() < 1e-9);
    }

    #[test]
    fn stable_with_huge_logits() {
        let logits = [1000.0f32, 1000.0, f32::NEG_INFINITY];
        assert!((entropy(&logits, Base::Bits) - 1.0).abs() < 1e-9);
        assert!((surprisal(&logits, 0, Base::Bits) - 1.0).abs() < 1e-9);
        assert_eq!(surprisal(&logits, 2, Base::Nats), f64::INFINITY);
    }

    #[test]
    fn perplexity_of_constant_surprisal() {
        let mut t = PerplexityTracker::new();
        assert_eq!(t.perplexity(), f64::INFINITY);
        t.add(2f64.ln());
        t.add(2f64.ln());
        assert!((t.perplexity() - 2.0).abs() < 1e-12);
        assert_eq!(t.count(), 2);
    }

    #[test]
    fn base_parse() {
        assert_eq!(Base::parse("bits").unwrap(), Base::Bits);
        assert!(Base::parse("dits").is_err());
    }
}
