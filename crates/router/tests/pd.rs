//! Prefill/decode disaggregation through the HTTP router (PROTOCOLS §11) on loopback, with
//! mock engines in the prefill and decode roles: long prompts go through a prefill engine
//! (phase 1 as vLLM's proxy sends it) and then the decode pick with the returned
//! `kv_transfer_params`; short or cached ones go straight to decode; every phase-1 failure
//! falls back to the decode pick without the client seeing it.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use serde_json::{json, Value};
use strata_mock::{Fault, MockConfig, MockEngine, Received};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::proxy::{PREFILLED_BY, SERVED_BY};
use strata_router::EndpointPickerConfig;

mod common;
use common::{start, wait_for, Harness};

async fn mock(kv_transfer: bool) -> MockEngine {
    MockEngine::spawn(MockConfig {
        model: "m".into(),
        output_tokens: 4,
        kv_transfer,
        ..Default::default()
    })
    .await
    .unwrap()
}

fn spec(m: &MockEngine, role: &str) -> EndpointSpec {
    let mut s = EndpointSpec::new(m.url(), EngineKind::Vllm);
    s.role = Some(role.into());
    s
}

fn config(endpoints: Vec<EndpointSpec>, threshold: u32) -> RouterConfig {
    RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        scrape_timeout_ms: 200,
        stale_after_ms: 200,
        endpoints,
        scheduling: Some(EndpointPickerConfig::pd(threshold)),
        ..RouterConfig::default()
    }
}

struct Answer {
    status: StatusCode,
    headers: hyper::HeaderMap,
    body: String,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

impl Harness {
    async fn post(&self, path: &str, body: Value, rid: &str) -> Answer {
        self.post_with(path, body, rid, &[]).await
    }

    async fn post_with(
        &self,
        path: &str,
        body: Value,
        rid: &str,
        headers: &[(&str, &str)],
    ) -> Answer {
        let mut req = Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .header("x-request-id", rid);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let req = req.body(Full::new(Bytes::from(body.to_string()))).unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(10), self.client.request(req))
            .await
            .expect("an answer in time")
            .unwrap();
        let status = resp.status();
        let headers = resp.headers().clone();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        Answer {
            status,
            headers,
            body: String::from_utf8_lossy(&bytes).into_owned(),
        }
    }

    fn metric(&self, name: &str) -> f64 {
        self.router
            .metrics()
            .encode()
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0.0)
    }
}

/// A prompt of `words` distinct words (about 1.5 tokens each by the router's estimate).
fn prompt(tag: &str, words: usize) -> String {
    (0..words)
        .map(|i| format!("{tag}{i}"))
        .collect::<Vec<_>>()
        .join(" ")
}

fn by_id<'a>(rs: &'a [Received], rid: &str) -> Vec<&'a Received> {
    rs.iter()
        .filter(|r| r.request_id.as_deref() == Some(rid))
        .collect()
}

#[tokio::test]
async fn long_prompts_prefill_then_decode_and_short_ones_go_straight_to_decode() {
    let prefill = mock(true).await;
    let d1 = mock(true).await;
    let d2 = mock(true).await;
    let h = start(config(
        vec![
            spec(&prefill, "prefill"),
            spec(&d1, "decode"),
            spec(&d2, "decode"),
        ],
        100,
    ))
    .await;
    let decoders = [&d1, &d2];

    // Long and streamed: phase 1 to the prefill engine, phase 2 streamed from a decoder.
    let long = prompt("alpha", 300);
    let a = h
        .post(
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": long}],
                   "max_completion_tokens": 4, "stream": true,
                   "stream_options": {"include_usage": true}}),
            "pd-long-1",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert!(a.body.trim_end().ends_with("data: [DONE]"), "{}", a.body);
    assert_eq!(
        a.header(PREFILLED_BY),
        Some(prefill.addr().to_string().as_str())
    );
    let p = prefill.received();
    let p = by_id(&p, "pd-long-1");
    assert_eq!(p.len(), 1, "one phase-1 request, same x-request-id");
    let p = p[0];
    let kv = p.kv_transfer_params.as_ref().unwrap();
    assert_eq!(kv["do_remote_decode"], true);
    assert_eq!(kv["do_remote_prefill"], false);
    assert!(kv["remote_engine_id"].is_null() && kv["remote_block_ids"].is_null());
    assert_eq!((p.max_tokens, p.max_completion_tokens), (Some(1), Some(1)));
    assert!(!p.stream && !p.stream_options, "phase 1 is not streamed");
    let served = a.header(SERVED_BY).unwrap().to_string();
    let decoder = decoders
        .iter()
        .find(|d| d.addr().to_string() == served)
        .expect("a decoder served");
    let got = decoder.received();
    let got = by_id(&got, "pd-long-1");
    assert_eq!(got.len(), 1);
    let kv = got[0].kv_transfer_params.as_ref().unwrap();
    assert_eq!(kv["do_remote_prefill"], true, "the prefill engine's params");
    assert_eq!(kv["remote_engine_id"], prefill.replica());
    assert_eq!(kv["remote_port"], prefill.addr().port());
    assert!(!kv["remote_block_ids"].as_array().unwrap().is_empty());
    assert_eq!(kv["remote_request_id"], "pd-long-1");
    assert!(
        got[0].stream && got[0].stream_options,
        "phase 2 as the client asked"
    );
    assert_eq!(got[0].max_completion_tokens, Some(4));

    // The same long prompt again: its decoder holds the prefix now, so decode only there.
    let a = h
        .post(
            "/v1/chat/completions",
            json!({"model": "m", "messages": [{"role": "user", "content": long}], "max_tokens": 4}),
            "pd-long-2",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.header(PREFILLED_BY), None);
    assert_eq!(a.header(SERVED_BY), Some(served.as_str()));
    assert!(by_id(&prefill.received(), "pd-long-2").is_empty());

    // Short: straight to a decoder, no kv_transfer_params anywhere.
    let a = h
        .post(
            "/v1/completions",
            json!({"model": "m", "prompt": "hello there", "max_tokens": 2}),
            "pd-short",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(a.header(PREFILLED_BY), None);
    assert!(by_id(&prefill.received(), "pd-short").is_empty());
    let all: Vec<Received> = decoders.iter().flat_map(|d| d.received()).collect();
    let short = by_id(&all, "pd-short");
    assert_eq!(short.len(), 1);
    assert!(short[0].kv_transfer_params.is_none());

    // A long text completion too (the other API).
    let a = h
        .post(
            "/v1/completions",
            json!({"model": "m", "prompt": prompt("beta", 300), "max_tokens": 3}),
            "pd-long-3",
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert!(a.body.contains("\"text_completion\""), "{}", a.body);
    assert_eq!(by_id(&prefill.received(), "pd-long-3").len(), 1);

    // The prefill engine's load counted during phase 1 only.
    let st = h.router.status();
    assert!(st.iter().all(|e| e.in_flight == 0), "{st:?}");
    assert_eq!(
        h.metric("strata_router_pd_requests_total{path=\"disaggregated\"}"),
        2.0
    );
    assert_eq!(
        h.metric("strata_router_pd_requests_total{path=\"decode_only\"}"),
        2.0
    );
    assert_eq!(
        h.metric("strata_router_pd_decisions_total{decision=\"prefill_decode\"}"),
        2.0
    );
    assert!(h.metric("strata_router_pd_prefill_duration_seconds_count") >= 2.0);
}

#[tokio::test]
async fn phase_one_failures_fall_back_to_the_decode_pick() {
    let prefill = mock(true).await;
    let silent = mock(false).await;
    let decoder = mock(true).await;
    let mut cfg = config(vec![spec(&prefill, "prefill"), spec(&decoder, "decode")], 0);
    cfg.pd.prefill_timeout_ms = 300;
    // The circuit must not open during this test: every phase-1 failure counts.
    cfg.circuit.failures = 100;
    let h = start(cfg).await;
    let body = |tag: &str| json!({"model": "m", "prompt": prompt(tag, 40), "max_tokens": 2});
    let check_fallback = |a: &Answer, rid: &str| {
        assert_eq!(a.status, StatusCode::OK, "{rid}: {}", a.body);
        assert_eq!(a.header(PREFILLED_BY), None, "{rid}");
        assert_eq!(
            a.header(SERVED_BY),
            Some(decoder.addr().to_string().as_str())
        );
        let got = decoder.received();
        let got = by_id(&got, rid);
        assert_eq!(got.len(), 1, "{rid}");
        assert!(
            got[0].kv_transfer_params.is_none(),
            "{rid}: the original request, computed locally"
        );
    };

    // An error status from the prefill engine.
    prefill.set_fault(Fault::Status(500));
    let a = h.post("/v1/completions", body("e"), "fb-500").await;
    check_fallback(&a, "fb-500");
    // A client error there too (its answer is not the client's).
    prefill.set_fault(Fault::Status(404));
    let a = h.post("/v1/completions", body("f"), "fb-404").await;
    check_fallback(&a, "fb-404");

    // A prefill engine that never answers: bounded by the timeout.
    prefill.set_fault(Fault::Hang);
    let t = Instant::now();
    let a = h.post("/v1/completions", body("g"), "fb-hang").await;
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    check_fallback(&a, "fb-hang");
    // Cut before any byte.
    prefill.set_fault(Fault::CloseMidStream { after_chunks: 0 });
    let a = h.post("/v1/completions", body("h"), "fb-cut").await;
    check_fallback(&a, "fb-cut");
    prefill.set_fault(Fault::None);
    let st = h.router.status();
    assert!(st.iter().all(|e| e.in_flight == 0), "{st:?}");

    // The client runs the protocol itself: its kv_transfer_params pass through untouched.
    let own = json!({"model": "m", "prompt": prompt("i", 40), "max_tokens": 2,
                     "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": "x"}});
    let a = h.post("/v1/completions", own, "own-params").await;
    assert_eq!(a.status, StatusCode::OK);
    assert!(by_id(&prefill.received(), "own-params").is_empty());
    let got = decoder.received();
    let got = by_id(&got, "own-params");
    assert_eq!(
        got[0].kv_transfer_params.as_ref().unwrap()["remote_engine_id"],
        "x"
    );

    // A prefill engine that dies: connection refused, still answered.
    let addr = prefill.addr();
    prefill.shutdown().await;
    let a = h.post("/v1/completions", body("j"), "fb-dead").await;
    check_fallback(&a, "fb-dead");
    // 500, 404, the hang and the cut; the dead engine either failed phase 1 or was
    // already out of the pool (then it was decode only).
    assert!(h.metric("strata_router_pd_requests_total{path=\"fallback\"}") >= 4.0);

    // An engine that does not speak the protocol (answers without kv_transfer_params).
    h.router.remove_endpoint(&format!("http://{addr}")).unwrap();
    h.router.add_endpoint(spec(&silent, "prefill")).unwrap();
    let r = h.router.clone();
    let url = silent.url();
    wait_for("the new prefill engine is ready", || {
        let ok = r
            .status()
            .iter()
            .any(|e| e.spec.url == url && e.ready && !e.stale);
        async move { ok }
    })
    .await;
    let a = h.post("/v1/completions", body("k"), "fb-no-params").await;
    check_fallback(&a, "fb-no-params");
    assert_eq!(by_id(&silent.received(), "fb-no-params").len(), 1);
}

#[tokio::test]
async fn without_prefill_engines_the_decode_pick_serves() {
    let d1 = mock(true).await;
    let plain = mock(true).await;
    // A decoder and an unlabelled replica: neither is a prefill engine.
    let h = start(config(
        vec![
            spec(&d1, "decode"),
            EndpointSpec::new(plain.url(), EngineKind::Vllm),
        ],
        0,
    ))
    .await;
    for i in 0..4 {
        let rid = format!("np-{i}");
        // A client cannot send a decoder to a prefill engine of its choosing.
        let a = h
            .post_with(
                "/v1/completions",
                json!({"model": "m", "prompt": prompt("n", 200), "max_tokens": 2}),
                &rid,
                &[("x-prefiller-host-port", "10.9.9.9:1")],
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        assert_eq!(a.header(PREFILLED_BY), None);
    }
    let all: Vec<Received> = d1.received().into_iter().chain(plain.received()).collect();
    assert_eq!(all.len(), 4, "each request once, no phase 1");
    assert!(all.iter().all(|r| r.kv_transfer_params.is_none()));
    assert!(all.iter().all(|r| r.prefiller.is_none()), "{all:?}");
    assert_eq!(
        h.metric("strata_router_pd_decisions_total{decision=\"no_prefill\"}"),
        4.0
    );
    // Embeddings are never split: no decision of the pair is counted for them.
    let _ = h
        .post(
            "/v1/embeddings",
            json!({"model": "m", "input": prompt("e", 200)}),
            "emb",
        )
        .await;
    let decisions: f64 = ["no_prefill", "prefill_decode", "decode_only"]
        .iter()
        .map(|d| format!("strata_router_pd_decisions_total{{decision=\"{d}\"}}"))
        .collect::<Vec<_>>()
        .iter()
        .map(|m| h.metric(m))
        .sum();
    assert_eq!(decisions, 4.0);
}
