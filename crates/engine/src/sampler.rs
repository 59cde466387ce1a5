//! Token sampling from one row of logits, following vLLM's sampling semantics.
//!
//! One [`Sampler`] is created per sequence. It owns the sequence's RNG (seeded from the
//! request's `seed`, or from a caller-drawn fallback seed) and scratch buffers that are
//! reused from one step to the next, so a call to [`Sampler::sample`] on a 49k-entry row
//! does not allocate beyond the returned top-logprob list.
//!
//! Processing order of [`Sampler::sample`]:
//!
//! 1. **Sanitize**: NaN → `-inf`, `+inf` → `f32::MAX`, `-0.0` → `0.0`. A row with no finite
//!    value left after masking and penalties is treated as uniform (all zeros).
//! 2. **logit_bias**: `logit += bias` for each `(token, bias)` pair (ids outside the row and
//!    non-finite biases are ignored; repeated ids add up).
//! 3. **min_tokens**: while fewer than `min_tokens` tokens have been generated, the
//!    `stop_token_ids` and the EOS ids are set to `-inf`. With `ignore_eos` the EOS ids are
//!    *not* masked (as in vLLM, where EOS is then not a stop token at all); ignoring EOS
//!    as a stop condition is the caller's stop check's job.
//! 4. **Penalties** (vLLM order): repetition penalty over every distinct token seen in the
//!    prompt or the output (`logit > 0` → `logit / r`, else `logit * r`); then
//!    `logit -= frequency_penalty * count` and `logit -= presence_penalty` for tokens that
//!    occur in the output (`count` = occurrences in the output only).
//! 5. **Logprobs**: the returned logprobs are the log-softmax of the logits *after* steps
//!    1–4 and *before* temperature, top-k, top-p and min-p (the "processed logits before
//!    temperature" flavour; note vLLM V1's default is the raw model output instead).
//! 6. **Selection**: greedy (`temperature < 1e-5`) → argmax, ties to the lowest id.
//!    Otherwise temperature scaling, then top-k, then top-p over the top-k renormalized
//!    distribution (the smallest descending-probability prefix whose mass reaches `top_p`,
//!    never empty), then min-p (drop tokens whose probability is below
//!    `min_p * max_prob`), then one draw from the renormalized survivors with the
//!    sequence RNG. This is vLLM V0's truncation order (V1 applies min-p first).
//!
//! On return the `logits` slice holds the processed values of steps 1–4.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;

/// Temperatures below this (or NaN) select greedy decoding.
pub const GREEDY_TEMPERATURE_EPS: f32 = 1e-5;

/// Top-m tried first when looking for the top-p nucleus (before the O(n) quickselect).
const TOP_P_FIRST_BLOCK: usize = 64;

/// Per-request sampling parameters (vLLM names and defaults).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingConfig {
    /// Softmax temperature; `0` (anything below [`GREEDY_TEMPERATURE_EPS`]) means greedy.
    pub temperature: f32,
    /// Keep only the `k` most likely tokens; `None` or `Some(0)` disables.
    pub top_k: Option<u32>,
    /// Nucleus sampling mass in `(0, 1]`; `1.0` disables, values `<= 0` keep one token.
    pub top_p: f32,
    /// Drop tokens whose probability is below `min_p * max_prob`; `0.0` disables.
    pub min_p: f32,
    /// Multiplicative penalty on tokens seen in prompt or output; `1.0` disables.
    /// Non-finite or non-positive values are treated as `1.0`.
    pub repetition_penalty: f32,
    /// Subtracted once from every token that occurs in the output; non-finite → `0`.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the output; non-finite → `0`.
    pub frequency_penalty: f32,
    /// Per-request seed; same seed and inputs → same samples.
    pub seed: Option<u64>,
    /// Number of top logprobs wanted per step (`None` → none).
    pub logprobs: Option<u32>,
    /// Do not stop on EOS (handled by the caller); also disables min_tokens EOS masking.
    pub ignore_eos: bool,
    /// EOS and `stop_token_ids` are masked until this many tokens have been generated.
    pub min_tokens: u32,
    /// Extra token ids that stop generation (masked during `min_tokens`).
    pub stop_token_ids: Vec<u32>,
    /// Additive per-token biases (OpenAI `logit_bias`), applied before penalties.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: None,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            logprobs: None,
            ignore_eos: false,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingConfig {
    /// Greedy decoding: temperature is zero, below [`GREEDY_TEMPERATURE_EPS`], or NaN.
    pub fn is_greedy(&self) -> bool {
        self.temperature.is_nan() || self.temperature < GREEDY_TEMPERATURE_EPS
    }

    fn effective_repetition_penalty(&self) -> f32 {
        let r = self.repetition_penalty;
        if r.is_finite() && r > 0.0 {
            r
        } else {
            1.0
        }
    }
}

/// Result of one sampling step.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleOutput {
    /// The chosen token id.
    pub token: u32,
    /// Logprob of `token` (see the module docs for which distribution).
    pub logprob: f32,
    /// The `config.logprobs` most likely tokens, descending logprob, ties by lower id.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Per-sequence sampler: configuration, RNG and reusable scratch buffers.
#[derive(Debug, Clone)]
pub struct Sampler {
    config: SamplingConfig,
    rng: StdRng,
    /// Vocab-sized occurrence counters, all zero between calls.
    counts: Vec<u32>,
    /// Candidate / index scratch.
    indices: Vec<u32>,
    /// Vocab-sized unnormalized probabilities, valid only for current candidates.
    weights: Vec<f32>,
    /// Packed (weight, id) sort keys for the top-p quickselect.
    keys: Vec<u64>,
}

impl Sampler {
    /// Creates a sampler; the RNG is seeded with `config.seed`, or `fallback_seed` when the
    /// request has none (the caller draws it from its own RNG).
    pub fn new(config: SamplingConfig, fallback_seed: u64) -> Self {
        let rng = StdRng::seed_from_u64(config.seed.unwrap_or(fallback_seed));
        Self {
            config,
            rng,
            counts: Vec::new(),
            indices: Vec::new(),
            weights: Vec::new(),
            keys: Vec::new(),
        }
    }

    /// The sampling parameters.
    pub fn config(&self) -> &SamplingConfig {
        &self.config
    }

    /// Samples the next token from `logits` (one vocab-sized row, modified in place; see the
    /// module docs for the processing order). Token ids in `prompt_tokens`, `output_tokens`,
    /// `eos_ids` or `stop_token_ids` outside the row are ignored. An empty row (a caller bug)
    /// returns token 0 with a `-inf` logprob.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
        eos_ids: &[u32],
    ) -> SampleOutput {
        // Token ids are u32: anything beyond is unaddressable and ignored.
        let n = logits.len().min(u32::MAX as usize);
        let logits = &mut logits[..n];
        if n == 0 {
            return SampleOutput {
                token: 0,
                logprob: f32::NEG_INFINITY,
                top_logprobs: Vec::new(),
            };
        }

        for x in logits.iter_mut() {
            *x = sanitize(*x);
        }
        for &(t, bias) in &self.config.logit_bias {
            if let Some(x) = logits.get_mut(t as usize) {
                if bias.is_finite() {
                    *x = sanitize(*x + bias);
                }
            }
        }
        self.apply_min_tokens(logits, output_tokens, eos_ids);
        self.apply_penalties(logits, prompt_tokens, output_tokens);

        let (mut argmax, mut max) = argmax(logits);
        if max == f32::NEG_INFINITY {
            // Nothing is possible: fall back to a uniform row rather than failing.
            logits.fill(0.0);
            argmax = 0;
            max = 0.0;
        }
        let lse = log_sum_exp(logits, max);

        let token = if self.config.is_greedy() {
            argmax
        } else {
            self.draw(logits, max).unwrap_or(argmax)
        };
        let logprob = (f64::from(logits[token]) - lse) as f32;
        let top_logprobs = match self.config.logprobs {
            Some(k) if k > 0 => self.top_logprobs(logits, lse, k as usize),
            _ => Vec::new(),
        };
        SampleOutput {
            token: token as u32,
            logprob,
            top_logprobs,
        }
    }

    fn apply_min_tokens(&self, logits: &mut [f32], output_tokens: &[u32], eos_ids: &[u32]) {
        if output_tokens.len() >= self.config.min_tokens as usize {
            return;
        }
        let eos: &[u32] = if self.config.ignore_eos { &[] } else { eos_ids };
        for &t in eos.iter().chain(&self.config.stop_token_ids) {
            if let Some(x) = logits.get_mut(t as usize) {
                *x = f32::NEG_INFINITY;
            }
        }
    }

    fn apply_penalties(
        &mut self,
        logits: &mut [f32],
        prompt_tokens: &[u32],
        output_tokens: &[u32],
    ) {
        let n = logits.len();
        let rep = self.config.effective_repetition_penalty();
        let freq = finite_or_zero(self.config.frequency_penalty);
        let pres = finite_or_zero(self.config.presence_penalty);
        let rep_active = rep != 1.0;
        let out_active = (freq != 0.0 || pres != 0.0) && !output_tokens.is_empty();
        if !rep_active && !out_active {
            return;
        }
        if self.counts.len() != n {
            self.counts.clear();
            self.counts.resize(n, 0);
        }
        let counts = &mut self.counts;

        if rep_active {
            // Mark each distinct seen token once, penalize it, then clear the marks.
            for &t in prompt_tokens.iter().chain(output_tokens) {
                let i = t as usize;
                if i < n && counts[i] == 0 {
                    counts[i] = 1;
                    let x = logits[i];
                    logits[i] = sanitize(if x > 0.0 { x / rep } else { x * rep });
                }
            }
            for &t in prompt_tokens.iter().chain(output_tokens) {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c = 0;
                }
            }
        }

        if out_active {
            for &t in output_tokens {
                if let Some(c) = counts.get_mut(t as usize) {
                    *c = c.saturating_add(1);
                }
            }
            // Apply once per distinct token, resetting its counter as we go.
            for &t in output_tokens {
                let i = t as usize;
                if i < n && counts[i] > 0 {
                    let c = counts[i] as f32;
                    counts[i] = 0;
                    let mut x = logits[i] - freq * c;
                    x -= pres;
                    logits[i] = sanitize(x);
                }
            }
        }
    }

    /// Temperature → top-k → top-p → min-p → one draw. `logits` has no NaN and at least one
    /// finite value equal to `max`. Returns `None` only if no candidate survives (not
    /// expected; the caller falls back to argmax).
    fn draw(&mut self, logits: &[f32], max: f32) -> Option<usize> {
        let Sampler {
            config,
            rng,
            indices: cand,
            weights,
            keys,
            ..
        } = self;
        let n = logits.len();
        if weights.len() != n {
            weights.clear();
            weights.resize(n, 0.0);
        }
        // Unnormalized probabilities exp((x - max) / T); the max token has weight exactly 1
        // and -inf tokens weight 0.
        let t = config.temperature;
        let weight = |x: f32| fast_exp((x - max) / t);

        // `cand` holds the surviving ids once a filter needs an explicit list; until then
        // every id of the row is a candidate (weights of the whole row are valid).
        let mut use_cand = false;
        let top_k = config.top_k.map_or(0, |k| k as usize);
        if top_k > 0 && top_k < n {
            top_m_sorted(logits, top_k, cand);
            for &i in cand.iter() {
                weights[i as usize] = weight(logits[i as usize]);
            }
            use_cand = true;
        } else {
            for (w, &x) in weights.iter_mut().zip(logits.iter()) {
                *w = weight(x);
            }
        }
        let weights = &*weights;

        let top_p = config.top_p;
        if top_p < 1.0 {
            if use_cand {
                let total = cand
                    .iter()
                    .map(|&i| f64::from(weights[i as usize]))
                    .sum::<f64>();
                let keep = nucleus_len(cand, weights, f64::from(top_p) * total);
                cand.truncate(keep.unwrap_or(cand.len()));
            } else {
                // Peaked rows: the nucleus is among the few best tokens (one streaming
                // pass). Otherwise a weighted quickselect over the whole row, O(n).
                let target = f64::from(top_p) * sum_f32(weights);
                top_m_sorted(logits, TOP_P_FIRST_BLOCK, cand);
                if let Some(keep) = nucleus_len(cand, weights, target) {
                    cand.truncate(keep);
                } else {
                    keys.clear();
                    keys.extend(
                        (0..n as u32)
                            .filter(|&i| weights[i as usize] > 0.0)
                            .map(|i| weight_key(weights[i as usize], i)),
                    );
                    let keep = weighted_prefix(keys, target);
                    cand.clear();
                    cand.extend(keys[..keep].iter().map(|&k| key_id(k)));
                }
                use_cand = true;
            }
        }

        let min_p = config.min_p;
        if min_p > 0.0 {
            // The max token has weight 1 = max_prob (unnormalized), so it always survives.
            let threshold = min_p.min(1.0);
            if use_cand {
                cand.retain(|&i| weights[i as usize] >= threshold);
            } else {
                cand.clear();
                cand.extend((0..n as u32).filter(|&i| weights[i as usize] >= threshold));
                use_cand = true;
            }
        }

        if use_cand {
            let total: f64 = cand.iter().map(|&i| f64::from(weights[i as usize])).sum();
            let u = rng.random::<f64>() * total;
            let mut cum = 0.0;
            for &i in cand.iter() {
                cum += f64::from(weights[i as usize]);
                if u < cum {
                    return Some(i as usize);
                }
            }
            // Rounding: take the last candidate with a non-zero weight.
            cand.iter()
                .rev()
                .find(|&&i| weights[i as usize] > 0.0)
                .map(|&i| i as usize)
        } else {
            draw_from_row(weights, rng.random::<f64>())
        }
    }

    fn top_logprobs(&mut self, logits: &[f32], lse: f64, k: usize) -> Vec<(u32, f32)> {
        let idx = &mut self.indices;
        top_m_sorted(logits, k, idx);
        idx.iter()
            .map(|&i| (i, (f64::from(logits[i as usize]) - lse) as f32))
            .collect()
    }
}

/// Block size of the lane-parallel loops (lets the compiler vectorize them).
const LANES: usize = 16;

/// Rows are scanned for top-m candidates in blocks of this size, skipping whole blocks
/// whose maximum does not beat the running threshold.
const TOP_M_BLOCK: usize = 256;

/// Capacity slack of the streaming top-m buffer beyond `2 * m`.
const TOP_M_SLACK: usize = 512;

/// Draws from the whole row given its unnormalized weights and a uniform `r` in `[0, 1)`.
/// Zero-weight ids are never chosen.
fn draw_from_row(weights: &[f32], r: f64) -> Option<usize> {
    const BLOCK: usize = 256;
    let u = r * sum_f32(weights);
    let mut cum = 0.0f64;
    for (b, block) in weights.chunks(BLOCK).enumerate() {
        let block_sum = sum_f32(block);
        if cum + block_sum <= u {
            cum += block_sum;
            continue;
        }
        for (j, &w) in block.iter().enumerate() {
            cum += f64::from(w);
            if u < cum {
                return Some(b * BLOCK + j);
            }
        }
    }
    weights.iter().rposition(|&w| w > 0.0)
}

/// Ids of the `m` largest logits (at most the row), sorted by descending logit, ties by
/// lower id, written to `out`. One streaming pass with a rising threshold, so the cost is
/// about one scan of the row when `m` is small.
fn top_m_sorted(logits: &[f32], m: usize, out: &mut Vec<u32>) {
    out.clear();
    let n = logits.len();
    let m = m.min(n);
    if m == 0 {
        return;
    }
    let cmp = |a: &u32, b: &u32| desc_by_logit(logits, *a, *b);
    let cap = m.saturating_mul(2).saturating_add(TOP_M_SLACK);
    if cap >= n {
        out.extend(0..n as u32);
    } else {
        // Until the first compaction everything is taken; afterwards only values strictly
        // above the current m-th best (later ids lose ties to it).
        let mut threshold = f32::NEG_INFINITY;
        let mut strict = false;
        let mut base = 0usize;
        for chunk in logits.chunks(TOP_M_BLOCK) {
            if strict && max_f32(chunk) <= threshold {
                base += chunk.len();
                continue;
            }
            for (j, &x) in chunk.iter().enumerate() {
                if x > threshold || !strict {
                    out.push((base + j) as u32);
                    if out.len() == cap {
                        out.select_nth_unstable_by(m - 1, cmp);
                        out.truncate(m);
                        threshold = logits[out[m - 1] as usize];
                        strict = true;
                    }
                }
            }
            base += chunk.len();
        }
    }
    if out.len() > m {
        out.select_nth_unstable_by(m - 1, cmp);
        out.truncate(m);
    }
    out.sort_unstable_by(cmp);
}

/// Sort key ordering by descending weight (`w >= 0`), then ascending id, as ascending u64:
/// the bits of a non-negative f32 order like its value.
fn weight_key(w: f32, id: u32) -> u64 {
    let raw = (u64::from(w.to_bits()) << 32) | u64::from(u32::MAX - id);
    u64::MAX - raw
}

fn key_id(key: u64) -> u32 {
    u32::MAX - ((u64::MAX - key) as u32)
}

fn key_weight(key: u64) -> f64 {
    f64::from(f32::from_bits(((u64::MAX - key) >> 32) as u32))
}

/// Weighted quickselect: reorders `keys` so that its first `k` entries are the `k` most
/// probable, for the smallest `k` whose weight reaches `target` (at least 1 when `keys` is
/// non-empty; all of them if rounding never gets there), and returns `k`. Expected O(n).
fn weighted_prefix(keys: &mut [u64], target: f64) -> usize {
    let (mut lo, mut hi) = (0, keys.len());
    let mut before = 0.0; // weight of keys[..lo], all more probable than keys[lo..]
    while hi - lo > 32 {
        let mid = lo + (hi - lo) / 2;
        keys[lo..hi].select_nth_unstable(mid - lo);
        let upper: f64 = keys[lo..=mid].iter().map(|&k| key_weight(k)).sum();
        if before + upper >= target {
            hi = mid + 1;
        } else {
            before += upper;
            lo = mid + 1;
        }
    }
    keys[lo..hi].sort_unstable();
    for (j, &k) in keys.iter().enumerate().take(hi).skip(lo) {
        before += key_weight(k);
        if before >= target {
            return j + 1;
        }
    }
    hi
}

/// Length of the top-p nucleus of the descending-sorted `cand`: the shortest prefix whose
/// weight reaches `target` (at least 1), or `None` if all of `cand` does not reach it.
fn nucleus_len(cand: &[u32], weights: &[f32], target: f64) -> Option<usize> {
    let mut cum = 0.0;
    for (j, &i) in cand.iter().enumerate() {
        cum += f64::from(weights[i as usize]);
        if cum >= target {
            return Some(j + 1);
        }
    }
    None
}

/// Descending logit, ties by ascending id. Logits hold no NaN here.
fn desc_by_logit(logits: &[f32], a: u32, b: u32) -> Ordering {
    logits[b as usize]
        .total_cmp(&logits[a as usize])
        .then(a.cmp(&b))
}

/// NaN → -inf, +inf → `f32::MAX`, -0.0 → 0.0 (so `total_cmp` ties agree with `==`).
fn sanitize(x: f32) -> f32 {
    let y = if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    };
    y + 0.0
}

fn finite_or_zero(x: f32) -> f32 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}

/// Maximum of a NaN-free slice (`-inf` when empty).
#[inline]
fn max_f32(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = if x > *l { x } else { *l };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &x in lanes.iter().chain(rest) {
        if x > m {
            m = x;
        }
    }
    m
}

/// Sum of non-negative weights.
fn sum_f32(xs: &[f32]) -> f64 {
    block_sum(xs, |x| x)
}

/// `sum(f(x))` for non-negative `f`: f32 lanes within blocks of 1024 (vectorizable),
/// blocks accumulated in f64.
fn block_sum(xs: &[f32], f: impl Fn(f32) -> f32) -> f64 {
    let mut total = 0f64;
    for block in xs.chunks(1024) {
        let mut lanes = [0f32; LANES];
        let chunks = block.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for (l, &x) in lanes.iter_mut().zip(c) {
                *l += f(x);
            }
        }
        for &x in rest {
            lanes[0] += f(x);
        }
        total += lanes.iter().map(|&x| f64::from(x)).sum::<f64>();
    }
    total
}

/// First index of the maximum (lowest id on ties) and the maximum. `logits` is non-empty.
fn argmax(logits: &[f32]) -> (usize, f32) {
    let max = max_f32(logits);
    let i = logits.iter().position(|&x| x == max).unwrap_or(0);
    (i, max)
}

/// `log(sum(exp(x)))` given the (finite) maximum.
fn log_sum_exp(logits: &[f32], max: f32) -> f64 {
    f64::from(max) + block_sum(logits, |x| fast_exp(x - max)).ln()
}

/// `exp(x)` in f32 (Cephes-style range reduction and polynomial, ~1 ulp), written without
/// library calls so that loops over a row vectorize. Exactly 1 at 0; 0 below -87 and for NaN.
pub(crate) fn fast_exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let underflow = x.is_nan() || x < -87.0;
    let xc = x.clamp(-87.0, 88.0);
    let xc = if underflow { 0.0 } else { xc };
    let shifted = xc * LOG2E + ROUND;
    let n = shifted - ROUND;
    let ni = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((ni + 127) as u32) << 23);
    if underflow {
        0.0
    } else {
        y * scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg() -> SamplingConfig {
        SamplingConfig::default()
    }

    fn greedy() -> SamplingConfig {
        SamplingConfig {
            temperature: 0.0,
            ..cfg()
        }
    }

    fn sample_once(config: SamplingConfig, logits: &[f32]) -> SampleOutput {
        let mut s = Sampler::new(config, 7);
        let mut l = logits.to_vec();
        s.sample(&mut l, &[], &[], &[])
    }

    fn logsumexp(xs: impl Iterator<Item = f32>) -> f64 {
        let v: Vec<f64> = xs.map(f64::from).collect();
        let m = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        m + v.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
    }

    fn draws(config: SamplingConfig, logits: &[f32], n: usize, seed: u64) -> Vec<u32> {
        let mut s = Sampler::new(config, seed);
        (0..n)
            .map(|_| {
                let mut l = logits.to_vec();
                s.sample(&mut l, &[], &[], &[]).token
            })
            .collect()
    }

    fn histogram(tokens: &[u32], vocab: usize) -> Vec<usize> {
        let mut h = vec![0; vocab];
        for &t in tokens {
            h[t as usize] += 1;
        }
        h
    }

    fn chi_square(observed: &[usize], probs: &[f64]) -> f64 {
        let n: usize = observed.iter().sum();
        observed
            .iter()
            .zip(probs)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    #[test]
    fn defaults_are_neutral() {
        let c = cfg();
        assert_eq!(c.temperature, 1.0);
        assert_eq!(c.top_p, 1.0);
        assert_eq!(c.repetition_penalty, 1.0);
        assert!(!c.is_greedy());
        assert!(greedy().is_greedy());
        let tiny = SamplingConfig {
            temperature: 1e-6,
            ..cfg()
        };
        assert!(tiny.is_greedy());
        let nan = SamplingConfig {
            temperature: f32::NAN,
            ..cfg()
        };
        assert!(nan.is_greedy());
        let parsed: SamplingConfig = serde_json::from_str(r#"{"temperature":0.5}"#).unwrap();
        assert_eq!(parsed.temperature, 0.5);
        assert_eq!(parsed.top_p, 1.0);
    }

    #[test]
    fn greedy_picks_argmax_lowest_id_on_ties() {
        let out = sample_once(greedy(), &[0.1, 3.0, -2.0, 2.9]);
        assert_eq!(out.token, 1);
        let out = sample_once(greedy(), &[1.0, 5.0, 5.0, 2.0]);
        assert_eq!(out.token, 1);
        let out = sample_once(greedy(), &[f32::NAN, 1.0, f32::INFINITY, f32::INFINITY]);
        assert_eq!(out.token, 2);
    }

    #[test]
    fn same_seed_same_samples_different_seeds_differ() {
        let logits = [0.0f32; 8];
        let seeded = |seed| SamplingConfig {
            seed: Some(seed),
            ..cfg()
        };
        // Request seed overrides the fallback seed.
        let a = draws(seeded(42), &logits, 500, 1);
        let b = draws(seeded(42), &logits, 500, 2);
        assert_eq!(a, b);
        let c = draws(seeded(43), &logits, 500, 1);
        let same = a.iter().zip(&c).filter(|(x, y)| x == y).count();
        // Independent uniform draws over 8 tokens agree ~1/8 of the time.
        assert!(same < 150, "seeds 42 and 43 agree on {same}/500 draws");
        // Without a request seed the fallback seed decides.
        let d = draws(cfg(), &logits, 500, 5);
        let e = draws(cfg(), &logits, 500, 5);
        assert_eq!(d, e);
        assert_ne!(d, draws(cfg(), &logits, 500, 6));
    }

    #[test]
    fn top_k_one_and_tiny_top_p_equal_greedy() {
        let logits: Vec<f32> = (0..1000)
            .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
            .collect();
        let want = sample_once(greedy(), &logits).token;
        for seed in 0..20 {
            let k1 = SamplingConfig {
                top_k: Some(1),
                seed: Some(seed),
                ..cfg()
            };
            assert_eq!(sample_once(k1, &logits).token, want);
            let p = SamplingConfig {
                top_p: 1e-6,
                seed: Some(seed),
                ..cfg()
            };
            assert_eq!(sample_once(p, &logits).token, want);
        }
    }

    #[test]
    fn top_k_restricts_to_k_best() {
        let logits: Vec<f32> = (0..5000)
            .map(|i| ((i * 31) % 5000) as f32 / 1000.0)
            .collect();
        let mut best: Vec<u32> = (0..5000).collect();
        best.sort_by(|a, b| desc_by_logit(&logits, *a, *b));
        best.truncate(5);
        let c = SamplingConfig {
            top_k: Some(5),
            temperature: 5.0,
            ..cfg()
        };
        let got = draws(c, &logits, 2000, 3);
        assert!(got.iter().all(|t| best.contains(t)));
        let h = histogram(&got, 5000);
        assert!(best.iter().all(|&t| h[t as usize] > 0));
    }

    #[test]
    fn top_p_keeps_smallest_nucleus() {
        // probs 0.5, 0.3, 0.15, 0.05
        let probs = [0.5f64, 0.3, 0.15, 0.05];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let c = SamplingConfig {
            top_p: 0.75,
            ..cfg()
        };
        let got = draws(c, &logits, 4000, 11);
        let h = histogram(&got, 4);
        assert_eq!(h[2] + h[3], 0);
        // renormalized 0.625 / 0.375
        assert!(chi_square(&h[..2], &[0.625, 0.375]) < 20.0, "{h:?}");
        // Exactly reaching the mass: 0.8 needs both of the first two tokens.
        let c = SamplingConfig {
            top_p: 0.8,
            ..cfg()
        };
        let h = histogram(&draws(c, &logits, 4000, 12), 4);
        assert!(h[0] > 0 && h[1] > 0 && h[3] == 0, "{h:?}");
    }

    #[test]
    fn top_m_matches_full_sort() {
        let n = 5000;
        let rows: Vec<Vec<f32>> = vec![
            (0..n).map(|i| ((i * 97) % n) as f32 * 1e-3).collect(),
            // ascending: worst case for the streaming threshold
            (0..n).map(|i| i as f32).collect(),
            // heavy ties and -inf
            (0..n)
                .map(|i| match i % 7 {
                    0 => f32::NEG_INFINITY,
                    k => (k % 3) as f32,
                })
                .collect(),
        ];
        let mut out = Vec::new();
        for logits in &rows {
            let mut order: Vec<u32> = (0..n as u32).collect();
            order.sort_by(|a, b| desc_by_logit(logits, *a, *b));
            for m in [1, 2, 40, 64, 700, 2000, n - 1, n, n + 5] {
                top_m_sorted(logits, m, &mut out);
                assert_eq!(out[..], order[..m.min(n)], "m={m}");
            }
        }
    }

    #[test]
    fn top_p_nucleus_on_large_vocab() {
        // A flat row needs a nucleus far beyond the first top-m block.
        let n = 3000;
        let logits: Vec<f32> = (0..n).map(|i| ((i * 97) % n) as f32 * 1e-3).collect();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|a, b| desc_by_logit(&logits, *a, *b));
        let w: Vec<f64> = order
            .iter()
            .map(|&i| f64::from(logits[i as usize]).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut cum = 0.0;
        let want = w
            .iter()
            .position(|x| {
                cum += x;
                cum >= 0.9 * total
            })
            .map(|j| j + 1)
            .unwrap();
        // (f32 weights may move the boundary by a token)
        let allowed = &order[..want + 2];
        let c = SamplingConfig {
            top_p: 0.9,
            ..cfg()
        };
        let got = draws(c, &logits, 3000, 5);
        assert!(got.iter().all(|t| allowed.contains(t)));
        // the draws reach deep into the nucleus (tokens ranked beyond the first blocks)
        let deepest = got
            .iter()
            .map(|t| order.iter().position(|o| o == t).unwrap())
            .max()
            .unwrap();
        assert!(deepest > want * 9 / 10, "{deepest} vs {want}");
    }

    #[test]
    fn weighted_prefix_matches_sorted_walk() {
        for (n, p) in [
            (0usize, 0.5f64),
            (1, 0.5),
            (10, 0.3),
            (5000, 0.9),
            (5000, 0.999),
            (5000, 0.0),
        ] {
            // Weights with ties; ids scrambled.
            let weights: Vec<f32> = (0..n).map(|i| ((i * 7919) % 97) as f32 / 97.0).collect();
            let mut order: Vec<u32> = (0..n as u32)
                .filter(|&i| weights[i as usize] > 0.0)
                .collect();
            order.sort_by(|&a, &b| {
                weights[b as usize]
                    .total_cmp(&weights[a as usize])
                    .then(a.cmp(&b))
            });
            let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            let target = p * total;
            let want = nucleus_len(&order, &weights, target).unwrap_or(order.len());
            let mut keys: Vec<u64> = order
                .iter()
                .rev()
                .map(|&i| weight_key(weights[i as usize], i))
                .collect();
            let got = weighted_prefix(&mut keys, target);
            assert_eq!(got, want, "n={n} p={p}");
            let mut ids: Vec<u32> = keys[..got].iter().map(|&k| key_id(k)).collect();
            ids.sort_unstable();
            let mut expect = order[..want].to_vec();
            expect.sort_unstable();
            assert_eq!(ids, expect);
            for &k in &keys {
                assert_eq!(key_weight(k), f64::from(weights[key_id(k) as usize]));
            }
        }
    }

    #[test]
    fn fast_exp_is_accurate() {
        assert_eq!(fast_exp(0.0), 1.0);
        assert_eq!(fast_exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(fast_exp(f32::NAN), 0.0);
        assert_eq!(fast_exp(-90.0), 0.0);
        for i in 0..=200_000 {
            let x = -87.0 + 95.0 * i as f32 / 200_000.0;
            let want = f64::from(x).exp();
            let got = f64::from(fast_exp(x));
            assert!(
                ((got - want) / want).abs() < 5e-7,
                "x={x} got={got} want={want}"
            );
        }
    }

    #[test]
    fn large_vocab_row() {
        let n = 49_152;
        // Peaked pseudo-random row, like a real LM head output.
        let logits: Vec<f32> = (0..n)
            .map(|i| {
                let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                (h % 10_000) as f32 / 10_000.0 * 20.0 - 10.0
            })
            .collect();
        let mut order: Vec<u32> = (0..n as u32).collect();
        order.sort_by(|a, b| desc_by_logit(&logits, *a, *b));
        assert_eq!(sample_once(greedy(), &logits).token, order[0]);
        let configs = [
            SamplingConfig {
                top_k: Some(40),
                ..cfg()
            },
            SamplingConfig {
                top_k: Some(40),
                top_p: 0.9,
                min_p: 0.05,
                ..cfg()
            },
        ];
        for c in configs {
            let got = draws(c, &logits, 50, 4);
            assert!(got.iter().all(|t| order[..40].contains(t)));
        }
        let c = SamplingConfig {
            top_p: 0.95,
            temperature: 0.8,
            logprobs: Some(20),
            ..cfg()
        };
        let mut s = Sampler::new(c, 1);
        for _ in 0..20 {
            let mut l = logits.clone();
            let out = s.sample(&mut l, &[1, 2, 3], &[4, 5], &[0]);
            assert!((out.token as usize) < n);
            let ids: Vec<u32> = out.top_logprobs.iter().map(|&(t, _)| t).collect();
            assert_eq!(ids, order[..20]);
        }
    }

    #[test]
    fn min_p_filters_relative_to_max() {
        let probs = [0.5f64, 0.3, 0.15, 0.05];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        // threshold 0.4 * 0.5 = 0.2: keeps tokens 0 and 1
        let c = SamplingConfig {
            min_p: 0.4,
            ..cfg()
        };
        let h = histogram(&draws(c, &logits, 4000, 9), 4);
        assert_eq!(h[2] + h[3], 0, "{h:?}");
        assert!(h[0] > 0 && h[1] > 0);
        // min_p > 1 still keeps the most likely token.
        let c = SamplingConfig {
            min_p: 5.0,
            ..cfg()
        };
        assert!(draws(c, &logits, 200, 9).iter().all(|&t| t == 0));
    }

    #[test]
    fn temperature_sharpens_distribution() {
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        let logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let n = 20_000;
        // T = 1: the model's distribution.
        let h = histogram(&draws(cfg(), &logits, n, 1), 4);
        let chi = chi_square(&h, &probs);
        assert!(chi < 25.0, "T=1 chi2 {chi} {h:?}");
        // T = 0.5: p^2 renormalized.
        let sq: Vec<f64> = probs.iter().map(|p| p * p).collect();
        let z: f64 = sq.iter().sum();
        let sharp: Vec<f64> = sq.iter().map(|p| p / z).collect();
        let c = SamplingConfig {
            temperature: 0.5,
            ..cfg()
        };
        let h = histogram(&draws(c, &logits, n, 2), 4);
        let chi = chi_square(&h, &sharp);
        assert!(chi < 25.0, "T=0.5 chi2 {chi} {h:?}");
        // and it is clearly not the unsharpened one
        assert!(chi_square(&h, &probs) > 200.0);
        // T = 2: sqrt(p) renormalized.
        let rt: Vec<f64> = probs.iter().map(|p| p.sqrt()).collect();
        let z: f64 = rt.iter().sum();
        let flat: Vec<f64> = rt.iter().map(|p| p / z).collect();
        let c = SamplingConfig {
            temperature: 2.0,
            ..cfg()
        };
        let h = histogram(&draws(c, &logits, n, 3), 4);
        let chi = chi_square(&h, &flat);
        assert!(chi < 25.0, "T=2 chi2 {chi} {h:?}");
    }

    #[test]
    fn penalties_follow_formulas() {
        let logits = [2.0f32, -1.0, 0.5, 3.0, -0.5, 1.0];
        let prompt = [0u32, 1, 1, 99];
        let output = [2u32, 2, 4, 1, 2];
        let c = SamplingConfig {
            repetition_penalty: 1.5,
            frequency_penalty: 0.25,
            presence_penalty: 0.75,
            logprobs: Some(6),
            ..greedy()
        };
        let mut s = Sampler::new(c, 0);
        let mut l = logits.to_vec();
        let out = s.sample(&mut l, &prompt, &output, &[]);
        let rep = |x: f32| if x > 0.0 { x / 1.5 } else { x * 1.5 };
        let fp = |x: f32, count: f32| {
            let mut y = x - 0.25 * count;
            y -= 0.75;
            y
        };
        let want = [
            rep(2.0),           // prompt only
            fp(rep(-1.0), 1.0), // prompt and output once
            fp(rep(0.5), 3.0),  // output three times
            3.0,                // unseen
            fp(rep(-0.5), 1.0), // output once
            1.0,                // unseen
        ];
        assert_eq!(l, want);
        // Logprobs are computed from these processed logits.
        let lse = logsumexp(want.iter().copied());
        for (t, lp) in &out.top_logprobs {
            let expect = f64::from(want[*t as usize]) - lse;
            assert!((f64::from(*lp) - expect).abs() < 1e-5);
        }
        // Counts reset between calls: same inputs → same result.
        let mut l2 = logits.to_vec();
        s.sample(&mut l2, &prompt, &output, &[]);
        assert_eq!(l2, want);
    }

    #[test]
    fn logit_bias_is_additive() {
        let c = SamplingConfig {
            logit_bias: vec![(0, 3.0), (2, -1.5), (2, -0.5), (9, 100.0), (1, f32::NAN)],
            ..greedy()
        };
        let mut s = Sampler::new(c, 0);
        let mut l = vec![1.0f32, 2.0, 0.5];
        let out = s.sample(&mut l, &[], &[], &[]);
        assert_eq!(l, [4.0, 2.0, -1.5]);
        assert_eq!(out.token, 0);
    }

    #[test]
    fn neutral_penalties_leave_logits_untouched() {
        let logits = [2.0f32, -1.0, 0.5];
        let mut s = Sampler::new(greedy(), 0);
        let mut l = logits.to_vec();
        s.sample(&mut l, &[0, 1, 2], &[0, 1, 2, 2], &[]);
        assert_eq!(l, logits);
    }

    #[test]
    fn min_tokens_masks_eos_and_stop_ids() {
        let logits = [0.0f32, 1.0, 5.0, 4.0, 3.0];
        let c = SamplingConfig {
            min_tokens: 2,
            stop_token_ids: vec![3, 1000],
            ..greedy()
        };
        let mut s = Sampler::new(c.clone(), 0);
        let mut l = logits.to_vec();
        let out = s.sample(&mut l, &[], &[7], &[2, 500]);
        assert_eq!(out.token, 4);
        assert_eq!(l[2], f32::NEG_INFINITY);
        assert_eq!(l[3], f32::NEG_INFINITY);
        // Once min_tokens outputs exist nothing is masked.
        let mut l = logits.to_vec();
        assert_eq!(s.sample(&mut l, &[], &[7, 8], &[2]).token, 2);
        // ignore_eos: EOS is not masked, stop ids still are.
        let mut s = Sampler::new(
            SamplingConfig {
                ignore_eos: true,
                ..c
            },
            0,
        );
        let mut l = logits.to_vec();
        assert_eq!(s.sample(&mut l, &[], &[], &[2]).token, 2);
        assert_eq!(l[3], f32::NEG_INFINITY);
    }

    #[test]
    fn logprobs_normalized_and_ordered() {
        let logits: Vec<f32> = (0..50)
            .map(|i| ((i * 13) % 17) as f32 * 0.3 - 2.0)
            .collect();
        let c = SamplingConfig {
            logprobs: Some(50),
            temperature: 0.7,
            top_k: Some(3),
            ..cfg()
        };
        let out = sample_once(c, &logits);
        assert_eq!(out.top_logprobs.len(), 50);
        let lse = logsumexp(out.top_logprobs.iter().map(|&(_, lp)| lp));
        assert!(lse.abs() < 1e-5, "logsumexp {lse}");
        for w in out.top_logprobs.windows(2) {
            let ((a, la), (b, lb)) = (w[0], w[1]);
            assert!(la > lb || (la == lb && a < b), "{w:?}");
        }
        let chosen = out
            .top_logprobs
            .iter()
            .find(|(t, _)| *t == out.token)
            .map(|&(_, lp)| lp);
        assert_eq!(chosen, Some(out.logprob));
        // Fewer requested than the vocab: the best few, same values.
        let c = SamplingConfig {
            logprobs: Some(5),
            temperature: 0.7,
            ..cfg()
        };
        let few = sample_once(c, &logits);
        assert_eq!(few.top_logprobs[..], out.top_logprobs[..5]);
        // None → no top list, still a chosen logprob.
        let none = sample_once(greedy(), &logits);
        assert!(none.top_logprobs.is_empty());
        assert!(none.logprob <= 0.0);
    }

    #[test]
    fn degenerate_rows_do_not_panic() {
        let out = sample_once(cfg(), &[]);
        assert_eq!(out.token, 0);
        let out = sample_once(cfg(), &[f32::NAN; 4]);
        assert!(out.token < 4);
        assert!((out.logprob - -(4f32.ln())).abs() < 1e-6);
        let out = sample_once(cfg(), &[f32::NEG_INFINITY, f32::NAN, 1.0]);
        assert_eq!(out.token, 2);
        assert_eq!(out.logprob, 0.0);
    }

    fn any_f32() -> impl Strategy<Value = f32> {
        prop_oneof![
            4 => -30.0f32..30.0,
            1 => Just(f32::NAN),
            1 => Just(f32::INFINITY),
            1 => Just(f32::NEG_INFINITY),
            1 => any::<f32>(),
        ]
    }

    fn any_config() -> impl Strategy<Value = SamplingConfig> {
        (
            (
                any_f32(),
                proptest::option::of(0u32..80),
                any_f32(),
                any_f32(),
            ),
            (any_f32(), any_f32(), any_f32()),
            (
                proptest::option::of(any::<u64>()),
                proptest::option::of(0u32..80),
                any::<bool>(),
                0u32..4,
                proptest::collection::vec(0u32..80, 0..4),
                proptest::collection::vec((0u32..80, any_f32()), 0..4),
            ),
        )
            .prop_map(
                |(
                    (temperature, top_k, top_p, min_p),
                    (repetition_penalty, presence_penalty, frequency_penalty),
                    (seed, logprobs, ignore_eos, min_tokens, stop_token_ids, logit_bias),
                )| SamplingConfig {
                    temperature,
                    top_k,
                    top_p,
                    min_p,
                    repetition_penalty,
                    presence_penalty,
                    frequency_penalty,
                    seed,
                    logprobs,
                    ignore_eos,
                    min_tokens,
                    stop_token_ids,
                    logit_bias,
                },
            )
    }

    proptest! {
        #[test]
        fn never_panics_and_token_in_range(
            config in any_config(),
            logits in proptest::collection::vec(any_f32(), 1..64),
            prompt in proptest::collection::vec(0u32..80, 0..10),
            output in proptest::collection::vec(0u32..80, 0..10),
            eos in proptest::collection::vec(0u32..80, 0..3),
            fallback in any::<u64>(),
        ) {
            let want_top = config.logprobs.map_or(0, |k| (k as usize).min(logits.len()));
            let mut s = Sampler::new(config, fallback);
            for _ in 0..3 {
                let mut l = logits.clone();
                let out = s.sample(&mut l, &prompt, &output, &eos);
                prop_assert!((out.token as usize) < logits.len());
                prop_assert!(!out.logprob.is_nan());
                prop_assert!(out.logprob <= 1e-4);
                prop_assert_eq!(out.top_logprobs.len(), want_top);
                prop_assert!(out.top_logprobs.iter().all(|&(t, lp)| (t as usize) < logits.len() && !lp.is_nan()));
                prop_assert!(l.iter().all(|x| !x.is_nan()));
            }
        }
    }
}
