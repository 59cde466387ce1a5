//! `strata sim calibrate`: fits "this machine" from a live engine.
//!
//! Two sweeps over the OpenAI API, with token-id prompts so lengths are exact and each
//! prompt is fresh (no prefix-cache hits):
//! - **prefill**: one request at a time, prompts of each `--prefill-sizes` length and one
//!   output token; the time to first token is one prefill step (or a few chunked ones);
//! - **batched prefill**: for each `--prefill-batches` entry `k`, one long "blocker"
//!   prompt and, while the engine runs it, `k` prompts of `--prefill-batch-len` tokens,
//!   which queue behind it and are admitted together: the time from the blocker's first
//!   token to theirs is one step prefilling `k` sequences;
//! - **decode**: `B` concurrent streams for each `--batch-sizes` entry; the median gap
//!   between tokens is one decode step of batch `B`.
//!
//! The roofline's free parameters (effective peak FLOP/s, effective bandwidth, per-step
//! overhead, and the prefill-row exponent, see [`HardwareProfile::prefill_row_exponent`])
//! are then fitted to every measurement by minimizing the squared relative error: the
//! exponent over a grid, peak and bandwidth over a log-spaced grid refined three times,
//! the overhead solved in closed form for each.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use strata_bench::client::{Client, ClientConfig, Endpoint, Prompt, PromptMode};
use strata_bench::prompt::{mix, Segment};

use crate::error::SimError;
use crate::profile::{CalibratedOn, HardwareProfile, ModelProfile, StepModel, StepShape};

/// `strata sim calibrate --url URL --output profile.json`.
#[derive(Debug, Clone, Args)]
pub struct CalibrateArgs {
    /// Base URL of a running engine.
    #[arg(long)]
    pub url: String,
    /// Model name to request; default: the first the server lists.
    #[arg(long)]
    pub model: Option<String>,
    /// The model profile the engine serves (its shape sets the flops and bytes).
    #[arg(long, default_value = "smollm2-135m")]
    pub model_profile: String,
    /// Where to write the fitted profile (JSON).
    #[arg(long)]
    pub output: PathBuf,
    /// Name recorded in the profile.
    #[arg(long, default_value = "this-machine")]
    pub name: String,
    /// Prompt lengths of the prefill sweep.
    #[arg(long, default_value = "32,128,512,1024", value_delimiter = ',')]
    pub prefill_sizes: Vec<u32>,
    /// Prompts prefilled together in the batched-prefill sweep (sizes below 2, or an
    /// empty list, skip it).
    #[arg(long, default_value = "2,4,8", value_delimiter = ',')]
    pub prefill_batches: Vec<u32>,
    /// Tokens of each prompt of the batched-prefill sweep.
    #[arg(long, default_value_t = 128)]
    pub prefill_batch_len: u32,
    /// Concurrent streams of the decode sweep.
    #[arg(long, default_value = "1,2,4,8", value_delimiter = ',')]
    pub batch_sizes: Vec<u32>,
    /// Output tokens per decode stream.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: u32,
    /// Prompt tokens per decode stream.
    #[arg(long, default_value_t = 64)]
    pub decode_prompt: u32,
    /// Repetitions of each prefill size (the median counts).
    #[arg(long, default_value_t = 3)]
    pub repeats: u32,
    /// The engine's KV-cache budget in bytes (its `--kv-cache-memory`), recorded so
    /// simulated replicas hold as many blocks as the live one.
    #[arg(long, default_value_t = 1 << 30)]
    pub kv_cache_bytes: u64,
    /// The engine's tokens per KV block (its `--block-size`), recorded in the profile.
    #[arg(long, default_value_t = 16)]
    pub kv_block_size: usize,
    /// The engine's KV-cache element type (its `--kv-cache-dtype`), recorded in the profile.
    #[arg(long, default_value = "f16")]
    pub kv_cache_dtype: String,
    /// Bound on one request.
    #[arg(long, default_value = "120s", value_parser = strata_bench::args::parse_duration)]
    pub timeout: Duration,
}

/// One measurement: a step's shape and how long it took.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Sample {
    pub shape_tokens: u64,
    pub batch: u64,
    pub seconds: f64,
    #[serde(skip)]
    pub shape: StepShape,
}

/// Fits peak, bandwidth and overhead of `base` (its other fields are kept) to `samples`.
pub fn fit(
    base: &HardwareProfile,
    model: &ModelProfile,
    samples: &[Sample],
) -> Result<HardwareProfile, SimError> {
    if samples.len() < 3 {
        return Err(SimError::Calibration(
            "need at least three measurements to fit three parameters".into(),
        ));
    }
    let unit = HardwareProfile {
        peak_flops: 1.0,
        mem_bandwidth: 1.0,
        flops_efficiency: 1.0,
        bandwidth_efficiency: 1.0,
        step_overhead_s: 0.0,
        allreduce_s: 0.0,
        ..base.clone()
    };
    let sm = StepModel {
        hardware: unit,
        model: model.clone(),
        tp: 1,
    };
    // The widest prefill step measured caps the row gain: beyond it nothing is known.
    let cap = samples
        .iter()
        .map(|s| s.shape.prefill_rows)
        .max()
        .unwrap_or(1)
        .max(1) as f64;
    // (flops, bytes, seconds, prefill rows) per measurement.
    let pts: Vec<(f64, f64, f64, f64)> = samples
        .iter()
        .map(|s| {
            let rows = (s.shape.prefill_rows.max(1) as f64).min(cap);
            (sm.flops(&s.shape), sm.bytes(&s.shape), s.seconds, rows)
        })
        .collect();
    // Without a step prefilling two or more sequences the exponent is not identified:
    // keep it neutral.
    let exponents: Vec<f64> = if cap >= 2.0 {
        (0..=40).map(|i| f64::from(i) * 0.05).collect()
    } else {
        vec![0.0]
    };
    let mut best = (f64::INFINITY, 0.0, 0.0, 0.0, 0.0);
    for &x in &exponents {
        let gains: Vec<f64> = pts.iter().map(|p| p.3.powf(x)).collect();
        let (err, p, w, o) = fit_roofline(&pts, &gains);
        if err < best.0 {
            best = (err, p, w, o, x);
        }
    }
    let (_, peak, bw, overhead, exponent) = best;
    let out = HardwareProfile {
        peak_flops: peak,
        mem_bandwidth: bw,
        flops_efficiency: 1.0,
        bandwidth_efficiency: 1.0,
        step_overhead_s: overhead,
        prefill_row_exponent: exponent,
        prefill_row_cap: if exponent > 0.0 { cap } else { 1.0 },
        ..base.clone()
    };
    out.validate()?;
    Ok(out)
}

/// The (error, peak, bandwidth, overhead) of the best roofline for `pts` (flops, bytes,
/// seconds, rows), each point's compute sped up by `gains[i]`.
fn fit_roofline(pts: &[(f64, f64, f64, f64)], gains: &[f64]) -> (f64, f64, f64, f64) {
    // For given peak and bandwidth, the overhead minimizing Σ((r_i + o) / t_i - 1)²
    // where r_i is the roofline part: o = Σ(1/t_i - r_i/t_i²) / Σ(1/t_i²), at least 0.
    let score = |p: f64, w: f64| -> (f64, f64) {
        let mut num = 0.0;
        let mut den = 0.0;
        for (&(f, b, t, _), g) in pts.iter().zip(gains) {
            let r = (f / (p * g)).max(b / w);
            num += 1.0 / t - r / (t * t);
            den += 1.0 / (t * t);
        }
        let o = (num / den).max(0.0);
        let err = pts
            .iter()
            .zip(gains)
            .map(|(&(f, b, t, _), g)| {
                let e = ((f / (p * g)).max(b / w) + o) / t - 1.0;
                e * e
            })
            .sum();
        (err, o)
    };
    let (mut lp_lo, mut lp_hi) = (6.0f64, 16.0f64); // 1 MFLOP/s .. 10 PFLOP/s
    let (mut lw_lo, mut lw_hi) = (6.0f64, 14.0f64); // 1 MB/s .. 100 TB/s
    let mut best = (f64::INFINITY, 0.0, 0.0, 0.0);
    for _ in 0..4 {
        let n = 60;
        for i in 0..=n {
            let lp = lp_lo + (lp_hi - lp_lo) * f64::from(i) / f64::from(n);
            for j in 0..=n {
                let lw = lw_lo + (lw_hi - lw_lo) * f64::from(j) / f64::from(n);
                let (p, w) = (10f64.powf(lp), 10f64.powf(lw));
                let (err, o) = score(p, w);
                if err < best.0 {
                    best = (err, p, w, o);
                }
            }
        }
        let (sp, sw) = ((lp_hi - lp_lo) / 10.0, (lw_hi - lw_lo) / 10.0);
        let (bp, bw) = (best.1.log10(), best.2.log10());
        (lp_lo, lp_hi) = (bp - sp, bp + sp);
        (lw_lo, lw_hi) = (bw - sw, bw + sw);
    }
    best
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(v[v.len() / 2])
}

/// Runs the sweeps against `args.url` and returns the measurements: one warm-up request,
/// then the prefill, batched-prefill and decode sweeps, in that order.
pub async fn measure(args: &CalibrateArgs) -> Result<Vec<Sample>, SimError> {
    let client = calibration_client(args).await?;
    let mut fresh = FreshPrompts::new();
    let mut samples = Vec::new();
    warm_up(&client, &mut fresh).await;
    prefill_sweep(args, &client, &mut fresh, &mut samples).await?;
    batched_prefill_sweep(args, &client, &mut fresh, &mut samples).await?;
    decode_sweep(args, &client, &mut fresh, &mut samples).await?;
    Ok(samples)
}

/// A client of the engine's completions API that sends token-id prompts and ignores EOS,
/// so lengths are exact; the model is `--model`, or the first the server lists.
async fn calibration_client(args: &CalibrateArgs) -> Result<Client, SimError> {
    let name = match &args.model {
        Some(m) => m.clone(),
        None => Client::discover_model(&args.url, args.timeout).await?,
    };
    Ok(Client::new(ClientConfig {
        url: args.url.clone(),
        model: name,
        endpoint: Endpoint::Completions,
        prompt_mode: PromptMode::TokenIds,
        ignore_eos: true,
        keepalive: true,
        timeout: args.timeout,
        api_key: None,
    })?)
}

/// Prompts no request sent before: each one's tokens are drawn from a counter and the
/// time since the calibration started.
struct FreshPrompts {
    /// When the calibration started (every request's times are measured from it too).
    start: Instant,
    counter: u64,
}

impl FreshPrompts {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            counter: 0,
        }
    }

    /// A fresh prompt of `len` tokens.
    fn prompt(&mut self, len: u32) -> Segment {
        self.counter += 1;
        // Seeded from the wall clock as well, so a second calibration against the same
        // engine does not hit the first one's cached prefixes.
        let salt = self.start.elapsed().as_nanos() as u64 ^ 0xca1b;
        Segment::new(mix(&[salt, self.counter]), len)
    }
}

/// A failed request as a calibration error.
fn failed(r: &strata_bench::RequestRecord) -> Option<SimError> {
    r.failure
        .as_ref()
        .map(|f| SimError::Calibration(format!("request failed: {}", f.message)))
}

/// The request body of a prompt of `seg`'s tokens asking for `max_tokens`.
fn body_of(client: &Client, seg: &[Segment; 1], max_tokens: u32) -> serde_json::Value {
    let p = Prompt {
        system: &[],
        history: &[],
        user: seg,
        session: None,
    };
    client.body(&p, max_tokens)
}

/// One request, not measured: the first one pays for what later ones find ready.
async fn warm_up(client: &Client, fresh: &mut FreshPrompts) {
    let seg = [fresh.prompt(16)];
    let _ = client
        .send(&body_of(client, &seg, 2), 16, None, fresh.start, false)
        .await;
}

/// One request at a time for each `--prefill-sizes` length, one output token each: the
/// median time to first token of `--repeats` is one prefill of that length.
async fn prefill_sweep(
    args: &CalibrateArgs,
    client: &Client,
    fresh: &mut FreshPrompts,
    samples: &mut Vec<Sample>,
) -> Result<(), SimError> {
    for &n in &args.prefill_sizes {
        let mut times = Vec::new();
        for _ in 0..args.repeats.max(1) {
            let seg = [fresh.prompt(n.max(1))];
            let r = client
                .send(&body_of(client, &seg, 1), n, None, fresh.start, false)
                .await;
            if let Some(e) = failed(&r) {
                return Err(e);
            }
            if let Some(t) = r.ttft {
                times.push(t.as_secs_f64());
            }
        }
        if let Some(t) = median(&mut times) {
            let mut shape = StepShape::default();
            shape.add(0, u64::from(n.max(1)), true);
            samples.push(Sample {
                shape_tokens: shape.tokens,
                batch: 1,
                seconds: t,
                shape,
            });
        }
    }
    Ok(())
}

/// For each `--prefill-batches` size `k` of at least 2, the median of `--repeats` steps
/// that prefill `k` prompts together ([`batched_prefill`]).
async fn batched_prefill_sweep(
    args: &CalibrateArgs,
    client: &Client,
    fresh: &mut FreshPrompts,
    samples: &mut Vec<Sample>,
) -> Result<(), SimError> {
    for &k in args.prefill_batches.iter().filter(|k| **k >= 2) {
        let mut times = Vec::new();
        for _ in 0..args.repeats.max(1) {
            if let Some(t) = batched_prefill(client, fresh, k, args.prefill_batch_len).await? {
                times.push(t);
            }
        }
        if let Some(t) = median(&mut times) {
            let mut shape = StepShape::default();
            for _ in 0..k {
                shape.add(0, u64::from(args.prefill_batch_len.max(2)), true);
            }
            samples.push(Sample {
                shape_tokens: shape.tokens,
                batch: u64::from(k),
                seconds: t,
                shape,
            });
        }
    }
    Ok(())
}

/// For each `--batch-sizes` entry `B`, `B` concurrent streams: the median gap between
/// their tokens (past each stream's first two) is one decode step of batch `B`.
async fn decode_sweep(
    args: &CalibrateArgs,
    client: &Client,
    fresh: &mut FreshPrompts,
    samples: &mut Vec<Sample>,
) -> Result<(), SimError> {
    for &b in &args.batch_sizes {
        let b = b.max(1);
        let segs: Vec<[Segment; 1]> = (0..b)
            .map(|_| [fresh.prompt(args.decode_prompt.max(1))])
            .collect();
        let bodies: Vec<_> = segs
            .iter()
            .map(|s| body_of(client, s, args.decode_tokens.max(4)))
            .collect();
        let sends = bodies
            .iter()
            .map(|body| client.send(body, args.decode_prompt, None, fresh.start, false));
        let records = futures_util::future::join_all(sends).await;
        let mut gaps = Vec::new();
        for r in &records {
            if let Some(e) = failed(r) {
                return Err(e);
            }
            // Skip the first gaps, while other streams may still be in prefill.
            gaps.extend(r.itls().skip(2).map(|d| d.as_secs_f64()));
        }
        if let Some(t) = median(&mut gaps) {
            let ctx = u64::from(args.decode_prompt + args.decode_tokens / 2);
            let mut shape = StepShape::default();
            for _ in 0..b {
                shape.add(ctx, 1, true);
            }
            samples.push(Sample {
                shape_tokens: shape.tokens,
                batch: u64::from(b),
                seconds: t,
                shape,
            });
        }
    }
    Ok(())
}

/// Tokens of the prompt that holds the engine busy while a batch queues behind it.
const BLOCKER_TOKENS: u32 = 512;
/// How long after the blocker the batch is sent: enough for the blocker to be admitted
/// alone, well inside its prefill (a second or more on a CPU).
const BLOCKER_LEAD: Duration = Duration::from_millis(100);

/// One step prefilling `k` fresh prompts of `len` tokens: the time from a blocker's first
/// token to the batch's last first token. `None` when the batch was not queued behind the
/// blocker (it finished before the batch was sent) or did not come out as one step.
async fn batched_prefill(
    client: &Client,
    fresh: &mut FreshPrompts,
    k: u32,
    len: u32,
) -> Result<Option<f64>, SimError> {
    let start = fresh.start;
    let blocker = [fresh.prompt(BLOCKER_TOKENS)];
    let segs: Vec<[Segment; 1]> = (0..k).map(|_| [fresh.prompt(len.max(2))]).collect();
    let body = |s: &[Segment; 1]| body_of(client, s, 1);
    let blocker_body = body(&blocker);
    let bodies: Vec<_> = segs.iter().map(body).collect();
    let batch = async {
        tokio::time::sleep(BLOCKER_LEAD).await;
        futures_util::future::join_all(
            bodies
                .iter()
                .map(|b| client.send(b, len.max(2), None, start, false)),
        )
        .await
    };
    let (b, records) = tokio::join!(
        client.send(&blocker_body, BLOCKER_TOKENS, None, start, false),
        batch
    );
    for r in std::iter::once(&b).chain(&records) {
        if let Some(e) = failed(r) {
            return Err(e);
        }
    }
    let first = |r: &strata_bench::RequestRecord| r.ttft.map(|t| r.start + t);
    let Some(blocker_first) = first(&b) else {
        return Ok(None);
    };
    let firsts: Vec<Duration> = records.iter().filter_map(first).collect();
    let (Some(lo), Some(hi)) = (firsts.iter().min(), firsts.iter().max()) else {
        return Ok(None);
    };
    let sent_last = records.iter().map(|r| r.start).max().unwrap_or_default();
    let step = hi.saturating_sub(blocker_first);
    // Queued behind the blocker, and out together (a split batch spreads its first
    // tokens over more than a step).
    if sent_last >= blocker_first || step.is_zero() || (*hi - *lo) > step / 4 {
        tracing::warn!(
            k,
            "batched prefill not measured as one step; sample skipped"
        );
        return Ok(None);
    }
    Ok(Some(step.as_secs_f64()))
}

/// Runs `strata sim calibrate`.
pub fn run(args: CalibrateArgs) -> Result<(), SimError> {
    let model = ModelProfile::named(&args.model_profile)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| SimError::Calibration(format!("cannot start a runtime: {e}")))?;
    let samples = rt.block_on(measure(&args))?;
    let profile = calibrate_profile(&args, &model, &samples)?;
    let text =
        serde_json::to_string_pretty(&profile).map_err(|e| SimError::Calibration(e.to_string()))?;
    std::fs::write(&args.output, text).map_err(|source| SimError::Io {
        path: args.output.clone(),
        source,
    })?;
    let sm = StepModel {
        hardware: profile.clone(),
        model,
        tp: 1,
    };
    println!("measured vs fitted step times:");
    for s in &samples {
        println!(
            "  {:>5} tokens, {:>2} prefilling, batch {:>3}: {:>8.2} ms measured, {:>8.2} ms model",
            s.shape_tokens,
            s.shape.prefill_rows,
            s.batch,
            s.seconds * 1e3,
            sm.step_time(&s.shape) * 1e3
        );
    }
    println!(
        "peak {:.3e} FLOP/s, bandwidth {:.3e} B/s, overhead {:.2} ms, \
         prefill-row exponent {:.2} (cap {}) -> {}",
        profile.peak_flops,
        profile.mem_bandwidth,
        profile.step_overhead_s * 1e3,
        profile.prefill_row_exponent,
        profile.prefill_row_cap,
        args.output.display()
    );
    Ok(())
}

/// The profile written for `samples`.
pub fn calibrate_profile(
    args: &CalibrateArgs,
    model: &ModelProfile,
    samples: &[Sample],
) -> Result<HardwareProfile, SimError> {
    let base = HardwareProfile {
        name: args.name.clone(),
        peak_flops: 1.0,
        mem_bandwidth: 1.0,
        // What the engine was given: weights plus its KV budget.
        memory_bytes: model.weight_bytes() + args.kv_cache_bytes as f64,
        flops_efficiency: 1.0,
        bandwidth_efficiency: 1.0,
        step_overhead_s: 0.0,
        allreduce_s: 0.0,
        memory_utilization: 1.0,
        kv_cache_bytes: Some(args.kv_cache_bytes as f64),
        prefill_row_exponent: 0.0,
        prefill_row_cap: 1.0,
        calibrated_on: Some(CalibratedOn {
            model_profile: model.name.clone(),
            served_model: args.model.clone(),
            kv_block_size: args.kv_block_size,
            kv_cache_dtype: args.kv_cache_dtype.clone(),
        }),
    };
    fit(&base, model, samples)
}
