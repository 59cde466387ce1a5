//! Canary rollouts on Kubernetes: the pieces [`crate::rollout_runner::RolloutRunner`] needs,
//! over the API server instead of the `strata up` router.
//!
//! - [`HttpRouteSplitter`] moves traffic by **routing weights only**: in every rule of an
//!   `HTTPRoute` (gateway.networking.k8s.io/v1) that sends to the baseline's
//!   `InferencePool`, the baseline's `backendRef` gets `100 - share` and the canary's pool
//!   `share` (a canary `backendRef` is added beside the baseline's, same group, kind and
//!   port, when the rule has none). Nothing is scaled, created or deleted: promotion is
//!   weight 100 on the canary, rollback weight 0. The weights are applied by a task of its
//!   own, retried every second until the API server takes them, so the runner's
//!   `set_split` never waits on the network; [`HttpRouteSplitter::applied`] says what the
//!   route carries now.
//! - [`PodMetricsStats`] reads each version's pods (a label selector per version) and
//!   their engines' `/metrics`: requests finished (`vllm:request_success_total`), errors
//!   (those finished with reason `abort` or `error`), and the TTFT and inter-token latency
//!   histograms, as deltas since the step began; a version is healthy while it has a
//!   ready pod and none of its containers restarted since the rollout began.
//!
//! A step counts from the first tick after it began (the reset only marks the step: the
//! page totals are read at that first tick).

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{json, Value};
use strata_api::model_server::EngineKind;
use strata_api::prometheus::{add_bucket, histogram_delta, histogram_quantile, samples, Buckets};
use tokio::sync::watch;

use crate::rollout::VersionStats;
use crate::rollout_runner::{StepStats, TrafficSplitter};

/// How long a failed weight change waits before it is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// A split the route should carry: `canary_percent` of the baseline pool's traffic to the
/// canary pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub baseline: String,
    pub canary: String,
    pub canary_percent: u8,
}

/// Sets an HTTPRoute's backend weights. See the module docs.
pub struct HttpRouteSplitter {
    want: watch::Sender<Option<Split>>,
    applied: watch::Receiver<Option<Split>>,
}

impl HttpRouteSplitter {
    /// Applies splits to the HTTPRoute `route` in `namespace`, each API call bounded by
    /// `timeout`, until dropped.
    pub fn spawn(
        client: kube::Client,
        namespace: &str,
        route: &str,
        timeout: Duration,
    ) -> HttpRouteSplitter {
        let resource = ApiResource {
            group: "gateway.networking.k8s.io".into(),
            version: "v1".into(),
            api_version: "gateway.networking.k8s.io/v1".into(),
            kind: "HTTPRoute".into(),
            plural: "httproutes".into(),
        };
        let api: Api<DynamicObject> = Api::namespaced_with(client, namespace, &resource);
        let (want, want_rx) = watch::channel(None);
        let (applied_tx, applied) = watch::channel(None);
        tokio::spawn(apply_loop(
            api,
            route.to_string(),
            timeout,
            want_rx,
            applied_tx,
        ));
        HttpRouteSplitter { want, applied }
    }

    /// The split the route carries, once the API server took it.
    pub fn applied(&self) -> Option<Split> {
        self.applied.borrow().clone()
    }
}

impl TrafficSplitter for HttpRouteSplitter {
    fn set_split(&self, baseline: &str, canary: &str, canary_percent: u8) -> Result<(), String> {
        if baseline == canary {
            return Err("the canary and the baseline are the same pool".into());
        }
        self.want.send_replace(Some(Split {
            baseline: baseline.to_string(),
            canary: canary.to_string(),
            canary_percent: canary_percent.min(100),
        }));
        Ok(())
    }
}

/// Applies the latest wanted split, retrying a failure until it succeeds or a newer split
/// replaces it; ends when the splitter is dropped.
async fn apply_loop(
    api: Api<DynamicObject>,
    route: String,
    timeout: Duration,
    mut want: watch::Receiver<Option<Split>>,
    applied: watch::Sender<Option<Split>>,
) {
    loop {
        let split = want.borrow_and_update().clone();
        if let Some(s) = &split {
            match tokio::time::timeout(timeout, apply(&api, &route, s)).await {
                Ok(Ok(())) => {
                    tracing::info!(route = %route, canary = %s.canary, share = s.canary_percent, "route weights set");
                    applied.send_replace(split.clone());
                }
                failed => {
                    let error = match failed {
                        Ok(Err(e)) => e,
                        _ => format!("no answer within {timeout:?}"),
                    };
                    tracing::warn!(route = %route, error = %error, "setting the route's weights; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(RETRY) => continue,
                        changed = want.changed() => {
                            if changed.is_err() { return; }
                            continue;
                        }
                    }
                }
            }
        }
        if want.changed().await.is_err() {
            return;
        }
    }
}

/// Reads the route, sets the weights in its rules, and writes the rules back.
async fn apply(api: &Api<DynamicObject>, route: &str, s: &Split) -> Result<(), String> {
    let obj = api
        .get(route)
        .await
        .map_err(|e| format!("reading HTTPRoute {route}: {e}"))?;
    let mut rules = obj
        .data
        .pointer("/spec/rules")
        .cloned()
        .ok_or_else(|| format!("HTTPRoute {route} has no spec.rules"))?;
    if !set_weights(&mut rules, s) {
        return Err(format!(
            "HTTPRoute {route} has no backendRef named {}",
            s.baseline
        ));
    }
    api.patch(
        route,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"rules": rules}})),
    )
    .await
    .map_err(|e| format!("patching HTTPRoute {route}: {e}"))?;
    Ok(())
}

/// Sets the weights of `s` in every rule that sends to the baseline; whether any did.
pub fn set_weights(rules: &mut Value, s: &Split) -> bool {
    let share = i64::from(s.canary_percent.min(100));
    let mut found = false;
    for rule in rules.as_array_mut().into_iter().flatten() {
        let Some(refs) = rule.get_mut("backendRefs").and_then(Value::as_array_mut) else {
            continue;
        };
        let Some(base) = refs.iter().position(|r| r["name"] == s.baseline.as_str()) else {
            continue;
        };
        found = true;
        refs[base]["weight"] = json!(100 - share);
        match refs.iter().position(|r| r["name"] == s.canary.as_str()) {
            Some(c) => refs[c]["weight"] = json!(share),
            None => {
                let mut c = refs[base].clone();
                c["name"] = json!(s.canary);
                c["weight"] = json!(share);
                refs.push(c);
            }
        }
    }
    found
}

/// What one version's pods reported, summed over the pods.
#[derive(Debug, Clone, Default)]
struct Totals {
    finished: f64,
    errors: f64,
    ttft: Buckets,
    itl: Buckets,
}

/// Step statistics and health from each version's pods. See the module docs.
pub struct PodMetricsStats {
    pods: Api<Pod>,
    /// The label selector of each version's pods, by the name the runner uses.
    selectors: BTreeMap<String, String>,
    port: u16,
    https: bool,
    kind: EngineKind,
    client: reqwest::Client,
    timeout: Duration,
    /// Each version's totals at the start of the step (read at its first tick).
    marks: BTreeMap<String, Totals>,
    /// Each version's container restarts when first seen.
    restarts: BTreeMap<String, i64>,
}

impl PodMetricsStats {
    /// Statistics of the versions in `selectors` (name → pod label selector), whose pods
    /// serve `/metrics` on `port` (`https` with `client` trusting their CA).
    pub fn new(
        client: kube::Client,
        namespace: &str,
        selectors: BTreeMap<String, String>,
        port: u16,
        https: bool,
        http: reqwest::Client,
        timeout: Duration,
    ) -> PodMetricsStats {
        PodMetricsStats {
            pods: Api::namespaced(client, namespace),
            selectors,
            port,
            https,
            kind: EngineKind::Vllm,
            client: http,
            timeout,
            marks: BTreeMap::new(),
            restarts: BTreeMap::new(),
        }
    }

    async fn list(&self, model: &str) -> Result<Vec<Pod>, String> {
        let selector = self
            .selectors
            .get(model)
            .ok_or_else(|| format!("no pod selector for {model}"))?;
        let params = ListParams::default().labels(selector);
        match tokio::time::timeout(self.timeout, self.pods.list(&params)).await {
            Ok(Ok(list)) => Ok(list.items),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("no answer within {:?}", self.timeout)),
        }
    }

    /// The version's pods' totals now (pods that do not answer are left out).
    async fn totals(&self, model: &str) -> Totals {
        let pods = match self.list(model).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(model, error = %e, "listing the version's pods");
                return Totals::default();
            }
        };
        let scheme = if self.https { "https" } else { "http" };
        let mut t = Totals::default();
        for ip in pods.iter().filter(|p| is_ready(p)).filter_map(pod_ip) {
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip
            };
            let url = format!("{scheme}://{host}:{}/metrics", self.port);
            let page = match self.fetch(&url).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(url = %url, error = %e, "scraping a pod");
                    continue;
                }
            };
            add_page(&mut t, &page, self.kind);
        }
        t
    }

    async fn fetch(&self, url: &str) -> Result<String, String> {
        let resp = self
            .client
            .get(url)
            .timeout(self.timeout)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        if !resp.status().is_success() {
            return Err(format!("status {}", resp.status()));
        }
        resp.text().await.map_err(|e| e.to_string())
    }
}

fn is_ready(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

fn pod_ip(p: &Pod) -> Option<String> {
    p.status.as_ref()?.pod_ip.clone()
}

fn restarts(pods: &[Pod]) -> i64 {
    pods.iter()
        .filter_map(|p| p.status.as_ref()?.container_statuses.as_ref())
        .flatten()
        .map(|c| i64::from(c.restart_count))
        .sum()
}

/// Adds one engine page's finished requests, errors and latency histograms to `t`.
fn add_page(t: &mut Totals, page: &str, kind: EngineKind) {
    let names = kind.metric_names();
    let bucket = |m: Option<&str>| m.map(|m| format!("{m}_bucket"));
    let (ttft, itl) = (bucket(names.ttft), bucket(names.itl));
    let (all, _) = samples(page);
    for s in &all {
        if Some(s.name) == names.requests_finished {
            if !s.value.is_finite() {
                continue;
            }
            t.finished += s.value;
            if matches!(s.label("finished_reason"), Some("abort" | "error")) {
                t.errors += s.value;
            }
        } else if ttft.as_deref() == Some(s.name) {
            if let Some(le) = s.le() {
                add_bucket(&mut t.ttft, le, s.value);
            }
        } else if itl.as_deref() == Some(s.name) {
            if let Some(le) = s.le() {
                add_bucket(&mut t.itl, le, s.value);
            }
        }
    }
}

/// What was served between `mark` and `now`.
fn stats_between(now: &Totals, mark: &Totals) -> VersionStats {
    let count = |a: f64, b: f64| (a - b).max(0.0).round() as u64;
    VersionStats {
        requests: count(now.finished, mark.finished),
        errors: count(now.errors, mark.errors),
        ttft_p90_secs: histogram_quantile(&histogram_delta(&now.ttft, &mark.ttft), 0.9),
        itl_p90_secs: histogram_quantile(&histogram_delta(&now.itl, &mark.itl), 0.9),
    }
}

impl StepStats for PodMetricsStats {
    fn reset(&mut self) {
        self.marks.clear();
    }

    async fn stats(&mut self, model: &str) -> VersionStats {
        let now = self.totals(model).await;
        match self.marks.get(model) {
            Some(mark) => stats_between(&now, mark),
            None => {
                self.marks.insert(model.to_string(), now);
                VersionStats::default()
            }
        }
    }

    async fn healthy(&mut self, model: &str) -> bool {
        let Ok(pods) = self.list(model).await else {
            return false;
        };
        let now = restarts(&pods);
        let first = *self.restarts.entry(model.to_string()).or_insert(now);
        now == first && pods.iter().any(is_ready)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(p: u8) -> Split {
        Split {
            baseline: "llama-pool".into(),
            canary: "llama-next-pool".into(),
            canary_percent: p,
        }
    }

    #[test]
    fn weights_go_on_the_rules_that_send_to_the_baseline_only() {
        let mut rules = json!([
            {"matches": [{"path": {"value": "/"}}],
             "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                              "name": "llama-pool", "port": 8000}]},
            {"backendRefs": [{"name": "other-pool"}]},
            {"filters": []}
        ]);
        assert!(set_weights(&mut rules, &split(10)));
        let refs = rules[0]["backendRefs"].as_array().unwrap();
        assert_eq!(refs.len(), 2);
        assert_eq!(refs[0]["weight"], 90);
        assert_eq!(refs[1]["name"], "llama-next-pool");
        assert_eq!(refs[1]["kind"], "InferencePool");
        assert_eq!(refs[1]["weight"], 10);
        assert_eq!(rules[1]["backendRefs"][0].get("weight"), None);
        // The next step changes the weights in place.
        assert!(set_weights(&mut rules, &split(100)));
        let refs = rules[0]["backendRefs"].as_array().unwrap();
        assert_eq!(
            (refs.len(), &refs[0]["weight"], &refs[1]["weight"]),
            (2, &json!(0), &json!(100))
        );
        // A route without the baseline is an error, not a silent no-op.
        let mut other = json!([{"backendRefs": [{"name": "x"}]}]);
        assert!(!set_weights(&mut other, &split(5)));
    }

    #[test]
    fn step_stats_are_deltas_of_the_pages() {
        let page = |ok: u32, abort: u32, fast: u32, slow: u32| {
            format!(
                "vllm:request_success_total{{finished_reason=\"stop\"}} {ok}\n\
                 vllm:request_success_total{{finished_reason=\"abort\"}} {abort}\n\
                 vllm:time_to_first_token_seconds_bucket{{le=\"0.1\"}} {fast}\n\
                 vllm:time_to_first_token_seconds_bucket{{le=\"2\"}} {}\n\
                 vllm:time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {}\n",
                fast + slow,
                fast + slow
            )
        };
        let mut mark = Totals::default();
        add_page(&mut mark, &page(10, 0, 10, 0), EngineKind::Vllm);
        let mut now = Totals::default();
        add_page(&mut now, &page(18, 2, 10, 10), EngineKind::Vllm);
        let s = stats_between(&now, &mark);
        assert_eq!((s.requests, s.errors), (10, 2));
        assert!(s.ttft_p90_secs.unwrap() > 1.0, "{s:?}");
        assert_eq!(stats_between(&mark, &mark).ttft_p90_secs, None);
    }
}
