//! The "model server protocol": which metrics each kind of engine serves at `GET /metrics`,
//! and the one load sample every reader in Strata makes of them (the router's scraper, the
//! controller's autoscaling signals, the dashboard, and the mock engine that imitates each
//! kind).
//!
//! Upstream: the Gateway API Inference Extension's model server protocol
//! (`docs/proposals/003-model-server-protocol` in kubernetes-sigs/gateway-api-inference-extension)
//! names the signals; the per-kind names are what vLLM, SGLang, TensorRT-LLM's
//! `trtllm-serve` and llama.cpp's server export (see `docs/PROTOCOLS.md` §2). The vLLM names
//! and buckets are also what a Strata engine exports, so they are defined here once
//! ([`vllm`]).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::prometheus::{self, Buckets};

/// vLLM's metric names and histogram buckets (vLLM 0.32; `tests/fixtures/vllm-0.32/metrics.txt`
/// is a real page). Counters are named without the `_total` suffix the text format adds.
pub mod vllm {
    pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
    pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
    pub const NUM_REQUESTS_WAITING_BY_REASON: &str = "vllm:num_requests_waiting_by_reason";
    pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
    /// Older releases' name for [`KV_CACHE_USAGE_PERC`].
    pub const GPU_CACHE_USAGE_PERC: &str = "vllm:gpu_cache_usage_perc";
    pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
    pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
    pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries";
    pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits";
    pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions";
    pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens";
    pub const PROMPT_TOKENS_CACHED: &str = "vllm:prompt_tokens_cached";
    pub const PROMPT_TOKENS_BY_SOURCE: &str = "vllm:prompt_tokens_by_source";
    pub const GENERATION_TOKENS: &str = "vllm:generation_tokens";
    pub const REQUEST_SUCCESS: &str = "vllm:request_success";
    pub const ITERATION_TOKENS: &str = "vllm:iteration_tokens_total";
    pub const REQUEST_PROMPT_TOKENS: &str = "vllm:request_prompt_tokens";
    pub const REQUEST_GENERATION_TOKENS: &str = "vllm:request_generation_tokens";
    pub const REQUEST_MAX_NUM_GENERATION_TOKENS: &str = "vllm:request_max_num_generation_tokens";
    pub const REQUEST_PARAMS_N: &str = "vllm:request_params_n";
    pub const REQUEST_PARAMS_MAX_TOKENS: &str = "vllm:request_params_max_tokens";
    pub const REQUEST_PREFILL_KV_COMPUTED_TOKENS: &str = "vllm:request_prefill_kv_computed_tokens";
    pub const TIME_TO_FIRST_TOKEN: &str = "vllm:time_to_first_token_seconds";
    pub const INTER_TOKEN_LATENCY: &str = "vllm:inter_token_latency_seconds";
    pub const TIME_PER_OUTPUT_TOKEN: &str = "vllm:request_time_per_output_token_seconds";
    pub const E2E_REQUEST_LATENCY: &str = "vllm:e2e_request_latency_seconds";
    pub const REQUEST_QUEUE_TIME: &str = "vllm:request_queue_time_seconds";
    pub const REQUEST_INFERENCE_TIME: &str = "vllm:request_inference_time_seconds";
    pub const REQUEST_PREFILL_TIME: &str = "vllm:request_prefill_time_seconds";
    pub const REQUEST_DECODE_TIME: &str = "vllm:request_decode_time_seconds";

    /// Time to first token.
    pub const TTFT_BUCKETS: &[f64] = &[
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
    ];
    /// Inter-token latency and time per output token.
    pub const ITL_BUCKETS: &[f64] = &[
        0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
        20.0, 40.0, 80.0,
    ];
    /// Whole-request phases: end to end, queue, inference, prefill, decode.
    pub const REQUEST_BUCKETS: &[f64] = &[
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
        240.0, 480.0, 960.0, 1920.0, 7680.0,
    ];
    /// `n` of a request.
    pub const PARAMS_N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
}

/// Strata's own engine metrics, without a vLLM counterpart: KV blocks moving between
/// engines and the shared KV tier (issue 21). Counters are named without `_total`.
pub mod strata {
    /// Blocks sent to or received from another engine or the tier, `direction="sent"` or
    /// `"received"`.
    pub const KV_TRANSFER_BLOCKS: &str = "strata:kv_transfer_blocks";
    /// Seconds one pull of blocks (from a prefill engine or the tier) took.
    pub const KV_TRANSFER_SECONDS: &str = "strata:kv_transfer_seconds";
    /// Blocks this engine holds cached, `medium="GPU"` (its own KV cache) or `"CPU"` (its
    /// evicted blocks that the tier acknowledged and still holds).
    pub const KV_TIER_BLOCKS: &str = "strata:kv_tier_blocks";
    /// Requests by where their prompt's KV came from, `path="local"`, `"remote_prefill"`,
    /// `"tier"` or `"fallback"` (a pull failed and the prompt was recomputed).
    pub const KV_TRANSFER_REQUESTS: &str = "strata:kv_transfer_requests";
    /// Evicted blocks not offered to the tier because its queue was full.
    pub const KV_OFFLOAD_DROPPED: &str = "strata:kv_offload_dropped_blocks";
    /// Buckets of [`KV_TRANSFER_SECONDS`].
    pub const KV_TRANSFER_BUCKETS: &[f64] = &[
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    ];
}

/// Strata's router and picker metrics that another process reads.
pub mod router {
    /// Requests flow control holds because their pool has no ready endpoint, per `pool`
    /// label: the scale-from-zero signal the controller reads from the picker.
    pub const FLOW_HELD_REQUESTS: &str = "strata_router_flow_held_requests";
}

/// vLLM's token-count histogram buckets for a model of context `max_len`: 1, 2, 5, 10, 20,
/// 50, ... up to the first value at or past `max_len` (vLLM's `build_1_2_5_buckets`, which
/// stops at the last value ≤ `max_len`).
pub fn token_buckets(max_len: u64) -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1u64;
    'outer: loop {
        for m in [1u64, 2, 5] {
            let v = m.saturating_mul(exp);
            if v > max_len {
                break 'outer;
            }
            out.push(v as f64);
        }
        exp = exp.saturating_mul(10);
        if exp > max_len {
            break;
        }
    }
    out
}

/// Which server software a replica runs: decides the metric names read from `/metrics`.
/// A Strata engine exports the vLLM names. On Kubernetes the pod label
/// `inference.networking.k8s.io/engine-type` names it; `vllm` is the default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EngineKind {
    Strata,
    #[default]
    Vllm,
    Sglang,
    Trtllm,
    Llamacpp,
}

/// The pod label that names a pod's engine kind (Gateway API Inference Extension).
pub const ENGINE_TYPE_LABEL: &str = "inference.networking.k8s.io/engine-type";

impl EngineKind {
    pub const ALL: [EngineKind; 5] = [
        EngineKind::Strata,
        EngineKind::Vllm,
        EngineKind::Sglang,
        EngineKind::Trtllm,
        EngineKind::Llamacpp,
    ];

    /// The lowercase name used in flags, files and labels.
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Strata => "strata",
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
            EngineKind::Trtllm => "trtllm",
            EngineKind::Llamacpp => "llamacpp",
        }
    }

    /// The metric names this kind exports.
    pub const fn metric_names(self) -> MetricNames {
        match self {
            EngineKind::Vllm | EngineKind::Strata => MetricNames {
                waiting: vllm::NUM_REQUESTS_WAITING,
                running: vllm::NUM_REQUESTS_RUNNING,
                kv_use: &[vllm::KV_CACHE_USAGE_PERC, vllm::GPU_CACHE_USAGE_PERC],
                block_size: Some(BlockSizeMetric::Label {
                    metric: vllm::CACHE_CONFIG_INFO,
                    label: "block_size",
                }),
                lora_info: Some(vllm::LORA_REQUESTS_INFO),
                ttft: Some(vllm::TIME_TO_FIRST_TOKEN),
                itl: Some(vllm::INTER_TOKEN_LATENCY),
                generation_tokens: Some("vllm:generation_tokens_total"),
                requests_finished: Some("vllm:request_success_total"),
                prefix_queries: Some("vllm:prefix_cache_queries_total"),
                prefix_hits: Some("vllm:prefix_cache_hits_total"),
            },
            EngineKind::Sglang => MetricNames {
                waiting: "sglang:num_queue_reqs",
                running: "sglang:num_running_reqs",
                kv_use: &["sglang:token_usage"],
                block_size: Some(BlockSizeMetric::Label {
                    metric: "sglang:cache_config_info",
                    label: "page_size",
                }),
                lora_info: None,
                ttft: Some("sglang:time_to_first_token_seconds"),
                itl: Some("sglang:inter_token_latency_seconds"),
                generation_tokens: Some("sglang:generation_tokens_total"),
                requests_finished: None,
                prefix_queries: None,
                prefix_hits: None,
            },
            EngineKind::Trtllm => MetricNames {
                waiting: "trtllm_num_requests_waiting",
                running: "trtllm_num_requests_running",
                kv_use: &["trtllm_kv_cache_utilization"],
                block_size: Some(BlockSizeMetric::Value("trtllm_kv_cache_tokens_per_block")),
                lora_info: None,
                ttft: None,
                itl: None,
                generation_tokens: None,
                requests_finished: None,
                prefix_queries: None,
                prefix_hits: None,
            },
            EngineKind::Llamacpp => MetricNames {
                waiting: "llamacpp:requests_deferred",
                running: "llamacpp:requests_processing",
                kv_use: &[],
                block_size: None,
                lora_info: None,
                ttft: None,
                itl: None,
                generation_tokens: Some("llamacpp:tokens_predicted_total"),
                requests_finished: None,
                prefix_queries: None,
                prefix_hits: None,
            },
        }
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An engine kind nobody knows.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine kind `{0}` (expected strata, vllm, sglang, trtllm or llamacpp)")]
pub struct UnknownEngineKind(pub String);

impl FromStr for EngineKind {
    type Err = UnknownEngineKind;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "strata" => Ok(EngineKind::Strata),
            "vllm" => Ok(EngineKind::Vllm),
            "sglang" => Ok(EngineKind::Sglang),
            "trtllm" | "tensorrt-llm" | "trtllm-serve" => Ok(EngineKind::Trtllm),
            "llamacpp" | "llama.cpp" | "llama-cpp" => Ok(EngineKind::Llamacpp),
            other => Err(UnknownEngineKind(other.to_string())),
        }
    }
}

/// Where a kind reports its KV block size (tokens per block).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSizeMetric {
    /// In a label of an info gauge (`vllm:cache_config_info{block_size="16"}`).
    Label {
        metric: &'static str,
        label: &'static str,
    },
    /// As a gauge's value.
    Value(&'static str),
}

/// The metric names of one engine kind. Histograms are named by their base name (the page
/// has `<base>_bucket`, `_sum`, `_count`); counters by their sample name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetricNames {
    pub waiting: &'static str,
    pub running: &'static str,
    /// KV use 0..1, with older aliases after the current name.
    pub kv_use: &'static [&'static str],
    pub block_size: Option<BlockSizeMetric>,
    pub lora_info: Option<&'static str>,
    pub ttft: Option<&'static str>,
    pub itl: Option<&'static str>,
    pub generation_tokens: Option<&'static str>,
    pub requests_finished: Option<&'static str>,
    pub prefix_queries: Option<&'static str>,
    pub prefix_hits: Option<&'static str>,
}

/// What one `/metrics` page says about a replica's load: the one sample type the router, the
/// controller and the dashboard read. Series that appear several times (one per
/// `model_name` or rank) are summed, except KV use, which takes the largest.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LoadSample {
    /// Requests queued, not yet scheduled.
    pub waiting: f64,
    /// Requests in the running batch.
    pub running: f64,
    /// Fraction of KV blocks in use, 0..1 (`None`: the engine does not say).
    pub kv_use: Option<f64>,
    /// Tokens per KV block.
    pub block_size: Option<u32>,
    /// KV blocks in the engine's cache.
    pub num_blocks: Option<u64>,
    /// LoRA slots, and the adapters running and waiting (vLLM's `lora_requests_info`).
    pub max_lora: Option<u32>,
    pub lora_running: Vec<String>,
    pub lora_waiting: Vec<String>,
    /// Counters (cumulative since the engine started; 0 when the kind has none).
    pub generation_tokens: f64,
    pub requests_finished: f64,
    pub prefix_queries: f64,
    pub prefix_hits: f64,
    /// Cumulative TTFT and ITL histograms (empty when the kind has none).
    pub ttft: Buckets,
    pub itl: Buckets,
}

impl LoadSample {
    /// Tokens held in the KV cache, when the page says enough to know.
    pub fn kv_tokens(&self) -> Option<f64> {
        Some(self.kv_use? * self.num_blocks? as f64 * f64::from(self.block_size?))
    }
}

/// Why a `/metrics` body was not a usable load sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    #[error("no `{0}` sample in the metrics body")]
    Missing(&'static str),
    #[error("metrics body is not UTF-8")]
    NotUtf8,
}

fn split_names(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

/// Reads a `/metrics` body for an engine of `kind`. A body in which the kind's queue gauges
/// do not both appear is an error, so an endpoint serving something else (an HTML page, a
/// proxy's own metrics) is never read as idle.
pub fn parse_load(kind: EngineKind, body: &[u8]) -> Result<LoadSample, MetricsError> {
    let text = std::str::from_utf8(body).map_err(|_| MetricsError::NotUtf8)?;
    let n = kind.metric_names();
    let ttft_bucket = n.ttft.map(|b| format!("{b}_bucket"));
    let itl_bucket = n.itl.map(|b| format!("{b}_bucket"));
    let mut m = LoadSample::default();
    let (mut saw_waiting, mut saw_running) = (false, false);
    let mut lora_ts = f64::NEG_INFINITY;
    let is = |name: Option<&str>, s: &str| name == Some(s);
    for line in text.lines() {
        let Some(s) = prometheus::parse_sample(line) else {
            continue;
        };
        if s.value.is_nan() {
            continue;
        }
        if s.name == n.waiting {
            if s.value.is_finite() {
                m.waiting += s.value.max(0.0);
                saw_waiting = true;
            }
        } else if s.name == n.running {
            if s.value.is_finite() {
                m.running += s.value.max(0.0);
                saw_running = true;
            }
        } else if n.kv_use.contains(&s.name) {
            let v = s.value.clamp(0.0, 1.0);
            m.kv_use = Some(m.kv_use.map_or(v, |old: f64| old.max(v)));
        } else if ttft_bucket.as_deref() == Some(s.name) {
            if let Some(le) = s.le() {
                prometheus::add_bucket(&mut m.ttft, le, s.value);
            }
        } else if itl_bucket.as_deref() == Some(s.name) {
            if let Some(le) = s.le() {
                prometheus::add_bucket(&mut m.itl, le, s.value);
            }
        } else if is(n.generation_tokens, s.name) {
            m.generation_tokens += s.value.max(0.0);
        } else if is(n.requests_finished, s.name) {
            m.requests_finished += s.value.max(0.0);
        } else if is(n.prefix_queries, s.name) {
            m.prefix_queries += s.value.max(0.0);
        } else if is(n.prefix_hits, s.name) {
            m.prefix_hits += s.value.max(0.0);
        } else if is(n.lora_info, s.name) {
            // One series per change; the newest (largest timestamp value) is current.
            if s.value >= lora_ts {
                lora_ts = s.value;
                m.max_lora = s.label("max_lora").and_then(|v| v.parse().ok());
                m.lora_running = s
                    .label("running_lora_adapters")
                    .map(split_names)
                    .unwrap_or_default();
                m.lora_waiting = s
                    .label("waiting_lora_adapters")
                    .map(split_names)
                    .unwrap_or_default();
            }
        } else {
            match n.block_size {
                Some(BlockSizeMetric::Label { metric, label }) if metric == s.name => {
                    if let Some(size) = s.label(label).and_then(|v| v.parse::<f64>().ok()) {
                        set_block_size(&mut m, size);
                    }
                    if let Some(blocks) = s.label("num_gpu_blocks").and_then(|v| v.parse().ok()) {
                        m.num_blocks = Some(blocks);
                    }
                }
                Some(BlockSizeMetric::Value(metric)) if metric == s.name => {
                    set_block_size(&mut m, s.value)
                }
                _ => {}
            }
        }
    }
    if !saw_waiting {
        return Err(MetricsError::Missing(n.waiting));
    }
    if !saw_running {
        return Err(MetricsError::Missing(n.running));
    }
    Ok(m)
}

fn set_block_size(m: &mut LoadSample, size: f64) {
    if (1.0..=1e6).contains(&size) {
        m.block_size = Some(size as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_body_maps_every_signal() {
        let body = r#"# HELP vllm:num_requests_waiting x
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="0",model_name="m"} 5
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",num_gpu_blocks="2048",engine="0"} 1.0
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a",waiting_lora_adapters="c"} 1.6e9
vllm:generation_tokens_total{model_name="m"} 42
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="m"} 1
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 2
"#;
        let m = parse_load(EngineKind::Vllm, body.as_bytes()).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_use), (3.0, 5.0, Some(0.25)));
        assert_eq!((m.block_size, m.num_blocks), (Some(16), Some(2048)));
        assert_eq!(m.max_lora, Some(4));
        assert_eq!(m.lora_running, vec!["a", "b"]);
        assert!(m.lora_waiting.is_empty());
        assert_eq!(m.generation_tokens, 42.0);
        assert_eq!(m.ttft, vec![(0.1, 1.0), (f64::INFINITY, 2.0)]);
        assert_eq!(m.kv_tokens(), Some(0.25 * 2048.0 * 16.0));
        // A Strata engine exports the same names.
        assert_eq!(parse_load(EngineKind::Strata, body.as_bytes()).unwrap(), m);
    }

    #[test]
    fn other_kinds_and_old_names() {
        let old = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.5\n";
        let m = parse_load(EngineKind::Vllm, old.as_bytes()).unwrap();
        assert_eq!((m.kv_use, m.block_size), (Some(0.5), None));
        let sg = "sglang:num_queue_reqs{model_name=\"m\"} 2\nsglang:num_running_reqs{model_name=\"m\"} 4\nsglang:token_usage{model_name=\"m\"} 0.9\nsglang:cache_config_info{page_size=\"1\"} 1\n";
        let m = parse_load(EngineKind::Sglang, sg.as_bytes()).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_use, m.block_size),
            (2.0, 4.0, Some(0.9), Some(1))
        );
        let trt = "trtllm_num_requests_waiting 1\ntrtllm_num_requests_running 2\ntrtllm_kv_cache_utilization 0.1\ntrtllm_kv_cache_tokens_per_block 32\n";
        let m = parse_load(EngineKind::Trtllm, trt.as_bytes()).unwrap();
        assert_eq!(
            (m.waiting, m.running, m.kv_use, m.block_size),
            (1.0, 2.0, Some(0.1), Some(32))
        );
        let lc = "llamacpp:requests_processing 1\nllamacpp:requests_deferred 6\n";
        let m = parse_load(EngineKind::Llamacpp, lc.as_bytes()).unwrap();
        assert_eq!((m.waiting, m.running, m.kv_use), (6.0, 1.0, None));
        // A vLLM page read as SGLang has none of its names.
        assert_eq!(
            parse_load(EngineKind::Sglang, old.as_bytes()),
            Err(MetricsError::Missing("sglang:num_queue_reqs"))
        );
    }

    #[test]
    fn garbage_is_an_error_never_a_panic() {
        for body in [
            &b"\xff\xfe"[..],
            b"",
            b"<html>oops</html>",
            b"vllm:num_requests_waiting{a=\"unterminated 3\n",
            b"vllm:num_requests_waiting NaN\nvllm:num_requests_running +Inf\n",
            b"{}}}{{ 1 2 3\n\0\0",
        ] {
            assert!(parse_load(EngineKind::Vllm, body).is_err(), "{body:?}");
        }
        let m = parse_load(
            EngineKind::Vllm,
            b"vllm:num_requests_waiting -4\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 7\n",
        )
        .unwrap();
        assert_eq!((m.waiting, m.kv_use), (0.0, Some(1.0)));
    }

    #[test]
    fn kinds_round_trip_through_their_names() {
        for k in EngineKind::ALL {
            assert_eq!(k.as_str().parse::<EngineKind>(), Ok(k));
            assert_eq!(serde_json::to_string(&k).unwrap(), format!("\"{k}\""));
        }
        assert_eq!("llama.cpp".parse::<EngineKind>(), Ok(EngineKind::Llamacpp));
        assert!("tgi".parse::<EngineKind>().is_err());
    }

    #[test]
    fn token_buckets_follow_one_two_five() {
        assert_eq!(
            token_buckets(8192),
            vec![1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0]
        );
        assert_eq!(token_buckets(1), vec![1.0]);
    }

    /// The real page a vLLM 0.32 CPU server served (recorded in `tests/fixtures/`).
    #[test]
    fn reads_a_real_vllm_page() {
        let page = include_str!("../../../tests/fixtures/vllm-0.32/metrics.txt");
        let m = parse_load(EngineKind::Vllm, page.as_bytes()).unwrap();
        assert_eq!(m.block_size, Some(32), "vLLM CPU ran with --block-size 32");
        assert!(m.num_blocks.is_some_and(|n| n > 0));
        assert!(m.kv_use.is_some());
        assert!(!m.ttft.is_empty() && !m.itl.is_empty());
        assert!(m.generation_tokens > 0.0);
        let (_, bad) = prometheus::samples(page);
        assert_eq!(bad, 0, "every sample line of a real page parses");
    }
}
