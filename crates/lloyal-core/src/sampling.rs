//! Sampling parameters (pure data + validation) and the penalty maths applied on logits.

use crate::error::{LloyalError, Result};

/// Mirostat settings (`version` 1 or 2).
#[derive(Debug, Clone, PartialEq)]
pub struct Mirostat {
    pub version: u8,
    pub tau: f32,
    pub eta: f32,
}

/// DRY ("don't repeat yourself") penalty settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Dry {
    pub multiplier: f32,
    pub base: f32,
    pub allowed_length: i32,
    /// Tokens of history to scan; -1 = the whole context.
    pub penalty_last_n: i32,
    pub sequence_breakers: Vec<String>,
}

/// XTC ("exclude top choices") settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Xtc {
    pub probability: f32,
    pub threshold: f32,
    pub min_keep: usize,
}

impl Default for Mirostat {
    /// Version 2, target surprise `tau` 5.0, learning rate `eta` 0.1 (llama.cpp's defaults).
    fn default() -> Self {
        Mirostat { version: 2, tau: 5.0, eta: 0.1 }
    }
}

impl Default for Dry {
    /// llama.cpp's recommended DRY settings: multiplier 0.8, base 1.75, allowed length 2,
    /// the whole context, breakers newline, colon, quote and asterisk.
    fn default() -> Self {
        Dry {
            multiplier: 0.8,
            base: 1.75,
            allowed_length: 2,
            penalty_last_n: -1,
            sequence_breakers: ["\n", ":", "\"", "*"].iter().map(|s| s.to_string()).collect(),
        }
    }
}

impl Default for Xtc {
    /// Probability 0.5, threshold 0.1, keep at least one candidate.
    fn default() -> Self {
        Xtc { probability: 0.5, threshold: 0.1, min_keep: 1 }
    }
}

/// The full sampler configuration of docs/api.md ("Sampling"). `temperature <= 0` means greedy.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: i32,
    pub top_p: f32,
    pub min_p: f32,
    pub typical_p: f32,
    pub repeat_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    pub penalty_last_n: i32,
    pub seed: Option<u32>,
    pub mirostat: Option<Mirostat>,
    pub dry: Option<Dry>,
    pub xtc: Option<Xtc>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            typical_p: 1.0,
            repeat_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            penalty_last_n: 64,
            seed: None,
            mirostat: None,
            dry: None,
            xtc: None,
        }
    }
}

fn check(ok: bool, msg: impl FnOnce() -> String) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(LloyalError::InvalidArgument(msg()))
    }
}

/// The longest DRY window: llama.cpp allocates two buffers of that many tokens for each branch
/// when its sampler is made (2**31 tokens was 16 GB and an abort).
pub const MAX_DRY_WINDOW: i32 = 1 << 20;

fn unit(name: &str, v: f32) -> Result<()> {
    check((0.0..=1.0).contains(&v), || format!("{name} must be in [0, 1], got {v}"))
}

impl SamplingParams {
    /// Greedy parameters (temperature 0).
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// Whether sampling is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 && self.mirostat.is_none()
    }

    /// Whether repeat/frequency/presence penalties do anything.
    pub fn has_penalties(&self) -> bool {
        self.penalty_last_n != 0
            && (self.repeat_penalty != 1.0 || self.frequency_penalty != 0.0 || self.presence_penalty != 0.0)
    }

    /// Reject values llama.cpp would misbehave on, with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        check(self.temperature.is_finite(), || {
            format!("temperature must be finite, got {}", self.temperature)
        })?;
        check(self.top_k >= 0, || format!("top_k must be >= 0 (0 disables it), got {}", self.top_k))?;
        unit("top_p", self.top_p)?;
        unit("min_p", self.min_p)?;
        check(self.typical_p > 0.0 && self.typical_p <= 1.0, || {
            format!("typical_p must be in (0, 1] (1 disables it), got {}", self.typical_p)
        })?;
        check(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0, || {
            format!("repeat_penalty must be > 0 (1 disables it), got {}", self.repeat_penalty)
        })?;
        check(self.frequency_penalty.is_finite(), || "frequency_penalty must be finite".into())?;
        check(self.presence_penalty.is_finite(), || "presence_penalty must be finite".into())?;
        check(self.penalty_last_n >= -1, || {
            format!("penalty_last_n must be >= -1 (-1 = whole history, 0 = off), got {}", self.penalty_last_n)
        })?;
        if let Some(m) = &self.mirostat {
            check(m.version == 1 || m.version == 2, || {
                format!("mirostat version must be 1 or 2, got {}", m.version)
            })?;
            check(m.tau.is_finite() && m.tau > 0.0, || format!("mirostat tau must be > 0, got {}", m.tau))?;
            check(m.eta.is_finite() && m.eta > 0.0, || format!("mirostat eta must be > 0, got {}", m.eta))?;
        }
        if let Some(d) = &self.dry {
            check(d.multiplier.is_finite() && d.multiplier >= 0.0, || "dry multiplier must be >= 0".into())?;
            check(d.base.is_finite() && d.base >= 1.0, || format!("dry base must be >= 1, got {}", d.base))?;
            check(d.allowed_length >= 0, || "dry allowed_length must be >= 0".into())?;
            // llama.cpp allocates two buffers of this many tokens per branch at once
            check((-1..=MAX_DRY_WINDOW).contains(&d.penalty_last_n), || {
                format!(
                    "dry penalty_last_n must be in -1..={MAX_DRY_WINDOW} (-1: the model's context length), got {}",
                    d.penalty_last_n
                )
            })?;
            check(d.sequence_breakers.iter().all(|s| !s.is_empty() && !s.contains('\0')), || {
                "dry sequence_breakers must be non-empty strings without NUL".into()
            })?;
        }
        if let Some(x) = &self.xtc {
            unit("xtc probability", x.probability)?;
            unit("xtc threshold", x.threshold)?;
        }
        Ok(())
    }
}

/// The logits that llama.cpp-style repeat/frequency/presence penalties change, as
/// `(token, new value)` pairs in ascending token order, computed from the token history
/// (O(history), not O(vocab)).
pub fn penalty_replacements(logits: &[f32], history: &[i32], params: &SamplingParams) -> Vec<(usize, f32)> {
    if !params.has_penalties() || history.is_empty() {
        return Vec::new();
    }
    let window = match params.penalty_last_n {
        -1 => history.len(),
        n => (n as usize).min(history.len()),
    };
    let mut recent = history[history.len() - window..].to_vec();
    recent.sort_unstable();
    let mut out = Vec::new();
    for run in recent.chunk_by(|a, b| a == b) {
        let (token, count) = (run[0] as usize, run.len());
        let Some(&l) = logits.get(token) else { continue };
        let mut v = if l <= 0.0 { l * params.repeat_penalty } else { l / params.repeat_penalty };
        v -= count as f32 * params.frequency_penalty + params.presence_penalty;
        out.push((token, v));
    }
    out
}

/// Apply llama.cpp-style repeat/frequency/presence penalties to `logits` in place.
pub fn apply_penalties(logits: &mut [f32], history: &[i32], params: &SamplingParams) {
    for (i, v) in penalty_replacements(logits, history, params) {
        logits[i] = v;
    }
}

/// Penalties then additive biases, as replacements for the given logits.
pub fn adjusted_replacements(
    logits: &[f32],
    history: &[i32],
    params: &SamplingParams,
    biases: &[(i32, f32)],
) -> Vec<(usize, f32)> {
    let mut repl = penalty_replacements(logits, history, params);
    if biases.len() <= 32 {
        add_biases_by_search(&mut repl, logits, biases);
        return repl;
    }
    // Many biases (a ban of much of the vocabulary): sorted and merged with the penalties'
    // replacements (in ascending token order), n log n where a search per bias was n squared.
    // A token biased twice (logit bias and steering) gets both, in the order given.
    let mut sorted: Vec<(usize, f32)> = biases.iter().map(|&(t, b)| (t as usize, b)).collect();
    sorted.sort_by_key(|&(t, _)| t);
    let mut out = Vec::with_capacity(repl.len() + sorted.len());
    let mut penalised = repl.drain(..).peekable();
    for run in sorted.chunk_by(|a, b| a.0 == b.0) {
        let t = run[0].0;
        while let Some(p) = penalised.next_if(|&(pt, _)| pt < t) {
            out.push(p);
        }
        let base = match penalised.next_if(|&(pt, _)| pt == t) {
            Some((_, v)) => v,
            None => match logits.get(t) {
                Some(&l) => l,
                None => continue,
            },
        };
        out.push((t, run.iter().fold(base, |v, &(_, b)| biased(v, b))));
    }
    out.extend(penalised);
    out
}

/// `logit` with `bias` added: a ban (-inf) bans whatever the logit, +inf included (whose sum
/// with -inf is NaN, which the samplers read differently).
pub fn biased(logit: f32, bias: f32) -> f32 {
    if bias == f32::NEG_INFINITY {
        f32::NEG_INFINITY
    } else {
        logit + bias
    }
}

/// Add `biases` to the replacements `repl` of `logits`, finding each token by a scan (the
/// definition; quadratic for a long bias map).
fn add_biases_by_search(repl: &mut Vec<(usize, f32)>, logits: &[f32], biases: &[(i32, f32)]) {
    for &(t, b) in biases {
        let t = t as usize;
        if let Some(entry) = repl.iter_mut().find(|(i, _)| *i == t) {
            entry.1 = biased(entry.1, b);
        } else if let Some(&l) = logits.get(t) {
            repl.push((t, biased(l, b)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What adjusted_replacements gives, by a search per bias (the definition).
    fn replacements_by_search(
        logits: &[f32],
        history: &[i32],
        params: &SamplingParams,
        biases: &[(i32, f32)],
    ) -> Vec<(usize, f32)> {
        let mut repl = penalty_replacements(logits, history, params);
        add_biases_by_search(&mut repl, logits, biases);
        repl.sort_by_key(|&(t, _)| t);
        repl
    }

    #[test]
    fn many_biases_merge_as_a_search_per_bias_would() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0 - 5.0).collect();
        let params = SamplingParams { repeat_penalty: 1.3, frequency_penalty: 0.2, ..Default::default() };
        let history: Vec<i32> = (0..64).map(|i| (i * 13) % 200).collect();
        // 600 biases over 500 tokens: penalised ones, repeats (bias and steering), -inf bans,
        // and ids past the vocabulary (skipped)
        let biases: Vec<(i32, f32)> = (0..600)
            .map(|i| {
                (
                    (i * 7) % 500 + if i % 97 == 0 { 2000 } else { 0 },
                    if i % 5 == 0 { f32::NEG_INFINITY } else { 0.5 },
                )
            })
            .collect();
        for (h, b) in [(&history[..], &biases[..]), (&[][..], &biases[..]), (&history[..], &biases[..20])] {
            let mut fast = adjusted_replacements(&logits, h, &params, b);
            fast.sort_by_key(|&(t, _)| t);
            let want = replacements_by_search(&logits, h, &params, b);
            assert_eq!(fast.len(), want.len());
            for (x, y) in fast.iter().zip(&want) {
                assert!(x.0 == y.0 && x.1.to_bits() == y.1.to_bits(), "{x:?} != {y:?}");
            }
        }
    }

    #[test]
    fn defaults_validate() {
        SamplingParams::default().validate().unwrap();
        assert!(SamplingParams::greedy().is_greedy());
    }

    #[test]
    fn rejects_bad_values() {
        let bad = [
            SamplingParams { top_k: -1, ..Default::default() },
            SamplingParams { top_p: 1.5, ..Default::default() },
            SamplingParams { repeat_penalty: 0.0, ..Default::default() },
            SamplingParams { temperature: f32::NAN, ..Default::default() },
            SamplingParams {
                mirostat: Some(Mirostat { version: 3, tau: 5.0, eta: 0.1 }),
                ..Default::default()
            },
        ];
        for p in bad {
            assert!(matches!(p.validate(), Err(LloyalError::InvalidArgument(_))), "{p:?}");
        }
    }

    #[test]
    fn penalties_follow_llama_cpp_formula() {
        let p = SamplingParams {
            repeat_penalty: 2.0,
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            penalty_last_n: 3,
            ..Default::default()
        };
        let mut logits = vec![4.0, -2.0, 1.0, 3.0];
        // token 0 is outside the 3-token window; token 1 twice, token 2 once.
        apply_penalties(&mut logits, &[0, 1, 1, 2], &p);
        assert_eq!(logits[0], 4.0);
        assert_eq!(logits[1], -2.0 * 2.0 - 2.0 * 0.5 - 0.25);
        assert_eq!(logits[2], 1.0 / 2.0 - 0.5 - 0.25);
        assert_eq!(logits[3], 3.0);
    }

    #[test]
    fn neutral_penalties_do_nothing() {
        let mut logits = vec![1.0, 2.0];
        apply_penalties(&mut logits, &[0, 1], &SamplingParams::default());
        assert_eq!(logits, vec![1.0, 2.0]);
    }
}
