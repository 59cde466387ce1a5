//! Speculative decoding without a draft model: prompt lookup (vLLM's `method: "ngram"`).
//!
//! Before a step, a decoding sequence whose last `n` tokens (`prompt_lookup_min..=max`)
//! occurred earlier in its own tokens proposes the tokens that followed that occurrence.
//! The proposals ride in the same batched forward as the sequence's pending token: they
//! sit at positions past the prompt, so their rows are decode rows and compute exactly as
//! they would one step at a time. The engine then samples each row in order with the
//! sequence's own sampler and keeps a proposal only while the sampled token equals it.
//!
//! For a proposal that is a single token `d` (a point mass), the standard speculative
//! rejection rule accepts `d` with probability `min(1, p(d) / 1) = p(d)` and on rejection
//! draws from the residual `max(0, p - q)` normalized, which is `p` with `d` removed.
//! Sampling `x ~ p` and accepting iff `x == d` has exactly these probabilities, so outputs
//! follow the target distribution; because the draws are the sampler's own, one per
//! emitted token, a seeded request even gives the same tokens as without speculation
//! (and greedy is the exact-match rule). The KV of rejected proposals is rolled back.
//!
//! Everything here is pure: the proposer and the adaptive policy that stops proposing for
//! a sequence whose proposals keep failing.
//!
//! Names here say `Speculative…` or `Draft…`: a bare "spec" in the engine is a KV block's
//! [`BlockSpec`](crate::kv::transfer::BlockSpec). The module keeps vLLM's `spec_decode`,
//! the prefix of the metrics it defines.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use serde::Deserialize;

/// Most proposals per step accepted in a configuration.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// `--speculative-config` (vLLM's JSON).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SpeculativeConfig {
    /// Proposals per step at most (`num_speculative_tokens`).
    pub num_speculative_tokens: usize,
    /// Longest suffix looked up (`prompt_lookup_max`).
    pub prompt_lookup_max: usize,
    /// Shortest suffix looked up (`prompt_lookup_min`).
    pub prompt_lookup_min: usize,
    /// What one more row in a step costs, relative to a one-row decode step (Strata's own
    /// key, `row_cost`), fixed; `None` (the default) measures it while serving
    /// ([`StepCosts`]). On a CPU a step's cost grows with its rows
    /// (`examples/verify_bench.rs` measures it); on an accelerator it is near 0. The
    /// adaptive policy proposes only as many tokens as pay for their rows at the
    /// sequence's acceptance rate.
    pub row_cost: Option<f32>,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 4,
            prompt_lookup_max: 4,
            prompt_lookup_min: 2,
            row_cost: None,
        }
    }
}

/// A `--speculative-config` that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpeculativeConfigError {
    #[error("--speculative-config is not valid JSON: {0}")]
    Json(String),
    #[error("--speculative-config method `{0}` is not supported (only \"ngram\")")]
    Method(String),
    #[error("--speculative-config: {0}")]
    Invalid(String),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSpeculativeConfig {
    method: Option<String>,
    num_speculative_tokens: Option<usize>,
    prompt_lookup_max: Option<usize>,
    prompt_lookup_min: Option<usize>,
    /// Strata's own: the relative cost of one more row.
    row_cost: Option<f32>,
}

impl SpeculativeConfig {
    /// Parses vLLM's JSON, e.g. `{"method": "ngram", "num_speculative_tokens": 4,
    /// "prompt_lookup_max": 4, "prompt_lookup_min": 2}`. vLLM's defaults fill what is
    /// missing (`prompt_lookup_min` defaults to `prompt_lookup_max` when only that is set).
    pub fn parse(json: &str) -> Result<Self, SpeculativeConfigError> {
        let raw: RawSpeculativeConfig =
            serde_json::from_str(json).map_err(|e| SpeculativeConfigError::Json(e.to_string()))?;
        match raw.method.as_deref() {
            Some("ngram") | Some("[ngram]") | None => {}
            Some(m) => return Err(SpeculativeConfigError::Method(m.to_string())),
        }
        let d = Self::default();
        let k = raw
            .num_speculative_tokens
            .unwrap_or(d.num_speculative_tokens);
        let max = raw.prompt_lookup_max.unwrap_or(d.prompt_lookup_max);
        let min = raw
            .prompt_lookup_min
            .unwrap_or(if raw.prompt_lookup_max.is_some() {
                max
            } else {
                d.prompt_lookup_min
            });
        if k == 0 || k > MAX_SPECULATIVE_TOKENS {
            return Err(SpeculativeConfigError::Invalid(format!(
                "num_speculative_tokens must be 1..={MAX_SPECULATIVE_TOKENS}, got {k}"
            )));
        }
        if min == 0 || min > max || max > 64 {
            return Err(SpeculativeConfigError::Invalid(format!(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max <= 64, got {min} and {max}"
            )));
        }
        let row_cost = raw.row_cost;
        if let Some(c) = row_cost.filter(|c| !(0.0..=1.0).contains(c)) {
            return Err(SpeculativeConfigError::Invalid(format!(
                "row_cost must be in 0..=1, got {c}"
            )));
        }
        Ok(Self {
            num_speculative_tokens: k,
            prompt_lookup_max: max,
            prompt_lookup_min: min,
            row_cost,
        })
    }
}

/// Proposes up to `max` tokens to follow `tokens`: for the longest suffix of length
/// `prompt_lookup_max` down to `prompt_lookup_min` that occurred before, the tokens after
/// its most recent earlier occurrence. Empty when nothing matches.
pub fn propose(tokens: &[u32], config: &SpeculativeConfig, max: usize) -> Vec<u32> {
    let max = max.min(config.num_speculative_tokens);
    if max == 0 {
        return Vec::new();
    }
    let len = tokens.len();
    for n in (config.prompt_lookup_min..=config.prompt_lookup_max).rev() {
        if n >= len {
            continue;
        }
        let suffix = &tokens[len - n..];
        // Most recent occurrence first: in a repetitive output it predicts best. The
        // suffix itself (start `len - n`) does not count.
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == suffix {
                let from = start + n;
                let to = (from + max).min(len);
                return tokens[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

/// One sequence's record of how its proposals fared: a per-token acceptance estimate
/// (accepted proposals over proposals checked, where checking stops at the first
/// rejection), as moving sums.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DraftState {
    accepted: f32,
    checked: f32,
    /// Decode steps left before proposing again.
    pub pause: u32,
    /// Length of the next pause.
    pub backoff: u32,
}

/// First pause when proposals do not pay, in decode steps; doubled each time up to the
/// max, back to the min when they pay again.
const MIN_BACKOFF: u32 = 8;
const MAX_BACKOFF: u32 = 256;
/// Weight kept by the moving sums per verification.
const DECAY: f32 = 0.7;
/// The acceptance a sequence starts from (and returns to after a pause): optimistic
/// enough to try a proposal or two.
const PRIOR_ACCEPTED: f32 = 2.0;
const PRIOR_CHECKED: f32 = 2.5;

impl Default for DraftState {
    fn default() -> Self {
        Self {
            accepted: PRIOR_ACCEPTED,
            checked: PRIOR_CHECKED,
            pause: 0,
            backoff: MIN_BACKOFF,
        }
    }
}

/// How many proposals pay at per-token acceptance `p` when each extra row costs
/// `row_cost` of a one-row step: the `k` in `0..=max` that maximizes expected tokens per
/// step, `(1 - p^(k+1)) / (1 - p)`, over its cost `1 + row_cost * k`.
pub fn best_len(p: f32, row_cost: f32, max: usize) -> usize {
    best_len_priced(p, 1, &linear_prices(row_cost, 1, max))
}

/// How many proposals one sequence should add to a step of `batch` one-row decodes whose
/// price with `k` more rows is `prices[k]` (relative to the step without, `prices[0]` =
/// 1): the `k` that maximizes the step's expected tokens per unit of time,
/// `(batch - 1 + E_k) / prices[k]` with `E_k = (1 - p^(k+1)) / (1 - p)` the tokens this
/// sequence gets. `prices.len() - 1` proposals at most.
pub fn best_len_priced(p: f32, batch: usize, prices: &[f32]) -> usize {
    let others = batch.max(1) as f32 - 1.0;
    let mut best = (0, others + 1.0);
    let mut tokens = 1.0f32;
    let mut pk = 1.0f32;
    for (k, &price) in prices.iter().enumerate().skip(1) {
        pk *= p;
        tokens += pk;
        if price <= 0.0 || !price.is_finite() {
            break;
        }
        let rate = (others + tokens) / price;
        if rate > best.1 * (1.0 + 1e-4) {
            best = (k, rate);
        }
    }
    best.0
}

/// Prices of `0..=max` extra rows in a step of `batch` one-row decodes when a step costs
/// `(1 - c) + c * rows` one-row steps (`c` = `row_cost`): `1 + k * c / ((1 - c) + c *
/// batch)`.
pub fn linear_prices(row_cost: f32, batch: usize, max: usize) -> Vec<f32> {
    let b = batch.max(1) as f32;
    let c = row_cost.clamp(0.0, 1.0);
    let denom = ((1.0 - c) + c * b).max(f32::MIN_POSITIVE);
    (0..=max).map(|k| 1.0 + k as f32 * c / denom).collect()
}

/// What one more row costs in a step of `batch` one-row decodes, in tokens of that step's
/// output. With a step costing `(1 - c) + c * rows` one-row steps (`c` = `row_cost`), a
/// row is worth `c * batch / ((1 - c) + c * batch)` tokens: `c` alone, close to a whole
/// token in a large batch, where extra rows crowd out other sequences' work.
pub fn batch_row_cost(row_cost: f32, batch: usize) -> f32 {
    let b = batch.max(1) as f32;
    let c = row_cost.clamp(0.0, 1.0);
    let denom = (1.0 - c) + c * b;
    if denom > 0.0 {
        c * b / denom
    } else {
        0.0
    }
}

impl DraftState {
    /// The per-token acceptance estimate.
    pub fn acceptance(&self) -> f32 {
        if self.checked > 0.0 {
            self.accepted / self.checked
        } else {
            0.0
        }
    }

    /// How many tokens to propose this step (0: none) when `batch` sequences decode in
    /// it and the step with `k` more rows costs `prices[k]` of the step without (see
    /// [`StepCosts::prices`]); counts down a pause, and starts one when proposing does
    /// not pay.
    pub fn budget(&mut self, config: &SpeculativeConfig, batch: usize, prices: &[f32]) -> usize {
        if self.pause > 0 {
            self.pause -= 1;
            if self.pause == 0 {
                // Try again from the prior: the text may have turned repetitive.
                self.accepted = PRIOR_ACCEPTED;
                self.checked = PRIOR_CHECKED;
            }
            return 0;
        }
        let max = config
            .num_speculative_tokens
            .min(prices.len().saturating_sub(1));
        let k = best_len_priced(self.acceptance(), batch, prices.get(..=max).unwrap_or(&[]));
        if k == 0 {
            self.pause = self.backoff;
            self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        }
        k
    }

    /// Records a verification of `proposed` tokens of which the first `accepted` were kept.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        let checked = accepted + usize::from(accepted < proposed);
        self.accepted = DECAY * self.accepted + accepted as f32;
        self.checked = DECAY * self.checked + checked as f32;
        if accepted * 2 >= proposed {
            self.backoff = MIN_BACKOFF;
        }
    }
}

/// Rows a step may have for [`StepCosts`]' table; larger steps are priced by its line.
const COST_TABLE_ROWS: usize = 256;

/// What decode-only steps cost on this machine under its present load, so the policy
/// prices rows at what they really cost: a table of the mean time of steps of each row
/// count, and a line `secs ≈ fixed + per_row · rows` fitted by least squares, for sizes
/// the table has not seen lately. Both weigh recent steps more.
///
/// The table matters because a step's time is not linear in its rows: the 4-bit kernels
/// multiply two activation rows per pass over the weights, so a second row costs much less
/// than a third. Steps are fed only while speculation is on, and their sizes vary by
/// themselves (the policy proposes, pauses, sequences come and go).
#[derive(Debug, Clone, PartialEq)]
pub struct StepCosts {
    /// The line's weighted sums: weight, rows, seconds, rows², rows · seconds.
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    /// Per row count: the weighted mean time and its weight.
    mean: Vec<f64>,
    weight: Vec<f64>,
}

impl Default for StepCosts {
    fn default() -> Self {
        Self {
            w: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            mean: vec![0.0; COST_TABLE_ROWS + 1],
            weight: vec![0.0; COST_TABLE_ROWS + 1],
        }
    }
}

impl StepCosts {
    /// Weight left to a step per newer one (a memory of about 100 steps) in the line, and
    /// in every table entry, so an entry not seen lately gives way to the line.
    const DECAY: f64 = 0.99;
    /// Steps needed (in weight) before the line is believed.
    const MIN_WEIGHT: f64 = 8.0;
    /// Weight a table entry needs to be used.
    const MIN_ENTRY_WEIGHT: f64 = 2.0;
    /// Row counts must spread this much (variance) for the line's slope to mean something.
    const MIN_VARIANCE: f64 = 0.2;
    /// A step slower than this many times the estimate is counted as this much: a time
    /// slice lost to another process says nothing about rows.
    const OUTLIER: f64 = 3.0;

    /// Records that a decode-only step of `rows` rows took `secs` (unusable times are
    /// ignored).
    pub fn observe(&mut self, rows: usize, secs: f64) {
        if rows == 0 || !secs.is_finite() || secs <= 0.0 {
            return;
        }
        let y = match self.cost(rows) {
            Some(est) => secs.min(Self::OUTLIER * est),
            None => secs,
        };
        let x = rows as f64;
        let d = Self::DECAY;
        self.w = self.w * d + 1.0;
        self.sx = self.sx * d + x;
        self.sy = self.sy * d + y;
        self.sxx = self.sxx * d + x * x;
        self.sxy = self.sxy * d + x * y;
        for w in self.weight.iter_mut() {
            *w *= d;
        }
        if rows <= COST_TABLE_ROWS {
            let w = self.weight[rows];
            self.mean[rows] = (self.mean[rows] * w + y) / (w + 1.0);
            self.weight[rows] = w + 1.0;
        }
    }

    /// `(fixed, per_row)` seconds once enough steps of different sizes were seen.
    fn line(&self) -> Option<(f64, f64)> {
        if self.w < Self::MIN_WEIGHT {
            return None;
        }
        let mx = self.sx / self.w;
        let my = self.sy / self.w;
        let var = self.sxx / self.w - mx * mx;
        if var < Self::MIN_VARIANCE {
            return None;
        }
        let per_row = ((self.sxy / self.w - mx * my) / var).max(0.0);
        // A negative intercept (noise, or steps far from one row) is read as no fixed part.
        let fixed = (my - per_row * mx).max(0.0);
        (fixed + per_row > 0.0).then_some((fixed, per_row))
    }

    /// The estimated time of a decode-only step of `rows` rows: the table's entry when it
    /// has one, else the line's; `None` when neither is determined.
    pub fn cost(&self, rows: usize) -> Option<f64> {
        if rows <= COST_TABLE_ROWS && self.weight[rows] >= Self::MIN_ENTRY_WEIGHT {
            return Some(self.mean[rows]);
        }
        let (fixed, per_row) = self.line()?;
        Some(fixed + per_row * rows as f64)
    }

    /// The line's relative cost of one more row, `per_row / (fixed + per_row)`, in
    /// `0..=1`; `None` until it is determined.
    pub fn row_cost(&self) -> Option<f32> {
        let (fixed, per_row) = self.line()?;
        Some((per_row / (fixed + per_row)).clamp(0.0, 1.0) as f32)
    }

    /// Prices of `0..=max` extra rows in a step of `batch` one-row decodes, relative to
    /// that step (`prices[0]` = 1), for [`DraftState::budget`]. Measured where possible;
    /// otherwise linear in `fallback` (the configured or the line's row cost). Never
    /// decreasing in `k`: noise must not make more rows look cheaper than fewer.
    pub fn prices(&self, batch: usize, max: usize, fallback: f32) -> Vec<f32> {
        let linear = linear_prices(fallback, batch, max);
        let base = self.cost(batch.max(1));
        let mut out = Vec::with_capacity(max + 1);
        out.push(1.0f32);
        for (k, &lin) in linear.iter().enumerate().skip(1) {
            let measured = match (base, self.cost(batch.max(1) + k)) {
                (Some(b), Some(c)) if b > 0.0 => Some((c / b) as f32),
                _ => None,
            };
            let prev = out[k - 1];
            out.push(measured.unwrap_or(lin).max(prev));
        }
        out
    }
}

/// The relative row cost assumed until steps of different sizes have been timed.
pub const PRIOR_ROW_COST: f32 = 0.5;

/// Index of the first row whose sampled token differs from the proposal: the number of
/// proposals accepted. `sampled[i]` is sampled from row `i`; `proposed[i]` is the token
/// row `i` was checked against.
pub fn accepted_prefix(proposed: &[u32], sampled: &[u32]) -> usize {
    proposed
        .iter()
        .zip(sampled)
        .take_while(|(p, s)| p == s)
        .count()
}

/// vLLM's `vllm:spec_decode_*` counters (PROTOCOLS §12).
#[derive(Default)]
pub struct SpecDecodeMetrics {
    pub num_drafts: Counter,
    pub num_draft_tokens: Counter,
    pub num_accepted_tokens: Counter,
    pub num_accepted_tokens_per_pos: Family<Vec<(String, String)>, Counter>,
}

impl SpecDecodeMetrics {
    /// Registers the counters (prometheus-client adds the `_total` suffix).
    pub fn register(&self, r: &mut Registry) {
        r.register(
            "vllm:spec_decode_num_drafts",
            "Speculative proposals verified",
            self.num_drafts.clone(),
        );
        r.register(
            "vllm:spec_decode_num_draft_tokens",
            "Proposed tokens verified",
            self.num_draft_tokens.clone(),
        );
        r.register(
            "vllm:spec_decode_num_accepted_tokens",
            "Proposed tokens accepted",
            self.num_accepted_tokens.clone(),
        );
        r.register(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Proposed tokens accepted, per position in the proposal",
            self.num_accepted_tokens_per_pos.clone(),
        );
    }

    /// Records one verification.
    pub fn record(&self, proposed: usize, accepted: usize) {
        if proposed == 0 {
            return;
        }
        self.num_drafts.inc();
        self.num_draft_tokens.inc_by(proposed as u64);
        self.num_accepted_tokens.inc_by(accepted as u64);
        for pos in 0..accepted {
            self.num_accepted_tokens_per_pos
                .get_or_create(&vec![("position".to_string(), pos.to_string())])
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_config_and_refuses_bad_ones() {
        let c = SpeculativeConfig::parse(
            r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}"#,
        )
        .unwrap();
        assert_eq!(
            (
                c.num_speculative_tokens,
                c.prompt_lookup_max,
                c.prompt_lookup_min
            ),
            (5, 3, 1)
        );
        let c = SpeculativeConfig::parse(r#"{"method": "ngram", "prompt_lookup_max": 3}"#).unwrap();
        assert_eq!((c.prompt_lookup_max, c.prompt_lookup_min), (3, 3));
        assert!(matches!(
            SpeculativeConfig::parse(r#"{"method": "eagle"}"#),
            Err(SpeculativeConfigError::Method(_))
        ));
        assert!(matches!(
            SpeculativeConfig::parse(r#"{"num_speculative_tokens": 0}"#),
            Err(SpeculativeConfigError::Invalid(_))
        ));
        assert!(matches!(
            SpeculativeConfig::parse(r#"{"prompt_lookup_min": 5, "prompt_lookup_max": 2}"#),
            Err(SpeculativeConfigError::Invalid(_))
        ));
        assert!(matches!(
            SpeculativeConfig::parse(r#"{"draft_model": "x"}"#),
            Err(SpeculativeConfigError::Json(_))
        ));
        assert!(matches!(
            SpeculativeConfig::parse("not json"),
            Err(SpeculativeConfigError::Json(_))
        ));
    }

    #[test]
    fn proposes_what_followed_the_latest_match_of_the_longest_suffix() {
        let c = SpeculativeConfig::default();
        // ... 1 2 3 [9 9] ... 1 2 3 [7 7 7 7 7] ... 1 2 3
        let t = [1, 2, 3, 9, 9, 5, 1, 2, 3, 7, 7, 7, 7, 7, 6, 2, 3];
        // Suffix [2, 3] (n=2; no 3- or 4-token match): latest earlier match at 7..9.
        assert_eq!(propose(&t, &c, 4), vec![7, 7, 7, 7]);
        assert_eq!(propose(&t, &c, 2), vec![7, 7]);
        assert_eq!(propose(&t, &c, 0), Vec::<u32>::new());
        // A longer suffix wins over a more recent shorter one.
        let t = [4, 1, 2, 3, 8, 0, 2, 3, 9, 1, 2, 3];
        assert_eq!(propose(&t, &c, 4), vec![8, 0, 2, 3]);
        // Nothing repeats: no proposal.
        assert!(propose(&[1, 2, 3, 4, 5, 6], &c, 4).is_empty());
        // Proposals stop at the end of the sequence.
        assert_eq!(propose(&[5, 6, 5, 6], &c, 4), vec![5, 6]);
    }

    #[test]
    fn adaptive_policy_proposes_what_pays_and_pauses_when_nothing_does() {
        // With rows costing half a step: no proposal pays below p = 0.5, one at 0.6,
        // the full four near 1; with free rows every proposal pays.
        assert_eq!(best_len(0.4, 0.5, 4), 0);
        assert_eq!(best_len(0.6, 0.5, 4), 1);
        assert_eq!(best_len(0.97, 0.5, 4), 4);
        assert_eq!(best_len(0.3, 0.0, 4), 4);
        assert_eq!(best_len(0.99, 0.5, 0), 0);

        let c = SpeculativeConfig::default();
        assert_eq!(batch_row_cost(0.5, 1), 0.5);
        assert!(batch_row_cost(0.5, 16) > 0.9);
        assert_eq!(batch_row_cost(0.0, 16), 0.0);
        // Sixteen decodes in the step: even good proposals do not pay.
        let prior = |batch| linear_prices(PRIOR_ROW_COST, batch, 4);
        assert_eq!(DraftState::default().budget(&c, 16, &prior(16)), 0);

        let mut s = DraftState::default();
        let mut proposals = 0;
        for _ in 0..60 {
            let k = s.budget(&c, 1, &prior(1));
            if k > 0 {
                proposals += 1;
                s.record(k, 0);
            }
        }
        // Always rejected: pauses of 8, 16 and 32 steps leave a few proposals out of 60.
        assert!(proposals <= 8, "{proposals}");
        assert!(s.backoff > MIN_BACKOFF);
        // Always accepted: it proposes every step, and soon the most it may.
        let mut s = DraftState::default();
        let mut last = 0;
        for _ in 0..20 {
            last = s.budget(&c, 1, &prior(1));
            assert!(last > 0);
            s.record(last, last);
        }
        assert_eq!(last, c.num_speculative_tokens);
        assert!(s.acceptance() > 0.95);
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(accepted_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(accepted_prefix(&[1], &[0, 3]), 0);
    }
    #[test]
    fn step_costs_price_rows_as_measured_and_ignore_noise() {
        // 10 ms a step plus 2 ms a row: one more row costs 2/12 of a one-row step.
        let mut f = StepCosts::default();
        assert_eq!(f.row_cost(), None);
        assert_eq!(f.cost(1), None);
        for i in 0..40 {
            let rows = 1 + i % 5;
            f.observe(rows, 0.010 + 0.002 * rows as f64);
        }
        let c = f.row_cost().expect("fitted");
        assert!((c - 2.0 / 12.0).abs() < 1e-3, "{c}");
        let p = f.prices(1, 4, PRIOR_ROW_COST);
        assert!((p[1] - 14.0 / 12.0).abs() < 1e-3 && (p[4] - 20.0 / 12.0).abs() < 1e-3);
        // Sizes not in the table come from the line.
        assert!((f.cost(40).expect("line") - 0.090).abs() < 1e-6);
        // A step that lost its time slice to another process barely moves the estimate.
        f.observe(2, 1.0);
        let p = f.prices(1, 4, PRIOR_ROW_COST);
        assert!(p[1] < 1.8, "{p:?}");
        // Unusable times are ignored.
        let before = f.clone();
        f.observe(3, f64::NAN);
        f.observe(0, 0.01);
        f.observe(3, -1.0);
        assert_eq!(f, before);

        // Two rows for the price of one, as the 4-bit kernels' row pairs give: a one-token
        // proposal is nearly free and pays at modest acceptance; the line alone would not
        // see it.
        let mut t = StepCosts::default();
        for i in 0..60 {
            let rows = 1 + i % 5;
            t.observe(rows, [0.0, 0.010, 0.0105, 0.017, 0.018, 0.025][rows]);
        }
        let p = t.prices(1, 4, PRIOR_ROW_COST);
        assert!((p[1] - 1.05).abs() < 0.01, "{p:?}");
        assert_eq!(best_len_priced(0.4, 1, &p), 1);
        assert_eq!(best_len(0.4, t.row_cost().expect("fitted"), 4), 0);
        // Prices never fall with more rows, whatever the noise.
        let mut n = StepCosts::default();
        for i in 0..30 {
            let rows = 1 + i % 3;
            n.observe(rows, [0.0, 0.010, 0.012, 0.009][rows]);
        }
        let p = n.prices(1, 2, PRIOR_ROW_COST);
        assert!(p[2] >= p[1] && p[1] >= 1.0, "{p:?}");

        // Steps all of one size: the line is not determined, and sizes never seen are
        // priced by the fallback.
        let mut g = StepCosts::default();
        for _ in 0..50 {
            g.observe(16, 0.05);
        }
        assert_eq!(g.row_cost(), None);
        assert_eq!(g.prices(16, 2, 0.5), linear_prices(0.5, 16, 2));
        // Compute-bound steps (time in proportion to rows): a row costs a whole step, and
        // in a batch of 16 even near-certain proposals do not pay.
        let mut h = StepCosts::default();
        for i in 0..50 {
            h.observe(12 + i % 8, 0.003 * (12 + i % 8) as f64);
        }
        assert!(h.row_cost().expect("fitted") > 0.99);
        let p = h.prices(16, 4, PRIOR_ROW_COST);
        assert!((p[4] - 20.0 / 16.0).abs() < 1e-3, "{p:?}");
        assert_eq!(best_len_priced(0.95, 16, &p), 0);
        // Cheaper rows make longer proposals pay at the same acceptance.
        assert_eq!(best_len(0.8, PRIOR_ROW_COST, 4), 2);
        assert_eq!(best_len(0.8, c, 4), 4);
        // Prices at batch 1 from a row cost are the classic `1 + c k`.
        assert_eq!(linear_prices(0.5, 1, 2), vec![1.0, 1.5, 2.0]);
    }
}
