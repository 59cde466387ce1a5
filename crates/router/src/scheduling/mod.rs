//! The scheduling framework: filters → weighted scorers → picker, grouped in named
//! profiles (the shape of the GIE / llm-d endpoint picker).
//!
//! Pure by construction: a decision is a function of the candidates (their last scraped
//! metrics and labels), the request, the prefix indexes, `now` and a seeded RNG. Nothing
//! here reads a clock, touches the network or needs tokio, so the simulator runs the very
//! same code in virtual time. Time is a [`Duration`] since an epoch the caller chooses (the
//! live router uses its start instant).
//!
//! One decision, step by step ([`EndpointPicker::schedule`]):
//! 1. eligibility: ready, not draining, serves the model;
//! 2. the traffic split ([`split`]) narrows to one endpoint group, if a split is set;
//! 3. the profile's filters, in order;
//! 4. each scorer gives every remaining candidate a score, clamped to 0..1; the total is
//!    the weighted sum (PROTOCOLS §6: queue 2, KV use 2, prefix 3 by default);
//! 5. the picker orders candidates; the first is the pick and the rest are the fallbacks
//!    the proxy retries in order.
//!
//! Adding a plugin: a scorer is a file in [`scorers`] implementing [`Scorer`] and one line
//! in [`scorers::SCORERS`]; a filter or picker is one type implementing [`Filter`] or
//! [`Picker`] and one line in [`config::build_plugin`].

pub mod config;
pub mod filters;
pub mod flow;
pub mod params;
pub mod pd;
pub mod pickers;
pub mod saturation;
pub mod scorers;
pub mod scratch;
pub mod split;

use std::fmt::Debug;
use std::sync::Arc;
use std::time::Duration;

use rand::RngCore;
use serde::Serialize;

use crate::endpoint::{EndpointId, EndpointSpec};
use crate::prefix::approx::ApproxIndex;
use crate::prefix::precise::PreciseIndex;

pub use config::{ConfigError, EndpointPickerConfig};
pub use pd::{PdChoice, PdDecider, PdHandler};
pub use scratch::PickScratch;
pub use split::TrafficSplit;

/// An endpoint's state as read from its `/metrics` (PROTOCOLS §2), whatever its kind.
///
/// In declaration order (`repr(C)`): what every pick reads (KV use, when read, the queue)
/// first, so it sits in the [`Candidate`]'s first cache line.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[repr(C)]
pub struct EndpointMetrics {
    /// Fraction of KV blocks in use, 0..1 (`None`: the engine does not say).
    pub kv_use: Option<f64>,
    /// When these values were read (time since the caller's epoch).
    pub updated: Duration,
    /// Requests queued, not yet scheduled.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Tokens per KV block.
    pub block_size: Option<u32>,
    /// KV blocks in the engine's cache.
    pub num_blocks: Option<u64>,
    /// LoRA slots.
    pub max_lora: Option<u32>,
    pub lora_running: Vec<String>,
    pub lora_waiting: Vec<String>,
}

/// One endpoint as the scheduler sees it.
///
/// A pick reads every candidate, and in a pool of a thousand each one is a cache miss:
/// so what every pick reads (readiness, the spec, the in-flight count, the metrics' KV
/// use, time and queue) comes first, in one aligned cache line
/// (`what_a_pick_reads_shares_one_cache_line`), and the rest after it.
#[derive(Debug, Clone)]
#[repr(C, align(64))]
pub struct Candidate {
    pub id: EndpointId,
    /// Requests this router has sent there that have not finished.
    pub in_flight: u32,
    /// Passed its readiness check and its circuit is not open.
    pub ready: bool,
    /// Being drained: finishes what it has, gets nothing new.
    pub draining: bool,
    pub spec: Arc<EndpointSpec>,
    /// The last good scrape (possibly stale; see [`Candidate::fresh_metrics`]).
    pub metrics: Option<EndpointMetrics>,
    /// Tokens per KV block as the endpoint's own KV events report it (the size its block
    /// hashes were computed with), when it publishes events.
    pub kv_block_size: Option<u32>,
    /// Requests this router sent there since its last scrape (the scrape does not show
    /// them yet), and requests that finished there since: flow control's room estimate
    /// between two scrapes ([`saturation::pool_room`]). Both reset at every scrape.
    pub sent_since_scrape: u32,
    pub done_since_scrape: u32,
}

impl Candidate {
    /// A ready candidate with no metrics yet.
    pub fn new(id: EndpointId, spec: EndpointSpec) -> Self {
        Candidate::with_spec(id, Arc::new(spec))
    }

    /// A ready candidate with no metrics yet, sharing `spec` (endpoints that serve the
    /// same way can share one spec: a pick then reads it from one place).
    pub fn with_spec(id: EndpointId, spec: Arc<EndpointSpec>) -> Self {
        Candidate {
            id,
            spec,
            metrics: None,
            in_flight: 0,
            ready: true,
            draining: false,
            kv_block_size: None,
            sent_since_scrape: 0,
            done_since_scrape: 0,
        }
    }

    /// A fresh scrape arrived: it shows what was sent before it.
    pub fn scraped(&mut self, metrics: EndpointMetrics) {
        self.metrics = Some(metrics);
        self.sent_since_scrape = 0;
        self.done_since_scrape = 0;
    }

    /// Whether the endpoint has never served metrics this router could read (a plain
    /// OpenAI-compatible proxy, a hosted API, llama.cpp without `--metrics`). Such an
    /// endpoint is routed by this router's own in-flight count (least-request), unlike one
    /// whose metrics went stale.
    pub fn load_unknown(&self) -> bool {
        self.metrics.is_none()
    }

    /// The block size this endpoint hashes its prompts with: what its KV events say, else
    /// what its metrics say (`vllm:cache_config_info{block_size}`), else `default`.
    pub fn block_size(&self, default: u32) -> u32 {
        self.kv_block_size
            .or_else(|| self.metrics.as_ref().and_then(|m| m.block_size))
            .filter(|b| *b > 0)
            .unwrap_or(default)
    }

    /// The metrics, when read no longer than `stale_after` before `now` (or after it).
    /// Compared as "read at or after `now - stale_after`": the same test, and in a loop
    /// over candidates the subtraction is done once.
    #[inline]
    pub fn fresh_metrics(&self, now: Duration, stale_after: Duration) -> Option<&EndpointMetrics> {
        let cutoff = now.saturating_sub(stale_after);
        self.metrics.as_ref().filter(|m| m.updated >= cutoff)
    }

    /// Whether it may serve `model` (and adapter `lora`). A request that names no model
    /// (an empty one: a `GET`, a body without `model` on a path that needs none) may go to
    /// any endpoint.
    #[inline]
    pub fn serves(&self, model: &str) -> bool {
        match &self.spec.model {
            None => true,
            Some(_) if model.is_empty() => true,
            Some(m) if m == model => true,
            Some(_) => self.serves_adapter(model),
        }
    }

    /// Whether `model` names an adapter it has or runs (out of line: the common cases
    /// above are checked for every candidate of every pick).
    fn serves_adapter(&self, model: &str) -> bool {
        self.spec.lora.iter().any(|a| a == model)
            || self.metrics.as_ref().is_some_and(|m| {
                m.lora_running
                    .iter()
                    .chain(&m.lora_waiting)
                    .any(|a| a == model)
            })
    }
}

/// What the scheduler knows about a request.
#[derive(Debug, Clone, Default)]
pub struct SchedRequest {
    /// The `model` asked for (a base model or a LoRA adapter's name); empty: any.
    pub model: String,
    /// The LoRA adapter asked for, when `model` names one.
    pub lora: Option<String>,
    /// Session key (from the session header), for session affinity.
    pub session: Option<String>,
    /// Priority (higher is more important; below 0 is sheddable).
    pub priority: i32,
    /// Chained prompt-text chunk hashes for the approximate index.
    pub approx_blocks: Vec<u64>,
    /// Wire block hashes of the prompt's tokens for the precise index, when known: one
    /// chain per block size the candidates use.
    pub precise_blocks: Option<PreciseBlocks>,
    /// Running request number, for round-robin.
    pub seq: u64,
    /// Scheduling profile to run (default: the first, or the prefill/decode pair when one
    /// is configured).
    pub profile: Option<String>,
    /// Prompt length in tokens (estimated from the text when the ids are unknown), set for
    /// generation requests only: a prefill/decode profile pair splits only requests that
    /// have it; others run the decode profile alone.
    pub prompt_tokens: Option<usize>,
}

/// A prompt's block hashes for the precise index, once per block size: endpoints name their
/// blocks with their own block size (vLLM on CPU needs a multiple of 32, a Strata engine
/// defaults to 16), so a candidate is matched against the chain of its own size.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PreciseBlocks {
    /// The block size used when a candidate's own is unknown, and its chain.
    pub default_block_size: u32,
    /// `(block size, wire hashes)`, one entry per size, the default's included.
    pub chains: Vec<(u32, Vec<u64>)>,
}

impl PreciseBlocks {
    /// One chain, for every candidate.
    pub fn single(block_size: u32, hashes: Vec<u64>) -> Self {
        PreciseBlocks {
            default_block_size: block_size,
            chains: vec![(block_size, hashes)],
        }
    }

    /// The chain for `block_size`, or the default's when that size was not hashed.
    pub fn chain(&self, block_size: u32) -> &[u64] {
        self.chains
            .iter()
            .find(|(b, _)| *b == block_size)
            .or_else(|| {
                self.chains
                    .iter()
                    .find(|(b, _)| *b == self.default_block_size)
            })
            .map_or(&[], |(_, h)| h.as_slice())
    }

    /// The chain a candidate is matched against.
    pub fn for_candidate(&self, c: &Candidate) -> &[u64] {
        self.chain(c.block_size(self.default_block_size))
    }
}

/// Everything besides the request and candidates that a decision may read.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    pub now: Duration,
    /// Metrics older than this are not trusted by scorers.
    pub stale_after: Duration,
    pub approx: Option<&'a ApproxIndex>,
    pub precise: Option<&'a PreciseIndex>,
}

impl Context<'_> {
    /// A context with no indexes, metrics stale after 200 ms.
    pub fn at(now: Duration) -> Self {
        Context {
            now,
            stale_after: Duration::from_millis(200),
            approx: None,
            precise: None,
        }
    }
}

/// Narrows the candidate list.
pub trait Filter: Debug + Send + Sync {
    fn filter<'c>(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        cands: Vec<&'c Candidate>,
    ) -> Vec<&'c Candidate>;
}

/// Scores each candidate; `out[i]` belongs to `cands[i]`, and should be in 0..1 (it is
/// clamped).
pub trait Scorer: Debug + Send + Sync {
    fn score(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        cands: &[&Candidate],
        out: &mut [f64],
        rng: &mut dyn RngCore,
    );
}

/// Orders scored candidates: the first is the pick, the rest are fallbacks.
pub trait Picker: Debug + Send + Sync {
    fn pick(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore);

    /// The first of [`Picker::pick`]'s order alone (`scored` is left holding just it, or
    /// nothing), with the same draws from `rng`: for a caller that needs no fallbacks.
    fn pick_first(&self, scored: &mut Vec<Scored>, rng: &mut dyn RngCore) {
        self.pick(scored, rng);
        scored.truncate(1);
    }
}

/// A candidate and its total score.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scored {
    pub id: EndpointId,
    pub score: f64,
}

/// A named pipeline.
#[derive(Debug)]
pub struct Profile {
    pub name: String,
    pub filters: Vec<(String, Arc<dyn Filter>)>,
    pub scorers: Vec<(String, Arc<dyn Scorer>, f64)>,
    pub picker: Arc<dyn Picker>,
}

/// The outcome of one decision.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PickDecision {
    pub profile: String,
    /// Best first; the proxy tries them in this order.
    pub ranked: Vec<Scored>,
}

impl PickDecision {
    pub fn pick(&self) -> EndpointId {
        // `schedule` never returns an empty ranking.
        self.ranked
            .first()
            .map(|s| s.id)
            .unwrap_or(EndpointId(u32::MAX))
    }
}

/// Why no endpoint could be chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScheduleError {
    #[error("no ready endpoint")]
    NoReadyEndpoint,
    #[error("no endpoint serves model `{0}`")]
    UnknownModel(String),
    #[error("no endpoint passed the filters of profile `{0}`")]
    Filtered(String),
    #[error("unknown scheduling profile `{0}`")]
    UnknownProfile(String),
}

/// A decision of the prefill/decode profile pair ([`EndpointPicker::schedule_pd`]).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PdDecision {
    /// The endpoint that generates (the only decision when not disaggregating).
    pub decode: PickDecision,
    /// The endpoint that computes the prompt first, when disaggregating: never the decode
    /// pick.
    pub prefill: Option<PickDecision>,
    pub choice: PdChoice,
}

/// Profiles, the first being the default, and an optional prefill/decode pair.
#[derive(Debug)]
pub struct EndpointPicker {
    profiles: Vec<Profile>,
    pd: Option<PdHandler>,
}

impl EndpointPicker {
    /// A scheduler over `profiles` (at least one; the first is the default).
    pub fn new(profiles: Vec<Profile>) -> Result<Self, ConfigError> {
        if profiles.is_empty() {
            return Err(ConfigError::NoProfile);
        }
        Ok(EndpointPicker { profiles, pd: None })
    }

    /// Runs requests through the prefill/decode profile pair `pd` (both profiles must
    /// exist).
    pub fn with_pd(mut self, pd: PdHandler) -> Result<Self, ConfigError> {
        for name in [&pd.decode_profile, &pd.prefill_profile] {
            if !self.profiles.iter().any(|p| &p.name == name) {
                return Err(ConfigError::UnknownProfile {
                    handler: pd::PD_PROFILE_HANDLER.into(),
                    name: name.clone(),
                });
            }
        }
        if pd.decode_profile == pd.prefill_profile {
            return Err(ConfigError::Parameters {
                name: pd::PD_PROFILE_HANDLER.into(),
                message: "decodeProfile and prefillProfile must differ".into(),
            });
        }
        self.pd = Some(pd);
        Ok(self)
    }

    /// The prefill/decode pair, when configured.
    pub fn pd(&self) -> Option<&PdHandler> {
        self.pd.as_ref()
    }

    /// The PROTOCOLS §6 defaults: queue ×2, KV use ×2, approximate prefix ×3, max-score.
    pub fn default_profile() -> Self {
        EndpointPickerConfig::default_config()
            .build()
            .unwrap_or_else(|_| EndpointPicker {
                profiles: vec![Profile {
                    name: "default".into(),
                    filters: vec![],
                    scorers: vec![],
                    picker: Arc::new(pickers::MaxScore),
                }],
                pd: None,
            })
    }

    pub fn profiles(&self) -> &[Profile] {
        &self.profiles
    }

    /// Runs one decision.
    pub fn schedule(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        candidates: &[Candidate],
        split: Option<&TrafficSplit>,
        rng: &mut dyn RngCore,
    ) -> Result<PickDecision, ScheduleError> {
        let profile = self.request_profile(req)?;
        let inputs = Inputs {
            ctx,
            req,
            candidates,
            split,
        };
        self.run_profile(profile, &inputs, rng, false, &mut PickScratch::default())
    }

    /// [`EndpointPicker::schedule`] for a caller that uses only the pick: the decision's
    /// ranking holds the first endpoint alone (the same one, after the same draws from
    /// `rng`), which spares ordering the fallbacks; its working lists are `scratch`'s.
    pub fn schedule_first(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        candidates: &[Candidate],
        split: Option<&TrafficSplit>,
        rng: &mut dyn RngCore,
        scratch: &mut PickScratch,
    ) -> Result<PickDecision, ScheduleError> {
        let profile = self.request_profile(req)?;
        let inputs = Inputs {
            ctx,
            req,
            candidates,
            split,
        };
        self.run_profile(profile, &inputs, rng, true, scratch)
    }

    /// The profile a request runs: the one it names, else P/D's decode profile, else the
    /// first.
    fn request_profile(&self, req: &SchedRequest) -> Result<&Profile, ScheduleError> {
        match (&req.profile, &self.pd) {
            (None, Some(pd)) => self.profile(&pd.decode_profile),
            (None, None) => Ok(&self.profiles[0]),
            (Some(name), _) => self.profile(name),
        }
    }

    fn profile(&self, name: &str) -> Result<&Profile, ScheduleError> {
        self.profiles
            .iter()
            .find(|p| p.name == name)
            .ok_or_else(|| ScheduleError::UnknownProfile(name.to_string()))
    }

    /// One decision through the prefill/decode pair: the decode profile, then, when the
    /// decider says the decode pick's uncached prompt tokens reach the threshold, the
    /// prefill profile (its ranking without the decode pick). A request that names a
    /// profile, one without a prompt length (not a generation request), or a picker with
    /// no pair runs one profile, as [`EndpointPicker::schedule`] does.
    pub fn schedule_pd(
        &self,
        ctx: &Context,
        req: &SchedRequest,
        candidates: &[Candidate],
        split: Option<&TrafficSplit>,
        rng: &mut dyn RngCore,
    ) -> Result<PdDecision, ScheduleError> {
        let single = |d| PdDecision {
            decode: d,
            prefill: None,
            choice: PdChoice::Single,
        };
        let (Some(pd), None, Some(prompt)) = (&self.pd, &req.profile, req.prompt_tokens) else {
            return self.schedule(ctx, req, candidates, split, rng).map(single);
        };
        let decode_profile = self.profile(&pd.decode_profile)?;
        let mut scratch = PickScratch::default();
        let inputs = Inputs {
            ctx,
            req,
            candidates,
            split,
        };
        let decode = self.run_profile(decode_profile, &inputs, rng, false, &mut scratch)?;
        let first = decode.pick();
        let cached = candidates
            .iter()
            .find(|c| c.id == first)
            .map_or(0, |c| pd::cached_tokens(ctx, req, c));
        if !pd.decider.decide(prompt, cached) {
            return Ok(PdDecision {
                decode,
                prefill: None,
                choice: PdChoice::DecodeOnly,
            });
        }
        let prefill_profile = self.profile(&pd.prefill_profile)?;
        let prefill = self
            .run_profile(prefill_profile, &inputs, rng, false, &mut scratch)
            .ok()
            .map(|mut p| {
                p.ranked.retain(|s| s.id != first);
                p
            })
            .filter(|p| !p.ranked.is_empty());
        let choice = if prefill.is_some() {
            PdChoice::Disaggregate
        } else {
            PdChoice::NoPrefill
        };
        Ok(PdDecision {
            decode,
            prefill,
            choice,
        })
    }

    /// One profile's decision; `first_only`: rank the pick alone. Its working lists are
    /// `scratch`'s, given back emptied.
    fn run_profile(
        &self,
        profile: &Profile,
        inputs: &Inputs,
        rng: &mut dyn RngCore,
        first_only: bool,
        scratch: &mut PickScratch,
    ) -> Result<PickDecision, ScheduleError> {
        let mut cands = scratch.take_cands();
        let ranked = self.rank(profile, inputs, rng, first_only, scratch, &mut cands);
        scratch.put_cands(cands);
        Ok(PickDecision {
            profile: profile.name.clone(),
            ranked: ranked?,
        })
    }

    /// [`Self::run_profile`]'s steps: eligibility, the split, the filters, the scorers'
    /// weighted sum and the picker's order.
    fn rank<'c>(
        &self,
        profile: &Profile,
        inputs: &Inputs<'_, 'c>,
        rng: &mut dyn RngCore,
        first_only: bool,
        scratch: &mut PickScratch,
        cands: &mut Vec<&'c Candidate>,
    ) -> Result<Vec<Scored>, ScheduleError> {
        let &Inputs {
            ctx,
            req,
            candidates,
            split,
        } = inputs;
        eligible(req, candidates, cands)?;
        if let Some(split) = split {
            *cands = split.apply(std::mem::take(cands), rng);
        }
        for (_, f) in &profile.filters {
            *cands = f.filter(ctx, req, std::mem::take(cands));
            if cands.is_empty() {
                return Err(ScheduleError::Filtered(profile.name.clone()));
            }
        }
        let totals = weighted_totals(profile, ctx, req, cands, rng, &mut scratch.totals);
        let scored = &mut scratch.scored;
        scored.clear();
        scored.extend(
            cands
                .iter()
                .zip(totals.iter())
                .map(|(c, &score)| Scored { id: c.id, score }),
        );
        if first_only {
            profile.picker.pick_first(scored, rng);
            // The pick alone: a list of its own, the scratch keeping its room.
            let ranked = scored.to_vec();
            scored.clear();
            Ok(ranked)
        } else {
            profile.picker.pick(scored, rng);
            Ok(std::mem::take(scored))
        }
    }
}

/// What one decision reads besides its profile.
struct Inputs<'a, 'c> {
    ctx: &'a Context<'a>,
    req: &'a SchedRequest,
    candidates: &'c [Candidate],
    split: Option<&'a TrafficSplit>,
}

/// Eligibility in one pass, into `cands`: ready, not draining, serves the model.
fn eligible<'c>(
    req: &SchedRequest,
    candidates: &'c [Candidate],
    cands: &mut Vec<&'c Candidate>,
) -> Result<(), ScheduleError> {
    cands.reserve(candidates.len());
    let mut any_ready = false;
    for c in candidates.iter().filter(|c| c.ready && !c.draining) {
        any_ready = true;
        if c.serves(&req.model) {
            cands.push(c);
        }
    }
    if !any_ready {
        return Err(ScheduleError::NoReadyEndpoint);
    }
    if cands.is_empty() {
        return Err(ScheduleError::UnknownModel(req.model.clone()));
    }
    Ok(())
}

/// Each candidate's weighted sum of the profile's scores (each clamped to 0..1, a
/// non-finite one counting 0), in `buf`: the totals, then one scorer's scratch.
fn weighted_totals<'b>(
    profile: &Profile,
    ctx: &Context,
    req: &SchedRequest,
    cands: &[&Candidate],
    rng: &mut dyn RngCore,
    buf: &'b mut Vec<f64>,
) -> &'b [f64] {
    let n = cands.len();
    buf.clear();
    buf.resize(2 * n, 0.0);
    let (total, one) = buf.split_at_mut(n);
    for (i, (_, scorer, weight)) in profile.scorers.iter().enumerate() {
        // The first scorer finds its half zeroed by the resize.
        if i > 0 {
            one.iter_mut().for_each(|s| *s = 0.0);
        }
        scorer.score(ctx, req, cands, one, rng);
        for (t, s) in total.iter_mut().zip(one.iter()) {
            let s = if s.is_finite() {
                s.clamp(0.0, 1.0)
            } else {
                0.0
            };
            *t += s * weight;
        }
    }
    &buf[..n]
}

#[cfg(test)]
pub(crate) mod testutil {
    use super::*;
    use crate::endpoint::EngineKind;

    pub fn cand(id: u32, waiting: f64, kv: f64) -> Candidate {
        let mut c = Candidate::new(
            EndpointId(id),
            EndpointSpec::new(format!("http://127.0.0.1:{}", 9000 + id), EngineKind::Vllm),
        );
        c.metrics = Some(EndpointMetrics {
            waiting,
            kv_use: Some(kv),
            updated: Duration::from_secs(10),
            ..Default::default()
        });
        c
    }

    pub fn now() -> Duration {
        Duration::from_secs(10)
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::*;
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    #[test]
    fn default_weights_follow_protocols_6_exactly() {
        // queue: waiting 0, 5, 10 → 1, 0.5, 0; KV: 0.2, 0.5, 0.9 → 0.8, 0.5, 0.1;
        // prefix: request of 4 blocks, endpoint 2 holds 3, endpoint 1 holds 1.
        let cands = vec![cand(0, 0.0, 0.2), cand(1, 5.0, 0.5), cand(2, 10.0, 0.9)];
        let mut approx = ApproxIndex::new(Default::default());
        approx.record(EndpointId(2), &[11, 12, 13]);
        approx.record(EndpointId(1), &[11]);
        let ctx = Context {
            approx: Some(&approx),
            ..Context::at(now())
        };
        let req = SchedRequest {
            model: "m".into(),
            approx_blocks: vec![11, 12, 13, 14],
            ..Default::default()
        };
        let s = EndpointPicker::default_profile();
        let mut rng = StdRng::seed_from_u64(1);
        let d = s.schedule(&ctx, &req, &cands, None, &mut rng).unwrap();
        let score = |id: u32| d.ranked.iter().find(|x| x.id.0 == id).unwrap().score;
        assert!((score(0) - (2.0 * 1.0 + 2.0 * 0.8 + 3.0 * 0.0)).abs() < 1e-12);
        assert!((score(1) - (2.0 * 0.5 + 2.0 * 0.5 + 3.0 * 0.25)).abs() < 1e-12);
        assert!((score(2) - (2.0 * 0.0 + 2.0 * 0.1 + 3.0 * 0.75)).abs() < 1e-12);
        assert_eq!(d.pick(), EndpointId(0));
        assert_eq!(
            d.ranked.iter().map(|x| x.id.0).collect::<Vec<_>>(),
            vec![0, 1, 2],
            "fallbacks by score"
        );
    }

    #[test]
    fn unready_draining_and_other_models_get_nothing() {
        let mut cands = vec![cand(0, 0.0, 0.0), cand(1, 9.0, 0.9), cand(2, 9.0, 0.9)];
        cands[0].ready = false;
        cands[2].draining = true;
        let s = EndpointPicker::default_profile();
        let req = SchedRequest {
            model: "m".into(),
            ..Default::default()
        };
        let mut rng = StdRng::seed_from_u64(0);
        for _ in 0..20 {
            let d = s
                .schedule(&Context::at(now()), &req, &cands, None, &mut rng)
                .unwrap();
            assert_eq!(d.ranked.len(), 1);
            assert_eq!(d.pick(), EndpointId(1));
        }
        cands[1].ready = false;
        assert_eq!(
            s.schedule(&Context::at(now()), &req, &cands, None, &mut rng),
            Err(ScheduleError::NoReadyEndpoint)
        );
        let mut only = vec![cand(0, 0.0, 0.0)];
        Arc::make_mut(&mut only[0].spec).model = Some("a".into());
        assert_eq!(
            s.schedule(&Context::at(now()), &req, &only, None, &mut rng),
            Err(ScheduleError::UnknownModel("m".into()))
        );
        let req = SchedRequest {
            profile: Some("nope".into()),
            ..req
        };
        assert!(matches!(
            s.schedule(&Context::at(now()), &req, &only, None, &mut rng),
            Err(ScheduleError::UnknownProfile(_))
        ));
    }

    #[test]
    fn pd_pair_disaggregates_long_uncached_prompts_only() {
        let mut cands = vec![cand(0, 0.0, 0.0), cand(1, 0.0, 0.0), cand(2, 0.0, 0.0)];
        Arc::make_mut(&mut cands[0].spec).role = Some("prefill".into());
        Arc::make_mut(&mut cands[1].spec).role = Some("decode".into());
        Arc::make_mut(&mut cands[2].spec).role = Some("decode".into());
        // Endpoint 1 holds the first four 16-token chunks of the shared prompt.
        let mut approx = ApproxIndex::new(Default::default());
        approx.record(EndpointId(1), &[1, 2, 3, 4]);
        let ctx = Context {
            approx: Some(&approx),
            ..Context::at(now())
        };
        let s = EndpointPickerConfig::pd(100).build().unwrap();
        let mut rng = StdRng::seed_from_u64(5);
        let req = |tokens: usize, blocks: Vec<u64>| SchedRequest {
            model: "m".into(),
            approx_blocks: blocks,
            prompt_tokens: Some(tokens),
            ..Default::default()
        };
        // Long and new: the decode pick is a decoder, the prefill pick the prefill engine.
        for _ in 0..10 {
            let d = s
                .schedule_pd(&ctx, &req(500, vec![9, 8, 7]), &cands, None, &mut rng)
                .unwrap();
            assert_eq!(d.choice, PdChoice::Disaggregate);
            assert!([1, 2].contains(&d.decode.pick().0));
            let p = d.prefill.unwrap();
            assert_eq!(p.profile, "prefill");
            assert_eq!(p.ranked.iter().map(|x| x.id.0).collect::<Vec<_>>(), vec![0]);
        }
        // Short: decode only.
        let d = s
            .schedule_pd(&ctx, &req(99, vec![9]), &cands, None, &mut rng)
            .unwrap();
        assert_eq!(
            (d.choice, d.prefill.is_none()),
            (PdChoice::DecodeOnly, true)
        );
        // Long but mostly cached where it lands (prefix score picks endpoint 1): 130 tokens,
        // 64 cached, 66 uncached < 100.
        let d = s
            .schedule_pd(&ctx, &req(130, vec![1, 2, 3, 4, 5]), &cands, None, &mut rng)
            .unwrap();
        assert_eq!(d.decode.pick(), EndpointId(1));
        assert_eq!(d.choice, PdChoice::DecodeOnly);
        // Not a generation request, or a named profile: one profile.
        let mut r = req(500, vec![]);
        r.prompt_tokens = None;
        let d = s.schedule_pd(&ctx, &r, &cands, None, &mut rng).unwrap();
        assert_eq!(
            (d.choice, d.decode.profile.as_str()),
            (PdChoice::Single, "decode")
        );
        let mut r = req(500, vec![]);
        r.profile = Some("prefill".into());
        let d = s.schedule_pd(&ctx, &r, &cands, None, &mut rng).unwrap();
        assert_eq!(d.decode.pick(), EndpointId(0));
        // No prefill engine: served by the decode pick alone.
        let decoders = &cands[1..];
        let d = s
            .schedule_pd(&ctx, &req(500, vec![]), decoders, None, &mut rng)
            .unwrap();
        assert_eq!((d.choice, d.prefill.is_none()), (PdChoice::NoPrefill, true));
        // Only prefill engines: no decoder, an error as for any empty profile.
        assert_eq!(
            s.schedule_pd(&ctx, &req(500, vec![]), &cands[..1], None, &mut rng),
            Err(ScheduleError::Filtered("decode".into()))
        );
    }

    #[test]
    fn same_seed_same_decision() {
        let cands: Vec<Candidate> = (0..8).map(|i| cand(i, 1.0, 0.5)).collect();
        let s = EndpointPicker::default_profile();
        let req = SchedRequest {
            model: "m".into(),
            ..Default::default()
        };
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..10)
                .map(|_| {
                    s.schedule(&Context::at(now()), &req, &cands, None, &mut rng)
                        .unwrap()
                        .pick()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        // Ties are broken at random: over many draws, more than one endpoint is picked.
        let mut rng = StdRng::seed_from_u64(3);
        let picks: std::collections::HashSet<_> = (0..64)
            .map(|_| {
                s.schedule(&Context::at(now()), &req, &cands, None, &mut rng)
                    .unwrap()
                    .pick()
            })
            .collect();
        assert!(picks.len() > 1);
    }
}

#[cfg(test)]
mod properties {
    use super::testutil::*;
    use super::*;
    use proptest::prelude::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::collections::{HashMap, HashSet};

    proptest! {
        /// "Read at or after `now - stale_after`" is "read no longer than `stale_after`
        /// before `now`", at every edge: reads after `now`, `now` before `stale_after`,
        /// equal times, nanoseconds across a second.
        #[test]
        fn fresh_is_read_no_longer_than_stale_after_before_now(
            now in (0u64..5, 0u32..1_000_000_000),
            updated in (0u64..5, 0u32..1_000_000_000),
            stale in (0u64..3, 0u32..1_000_000_000),
            edge in 0u8..3,
        ) {
            let now = Duration::new(now.0, now.1);
            let stale_after = Duration::new(stale.0, stale.1);
            let updated = match edge {
                0 => Duration::new(updated.0, updated.1),
                1 => now.saturating_sub(stale_after),
                _ => now,
            };
            let mut c = cand(0, 1.0, 0.5);
            if let Some(m) = c.metrics.as_mut() {
                m.updated = updated;
            }
            let want = now.saturating_sub(updated) <= stale_after;
            prop_assert_eq!(c.fresh_metrics(now, stale_after).is_some(), want);
        }
    }

    /// The default profile (queue ×2, KV ×2, approximate prefix ×3, max-score) written
    /// out the slow, obvious way.
    fn reference(
        cands: &[Candidate],
        held: &HashMap<u32, HashSet<u64>>,
        blocks: &[u64],
        rng: &mut StdRng,
    ) -> Vec<Scored> {
        let ctx = Context::at(now());
        let elig: Vec<&Candidate> = cands.iter().filter(|c| c.ready && !c.draining).collect();
        let waits: Vec<f64> = elig
            .iter()
            .filter_map(|c| c.fresh_metrics(ctx.now, ctx.stale_after).map(|m| m.waiting))
            .collect();
        let min = waits.iter().copied().fold(f64::INFINITY, f64::min);
        let max = waits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut scored: Vec<Scored> = elig
            .iter()
            .map(|c| {
                let fresh = c.fresh_metrics(ctx.now, ctx.stale_after);
                let q = match fresh {
                    None => 0.0,
                    Some(_) if max <= min => 1.0,
                    Some(m) => (max - m.waiting) / (max - min),
                };
                let kv = fresh.map_or(0.0, |m| m.kv_use.map_or(0.5, |k| 1.0 - k));
                let mine = held.get(&c.id.0);
                let matched = blocks
                    .iter()
                    .take_while(|b| mine.is_some_and(|s| s.contains(b)))
                    .count();
                let p = if blocks.is_empty() {
                    0.0
                } else {
                    matched as f64 / blocks.len() as f64
                };
                let mut t = 0.0;
                t += q.clamp(0.0, 1.0) * 2.0;
                t += kv.clamp(0.0, 1.0) * 2.0;
                t += p.clamp(0.0, 1.0) * 3.0;
                Scored { id: c.id, score: t }
            })
            .collect();
        scored.sort_by(|a, b| b.score.total_cmp(&a.score));
        let ties = scored
            .iter()
            .take_while(|s| s.score == scored[0].score)
            .count();
        if ties > 1 {
            let i = rng.random_range(0..ties);
            scored.swap(0, i);
        }
        scored
    }

    proptest! {
        #[test]
        fn default_profile_equals_reference(
            eps in proptest::collection::vec(
                (0u8..6, 0u8..5, any::<bool>(), any::<bool>(), any::<bool>()), 1..70),
            records in proptest::collection::vec(
                (0usize..70, proptest::collection::vec(0u64..12, 0..8)), 0..40),
            blocks in proptest::collection::vec(0u64..12, 0..10),
            seed in any::<u64>(),
        ) {
            // Slots in a scrambled order, as a pool that reused slots would have them.
            let n = eps.len() as u32;
            let cands: Vec<Candidate> = eps
                .iter()
                .enumerate()
                .map(|(i, &(w, kv, stale, unready, nokv))| {
                    let mut c = cand((i as u32 * 37) % 71, f64::from(w), f64::from(kv) / 4.0);
                    let m = c.metrics.as_mut().unwrap();
                    if stale {
                        m.updated = Duration::ZERO;
                    }
                    if nokv {
                        m.kv_use = None;
                    }
                    c.ready = !unready;
                    c
                })
                .collect();
            let mut approx = ApproxIndex::new(Default::default());
            let mut held: HashMap<u32, HashSet<u64>> = HashMap::new();
            for (e, hashes) in records {
                let id = cands[e % n as usize].id;
                approx.record(id, &hashes);
                held.entry(id.0).or_default().extend(hashes);
            }
            let ctx = Context { approx: Some(&approx), ..Context::at(now()) };
            let req = SchedRequest { model: "m".into(), approx_blocks: blocks.clone(), ..Default::default() };
            let got = EndpointPicker::default_profile()
                .schedule(&ctx, &req, &cands, None, &mut StdRng::seed_from_u64(seed));
            if cands.iter().all(|c| !c.ready) {
                prop_assert_eq!(got, Err(ScheduleError::NoReadyEndpoint));
            } else {
                let want = reference(&cands, &held, &blocks, &mut StdRng::seed_from_u64(seed));
                let bits = |v: &[Scored]| v.iter().map(|s| (s.id, s.score.to_bits())).collect::<Vec<_>>();
                prop_assert_eq!(bits(&got.unwrap().ranked), bits(&want));
            }
        }
    }
}

#[cfg(test)]
mod layout_tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn what_a_pick_reads_shares_one_cache_line() {
        assert_eq!(align_of::<Candidate>(), 64);
        let m = offset_of!(Candidate, metrics);
        for end in [
            offset_of!(Candidate, id) + size_of::<EndpointId>(),
            offset_of!(Candidate, in_flight) + 4,
            offset_of!(Candidate, draining) + 1,
            offset_of!(Candidate, spec) + size_of::<Arc<EndpointSpec>>(),
            m + offset_of!(EndpointMetrics, kv_use) + size_of::<Option<f64>>(),
            m + offset_of!(EndpointMetrics, updated) + size_of::<Duration>(),
            m + offset_of!(EndpointMetrics, waiting) + size_of::<f64>(),
        ] {
            assert!(end <= 64, "a hot field ends at byte {end}");
        }
    }
}
