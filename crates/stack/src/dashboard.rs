//! The live dashboard served at `/ui` on the stack's front port.
//!
//! A collector task scrapes every replica's `/metrics` (the vLLM names of PROTOCOLS §2) and
//! the router's own metrics once per interval, turns counters into rates and histogram
//! buckets into percentiles over a sliding window, and keeps the last
//! [`HISTORY`] points of every series. The page (plain HTML/JS/CSS compiled into the binary,
//! no build step) polls `/ui/api/state` and draws the series on canvases.
//!
//! The arithmetic ([`EngineSample::parse`], [`quantile`], [`Collector::tick`]) is pure and
//! unit-tested; only [`Dashboard::spawn`] touches the network.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use serde::Serialize;
use strata_router::datalayer::metrics::parse_sample;

/// Points kept per series (at one per second: five minutes).
pub const HISTORY: usize = 300;
/// Ticks of histogram deltas that make up one percentile window.
pub const WINDOW_TICKS: usize = 10;

const INDEX_HTML: &str = include_str!("ui/index.html");
const APP_JS: &str = include_str!("ui/app.js");
const STYLE_CSS: &str = include_str!("ui/style.css");

/// One replica as the stack sees it (state from the supervisor, load from the router).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ReplicaView {
    pub name: String,
    pub url: String,
    /// `starting`, `ready`, `restarting`, `failed`, `draining`, ...
    pub state: String,
    /// Admitted by the router.
    pub ready: bool,
    pub model: String,
    pub adapters: Vec<String>,
}

/// Where the dashboard learns which replicas exist and what the router did.
pub trait StackView: Send + Sync + 'static {
    fn replicas(&self) -> Vec<ReplicaView>;
    /// The router's Prometheus text, for picks per replica.
    fn router_metrics(&self) -> Option<String>;
    /// The controller's view: `{desired, ready, reason, signal, rollout}`.
    fn controller(&self) -> Option<serde_json::Value> {
        None
    }
}

/// The counters and histograms one `/metrics` scrape of an engine yields.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSample {
    pub generation_tokens: f64,
    pub requests: f64,
    pub prefix_queries: f64,
    pub prefix_hits: f64,
    pub waiting: f64,
    pub running: f64,
    pub kv_usage: f64,
    /// Cumulative bucket counts by upper bound, summed over label sets.
    pub ttft: Vec<(f64, f64)>,
    pub itl: Vec<(f64, f64)>,
}

fn add_bucket(buckets: &mut Vec<(f64, f64)>, le: f64, count: f64) {
    match buckets.iter_mut().find(|(b, _)| *b == le) {
        Some((_, c)) => *c += count,
        None => buckets.push((le, count)),
    }
}

impl EngineSample {
    /// Reads the vLLM metric names from a Prometheus text body; unknown lines are ignored.
    pub fn parse(text: &str) -> EngineSample {
        let mut s = EngineSample::default();
        for line in text.lines() {
            let Some(m) = parse_sample(line) else {
                continue;
            };
            if m.value.is_nan() {
                continue;
            }
            let le = || {
                m.labels
                    .iter()
                    .find(|(k, _)| *k == "le")
                    .and_then(|(_, v)| match v.as_str() {
                        "+Inf" => Some(f64::INFINITY),
                        v => v.parse::<f64>().ok(),
                    })
            };
            match m.name {
                "vllm:generation_tokens_total" => s.generation_tokens += m.value,
                "vllm:request_success_total" => s.requests += m.value,
                "vllm:prefix_cache_queries_total" => s.prefix_queries += m.value,
                "vllm:prefix_cache_hits_total" => s.prefix_hits += m.value,
                "vllm:num_requests_waiting" => s.waiting += m.value,
                "vllm:num_requests_running" => s.running += m.value,
                "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                    s.kv_usage = s.kv_usage.max(m.value)
                }
                "vllm:time_to_first_token_seconds_bucket" => {
                    if let Some(le) = le() {
                        add_bucket(&mut s.ttft, le, m.value);
                    }
                }
                "vllm:inter_token_latency_seconds_bucket" => {
                    if let Some(le) = le() {
                        add_bucket(&mut s.itl, le, m.value);
                    }
                }
                _ => {}
            }
        }
        s.ttft.sort_by(|a, b| a.0.total_cmp(&b.0));
        s.itl.sort_by(|a, b| a.0.total_cmp(&b.0));
        s
    }
}

/// `now - before` for a counter, treating a decrease as a restart (the new value is all
/// new).
fn delta(now: f64, before: f64) -> f64 {
    if now >= before {
        now - before
    } else {
        now
    }
}

fn bucket_delta(now: &[(f64, f64)], before: &[(f64, f64)]) -> Vec<(f64, f64)> {
    let reset = now.iter().any(|(le, c)| {
        before
            .iter()
            .find(|(b, _)| b == le)
            .is_some_and(|(_, p)| p > c)
    });
    now.iter()
        .map(|&(le, c)| {
            let prev = if reset {
                0.0
            } else {
                before
                    .iter()
                    .find(|(b, _)| *b == le)
                    .map_or(0.0, |(_, p)| *p)
            };
            (le, c - prev)
        })
        .collect()
}

/// The `q`-quantile of a cumulative histogram, interpolating linearly inside the bucket
/// (Prometheus' `histogram_quantile`). `None` without observations; a quantile in the
/// `+Inf` bucket is the largest finite bound.
pub fn quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q.clamp(0.0, 1.0) * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(le, cum) in buckets {
        if cum >= rank && cum > below {
            if le.is_infinite() {
                return Some(lower);
            }
            return Some(lower + (le - lower) * (rank - below) / (cum - below));
        }
        lower = if le.is_finite() { le } else { lower };
        below = cum;
    }
    Some(lower)
}

fn sum_buckets(into: &mut Vec<(f64, f64)>, add: &[(f64, f64)]) {
    for &(le, c) in add {
        add_bucket(into, le, c);
    }
    into.sort_by(|a, b| a.0.total_cmp(&b.0));
}

/// Cumulative histogram buckets: (upper bound, count).
type Buckets = Vec<(f64, f64)>;

/// Per-replica series.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaSeries {
    pub queue: VecDeque<Option<f64>>,
    pub kv: VecDeque<Option<f64>>,
    pub picks_per_s: VecDeque<Option<f64>>,
}

/// Every series the page draws, oldest point first; `None` where there was no data.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Series {
    /// Seconds since the collector started.
    pub t: VecDeque<f64>,
    pub ttft_p50: VecDeque<Option<f64>>,
    pub ttft_p90: VecDeque<Option<f64>>,
    pub ttft_p99: VecDeque<Option<f64>>,
    pub itl_p50: VecDeque<Option<f64>>,
    pub itl_p90: VecDeque<Option<f64>>,
    pub itl_p99: VecDeque<Option<f64>>,
    pub output_tokens_per_s: VecDeque<Option<f64>>,
    pub requests_per_s: VecDeque<Option<f64>>,
    pub prefix_hit_rate: VecDeque<Option<f64>>,
    pub replicas: BTreeMap<String, ReplicaSeries>,
}

fn push<T>(q: &mut VecDeque<T>, v: T) {
    if q.len() == HISTORY {
        q.pop_front();
    }
    q.push_back(v);
}

/// What one tick observed: each replica's scrape (`None` when it failed) and the router's
/// picks counter per endpoint URL.
#[derive(Debug, Clone, Default)]
pub struct Observation {
    pub t: f64,
    pub engines: Vec<(String, Option<EngineSample>)>,
    pub picks: HashMap<String, f64>,
}

/// Turns successive observations into series. Pure: the caller supplies time and data.
#[derive(Debug, Default)]
pub struct Collector {
    last: HashMap<String, EngineSample>,
    last_picks: HashMap<String, f64>,
    last_t: Option<f64>,
    /// Per tick: (TTFT, ITL) bucket deltas.
    window: VecDeque<(Buckets, Buckets)>,
    pub series: Series,
    pub latest: HashMap<String, EngineSample>,
}

impl Collector {
    pub fn tick(&mut self, obs: Observation) {
        let dt = self.last_t.map(|t| obs.t - t).filter(|d| *d > 0.0);
        self.last_t = Some(obs.t);
        let (mut tokens, mut requests, mut queries, mut hits) = (0.0, 0.0, 0.0, 0.0);
        let (mut ttft, mut itl) = (Vec::new(), Vec::new());
        let mut seen = Vec::new();
        for (url, sample) in &obs.engines {
            seen.push(url.clone());
            let series = self.series.replicas.entry(url.clone()).or_default();
            let Some(now) = sample else {
                push(&mut series.queue, None);
                push(&mut series.kv, None);
                continue;
            };
            push(&mut series.queue, Some(now.waiting));
            push(&mut series.kv, Some(now.kv_usage));
            if let Some(before) = self.last.get(url) {
                tokens += delta(now.generation_tokens, before.generation_tokens);
                requests += delta(now.requests, before.requests);
                queries += delta(now.prefix_queries, before.prefix_queries);
                hits += delta(now.prefix_hits, before.prefix_hits);
                sum_buckets(&mut ttft, &bucket_delta(&now.ttft, &before.ttft));
                sum_buckets(&mut itl, &bucket_delta(&now.itl, &before.itl));
            }
            self.last.insert(url.clone(), now.clone());
            self.latest.insert(url.clone(), now.clone());
        }
        self.last.retain(|u, _| seen.contains(u));
        self.latest.retain(|u, _| seen.contains(u));
        self.series.replicas.retain(|u, _| seen.contains(u));

        for (url, series) in self.series.replicas.iter_mut() {
            let key = endpoint_key(url);
            let now = obs.picks.get(key).copied();
            let rate = match (now, self.last_picks.get(key), dt) {
                (Some(n), Some(&b), Some(dt)) => Some(delta(n, b) / dt),
                _ => None,
            };
            push(&mut series.picks_per_s, rate);
        }
        self.last_picks = obs.picks;

        if self.window.len() == WINDOW_TICKS {
            self.window.pop_front();
        }
        self.window.push_back((ttft, itl));
        let (mut wt, mut wi) = (Vec::new(), Vec::new());
        for (t, i) in &self.window {
            sum_buckets(&mut wt, t);
            sum_buckets(&mut wi, i);
        }
        let s = &mut self.series;
        push(&mut s.t, obs.t);
        push(&mut s.ttft_p50, quantile(&wt, 0.5));
        push(&mut s.ttft_p90, quantile(&wt, 0.9));
        push(&mut s.ttft_p99, quantile(&wt, 0.99));
        push(&mut s.itl_p50, quantile(&wi, 0.5));
        push(&mut s.itl_p90, quantile(&wi, 0.9));
        push(&mut s.itl_p99, quantile(&wi, 0.99));
        push(&mut s.output_tokens_per_s, dt.map(|dt| tokens / dt));
        push(&mut s.requests_per_s, dt.map(|dt| requests / dt));
        push(
            &mut s.prefix_hit_rate,
            (queries > 0.0).then(|| hits / queries),
        );
    }
}

/// How an endpoint is keyed across sources: `host:port`, without scheme or trailing slash
/// (the router labels endpoints that way; replicas are known by URL).
pub fn endpoint_key(url: &str) -> &str {
    let s = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .unwrap_or(url);
    s.trim_end_matches('/')
}

/// The router's picks counter per endpoint ([`endpoint_key`]).
pub fn parse_picks(text: &str) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for line in text.lines() {
        let Some(m) = parse_sample(line) else {
            continue;
        };
        if !m.name.ends_with("picks_total") {
            continue;
        }
        if let Some((_, url)) = m.labels.iter().find(|(k, _)| *k == "endpoint") {
            *out.entry(endpoint_key(url).to_string()).or_insert(0.0) += m.value;
        }
    }
    out
}

#[derive(Serialize)]
struct ReplicaRow<'a> {
    #[serde(flatten)]
    view: &'a ReplicaView,
    waiting: Option<f64>,
    running: Option<f64>,
    kv_usage: Option<f64>,
}

struct Shared {
    view: Arc<dyn StackView>,
    collector: Mutex<Collector>,
}

/// The dashboard: a collector and the `/ui` routes.
#[derive(Clone)]
pub struct Dashboard {
    shared: Arc<Shared>,
}

impl Dashboard {
    pub fn new(view: Arc<dyn StackView>) -> Dashboard {
        Dashboard {
            shared: Arc::new(Shared {
                view,
                collector: Mutex::new(Collector::default()),
            }),
        }
    }

    /// Starts the collector: one scrape of every replica per `interval`.
    pub fn spawn(&self, interval: Duration) -> tokio::task::JoinHandle<()> {
        let shared = self.shared.clone();
        tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .timeout(interval.max(Duration::from_millis(500)))
                .build()
                .unwrap_or_default();
            let start = tokio::time::Instant::now();
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let replicas = shared.view.replicas();
                let scrapes = replicas.iter().map(|r| {
                    let client = client.clone();
                    let url = r.url.clone();
                    async move {
                        let text = async {
                            client
                                .get(format!("{url}/metrics"))
                                .send()
                                .await?
                                .error_for_status()?
                                .text()
                                .await
                        }
                        .await;
                        (url, text.ok().map(|t| EngineSample::parse(&t)))
                    }
                });
                let engines = futures_join_all(scrapes).await;
                let picks = shared
                    .view
                    .router_metrics()
                    .map(|t| parse_picks(&t))
                    .unwrap_or_default();
                let obs = Observation {
                    t: start.elapsed().as_secs_f64(),
                    engines,
                    picks,
                };
                shared
                    .collector
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .tick(obs);
            }
        })
    }

    /// `GET /ui`, its assets, and `GET /ui/api/state`.
    pub fn routes(&self) -> axum::Router {
        axum::Router::new()
            .route(
                "/ui",
                get(|| async { page("text/html; charset=utf-8", INDEX_HTML) }),
            )
            .route(
                "/ui/",
                get(|| async { page("text/html; charset=utf-8", INDEX_HTML) }),
            )
            .route(
                "/ui/app.js",
                get(|| async { page("text/javascript; charset=utf-8", APP_JS) }),
            )
            .route(
                "/ui/style.css",
                get(|| async { page("text/css; charset=utf-8", STYLE_CSS) }),
            )
            .route("/ui/api/state", get(state))
            .with_state(self.shared.clone())
    }
}

fn page(content_type: &'static str, body: &'static str) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

async fn state(State(shared): State<Arc<Shared>>) -> impl IntoResponse {
    let replicas = shared.view.replicas();
    let c = shared.collector.lock().unwrap_or_else(|e| e.into_inner());
    let rows: Vec<ReplicaRow<'_>> = replicas
        .iter()
        .map(|r| {
            let s = c.latest.get(&r.url);
            ReplicaRow {
                view: r,
                waiting: s.map(|s| s.waiting),
                running: s.map(|s| s.running),
                kv_usage: s.map(|s| s.kv_usage),
            }
        })
        .collect();
    let controller = shared.view.controller();
    axum::Json(serde_json::json!({
        "controller": controller,
        "replicas": rows,
        "series": c.series,
        "window_ticks": WINDOW_TICKS,
    }))
}

/// Awaits every future concurrently, keeping their order.
async fn futures_join_all<F>(futs: impl Iterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        if let Ok(v) = h.await {
            out.push(v);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const METRICS: &str = "\
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name=\"m\",engine=\"0\"} 100
vllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 3
vllm:request_success_total{finished_reason=\"length\",model_name=\"m\"} 2
vllm:prefix_cache_queries_total{model_name=\"m\"} 400
vllm:prefix_cache_hits_total{model_name=\"m\"} 100
vllm:num_requests_waiting{model_name=\"m\"} 4
vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25
vllm:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\"} 1
vllm:time_to_first_token_seconds_bucket{le=\"0.5\",model_name=\"m\"} 3
vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 5
";

    #[test]
    fn parses_the_vllm_names() {
        let s = EngineSample::parse(METRICS);
        assert_eq!(s.generation_tokens, 100.0);
        assert_eq!(s.requests, 5.0);
        assert_eq!(s.prefix_queries, 400.0);
        assert_eq!(s.waiting, 4.0);
        assert_eq!(s.kv_usage, 0.25);
        assert_eq!(s.ttft, vec![(0.1, 1.0), (0.5, 3.0), (f64::INFINITY, 5.0)]);
        assert_eq!(EngineSample::parse("garbage {{{"), EngineSample::default());
    }

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        let b = [(0.1, 1.0), (0.5, 3.0), (f64::INFINITY, 5.0)];
        // rank 2.5 of 5: in (0.1, 0.5], 1.5 of its 2 observations in.
        let p50 = quantile(&b, 0.5).unwrap();
        assert!((p50 - (0.1 + 0.4 * 0.75)).abs() < 1e-12, "{p50}");
        // rank 0.5: half-way into the first bucket from 0.
        assert!((quantile(&b, 0.1).unwrap() - 0.05).abs() < 1e-12);
        // In +Inf: the largest finite bound.
        assert_eq!(quantile(&b, 0.99), Some(0.5));
        assert_eq!(quantile(&[(0.1, 0.0), (f64::INFINITY, 0.0)], 0.5), None);
        assert_eq!(quantile(&[], 0.5), None);
    }

    fn obs(t: f64, samples: Vec<(&str, Option<&str>)>, picks: &[(&str, f64)]) -> Observation {
        Observation {
            t,
            engines: samples
                .into_iter()
                .map(|(u, s)| (u.to_string(), s.map(EngineSample::parse)))
                .collect(),
            picks: picks.iter().map(|(u, v)| (u.to_string(), *v)).collect(),
        }
    }

    #[test]
    fn rates_and_percentiles_come_from_deltas() {
        let mut c = Collector::default();
        let first = "vllm:generation_tokens_total 100\nvllm:request_success_total 5\n\
                     vllm:time_to_first_token_seconds_bucket{le=\"1\"} 5\n\
                     vllm:time_to_first_token_seconds_bucket{le=\"2\"} 5\n\
                     vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} 5\n";
        let second = "vllm:generation_tokens_total 300\nvllm:request_success_total 9\n\
                      vllm:prefix_cache_queries_total 10\nvllm:prefix_cache_hits_total 4\n\
                      vllm:time_to_first_token_seconds_bucket{le=\"1\"} 5\n\
                      vllm:time_to_first_token_seconds_bucket{le=\"2\"} 9\n\
                      vllm:time_to_first_token_seconds_bucket{le=\"+Inf\"} 9\n";
        c.tick(obs(
            0.0,
            vec![("a", Some(first)), ("b", None)],
            &[("a", 10.0)],
        ));
        assert_eq!(c.series.output_tokens_per_s.back(), Some(&None));
        c.tick(obs(
            2.0,
            vec![("a", Some(second)), ("b", None)],
            &[("a", 16.0)],
        ));
        assert_eq!(c.series.output_tokens_per_s.back(), Some(&Some(100.0)));
        assert_eq!(c.series.requests_per_s.back(), Some(&Some(2.0)));
        assert_eq!(c.series.prefix_hit_rate.back(), Some(&Some(0.4)));
        // The four new first tokens all landed in (1, 2]: the median is 1.5.
        assert_eq!(c.series.ttft_p50.back(), Some(&Some(1.5)));
        assert_eq!(c.series.replicas["a"].picks_per_s.back(), Some(&Some(3.0)));
        assert_eq!(c.series.replicas["b"].queue.back(), Some(&None));
        // A restarted engine (counters went down) counts from zero, never negative.
        c.tick(obs(3.0, vec![("a", Some(first))], &[]));
        assert_eq!(c.series.output_tokens_per_s.back(), Some(&Some(100.0)));
        assert!(!c.series.replicas.contains_key("b"));
    }

    #[test]
    fn history_is_bounded() {
        let mut c = Collector::default();
        for i in 0..(HISTORY + 50) {
            c.tick(obs(i as f64, vec![("a", Some(METRICS))], &[]));
        }
        assert_eq!(c.series.t.len(), HISTORY);
        assert_eq!(c.series.replicas["a"].kv.len(), HISTORY);
    }

    #[test]
    fn picks_are_read_per_endpoint() {
        let text = "strata_router_picks_total{endpoint=\"http://a\"} 3\n\
                    strata_router_picks_total{endpoint=\"http://b\"} 5\n\
                    strata_router_requests_total 8\n";
        let p = parse_picks(text);
        assert_eq!(p["a"], 3.0);
        assert_eq!(p["b"], 5.0);
        assert_eq!(endpoint_key("http://127.0.0.1:80/"), "127.0.0.1:80");
        assert_eq!(p.len(), 2);
    }
}
