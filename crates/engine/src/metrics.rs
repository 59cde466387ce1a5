//! The engine's Prometheus metrics, under vLLM's names (the "model server protocol" that
//! the Gateway API Inference Extension and llm-d read), with labels `model_name` and
//! `engine`. Names and buckets are defined once, here.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

type Labels = Vec<(String, String)>;

pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
pub const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
pub const REQUEST_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Every metric the engine exports.
pub struct EngineMetrics {
    registry: Registry,
    pub num_requests_waiting: Gauge,
    pub num_requests_running: Gauge,
    pub kv_cache_usage_perc: Gauge<f64, AtomicU64>,
    pub prefix_cache_queries: Counter,
    pub prefix_cache_hits: Counter,
    pub num_preemptions: Counter,
    pub prompt_tokens: Counter,
    pub generation_tokens: Counter,
    pub request_success: Family<Labels, Counter>,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub time_per_output_token: Histogram,
    pub e2e_request_latency: Histogram,
    pub request_queue_time: Histogram,
    pub request_prefill_time: Histogram,
    pub request_decode_time: Histogram,
}

impl EngineMetrics {
    pub fn new(model_name: &str, block_size: usize, num_blocks: usize) -> Self {
        let mut registry = Registry::with_labels(
            [
                ("model_name".into(), model_name.to_string().into()),
                ("engine".into(), "0".into()),
            ]
            .into_iter(),
        );
        let m = Self {
            num_requests_waiting: Gauge::default(),
            num_requests_running: Gauge::default(),
            kv_cache_usage_perc: Gauge::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            num_preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            request_success: Family::default(),
            time_to_first_token: Histogram::new(TTFT_BUCKETS.iter().copied()),
            inter_token_latency: Histogram::new(ITL_BUCKETS.iter().copied()),
            time_per_output_token: Histogram::new(ITL_BUCKETS.iter().copied()),
            e2e_request_latency: Histogram::new(REQUEST_BUCKETS.iter().copied()),
            request_queue_time: Histogram::new(REQUEST_BUCKETS.iter().copied()),
            request_prefill_time: Histogram::new(REQUEST_BUCKETS.iter().copied()),
            request_decode_time: Histogram::new(REQUEST_BUCKETS.iter().copied()),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "vllm:num_requests_waiting",
            "Requests queued, not yet scheduled",
            m.num_requests_waiting.clone(),
        );
        r.register(
            "vllm:num_requests_running",
            "Requests in the running batch",
            m.num_requests_running.clone(),
        );
        r.register(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0..1)",
            m.kv_cache_usage_perc.clone(),
        );
        let info: Family<Labels, Gauge> = Family::default();
        info.get_or_create(&vec![
            ("block_size".into(), block_size.to_string()),
            ("num_gpu_blocks".into(), num_blocks.to_string()),
        ])
        .set(1);
        r.register("vllm:cache_config_info", "KV-cache configuration", info);
        r.register(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_cache_queries.clone(),
        );
        r.register(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            m.prefix_cache_hits.clone(),
        );
        r.register(
            "vllm:num_preemptions",
            "Sequences preempted to free KV blocks",
            m.num_preemptions.clone(),
        );
        r.register(
            "vllm:prompt_tokens",
            "Prompt tokens processed",
            m.prompt_tokens.clone(),
        );
        r.register(
            "vllm:generation_tokens",
            "Tokens generated",
            m.generation_tokens.clone(),
        );
        r.register(
            "vllm:request_success",
            "Finished requests by finish reason",
            m.request_success.clone(),
        );
        r.register(
            "vllm:time_to_first_token_seconds",
            "Time to first token",
            m.time_to_first_token.clone(),
        );
        r.register(
            "vllm:inter_token_latency_seconds",
            "Time between consecutive output tokens",
            m.inter_token_latency.clone(),
        );
        r.register(
            "vllm:request_time_per_output_token_seconds",
            "Mean time per output token after the first, per request",
            m.time_per_output_token.clone(),
        );
        r.register(
            "vllm:e2e_request_latency_seconds",
            "Arrival to finish",
            m.e2e_request_latency.clone(),
        );
        r.register(
            "vllm:request_queue_time_seconds",
            "Arrival to first scheduled",
            m.request_queue_time.clone(),
        );
        r.register(
            "vllm:request_prefill_time_seconds",
            "First scheduled to first token",
            m.request_prefill_time.clone(),
        );
        r.register(
            "vllm:request_decode_time_seconds",
            "First token to last token",
            m.request_decode_time.clone(),
        );
        Self { registry, ..m }
    }

    /// Counts a finished request under its `finished_reason`.
    pub fn record_finish(&self, reason: &str) {
        self.request_success
            .get_or_create(&vec![("finished_reason".into(), reason.into())])
            .inc();
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}
