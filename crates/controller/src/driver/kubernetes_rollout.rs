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
//!   route carries now. Each write carries the `resourceVersion` it read, so an edit made
//!   in between is answered 409 Conflict and the route is read and written again rather
//!   than the edit lost.
//! - [`PodMetricsStats`] reads each version's pods (a label selector per version) and
//!   their engines' `/metrics`: requests finished (`vllm:request_success_total`), errors
//!   (those finished with reason `abort` or `error`), and the TTFT and inter-token latency
//!   histograms, as deltas since the step began, each pod (by UID) against its own mark;
//!   a version is healthy while it has a ready pod and no pod's containers restarted since
//!   the rollout first saw it (nor did a pod stop being ready and go away).
//!
//! A step counts from the first tick after it began (the reset only marks the step: the
//! pages are read at that first tick). A pod read then counts from that page; a pod read
//! first later counts from zero if it was created after the mark and was not listed then
//! (all its page is the step's), else from that first read (its page may hold older
//! traffic). A pod that is gone, not ready or not answering keeps what it served up to its
//! last read, so a pod leaving never subtracts from the others.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use serde_json::{json, Value};
use strata_api::model_server::EngineKind;
use strata_api::prometheus::{
    add_bucket, add_histogram, histogram_delta, histogram_quantile, samples, Buckets,
};
use tokio::sync::watch;

use crate::rollout::VersionStats;
use crate::rollout_runner::{StepStats, TrafficSplitter};

/// How long a failed weight change waits before it is tried again.
const RETRY: Duration = Duration::from_secs(1);

/// How many times one weight change reads and writes the route when others keep changing it.
const CONFLICT_TRIES: u32 = 3;

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

/// Reads the route, sets the weights in its rules, and writes the rules back, guarded by the
/// `resourceVersion` it read: a route changed in between is answered 409 Conflict, and read
/// and written again (at most [`CONFLICT_TRIES`] times here; the apply loop retries after).
async fn apply(api: &Api<DynamicObject>, route: &str, s: &Split) -> Result<(), String> {
    let mut attempt = 1;
    loop {
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
        let version = obj
            .metadata
            .resource_version
            .clone()
            .ok_or_else(|| format!("HTTPRoute {route} has no resourceVersion"))?;
        let patch = json!({
            "metadata": {"resourceVersion": version},
            "spec": {"rules": rules},
        });
        match api
            .patch(route, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 && attempt < CONFLICT_TRIES => {
                tracing::debug!(route = %route, "the route changed since it was read; reading it again");
                attempt += 1;
            }
            Err(e) => return Err(format!("patching HTTPRoute {route}: {e}")),
        }
    }
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

/// What one pod's page shows (or, summed, what pods served in a step).
#[derive(Debug, Clone, Default, PartialEq)]
struct Totals {
    finished: f64,
    errors: f64,
    ttft: Buckets,
    itl: Buckets,
}

impl Totals {
    /// Adds `other` (summing pods, or a pod's parts).
    fn add(&mut self, other: &Totals) {
        self.finished += other.finished;
        self.errors += other.errors;
        add_histogram(&mut self.ttft, &other.ttft);
        add_histogram(&mut self.itl, &other.itl);
    }

    /// Whether this page is below `mark`, an earlier page of the same pod: a counter went
    /// down or a histogram lost a bucket or a count, so the engine restarted since.
    fn went_back_from(&self, mark: &Totals) -> bool {
        let hist = |now: &Buckets, then: &Buckets| {
            !then.is_empty()
                && (now.len() != then.len()
                    || now.iter().zip(then).any(|(a, b)| a.0 != b.0 || a.1 < b.1))
        };
        self.finished < mark.finished
            || self.errors < mark.errors
            || hist(&self.ttft, &mark.ttft)
            || hist(&self.itl, &mark.itl)
    }

    /// `self - mark`, for a page that did not go back from `mark`.
    fn since(&self, mark: &Totals) -> Totals {
        Totals {
            finished: self.finished - mark.finished,
            errors: self.errors - mark.errors,
            ttft: histogram_delta(&self.ttft, &mark.ttft),
            itl: histogram_delta(&self.itl, &mark.itl),
        }
    }

    /// As the rollout's analysis reads it.
    fn stats(&self) -> VersionStats {
        let count = |v: f64| v.max(0.0).round() as u64;
        VersionStats {
            requests: count(self.finished),
            errors: count(self.errors),
            ttft_p90_secs: histogram_quantile(&self.ttft, 0.9),
            itl_p90_secs: histogram_quantile(&self.itl, 0.9),
        }
    }
}

/// One pod as one read saw it.
#[derive(Debug, Clone)]
struct PodRead {
    uid: String,
    /// When it was created, in milliseconds since the Unix epoch (the API server's clock).
    created: Option<i64>,
    /// Its page, when it was ready and answered.
    page: Option<Totals>,
}

/// One pod's part of a step.
#[derive(Debug, Clone, Default)]
struct PodPart {
    /// Its page when the step began for it (zero for a pod started since the mark).
    mark: Totals,
    /// What it had served before its engine restarted (counters start again from zero).
    before_restart: Totals,
    /// What it served in the step, as of its latest read.
    served: Totals,
}

/// One version's step: each pod counted against its own mark, by UID.
#[derive(Debug, Clone)]
struct Step {
    /// When the step was marked (just before its pods were listed), in milliseconds since
    /// the Unix epoch.
    at: i64,
    /// The pods listed at the mark, ready or not.
    listed: BTreeSet<String>,
    pods: BTreeMap<String, PodPart>,
}

impl Step {
    /// The step's mark: each pod read now counts from its page now.
    fn mark(at: i64, reads: &[PodRead]) -> Step {
        let mut step = Step {
            at,
            listed: reads.iter().map(|r| r.uid.clone()).collect(),
            pods: BTreeMap::new(),
        };
        step.update(reads);
        step
    }

    /// Takes a later read. A pod read for the first time in the step counts from zero when
    /// it was created after the mark (all its page is new); one present at the mark but
    /// not read then (not ready, or its scrape failed) counts from this read. A pod not
    /// read now (gone, not ready, no answer) keeps what it served up to its last read.
    fn update(&mut self, reads: &[PodRead]) {
        for r in reads {
            let Some(page) = &r.page else { continue };
            let part = self.pods.entry(r.uid.clone()).or_insert_with(|| {
                let new = !self.listed.contains(&r.uid) && r.created.is_some_and(|c| c >= self.at);
                PodPart {
                    mark: if new { Totals::default() } else { page.clone() },
                    ..PodPart::default()
                }
            });
            if page.went_back_from(&part.mark) {
                part.before_restart = part.served.clone();
                part.mark = Totals::default();
            }
            let mut served = part.before_restart.clone();
            served.add(&page.since(&part.mark));
            part.served = served;
        }
    }

    /// What the version's pods served in the step.
    fn served(&self) -> Totals {
        let mut t = Totals::default();
        for part in self.pods.values() {
            t.add(&part.served);
        }
        t
    }
}

/// What the rollout saw of one pod, for the version's health.
#[derive(Debug, Clone)]
struct PodSeen {
    name: String,
    /// Its containers' restarts when first seen (zero for a pod created since the first
    /// look).
    first_restarts: i64,
    was_ready: bool,
    ready: bool,
    terminating: bool,
}

/// One version's health over the rollout.
#[derive(Debug, Clone)]
struct Health {
    /// When the version's pods were first listed (milliseconds since the Unix epoch), and
    /// which were.
    at: i64,
    listed: BTreeSet<String>,
    pods: BTreeMap<String, PodSeen>,
    /// The first fault seen; a version with one stays unhealthy.
    fault: Option<String>,
}

impl Health {
    fn new(at: i64, pods: &[Pod]) -> Health {
        Health {
            at,
            listed: pods.iter().map(uid).collect(),
            pods: BTreeMap::new(),
            fault: None,
        }
    }

    /// Takes a listing of the version's pods; the fault it shows, if it is the first.
    fn update(&mut self, pods: &[Pod]) -> Option<String> {
        let mut faults = Vec::new();
        let mut now = BTreeSet::new();
        for p in pods {
            let id = uid(p);
            let restarts = restarts(p);
            let ready = is_ready(p);
            let seen = self.pods.entry(id.clone()).or_insert_with(|| {
                let new = !self.listed.contains(&id) && created(p).is_some_and(|c| c >= self.at);
                PodSeen {
                    name: p.metadata.name.clone().unwrap_or_else(|| id.clone()),
                    first_restarts: if new { 0 } else { restarts },
                    was_ready: false,
                    ready: false,
                    terminating: false,
                }
            });
            if restarts > seen.first_restarts {
                faults.push(format!(
                    "pod {}: containers restarted {} times since the rollout began",
                    seen.name,
                    restarts - seen.first_restarts
                ));
            }
            seen.was_ready |= ready;
            seen.ready = ready;
            seen.terminating = p.metadata.deletion_timestamp.is_some();
            now.insert(id);
        }
        // A pod that was ready, stopped being ready without being deleted, and then went
        // away failed (its replacement does not make up for it). One deleted on purpose
        // shows its deletion first; one that simply went away while ready is a replacement.
        let gone: Vec<String> = self
            .pods
            .keys()
            .filter(|id| !now.contains(*id))
            .cloned()
            .collect();
        for id in gone {
            if let Some(s) = self.pods.remove(&id) {
                if s.was_ready && !s.ready && !s.terminating {
                    faults.push(format!("pod {} stopped being ready and went away", s.name));
                }
            }
        }
        match (&self.fault, faults.into_iter().next()) {
            (None, Some(f)) => {
                self.fault = Some(f.clone());
                Some(f)
            }
            _ => None,
        }
    }
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
    /// Each version's step, from its first tick.
    steps: BTreeMap<String, Step>,
    /// Each version's health since the rollout began.
    health: BTreeMap<String, Health>,
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
            steps: BTreeMap::new(),
            health: BTreeMap::new(),
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

    /// The version's pods now, with the pages of those that are ready and answer.
    async fn read(&self, model: &str) -> Result<Vec<PodRead>, String> {
        let pods = self.list(model).await?;
        let scheme = if self.https { "https" } else { "http" };
        let mut reads = Vec::with_capacity(pods.len());
        for p in &pods {
            let mut page = None;
            if let Some(ip) = pod_ip(p).filter(|_| is_ready(p)) {
                let host = if ip.contains(':') {
                    format!("[{ip}]")
                } else {
                    ip
                };
                let url = format!("{scheme}://{host}:{}/metrics", self.port);
                match self.fetch(&url).await {
                    Ok(text) => {
                        let mut t = Totals::default();
                        add_page(&mut t, &text, self.kind);
                        page = Some(t);
                    }
                    Err(e) => tracing::warn!(url = %url, error = %e, "scraping a pod"),
                }
            }
            reads.push(PodRead {
                uid: uid(p),
                created: created(p),
                page,
            });
        }
        Ok(reads)
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

/// Milliseconds since the Unix epoch, by this machine's clock.
fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// When a pod was created, in milliseconds since the Unix epoch.
fn created(p: &Pod) -> Option<i64> {
    Some(p.metadata.creation_timestamp.as_ref()?.0.timestamp_millis())
}

/// A pod's UID (its name when it has none).
fn uid(p: &Pod) -> String {
    p.metadata
        .uid
        .clone()
        .or_else(|| p.metadata.name.clone())
        .unwrap_or_default()
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

/// The restarts of a pod's containers, init containers included.
fn restarts(p: &Pod) -> i64 {
    let Some(s) = p.status.as_ref() else { return 0 };
    [&s.container_statuses, &s.init_container_statuses]
        .into_iter()
        .flatten()
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

impl StepStats for PodMetricsStats {
    fn reset(&mut self) {
        self.steps.clear();
    }

    async fn stats(&mut self, model: &str) -> VersionStats {
        let at = now_millis();
        let reads = match self.read(model).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(model, error = %e, "listing the version's pods");
                // What the step had as of the last read (no mark yet: nothing).
                return self
                    .steps
                    .get(model)
                    .map(|s| s.served().stats())
                    .unwrap_or_default();
            }
        };
        match self.steps.get_mut(model) {
            Some(step) => {
                step.update(&reads);
                step.served().stats()
            }
            None => {
                self.steps.insert(model.to_string(), Step::mark(at, &reads));
                VersionStats::default()
            }
        }
    }

    async fn healthy(&mut self, model: &str) -> bool {
        let at = now_millis();
        let pods = match self.list(model).await {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!(model, error = %e, "listing the version's pods");
                return false;
            }
        };
        let health = self
            .health
            .entry(model.to_string())
            .or_insert_with(|| Health::new(at, &pods));
        if let Some(fault) = health.update(&pods) {
            tracing::warn!(model, fault = %fault, "the version is unhealthy");
        }
        health.fault.is_none() && pods.iter().any(is_ready)
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

    fn page(ok: u32, abort: u32, fast: u32, slow: u32) -> Totals {
        let text = format!(
            "vllm:request_success_total{{finished_reason=\"stop\"}} {ok}\n\
             vllm:request_success_total{{finished_reason=\"abort\"}} {abort}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"0.1\"}} {fast}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"2\"}} {}\n\
             vllm:time_to_first_token_seconds_bucket{{le=\"+Inf\"}} {}\n",
            fast + slow,
            fast + slow
        );
        let mut t = Totals::default();
        add_page(&mut t, &text, EngineKind::Vllm);
        t
    }

    fn read(uid: &str, created: i64, page: Option<Totals>) -> PodRead {
        PodRead {
            uid: uid.into(),
            created: Some(created),
            page,
        }
    }

    #[test]
    fn step_stats_are_deltas_of_the_pages() {
        let mut step = Step::mark(1000, &[read("a", 0, Some(page(10, 0, 10, 0)))]);
        assert_eq!(step.served().stats(), VersionStats::default());
        step.update(&[read("a", 0, Some(page(18, 2, 10, 10)))]);
        let s = step.served().stats();
        assert_eq!((s.requests, s.errors), (10, 2));
        assert!(s.ttft_p90_secs.unwrap() > 1.0, "{s:?}");
        let same = Step::mark(1000, &[read("a", 0, Some(page(10, 0, 10, 0)))]);
        assert_eq!(same.served().stats().ttft_p90_secs, None);
    }

    #[test]
    fn each_pod_counts_against_its_own_mark() {
        // At the mark: a ready pod, and one listed but not read (not ready, or no answer).
        let mut step = Step::mark(
            1000,
            &[
                read("a", 0, Some(page(100, 0, 100, 0))),
                read("late", 0, None),
            ],
        );
        // Later: `late` answers with a page full of old aborts, `old` shows up (created
        // before the mark, not listed then: relabelled) with more, and `new` (created
        // after the mark) with what it served since it started.
        step.update(&[
            read("a", 0, Some(page(110, 0, 110, 0))),
            read("late", 0, Some(page(0, 500, 0, 500))),
            read("old", 500, Some(page(0, 700, 0, 700))),
            read("new", 2000, Some(page(5, 1, 6, 0))),
        ]);
        let s = step.served().stats();
        assert_eq!((s.requests, s.errors), (16, 1), "{s:?}");
        // Their next pages count from there.
        step.update(&[
            read("a", 0, Some(page(120, 0, 120, 0))),
            read("late", 0, Some(page(0, 503, 0, 503))),
            read("old", 500, Some(page(0, 700, 0, 700))),
            read("new", 2000, Some(page(5, 1, 6, 0))),
        ]);
        let s = step.served().stats();
        assert_eq!((s.requests, s.errors), (29, 4), "{s:?}");
        // `a` goes away (or stops answering): what it served stays, and nothing of the
        // others is cancelled by its page leaving the sum.
        step.update(&[
            read("late", 0, Some(page(0, 510, 0, 510))),
            read("old", 500, Some(page(0, 700, 0, 700))),
            read("new", 2000, Some(page(5, 1, 6, 0))),
        ]);
        let s = step.served().stats();
        assert_eq!((s.requests, s.errors), (36, 11), "{s:?}");
        assert!(s.ttft_p90_secs.unwrap() > 1.0, "{s:?}");
    }

    #[test]
    fn an_engine_restart_counts_its_new_page_after_what_it_had_served() {
        let mut step = Step::mark(1000, &[read("a", 0, Some(page(100, 10, 110, 0)))]);
        step.update(&[read("a", 0, Some(page(130, 10, 140, 0)))]);
        // The engine restarted: its counters start again from zero.
        step.update(&[read("a", 0, Some(page(5, 1, 6, 0)))]);
        let s = step.served().stats();
        assert_eq!((s.requests, s.errors), (36, 1), "{s:?}");
        // And grow from there, past the old mark, without being cut by it.
        step.update(&[read("a", 0, Some(page(200, 20, 220, 0)))]);
        let s = step.served().stats();
        assert_eq!((s.requests, s.errors), (250, 20), "{s:?}");
    }

    fn pod(uid: &str, created: &str, ready: bool, restarts: i32, terminating: bool) -> Pod {
        let mut p: Pod = serde_json::from_value(json!({
            "metadata": {"name": uid, "uid": uid, "creationTimestamp": created},
            "status": {
                "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
                "containerStatuses": [{"name": "engine", "ready": ready, "restartCount": restarts,
                                       "image": "i", "imageID": ""}]
            }
        }))
        .unwrap();
        if terminating {
            p.metadata.deletion_timestamp = p.metadata.creation_timestamp.clone();
        }
        p
    }

    const BEFORE: &str = "2026-01-01T00:00:00Z";
    const AFTER: &str = "2026-01-01T01:00:00Z";
    /// The first look, between `BEFORE` and `AFTER`.
    const AT: i64 = 1_767_227_400_000;

    #[test]
    fn restarts_are_counted_per_pod() {
        let first = [
            pod("a", BEFORE, true, 0, false),
            pod("b", BEFORE, true, 3, false),
        ];
        let mut h = Health::new(AT, &first);
        assert_eq!(
            h.update(&first),
            None,
            "restarts before the rollout are not faults"
        );
        // `b` is replaced by `c`: not a fault by itself.
        let replaced = [
            pod("a", BEFORE, true, 0, false),
            pod("c", AFTER, true, 0, false),
        ];
        assert_eq!(h.update(&replaced), None);
        // `a` restarts three times while `b` is replaced by `c`: the sum of the restarts is
        // what it was at the first look, but `a` crashed.
        let mut h = Health::new(AT, &first);
        h.update(&first);
        let f = h.update(&[
            pod("a", BEFORE, true, 3, false),
            pod("c", AFTER, true, 0, false),
        ]);
        assert!(f.unwrap().contains("pod a"));
        // The fault stays, even once the pod is gone.
        assert_eq!(h.update(&[pod("c", AFTER, true, 0, false)]), None);
        assert!(h.fault.is_some());
        // A pod created since the first look counts its restarts from zero.
        let mut h = Health::new(AT, &first);
        h.update(&first);
        let f = h.update(&[
            pod("a", BEFORE, true, 0, false),
            pod("d", AFTER, false, 2, false),
        ]);
        assert!(f.unwrap().contains("pod d"));
    }

    #[test]
    fn a_pod_that_failed_and_went_away_is_a_fault_one_deleted_is_not() {
        let first = [
            pod("a", BEFORE, true, 0, false),
            pod("b", BEFORE, true, 0, false),
        ];
        let mut h = Health::new(AT, &first);
        h.update(&first);
        // `b` is deleted on purpose (its deletion shows first), then goes.
        h.update(&[
            pod("a", BEFORE, true, 0, false),
            pod("b", BEFORE, false, 0, true),
        ]);
        assert_eq!(h.update(&[pod("a", BEFORE, true, 0, false)]), None);
        // `a` stops being ready, then goes.
        h.update(&[pod("a", BEFORE, false, 0, false)]);
        let f = h.update(&[pod("c", AFTER, true, 0, false)]);
        assert!(f.unwrap().contains("pod a"));
    }
}
