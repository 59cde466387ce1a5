//! The live dashboard served at `/ui` on the stack's front port.
//!
//! A collector task reads, once per interval, every replica's last `/metrics` page as the
//! router's scraper parsed it ([`StackView::load`]: one reader of each page inside `strata
//! up`) and the router's own metrics, turns counters into rates and histogram buckets into
//! percentiles over a sliding window, and keeps the last [`HISTORY`] points of every series. The page (plain HTML/JS/CSS compiled into the binary,
//! no build step) polls `/ui/api/state` and draws the series on canvases.
//!
//! The arithmetic ([`Collector::tick`]) is pure and unit-tested; the page parsing and the
//! histogram quantiles are `strata_api`'s.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use serde::Serialize;
use strata_api::model_server::LoadSample;
use strata_api::prometheus::{
    add_histogram, counter_delta, histogram_delta, histogram_quantile, parse_sample, Buckets,
};

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
    /// The served name of the pool it belongs to.
    pub pool: String,
}

/// One pool (one served model) as the controller sees it.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct PoolView {
    /// The served name.
    pub name: String,
    /// What its replicas load.
    pub model: String,
    pub adapters: Vec<String>,
    pub min_replicas: u32,
    pub max_replicas: u32,
    /// The policy's last count and the replicas admitted by the router.
    pub desired: u32,
    pub ready: u32,
    /// Why the policy chose `desired` last.
    pub reason: Option<String>,
}

/// Where the dashboard learns which replicas exist and what the router did.
pub trait StackView: Send + Sync + 'static {
    fn replicas(&self) -> Vec<ReplicaView>;
    /// The router's Prometheus text, for picks per replica.
    fn router_metrics(&self) -> Option<String>;
    /// The replica at `url`'s last `/metrics` page, when it is recent.
    fn load(&self, url: &str) -> Option<Arc<LoadSample>>;
    /// The controller's view: `{desired, ready, reason, signal, rollout}`.
    fn controller(&self) -> Option<serde_json::Value> {
        None
    }
    /// Every pool, in configuration order.
    fn pools(&self) -> Vec<PoolView> {
        Vec::new()
    }
    /// The gateway's Prometheus text, for its cache hit rate per tenant (none without a
    /// gateway).
    fn gateway_metrics(&self) -> Option<String> {
        None
    }
}

/// Per-replica series.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ReplicaSeries {
    pub queue: VecDeque<Option<f64>>,
    pub kv: VecDeque<Option<f64>>,
    pub picks_per_s: VecDeque<Option<f64>>,
    /// Finished requests per second.
    pub requests_per_s: VecDeque<Option<f64>>,
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
    pub engines: Vec<(String, Option<Arc<LoadSample>>)>,
    pub picks: HashMap<String, f64>,
}

/// Turns successive observations into series. Pure: the caller supplies time and data.
#[derive(Debug, Default)]
pub struct Collector {
    last: HashMap<String, Arc<LoadSample>>,
    last_picks: HashMap<String, f64>,
    last_t: Option<f64>,
    /// Per tick: (TTFT, ITL) bucket deltas.
    window: VecDeque<(Buckets, Buckets)>,
    pub series: Series,
    pub latest: HashMap<String, Arc<LoadSample>>,
    /// The gateway's cache hit rate per tenant ([`crate::gateway_cache`]).
    pub cache: crate::gateway_cache::CacheRates,
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
                push(&mut series.requests_per_s, None);
                continue;
            };
            push(&mut series.queue, Some(now.waiting));
            push(&mut series.kv, Some(now.kv_use.unwrap_or(0.0)));
            let zero = LoadSample::default();
            let before: Option<&LoadSample> = match self.last.get(url) {
                Some(b) => Some(b),
                // A replica first read after the collector's first tick started while the
                // dashboard watched (strata up launches every replica it shows), so its
                // counters began at zero: all they hold happened since the last tick. Without
                // this, traffic a fast replica served before its first reading never shows.
                None if dt.is_some() => Some(&zero),
                None => None,
            };
            let done = before.map(|b| counter_delta(now.requests_finished, b.requests_finished));
            push(
                &mut series.requests_per_s,
                done.zip(dt).map(|(n, dt)| n / dt),
            );
            if let Some(before) = before {
                tokens += counter_delta(now.generation_tokens, before.generation_tokens);
                requests += done.unwrap_or(0.0);
                queries += counter_delta(now.prefix_queries, before.prefix_queries);
                hits += counter_delta(now.prefix_hits, before.prefix_hits);
                add_histogram(&mut ttft, &histogram_delta(&now.ttft, &before.ttft));
                add_histogram(&mut itl, &histogram_delta(&now.itl, &before.itl));
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
                (Some(n), Some(&b), Some(dt)) => Some(counter_delta(n, b) / dt),
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
            add_histogram(&mut wt, t);
            add_histogram(&mut wi, i);
        }
        let s = &mut self.series;
        push(&mut s.t, obs.t);
        push(&mut s.ttft_p50, histogram_quantile(&wt, 0.5));
        push(&mut s.ttft_p90, histogram_quantile(&wt, 0.9));
        push(&mut s.ttft_p99, histogram_quantile(&wt, 0.99));
        push(&mut s.itl_p50, histogram_quantile(&wi, 0.5));
        push(&mut s.itl_p90, histogram_quantile(&wi, 0.9));
        push(&mut s.itl_p99, histogram_quantile(&wi, 0.99));
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

    /// The collector, to spawn: one observation of every replica per `interval`, read
    /// from the pages the router's scraper already holds. It never ends by itself; the
    /// caller drops it at shutdown.
    pub fn collect(
        &self,
        interval: Duration,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        let shared = self.shared.clone();
        async move {
            let start = tokio::time::Instant::now();
            let mut ticker = tokio::time::interval(interval);
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticker.tick().await;
                let engines = shared
                    .view
                    .replicas()
                    .into_iter()
                    .map(|r| {
                        let load = shared.view.load(&r.url);
                        (r.url, load)
                    })
                    .collect();
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
                let gateway = shared.view.gateway_metrics();
                let mut c = shared.collector.lock().unwrap_or_else(|e| e.into_inner());
                c.tick(obs);
                let points = c.series.t.len();
                c.cache.tick(gateway.as_deref(), points);
            }
        }
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
                kv_usage: s.and_then(|s| s.kv_use),
            }
        })
        .collect();
    let pools: Vec<serde_json::Value> = shared
        .view
        .pools()
        .into_iter()
        .map(|p| pool_row(&p, &replicas, &c))
        .collect();
    let controller = shared.view.controller();
    axum::Json(serde_json::json!({
        "controller": controller,
        "pools": pools,
        "replicas": rows,
        "series": c.series,
        "cache_hit_rate": c.cache.series,
        "window_ticks": WINDOW_TICKS,
    }))
}

/// A pool's row: its controller view with its replicas' load and request rate summed.
fn pool_row(p: &PoolView, replicas: &[ReplicaView], c: &Collector) -> serde_json::Value {
    let mine: Vec<&ReplicaView> = replicas.iter().filter(|r| r.pool == p.name).collect();
    let sum = |f: &dyn Fn(&LoadSample) -> f64| -> Option<f64> {
        let v: Vec<f64> = mine
            .iter()
            .filter_map(|r| c.latest.get(&r.url).map(|s| f(s)))
            .collect();
        (!v.is_empty()).then(|| v.iter().sum())
    };
    let rates: Vec<f64> = mine
        .iter()
        .filter_map(|r| {
            c.series
                .replicas
                .get(&r.url)
                .and_then(|s| s.requests_per_s.back().copied().flatten())
        })
        .collect();
    let mut row = serde_json::to_value(p).unwrap_or_default();
    if let Some(o) = row.as_object_mut() {
        o.insert("replicas".into(), mine.len().into());
        o.insert("waiting".into(), sum(&|s| s.waiting).into());
        o.insert("running".into(), sum(&|s| s.running).into());
        o.insert(
            "requests_per_s".into(),
            (!rates.is_empty())
                .then(|| rates.iter().sum::<f64>())
                .into(),
        );
    }
    row
}

#[cfg(test)]
mod tests {
    use super::*;
    use strata_api::model_server::EngineKind;

    const METRICS: &str = "\
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name=\"m\",engine=\"0\"} 100
vllm:request_success_total{finished_reason=\"stop\",model_name=\"m\"} 3
vllm:request_success_total{finished_reason=\"length\",model_name=\"m\"} 2
vllm:prefix_cache_queries_total{model_name=\"m\"} 400
vllm:prefix_cache_hits_total{model_name=\"m\"} 100
vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25
vllm:time_to_first_token_seconds_bucket{le=\"0.1\",model_name=\"m\"} 1
vllm:time_to_first_token_seconds_bucket{le=\"0.5\",model_name=\"m\"} 3
vllm:time_to_first_token_seconds_bucket{le=\"+Inf\",model_name=\"m\"} 5
";

    fn load(text: &str) -> Arc<LoadSample> {
        let page = format!("vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n{text}");
        Arc::new(strata_api::model_server::parse_load(EngineKind::Vllm, page.as_bytes()).unwrap())
    }

    fn obs(t: f64, samples: Vec<(&str, Option<&str>)>, picks: &[(&str, f64)]) -> Observation {
        Observation {
            t,
            engines: samples
                .into_iter()
                .map(|(u, s)| (u.to_string(), s.map(load)))
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
    fn a_replica_first_read_after_the_first_tick_counts_from_zero() {
        let mut c = Collector::default();
        let page = "vllm:generation_tokens_total 60\nvllm:request_success_total 6\n";
        // Present from the first tick: its counters are history, a baseline only.
        c.tick(obs(0.0, vec![("a", Some(page)), ("b", None)], &[]));
        assert_eq!(c.series.output_tokens_per_s.back(), Some(&None));
        // `b` started while the dashboard watched and served before its first reading.
        c.tick(obs(2.0, vec![("a", Some(page)), ("b", Some(page))], &[]));
        assert_eq!(c.series.output_tokens_per_s.back(), Some(&Some(30.0)));
        assert_eq!(
            c.series.replicas["b"].requests_per_s.back(),
            Some(&Some(3.0))
        );
        assert_eq!(
            c.series.replicas["a"].requests_per_s.back(),
            Some(&Some(0.0))
        );
        // Once read, it counts by deltas like any other.
        c.tick(obs(3.0, vec![("a", Some(page)), ("b", Some(page))], &[]));
        assert_eq!(c.series.output_tokens_per_s.back(), Some(&Some(0.0)));
    }

    #[test]
    fn pool_rows_sum_their_own_replicas() {
        let mut c = Collector::default();
        let page = |done: u32| format!("vllm:request_success_total {done}\n");
        let (p1, p2) = (page(10), page(30));
        c.tick(obs(
            0.0,
            vec![("a", Some(&p1)), ("b", Some(&p1)), ("c", Some(&p1))],
            &[],
        ));
        c.tick(obs(
            2.0,
            vec![("a", Some(&p2)), ("b", Some(&p1)), ("c", Some(&p2))],
            &[],
        ));
        let replica = |url: &str, pool: &str| ReplicaView {
            name: url.into(),
            url: url.into(),
            state: "ready".into(),
            ready: true,
            model: "m".into(),
            adapters: vec![],
            pool: pool.into(),
        };
        let replicas = [
            replica("a", "chat"),
            replica("b", "chat"),
            replica("c", "embed"),
        ];
        let pool = PoolView {
            name: "chat".into(),
            desired: 2,
            ready: 2,
            ..PoolView::default()
        };
        let row = pool_row(&pool, &replicas, &c);
        assert_eq!(row["replicas"], 2);
        // a finished 20 in 2 s, b none: 10/s for the pool; c belongs to another pool.
        assert_eq!(row["requests_per_s"], 10.0);
        assert_eq!(row["desired"], 2);
        assert_eq!(row["waiting"], 0.0);
        let empty = PoolView {
            name: "idle".into(),
            ..PoolView::default()
        };
        let row = pool_row(&empty, &replicas, &c);
        assert_eq!(row["replicas"], 0);
        assert!(row["requests_per_s"].is_null() && row["waiting"].is_null());
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
