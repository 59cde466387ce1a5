//! The engine's Prometheus metrics, under vLLM's names, buckets and labels (the "model
//! server protocol" that the Gateway API Inference Extension and llm-d read, and what vLLM's
//! own Grafana dashboards query). The names and buckets are `strata_api::model_server::vllm`,
//! defined once for every crate; this file registers them and records what the engine
//! thread and the HTTP server observe. Each metric is declared once, in the
//! `metrics_struct!` list: its field, how it is built, its name and help; the struct, its
//! construction and its registration all come from that list.
//!
//! Three groups, each as vLLM exports it:
//! - `vllm:*`, labelled `model_name` and `engine`: queue, KV, prefix cache, tokens,
//!   latencies, per-request sizes and parameters, tokens per step;
//! - `http_requests_total{handler,method,status}` and `http_request_duration_seconds`
//!   (`status` grouped as `2xx`, `4xx`, ... like vLLM's instrumentator);
//! - `process_*` (CPU seconds, resident memory, open and maximum fds, start time), read
//!   from `/proc` when the page is rendered.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use strata_api::model_server::{strata, token_buckets, vllm};

use crate::kv::cache::KvDtype;

/// The labels of every series (prometheus-client's generic label set).
type Labels = Vec<(String, String)>;

pub const TTFT_BUCKETS: &[f64] = vllm::TTFT_BUCKETS;
pub const ITL_BUCKETS: &[f64] = vllm::ITL_BUCKETS;
pub const REQUEST_BUCKETS: &[f64] = vllm::REQUEST_BUCKETS;
/// `http_request_duration_seconds` (vLLM's instrumentator default; `+Inf` is implied).
pub const HTTP_DURATION_BUCKETS: &[f64] = &[0.1, 0.5, 1.0];

/// Tokens-per-step buckets: 1, 8, then 16 doubling up to the step's token budget (what vLLM
/// uses for `iteration_tokens_total`).
pub fn iteration_buckets(token_budget: usize) -> Vec<f64> {
    let mut out = vec![1.0, 8.0];
    let mut b = 16usize;
    while b <= token_budget.max(16) {
        out.push(b as f64);
        b = b.saturating_mul(2);
    }
    out
}

/// The limits that size the token-count buckets.
#[derive(Debug, Clone, Copy)]
pub struct MetricLimits {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Prompt + output cap: token-count histograms go up to it (1, 2, 5, 10, ...).
    pub max_model_len: usize,
    /// Tokens per step: the tokens-per-step histogram goes up to it.
    pub max_num_batched_tokens: usize,
    /// The KV cache's entry type (`cache_config_info{cache_dtype}`).
    pub cache_dtype: KvDtype,
}

impl MetricLimits {
    /// The buckets of the per-request token-count histograms.
    fn token_buckets(&self) -> Vec<f64> {
        token_buckets(self.max_model_len as u64)
    }

    /// `cache_config_info`'s one series: the cache's layout as labels, at 1.
    fn cache_config_info(&self) -> Family<Labels, Gauge> {
        let info: Family<Labels, Gauge> = Family::default();
        info.get_or_create(&vec![
            ("block_size".into(), self.block_size.to_string()),
            ("cache_dtype".into(), self.cache_dtype.vllm_name().into()),
            ("num_gpu_blocks".into(), self.num_blocks.to_string()),
            ("enable_prefix_caching".into(), "True".into()),
            ("prefix_caching_hash_algo".into(), "sha256_cbor".into()),
        ])
        .set(1);
        info
    }
}

/// Where a request's prompt KV came from (`strata:kv_transfer_requests_total{path}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransferPath {
    /// Computed here (or found in this engine's own prefix cache).
    Local,
    /// Pulled from a prefill engine.
    RemotePrefill,
    /// Fetched from the shared KV tier.
    Tier,
    /// A pull failed or timed out and the prompt was recomputed here.
    Fallback,
}

impl TransferPath {
    pub const ALL: [TransferPath; 4] = [
        TransferPath::Local,
        TransferPath::RemotePrefill,
        TransferPath::Tier,
        TransferPath::Fallback,
    ];

    /// The `path` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Local => "local",
            Self::RemotePrefill => "remote_prefill",
            Self::Tier => "tier",
            Self::Fallback => "fallback",
        }
    }
}

/// What one finished sequence reports.
#[derive(Debug, Clone, Copy)]
pub struct FinishedRequest {
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
    /// First scheduled to finish (`None` when it never ran).
    pub inference_time: Option<Duration>,
}

/// Which registry a metric is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scope {
    /// Labelled `model_name` and `engine`, as vLLM's `vllm:*` series are.
    Model,
    /// Unlabelled: the `http_*`, `process_*` and LoRA series, as vLLM's.
    Unlabelled,
}

/// Declares the metrics struct from one list: each entry is a field (doc, visibility, name,
/// type), how it is built, and, for one on the page, its scope, name and help (an entry
/// with a scope and no name is a group that registers itself). The struct, `build` and
/// `register` all come from the list, and the page follows its order within each scope.
/// `build` binds each field in turn, so an entry may read the ones above it, and names its
/// argument after the identifier in parentheses.
macro_rules! metrics_struct {
    (
        $(#[$struct_doc:meta])*
        $struct_vis:vis struct $name:ident($limits:ident) {
            $(
                $(#[$doc:meta])*
                $vis:vis $field:ident: $ty:ty = $init:expr
                $(=> $scope:ident $(: $metric:expr, $help:expr)?)?;
            )*
        }
    ) => {
        $(#[$struct_doc])*
        $struct_vis struct $name {
            registry: Registry,
            $($(#[$doc])* $vis $field: $ty,)*
        }

        impl $name {
            /// Every metric, built in the declared order, and an empty registry.
            fn build($limits: MetricLimits) -> Self {
                $(let $field: $ty = $init;)*
                Self {
                    registry: Registry::default(),
                    $($field,)*
                }
            }

            /// Registers the metrics of `scope` on `r`, in the declared order.
            fn register(&self, scope: Scope, r: &mut Registry) {
                $($(
                    if scope == Scope::$scope {
                        metrics_struct!(@register self, r, $field $(, $metric, $help)?);
                    }
                )?)*
            }
        }
    };
    (@register $self:ident, $r:ident, $field:ident, $metric:expr, $help:expr) => {
        $r.register($metric, $help, $self.$field.clone())
    };
    (@register $self:ident, $r:ident, $field:ident) => {
        $self.$field.register($r)
    };
}

metrics_struct! {
    /// Every metric the engine exports.
    pub struct EngineMetrics(limits) {
        // --- `vllm:*`: queue, KV, prefix cache, tokens, latencies ---
        pub num_requests_waiting: Gauge = Gauge::default()
            => Model: vllm::NUM_REQUESTS_WAITING, "Requests queued, not yet scheduled";
        pub num_requests_running: Gauge = Gauge::default()
            => Model: vllm::NUM_REQUESTS_RUNNING, "Requests in the running batch";
        /// `reason`: `capacity` (waiting for a slot or blocks) or `deferred` (held by a
        /// transient constraint; this engine defers nothing, so it stays 0).
        pub num_requests_waiting_by_reason: Family<Labels, Gauge> =
            seeded("reason", &["capacity", "deferred"])
            => Model: vllm::NUM_REQUESTS_WAITING_BY_REASON,
            "Waiting requests by reason (capacity, deferred); they sum to num_requests_waiting";
        pub kv_cache_usage_perc: Gauge<f64, AtomicU64> = Gauge::default()
            => Model: vllm::KV_CACHE_USAGE_PERC, "Fraction of KV-cache blocks in use (0..1)";
        /// `cache_config_info{block_size, cache_dtype, ...}`: set once, at 1.
        cache_config_info: Family<Labels, Gauge> = limits.cache_config_info()
            => Model: vllm::CACHE_CONFIG_INFO, "KV-cache configuration";
        pub prefix_cache_queries: Counter = Counter::default()
            => Model: vllm::PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache";
        pub prefix_cache_hits: Counter = Counter::default()
            => Model: vllm::PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache";
        pub num_preemptions: Counter = Counter::default()
            => Model: vllm::NUM_PREEMPTIONS, "Sequences preempted to free KV blocks";
        pub prompt_tokens: Counter = Counter::default()
            => Model: vllm::PROMPT_TOKENS, "Prompt tokens processed";
        pub prompt_tokens_cached: Counter = Counter::default()
            => Model: vllm::PROMPT_TOKENS_CACHED,
            "Prompt tokens whose KV came from the prefix cache";
        /// `source`: `local_compute`, `local_cache_hit`, `external_kv_transfer`.
        pub prompt_tokens_by_source: Family<Labels, Counter> =
            seeded("source", &["local_compute", "local_cache_hit", "external_kv_transfer"])
            => Model: vllm::PROMPT_TOKENS_BY_SOURCE,
            "Prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer)";
        pub generation_tokens: Counter = Counter::default()
            => Model: vllm::GENERATION_TOKENS, "Tokens generated";
        pub request_success: Family<Labels, Counter> =
            seeded("finished_reason", &["stop", "length", "abort", "error"])
            => Model: vllm::REQUEST_SUCCESS, "Finished requests by finish reason";
        pub iteration_tokens: Histogram =
            histogram(&iteration_buckets(limits.max_num_batched_tokens))
            => Model: vllm::ITERATION_TOKENS, "Tokens (prompt and output) per engine step";
        pub request_prompt_tokens: Histogram = histogram(&limits.token_buckets())
            => Model: vllm::REQUEST_PROMPT_TOKENS, "Prompt tokens per request";
        pub request_generation_tokens: Histogram = histogram(&limits.token_buckets())
            => Model: vllm::REQUEST_GENERATION_TOKENS, "Generated tokens per request";
        pub request_max_num_generation_tokens: Histogram = histogram(&limits.token_buckets())
            => Model: vllm::REQUEST_MAX_NUM_GENERATION_TOKENS,
            "Largest generated-token count over a request's sequences";
        pub request_params_n: Histogram = histogram(vllm::PARAMS_N_BUCKETS)
            => Model: vllm::REQUEST_PARAMS_N, "The n of each request";
        pub request_params_max_tokens: Histogram = histogram(&limits.token_buckets())
            => Model: vllm::REQUEST_PARAMS_MAX_TOKENS, "The max_tokens of each request";
        pub request_prefill_kv_computed_tokens: Histogram = histogram(&limits.token_buckets())
            => Model: vllm::REQUEST_PREFILL_KV_COMPUTED_TOKENS,
            "Prompt tokens computed (not found in the prefix cache) per request";
        pub time_to_first_token: Histogram = histogram(TTFT_BUCKETS)
            => Model: vllm::TIME_TO_FIRST_TOKEN, "Time to first token";
        pub inter_token_latency: Histogram = histogram(ITL_BUCKETS)
            => Model: vllm::INTER_TOKEN_LATENCY, "Time between consecutive output tokens";
        pub time_per_output_token: Histogram = histogram(ITL_BUCKETS)
            => Model: vllm::TIME_PER_OUTPUT_TOKEN,
            "Mean time per output token after the first, per request";
        pub e2e_request_latency: Histogram = histogram(REQUEST_BUCKETS)
            => Model: vllm::E2E_REQUEST_LATENCY, "Arrival to finish";
        pub request_queue_time: Histogram = histogram(REQUEST_BUCKETS)
            => Model: vllm::REQUEST_QUEUE_TIME, "Arrival to first scheduled";
        pub request_inference_time: Histogram = histogram(REQUEST_BUCKETS)
            => Model: vllm::REQUEST_INFERENCE_TIME, "First scheduled to finish";
        pub request_prefill_time: Histogram = histogram(REQUEST_BUCKETS)
            => Model: vllm::REQUEST_PREFILL_TIME, "First scheduled to first token";
        pub request_decode_time: Histogram = histogram(REQUEST_BUCKETS)
            => Model: vllm::REQUEST_DECODE_TIME, "First token to last token";
        // --- speculative decoding (PROTOCOLS §12), defined in spec_decode.rs ---
        pub spec_decode: crate::spec_decode::SpecDecodeMetrics = Default::default() => Model;
        // --- KV transfer and the shared tier (issue 21), `strata:*` names; every label
        // value present from the start ---
        /// `direction`: `sent` (exported to a peer) or `received` (installed from a peer or
        /// the tier); both counted by the engine loop.
        pub kv_transfer_blocks: Family<Labels, Counter> = seeded("direction", &["sent", "received"])
            => Model: strata::KV_TRANSFER_BLOCKS,
            "KV blocks sent to or received from another engine or the KV tier";
        /// One pull (the server observes it, [`EngineMetrics::observe_transfer`]).
        pub kv_transfer_seconds: Histogram = histogram(strata::KV_TRANSFER_BUCKETS)
            => Model: strata::KV_TRANSFER_SECONDS,
            "Seconds one pull of KV blocks from a prefill engine or the KV tier took";
        /// `medium`: `GPU` (cached blocks in the pool) or `CPU` (announced on the tier).
        pub kv_tier_blocks: Family<Labels, Gauge> = Family::default()
            => Model: strata::KV_TIER_BLOCKS,
            "Cached KV blocks by medium (GPU: this engine's cache, CPU: on the KV tier)";
        /// The `GPU` and `CPU` series of `kv_tier_blocks`, set every engine step without a
        /// label lookup.
        tier_gpu: Gauge = series(&kv_tier_blocks, "medium", "GPU");
        tier_cpu: Gauge = series(&kv_tier_blocks, "medium", "CPU");
        /// `path`: see [`TransferPath`].
        pub kv_transfer_requests: Family<Labels, Counter> =
            seeded("path", &TransferPath::ALL.map(TransferPath::as_str))
            => Model: strata::KV_TRANSFER_REQUESTS, "Requests by where their prompt KV came from";
        /// Evicted blocks dropped because the offload queue was full.
        pub kv_offload_dropped: Counter = Counter::default()
            => Model: strata::KV_OFFLOAD_DROPPED,
            "Evicted KV blocks not offered to the tier because its queue was full";
        // --- unlabelled: HTTP, LoRA and process ---
        pub http_requests: Family<Labels, Counter> = Family::default()
            => Unlabelled: "http_requests",
            "Total number of requests by method, status and handler";
        pub http_request_duration: Family<Labels, Histogram> =
            Family::new_with_constructor(|| histogram(HTTP_DURATION_BUCKETS))
            => Unlabelled: "http_request_duration_seconds",
            "Latency by handler and method, to the start of the response";
        /// `vllm:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}`
        /// = the wall time of the last update; one series, the current one (no series at all
        /// while LoRA is off, as vLLM). vLLM's carries no model_name or engine label.
        pub lora_requests_info: Family<Labels, Gauge<f64, AtomicU64>> = Family::default()
            => Unlabelled: vllm::LORA_REQUESTS_INFO, "Running stats on lora requests.";
        lora_last: Mutex<Option<Labels>> = Mutex::new(None);
        process: ProcessMetrics = ProcessMetrics::default() => Unlabelled;
    }
}

fn histogram(buckets: &[f64]) -> Histogram {
    Histogram::new(buckets.iter().copied())
}

/// A family with one series per value of `label`, each at 0 from the start, as vLLM's page
/// has them: panels then read 0, not "no data".
fn seeded<M: Default>(label: &str, values: &[&str]) -> Family<Labels, M> {
    let family = Family::default();
    for value in values {
        // Creating the series is all that is wanted: its guard goes at once.
        drop(family.get_or_create(&vec![(label.to_string(), value.to_string())]));
    }
    family
}

/// The `label`=`value` series of `family` (created at 0), to set without a label lookup.
fn series(family: &Family<Labels, Gauge>, label: &str, value: &str) -> Gauge {
    family
        .get_or_create(&vec![(label.to_string(), value.to_string())])
        .clone()
}

impl EngineMetrics {
    /// Metrics sized for a default engine (context 8192, 2048 tokens per step).
    pub fn new(model_name: &str, block_size: usize, num_blocks: usize) -> Self {
        Self::with_limits(
            model_name,
            MetricLimits {
                block_size,
                num_blocks,
                max_model_len: 8192,
                max_num_batched_tokens: 2048,
                cache_dtype: KvDtype::F16,
            },
        )
    }

    pub fn with_limits(model_name: &str, limits: MetricLimits) -> Self {
        let mut m = Self::build(limits);
        let mut registry = Registry::default();
        let model = registry.sub_registry_with_labels(
            [
                ("model_name".into(), model_name.to_string().into()),
                ("engine".into(), "0".into()),
            ]
            .into_iter(),
        );
        m.register(Scope::Model, model);
        m.register(Scope::Unlabelled, &mut registry);
        m.registry = registry;
        m
    }

    /// The LoRA slots and the adapters of the running and waiting requests (comma-joined,
    /// as vLLM's labels), stamped with the current wall time. The previous series is
    /// removed once the new one is in, so the page holds the current state only.
    pub fn set_lora_info(&self, max_lora: usize, running: &[String], waiting: &[String]) {
        let labels: Labels = vec![
            ("max_lora".into(), max_lora.to_string()),
            ("waiting_lora_adapters".into(), waiting.join(",")),
            ("running_lora_adapters".into(), running.join(",")),
        ];
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        self.lora_requests_info.get_or_create(&labels).set(now);
        let mut last = self.lora_last.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(prev) = last.as_ref().filter(|p| **p != labels) {
            self.lora_requests_info.remove(prev);
        }
        *last = Some(labels);
    }

    /// Counts a finished request under its `finished_reason`.
    pub fn record_finish(&self, reason: &str) {
        self.request_success
            .get_or_create(&vec![("finished_reason".into(), reason.into())])
            .inc();
    }

    /// The queue gauges, with the waiting requests all waiting for capacity.
    pub fn set_queue(&self, waiting: usize, running: usize) {
        let waiting = i64::try_from(waiting).unwrap_or(i64::MAX);
        self.num_requests_waiting.set(waiting);
        self.num_requests_running
            .set(i64::try_from(running).unwrap_or(i64::MAX));
        self.num_requests_waiting_by_reason
            .get_or_create(&vec![("reason".into(), "capacity".into())])
            .set(waiting);
    }

    /// One engine step of `tokens` prompt and output tokens.
    pub fn record_step(&self, tokens: usize) {
        if tokens > 0 {
            self.iteration_tokens.observe(tokens as f64);
        }
    }

    /// A sequence produced its first token: its prompt is counted, by where its KV came from.
    pub fn record_prompt(&self, prompt_tokens: usize, cached_tokens: usize) {
        self.record_prompt_sources(prompt_tokens, cached_tokens, 0);
    }

    /// [`Self::record_prompt`] for a prompt of which `imported_tokens` (a part of
    /// `cached_tokens`) came from another engine or the tier: those count as
    /// `external_kv_transfer`, the other cached ones as `local_cache_hit`, and all of them
    /// as cached (vLLM's `prompt_tokens_cached` includes KV-transferred tokens too).
    pub fn record_prompt_sources(
        &self,
        prompt_tokens: usize,
        cached_tokens: usize,
        imported_tokens: usize,
    ) {
        let cached = cached_tokens.min(prompt_tokens);
        let imported = imported_tokens.min(cached);
        let computed = prompt_tokens - cached;
        self.prompt_tokens.inc_by(prompt_tokens as u64);
        self.prompt_tokens_cached.inc_by(cached as u64);
        for (source, n) in [
            ("local_compute", computed),
            ("local_cache_hit", cached - imported),
            ("external_kv_transfer", imported),
        ] {
            self.prompt_tokens_by_source
                .get_or_create(&vec![("source".into(), source.into())])
                .inc_by(n as u64);
        }
    }

    /// `n` blocks went `direction` (`"sent"` or `"received"`).
    pub fn record_transfer_blocks(&self, direction: &str, n: u64) {
        self.kv_transfer_blocks
            .get_or_create(&vec![("direction".into(), direction.into())])
            .inc_by(n);
    }

    /// One pull of blocks took `elapsed`.
    pub fn observe_transfer(&self, elapsed: Duration) {
        self.kv_transfer_seconds.observe(elapsed.as_secs_f64());
    }

    /// A request's prompt KV came through `path`.
    pub fn record_transfer_request(&self, path: TransferPath) {
        self.kv_transfer_requests
            .get_or_create(&vec![("path".into(), path.as_str().into())])
            .inc();
    }

    /// Cached blocks in the engine's own cache (`GPU`) and announced on the tier (`CPU`).
    pub fn set_tier_blocks(&self, gpu: usize, cpu: usize) {
        self.tier_gpu.set(i64::try_from(gpu).unwrap_or(i64::MAX));
        self.tier_cpu.set(i64::try_from(cpu).unwrap_or(i64::MAX));
    }

    /// The parameters of an accepted request (once per request, whatever its `n`).
    pub fn record_params(&self, n: usize, max_tokens: usize) {
        self.request_params_n.observe(n as f64);
        self.request_params_max_tokens.observe(max_tokens as f64);
    }

    /// A sequence finished. Each of a request's `n` choices runs as its own sequence here,
    /// so the per-request token histograms count choices (the same thing for `n = 1`).
    pub fn record_request(&self, r: FinishedRequest) {
        self.request_prompt_tokens.observe(r.prompt_tokens as f64);
        self.request_generation_tokens
            .observe(r.generation_tokens as f64);
        self.request_max_num_generation_tokens
            .observe(r.generation_tokens as f64);
        self.request_prefill_kv_computed_tokens
            .observe(r.prompt_tokens.saturating_sub(r.cached_tokens) as f64);
        if let Some(t) = r.inference_time {
            self.request_inference_time.observe(t.as_secs_f64());
        }
    }

    /// One HTTP exchange: `handler` is the matched route (`none` for unknown paths).
    pub fn record_http(&self, handler: &str, method: &str, status: u16, elapsed: Duration) {
        let group = format!("{}xx", status / 100);
        self.http_requests
            .get_or_create(&vec![
                ("handler".into(), handler.into()),
                ("method".into(), method.into()),
                ("status".into(), group),
            ])
            .inc();
        self.http_request_duration
            .get_or_create(&vec![
                ("handler".into(), handler.into()),
                ("method".into(), method.into()),
            ])
            .observe(elapsed.as_secs_f64());
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        self.process.refresh();
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// The process metrics every Prometheus client library exports, read from `/proc` (Linux)
/// each time the page is rendered; elsewhere they stay 0.
#[derive(Default)]
struct ProcessMetrics {
    cpu_seconds: Counter<f64, AtomicU64>,
    /// CPU seconds already counted, to add only the difference.
    cpu_counted: Mutex<f64>,
    resident_memory_bytes: Gauge,
    open_fds: Gauge,
    max_fds: Gauge,
    start_time_seconds: Gauge<f64, AtomicU64>,
    started: AtomicU64,
}

impl ProcessMetrics {
    /// Registers the five series (unlabelled, as every client library's).
    fn register(&self, r: &mut Registry) {
        r.register(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            self.cpu_seconds.clone(),
        );
        r.register(
            "process_resident_memory_bytes",
            "Resident memory size in bytes",
            self.resident_memory_bytes.clone(),
        );
        r.register(
            "process_open_fds",
            "Number of open file descriptors",
            self.open_fds.clone(),
        );
        r.register(
            "process_max_fds",
            "Maximum number of open file descriptors",
            self.max_fds.clone(),
        );
        r.register(
            "process_start_time_seconds",
            "Start time of the process since unix epoch in seconds",
            self.start_time_seconds.clone(),
        );
    }

    fn refresh(&self) {
        let Some(p) = proc_self() else { return };
        let mut counted = self.cpu_counted.lock().unwrap_or_else(|e| e.into_inner());
        if p.cpu_seconds > *counted {
            self.cpu_seconds.inc_by(p.cpu_seconds - *counted);
            *counted = p.cpu_seconds;
        }
        drop(counted);
        self.resident_memory_bytes
            .set(i64::try_from(p.resident_bytes).unwrap_or(i64::MAX));
        self.open_fds.set(p.open_fds);
        self.max_fds.set(p.max_fds);
        if self.started.swap(1, Ordering::AcqRel) == 0 {
            self.start_time_seconds.set(p.start_time_secs);
        }
    }
}

/// What `/proc/self` says about this process.
struct ProcSelf {
    cpu_seconds: f64,
    resident_bytes: u64,
    open_fds: i64,
    max_fds: i64,
    start_time_secs: f64,
}

fn proc_self() -> Option<ProcSelf> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    // Field numbers from proc(5), minus the two before `)`: utime 14, stime 15,
    // starttime 22, rss 24.
    let field = |n: usize| f.get(n - 3).and_then(|v| v.parse::<u64>().ok());
    let ticks = clock_ticks();
    let cpu_seconds = (field(14)? + field(15)?) as f64 / ticks;
    let resident_bytes = field(24)?.saturating_mul(page_size());
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))
        .and_then(|v| v.trim().parse::<f64>().ok())?;
    let start_time_secs = boot + field(22)? as f64 / ticks;
    let open_fds = std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count() as i64)
        .unwrap_or(0);
    let max_fds = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|l| {
            l.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3))
                .and_then(|v| v.parse::<i64>().ok())
        })
        .unwrap_or(0);
    Some(ProcSelf {
        cpu_seconds,
        resident_bytes,
        open_fds,
        max_fds,
        start_time_secs,
    })
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let t = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if t > 0 {
        t as f64
    } else {
        100.0
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(p).ok().filter(|p| *p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_api::model_server::{parse_load, EngineKind};
    use strata_api::prometheus::samples;

    /// The limits the page tests size their buckets with.
    fn test_limits() -> MetricLimits {
        MetricLimits {
            block_size: 16,
            num_blocks: 100,
            max_model_len: 8192,
            max_num_batched_tokens: 2048,
            cache_dtype: KvDtype::Int8,
        }
    }

    #[test]
    fn the_page_has_vllms_names_labels_and_buckets() {
        let m = EngineMetrics::with_limits("m", test_limits());
        m.set_queue(3, 2);
        m.record_step(17);
        m.record_prompt(100, 32);
        m.record_params(1, 64);
        m.record_request(FinishedRequest {
            prompt_tokens: 100,
            generation_tokens: 10,
            cached_tokens: 32,
            inference_time: Some(Duration::from_millis(400)),
        });
        m.record_http("/v1/completions", "POST", 200, Duration::from_millis(30));
        let page = m.render();
        let (all, bad) = samples(&page);
        assert_eq!(bad, 0);
        let value = |name: &str, label: Option<(&str, &str)>| {
            all.iter()
                .find(|s| s.name == name && label.is_none_or(|(k, v)| s.label(k) == Some(v)))
                .map(|s| s.value)
        };
        assert_eq!(
            value(
                "vllm:num_requests_waiting_by_reason",
                Some(("reason", "capacity"))
            ),
            Some(3.0)
        );
        assert_eq!(
            value(
                "vllm:num_requests_waiting_by_reason",
                Some(("reason", "deferred"))
            ),
            Some(0.0)
        );
        assert_eq!(value("vllm:prompt_tokens_cached_total", None), Some(32.0));
        assert_eq!(
            value("vllm:cache_config_info", Some(("cache_dtype", "int8"))),
            Some(1.0)
        );
        assert_eq!(
            value(
                "vllm:prompt_tokens_by_source_total",
                Some(("source", "local_compute"))
            ),
            Some(68.0)
        );
        assert_eq!(
            value(
                "vllm:prompt_tokens_by_source_total",
                Some(("source", "local_cache_hit"))
            ),
            Some(32.0)
        );
        assert_eq!(
            value("vllm:request_prefill_kv_computed_tokens_sum", None),
            Some(68.0)
        );
        assert_eq!(
            value("vllm:iteration_tokens_total_bucket", Some(("le", "32.0"))),
            Some(1.0)
        );
        assert_eq!(
            value("vllm:request_prompt_tokens_bucket", Some(("le", "5000.0"))),
            Some(1.0)
        );
        assert_eq!(value("vllm:request_params_n_count", None), Some(1.0));
        assert_eq!(
            value("vllm:request_inference_time_seconds_count", None),
            Some(1.0)
        );
        assert_eq!(
            value("http_requests_total", Some(("status", "2xx"))),
            Some(1.0)
        );
        assert_eq!(
            value("http_request_duration_seconds_bucket", Some(("le", "0.1"))),
            Some(1.0)
        );
        // The vLLM series carry the model; http and process series don't (as vLLM's).
        let labelled = |name: &str| {
            all.iter()
                .filter(|s| s.name == name)
                .all(|s| s.label("model_name") == Some("m"))
        };
        assert!(
            labelled("vllm:num_requests_waiting") && labelled("vllm:iteration_tokens_total_count")
        );
        assert!(all
            .iter()
            .filter(|s| s.name.starts_with("http_"))
            .all(|s| s.label("model_name").is_none()));
        if std::path::Path::new("/proc/self/stat").exists() {
            assert!(value("process_resident_memory_bytes", None).is_some_and(|v| v > 0.0));
            assert!(value("process_open_fds", None).is_some_and(|v| v > 0.0));
            assert!(value("process_max_fds", None).is_some_and(|v| v > 0.0));
            assert!(value("process_start_time_seconds", None).is_some_and(|v| v > 1.6e9));
            assert!(value("process_cpu_seconds_total", None).is_some());
        }
        // The router, controller and dashboard read it like a vLLM page.
        let load = parse_load(EngineKind::Strata, page.as_bytes()).unwrap();
        assert_eq!(
            (load.waiting, load.running, load.block_size),
            (3.0, 2.0, Some(16))
        );
    }

    #[test]
    fn kv_transfer_and_tier_series_start_at_zero_and_count() {
        let m = EngineMetrics::new("m", 16, 100);
        let value = |page: &str, name: &str, label: (&str, &str)| {
            let (all, bad) = samples(page);
            assert_eq!(bad, 0);
            all.iter()
                .find(|s| s.name == name && s.label(label.0) == Some(label.1))
                .map(|s| s.value)
        };
        let page = m.render();
        for d in ["sent", "received"] {
            assert_eq!(
                value(&page, "strata:kv_transfer_blocks_total", ("direction", d)),
                Some(0.0)
            );
        }
        for p in TransferPath::ALL {
            assert_eq!(
                value(
                    &page,
                    "strata:kv_transfer_requests_total",
                    ("path", p.as_str())
                ),
                Some(0.0)
            );
        }
        assert_eq!(
            value(&page, "strata:kv_tier_blocks", ("medium", "CPU")),
            Some(0.0)
        );
        m.record_transfer_blocks("sent", 3);
        m.record_transfer_blocks("received", 5);
        m.record_transfer_request(TransferPath::Tier);
        m.record_transfer_request(TransferPath::Tier);
        m.record_transfer_request(TransferPath::Fallback);
        m.observe_transfer(Duration::from_millis(3));
        m.set_tier_blocks(7, 11);
        m.kv_offload_dropped.inc_by(2);
        // 100 prompt tokens: 40 computed, 60 cached of which 20 were imported.
        m.record_prompt_sources(100, 60, 20);
        let page = m.render();
        let v = |name: &str, label: (&str, &str)| value(&page, name, label);
        assert_eq!(
            v("strata:kv_transfer_blocks_total", ("direction", "sent")),
            Some(3.0)
        );
        assert_eq!(
            v("strata:kv_transfer_blocks_total", ("direction", "received")),
            Some(5.0)
        );
        assert_eq!(
            v("strata:kv_transfer_requests_total", ("path", "tier")),
            Some(2.0)
        );
        assert_eq!(
            v("strata:kv_transfer_requests_total", ("path", "fallback")),
            Some(1.0)
        );
        assert_eq!(
            v("strata:kv_transfer_requests_total", ("path", "local")),
            Some(0.0)
        );
        assert_eq!(
            v("strata:kv_transfer_seconds_bucket", ("le", "0.005")),
            Some(1.0)
        );
        assert_eq!(
            v("strata:kv_transfer_seconds_bucket", ("le", "0.0025")),
            Some(0.0)
        );
        assert_eq!(v("strata:kv_tier_blocks", ("medium", "GPU")), Some(7.0));
        assert_eq!(v("strata:kv_tier_blocks", ("medium", "CPU")), Some(11.0));
        assert_eq!(
            v(
                "strata:kv_offload_dropped_blocks_total",
                ("model_name", "m")
            ),
            Some(2.0)
        );
        let by = |s: &str| v("vllm:prompt_tokens_by_source_total", ("source", s));
        assert_eq!(by("local_compute"), Some(40.0));
        assert_eq!(by("local_cache_hit"), Some(40.0));
        assert_eq!(by("external_kv_transfer"), Some(20.0));
        assert_eq!(
            v("vllm:prompt_tokens_cached_total", ("model_name", "m")),
            Some(60.0)
        );
    }

    /// The whole page of a fresh registry after one HTTP exchange, against a golden file:
    /// every name, HELP and TYPE line, the metrics' order, the label sets and the buckets.
    /// The process series are left at 0 (the registry is encoded without reading `/proc`).
    /// To refresh the golden after a deliberate change, run with `STRATA_BLESS=1`.
    #[test]
    fn the_page_matches_the_golden_exposition() {
        let m = EngineMetrics::with_limits("m", test_limits());
        m.record_http("/v1/completions", "POST", 200, Duration::from_millis(30));
        let mut page = String::new();
        encode(&mut page, &m.registry).unwrap();
        let golden = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/engine_metrics.txt"
        );
        if std::env::var_os("STRATA_BLESS").is_some() {
            std::fs::write(golden, canonical(&page)).unwrap();
        }
        let want = std::fs::read_to_string(golden).unwrap();
        assert_eq!(canonical(&page), want);
    }

    /// `page` with each metric's series sorted by their labels (a family keeps its series
    /// in a hash map, so their order changes from run to run). The sort is stable and keyed
    /// on the labels without `le`, so a histogram's lines stay in the order written.
    fn canonical(page: &str) -> String {
        fn series_key(line: &str) -> String {
            let labels = line
                .split_once('{')
                .and_then(|(_, rest)| rest.split_once('}'))
                .map_or("", |(labels, _)| labels);
            labels
                .split(',')
                .filter(|pair| !pair.starts_with("le="))
                .collect::<Vec<_>>()
                .join(",")
        }
        fn flush(series: &mut Vec<&str>, out: &mut String) {
            series.sort_by_key(|line| series_key(line));
            for line in series.drain(..) {
                out.push_str(line);
                out.push('\n');
            }
        }
        let mut out = String::new();
        let mut series: Vec<&str> = Vec::new();
        for line in page.lines() {
            if line.starts_with('#') {
                flush(&mut series, &mut out);
                out.push_str(line);
                out.push('\n');
            } else {
                series.push(line);
            }
        }
        flush(&mut series, &mut out);
        out
    }

    #[test]
    fn iteration_buckets_double_up_to_the_budget() {
        assert_eq!(iteration_buckets(64), vec![1.0, 8.0, 16.0, 32.0, 64.0]);
        assert_eq!(iteration_buckets(1), vec![1.0, 8.0, 16.0]);
    }
}
