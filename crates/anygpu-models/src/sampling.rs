//! Token sampling, in llama.cpp's order: repetition penalty -> top-k -> top-p -> min-p ->
//! temperature -> draw. Temperature 0 is greedy. A seed makes the draw repeatable.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 = greedy (argmax).
    pub temperature: f32,
    /// 0 = off.
    pub top_k: usize,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0.0 = off: drop tokens below min_p x the top probability.
    pub min_p: f32,
    /// 1.0 = off: logits of recently seen tokens are divided (if > 0) or multiplied by this.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding: the most likely token every step.
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Default::default() }
    }
    /// Checks ranges, with messages naming the flag (negated comparisons so that NaN fails).
    #[allow(clippy::neg_cmp_op_on_partial_ord)]
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0) {
            return Err(format!("--temp must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("--top-p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("--min-p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repeat_penalty > 0.0) {
            return Err(format!("--repeat-penalty must be > 0, got {}", self.repeat_penalty));
        }
        Ok(())
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest value (lowest index on ties); None for an empty slice.
pub fn argmax(logits: &[f32]) -> Option<usize> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &v) in logits.iter().enumerate() {
        if best.is_none_or(|(_, b)| v > b) {
            best = Some((i, v));
        }
    }
    best.map(|(i, _)| i)
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Sampler {
        let rng = StdRng::seed_from_u64(params.seed);
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether every pick is the plain argmax of the logits (temperature 0, no repetition
    /// penalty): then the choice can be made on the GPU (see `Llama::decode_greedy`).
    pub fn is_greedy(&self) -> bool {
        let p = &self.params;
        p.temperature <= 0.0 && (p.repeat_penalty == 1.0 || p.repeat_last_n == 0)
    }

    /// Picks the next token from `logits` [V], given the tokens so far (`history`).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let mut logits = logits.to_vec();
        if p.repeat_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &id in &history[start..] {
                if let Some(l) = logits.get_mut(id as usize) {
                    if seen.insert(id) {
                        *l = if *l > 0.0 { *l / p.repeat_penalty } else { *l * p.repeat_penalty };
                    }
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(&logits).unwrap_or(0) as u32;
        }
        // Candidates sorted by logit, best first.
        let mut cand: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
        let k = if p.top_k == 0 { cand.len() } else { p.top_k.min(cand.len()) };
        if k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(k);
        }
        cand.sort_by(|a, b| b.1.total_cmp(&a.1));
        // Probabilities at temperature 1 for top-p and min-p (as llama.cpp's samplers see them).
        let probs = softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>(), 1.0);
        let mut keep = cand.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = probs[0] * p.min_p;
            keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
        }
        cand.truncate(keep.max(1));
        let probs = softmax(&cand.iter().map(|c| c.1).collect::<Vec<_>>(), p.temperature);
        let r: f32 = self.rng.random();
        let mut cum = 0.0;
        for (c, pr) in cand.iter().zip(&probs) {
            cum += pr;
            if r < cum {
                return c.0;
            }
        }
        cand.last().map_or(0, |c| c.0)
    }
}

fn softmax(logits: &[f32], temperature: f32) -> Vec<f32> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|&l| ((l - max) / temperature).exp()).collect();
    let s: f32 = e.iter().sum();
    e.iter().map(|v| v / s).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 3.0], &[]), 1);
    }

    #[test]
    fn same_seed_same_draws() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let p = SamplingParams { seed: 42, temperature: 1.0, ..Default::default() };
        let draw = |p: &SamplingParams| {
            let mut s = Sampler::new(p.clone());
            (0..20).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(draw(&p), draw(&p));
        assert_ne!(draw(&p), draw(&SamplingParams { seed: 43, ..p.clone() }));
    }

    #[test]
    fn top_k_one_is_greedy_and_penalty_demotes() {
        let mut s = Sampler::new(SamplingParams { top_k: 1, temperature: 1.0, ..Default::default() });
        assert_eq!(s.sample(&[1.0, 2.0, 0.5], &[]), 1);
        let mut s = Sampler::new(SamplingParams { repeat_penalty: 10.0, ..SamplingParams::greedy() });
        assert_eq!(s.sample(&[1.0, 2.0, 0.5], &[1]), 0);
    }

    #[test]
    fn min_p_and_top_p_cut_the_tail() {
        // One dominant token: min_p 0.5 leaves only it, whatever the seed.
        for seed in 0..20 {
            let mut s =
                Sampler::new(SamplingParams { min_p: 0.5, top_k: 0, temperature: 5.0, seed, ..Default::default() });
            assert_eq!(s.sample(&[10.0, 1.0, 0.0, 0.5], &[]), 0);
            let mut s = Sampler::new(SamplingParams {
                top_p: 0.5,
                min_p: 0.0,
                top_k: 0,
                temperature: 5.0,
                seed,
                ..Default::default()
            });
            assert_eq!(s.sample(&[10.0, 1.0, 0.0, 0.5], &[]), 0);
        }
    }
}
