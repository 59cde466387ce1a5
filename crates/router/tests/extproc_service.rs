//! The ext_proc endpoint picker driven as Envoy drives it: a tonic client opens one
//! `Process` stream per HTTP request and sends request headers, body chunks (end of stream
//! on the last), then the response's headers and body, and checks every answer. The router
//! behind it has mock engines on loopback.

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request, processing_response, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use serde_json::json;
use strata_mock::{Fault, MockConfig, MockEngine};
use strata_router::config::RouterConfig;
use strata_router::endpoint::{EndpointSpec, EngineKind};
use strata_router::extproc::serve::{serve, BoundAddrs, Listeners};
use strata_router::extproc::ExtProc;
use strata_router::Router;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

struct Harness {
    router: Router,
    ext: ExtProc,
    addrs: BoundAddrs,
    mocks: Vec<MockEngine>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn harness(n: usize, tweak: impl FnOnce(&mut RouterConfig)) -> Harness {
    harness_with_fallbacks(n, 0, tweak).await
}

async fn harness_with_fallbacks(
    n: usize,
    fallbacks: usize,
    tweak: impl FnOnce(&mut RouterConfig),
) -> Harness {
    let mut mocks = Vec::new();
    for _ in 0..n {
        mocks.push(
            MockEngine::spawn(MockConfig {
                model: "m".into(),
                output_tokens: 3,
                ..Default::default()
            })
            .await
            .unwrap(),
        );
    }
    let mut config = RouterConfig {
        scrape_interval_ms: 10,
        health_interval_ms: 20,
        scrape_timeout_ms: 200,
        stale_after_ms: 200,
        endpoints: mocks
            .iter()
            .map(|m| EndpointSpec::new(m.url(), EngineKind::Vllm))
            .collect(),
        ..RouterConfig::default()
    };
    tweak(&mut config);
    let router = Router::new(config).unwrap();
    let r = router.clone();
    wait_for("endpoints ready", || {
        r.status().iter().all(|e| e.ready && !e.stale) && r.status().len() == n
    })
    .await;
    let ext = ExtProc::new(router.clone()).with_fallbacks(fallbacks);
    let listeners = Listeners::bind("127.0.0.1", 0, Some(0), Some(0))
        .await
        .unwrap();
    let addrs = listeners.addrs().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(ext.clone(), listeners, async move {
        let _ = stopped.await;
    }));
    Harness {
        router,
        ext,
        addrs,
        mocks,
        _stop: stop,
    }
}

async fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One ext_proc stream, as Envoy holds it for one HTTP request.
struct Exchange {
    tx: Option<mpsc::Sender<ProcessingRequest>>,
    rx: Streaming<ProcessingResponse>,
}

impl Harness {
    fn addr_of(&self, i: usize) -> String {
        self.mocks[i].addr().to_string()
    }

    async fn open(&self) -> Exchange {
        let mut client =
            ExternalProcessorClient::new(channel(&self.addrs.ext_proc.to_string()).await)
                .max_decoding_message_size(64 << 20);
        let (tx, rx) = mpsc::channel(64);
        let resp = client.process(ReceiverStream::new(rx)).await.unwrap();
        Exchange {
            tx: Some(tx),
            rx: resp.into_inner(),
        }
    }

    fn in_flight(&self, addr: &str) -> u32 {
        self.router
            .status()
            .into_iter()
            .find(|s| s.spec.url.ends_with(addr))
            .map(|s| s.in_flight)
            .unwrap()
    }
}

fn header_map(headers: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: headers
            .iter()
            .map(|(k, v)| HeaderValue {
                key: k.to_string(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn request_headers(path: &str, extra: &[(&str, &str)], eos: bool) -> ProcessingRequest {
    let mut h = vec![
        (":method", "POST"),
        (":path", path),
        (":authority", "gateway"),
        ("content-type", "application/json"),
    ];
    h.extend_from_slice(extra);
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&h)),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn request_body(b: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: eos,
        })),
        ..Default::default()
    }
}

fn response_headers(status: &str, content_type: &str, eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(&[
                (":status", status),
                ("content-type", content_type),
            ])),
            end_of_stream: eos,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_body(b: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: b.to_vec(),
            end_of_stream: eos,
        })),
        ..Default::default()
    }
}

fn subset_metadata(v: Value) -> Metadata {
    Metadata {
        filter_metadata: [(
            "envoy.lb.subset_hint".to_string(),
            Struct {
                fields: [("x-gateway-destination-endpoint-subset".to_string(), v)]
                    .into_iter()
                    .collect(),
            },
        )]
        .into_iter()
        .collect(),
        ..Default::default()
    }
}

fn string_list(items: &[&str]) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue {
            values: items
                .iter()
                .map(|s| Value {
                    kind: Some(Kind::StringValue(s.to_string())),
                })
                .collect(),
        })),
    }
}

impl Exchange {
    async fn send(&self, r: ProcessingRequest) {
        self.tx.as_ref().unwrap().send(r).await.unwrap();
    }

    async fn recv(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer in time")
            .expect("a healthy stream")
            .expect("the stream stays open")
    }

    /// Nothing arrives for a while.
    async fn quiet(&mut self, ms: u64) -> bool {
        tokio::time::timeout(Duration::from_millis(ms), self.rx.message())
            .await
            .is_err()
    }

    /// The whole request: headers, then the body in `chunk`-byte pieces.
    async fn request(&mut self, path: &str, headers: &[(&str, &str)], body: &[u8], chunk: usize) {
        self.send(request_headers(path, headers, false)).await;
        let pieces: Vec<&[u8]> = body.chunks(chunk.max(1)).collect();
        for (i, p) in pieces.iter().enumerate() {
            self.send(request_body(p, i + 1 == pieces.len())).await;
        }
    }

    /// Reads the header answer and the streamed body that follows it.
    async fn picked(&mut self) -> Picked {
        let first = self.recv().await;
        let metadata = first.dynamic_metadata.clone();
        let Some(processing_response::Response::RequestHeaders(h)) = first.response else {
            panic!("expected a request-headers answer, got {first:?}");
        };
        let common = h.response.unwrap();
        assert!(common.clear_route_cache, "the route is recomputed");
        let mut headers = Vec::new();
        let m = common.header_mutation.unwrap();
        for o in m.set_headers {
            let hv = o.header.unwrap();
            headers.push((hv.key, String::from_utf8(hv.raw_value).unwrap()));
        }
        let md = metadata
            .and_then(|s| s.fields.get("envoy.lb").cloned())
            .and_then(|v| match v.kind {
                Some(Kind::StructValue(s)) => {
                    s.fields.get("x-gateway-destination-endpoint").cloned()
                }
                _ => None,
            })
            .and_then(|v| match v.kind {
                Some(Kind::StringValue(s)) => Some(s),
                _ => None,
            })
            .expect("envoy.lb metadata names the destinations");
        Picked {
            headers,
            metadata: md,
            removed: m.remove_headers,
        }
    }

    async fn body_chunks(&mut self) -> Vec<(Vec<u8>, bool)> {
        let mut out = Vec::new();
        loop {
            let r = self.recv().await;
            let Some(processing_response::Response::RequestBody(b)) = r.response else {
                panic!("expected a body answer, got {r:?}");
            };
            let m = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
            let body_mutation::Mutation::StreamedResponse(s) = m else {
                panic!("bodies are streamed back");
            };
            let eos = s.end_of_stream;
            out.push((s.body, eos));
            if eos {
                return out;
            }
        }
    }

    async fn immediate(&mut self) -> (i32, serde_json::Value, Vec<(String, String)>) {
        let r = self.recv().await;
        let Some(processing_response::Response::ImmediateResponse(i)) = r.response else {
            panic!("expected an immediate response, got {r:?}");
        };
        let headers = i
            .headers
            .unwrap()
            .set_headers
            .into_iter()
            .map(|o| {
                let h = o.header.unwrap();
                (h.key, String::from_utf8(h.raw_value).unwrap())
            })
            .collect();
        let body: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
        (i.status.unwrap().code, body, headers)
    }

    /// The response phase with `chunks` of body; returns what came back.
    async fn respond(&mut self, content_type: &str, chunks: &[&[u8]]) -> Vec<u8> {
        self.send(response_headers("200", content_type, false))
            .await;
        let r = self.recv().await;
        assert!(
            matches!(
                r.response,
                Some(processing_response::Response::ResponseHeaders(_))
            ),
            "{r:?}"
        );
        let mut back = Vec::new();
        for (i, c) in chunks.iter().enumerate() {
            let eos = i + 1 == chunks.len();
            self.send(response_body(c, eos)).await;
            let r = self.recv().await;
            let Some(processing_response::Response::ResponseBody(b)) = r.response else {
                panic!("expected a response-body answer, got {r:?}");
            };
            let m = b.response.unwrap().body_mutation.unwrap().mutation.unwrap();
            let body_mutation::Mutation::StreamedResponse(s) = m else {
                panic!("streamed");
            };
            assert_eq!(s.end_of_stream, eos);
            back.extend_from_slice(&s.body);
        }
        back
    }
}

struct Picked {
    headers: Vec<(String, String)>,
    metadata: String,
    removed: Vec<String>,
}

impl Picked {
    fn header(&self, k: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    }
    fn destination(&self) -> &str {
        self.header("x-gateway-destination-endpoint").unwrap()
    }
}

fn completion(prompt: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"model": "m", "prompt": prompt, "max_tokens": 3})).unwrap()
}

#[tokio::test]
async fn picks_after_the_body_with_header_metadata_and_content_length() {
    let h = harness_with_fallbacks(3, 2, |_| {}).await;
    let mut x = h.open().await;
    let body = completion("the quick brown fox jumps over the lazy dog");
    x.send(request_headers(
        "/v1/completions",
        &[("x-request-id", "rid-1")],
        false,
    ))
    .await;
    assert!(x.quiet(150).await, "no answer before the body is complete");
    let (a, b) = body.split_at(10);
    x.send(request_body(a, false)).await;
    assert!(x.quiet(100).await, "still buffering");
    x.send(request_body(b, true)).await;
    let p = x.picked().await;
    // Header and metadata carry the same ordered list: the pick, then its fallbacks.
    assert_eq!(p.destination(), p.metadata, "header and metadata agree");
    let list: Vec<&str> = p.metadata.split(',').collect();
    let dest = list[0].to_string();
    let all: Vec<String> = (0..3).map(|i| h.addr_of(i)).collect();
    assert!(all.contains(&dest), "{dest} is one of the engines");
    assert_eq!(list.len(), 3);
    let mut sorted: Vec<String> = list.iter().map(|s| s.to_string()).collect();
    sorted.sort();
    let mut want = all.clone();
    want.sort();
    assert_eq!(sorted, want, "every endpoint once");
    assert_eq!(
        p.header("content-length"),
        Some(body.len().to_string().as_str())
    );
    assert_eq!(p.header("x-request-id"), Some("rid-1"));
    assert!(p
        .removed
        .iter()
        .any(|r| r == "x-gateway-destination-endpoint-served"));
    let chunks = x.body_chunks().await;
    let joined: Vec<u8> = chunks.iter().flat_map(|(c, _)| c.clone()).collect();
    assert_eq!(joined, body, "the body comes back whole");
    // The pick holds a lease until the response ends.
    assert_eq!(h.in_flight(&dest), 1);
    let back = x
        .respond(
            "application/json",
            &[br#"{"id":"x","usage":{"prompt_tokens":9,"completion_tokens":3}}"#],
        )
        .await;
    assert!(back.ends_with(b"}}"));
    wait_for("lease released", || h.in_flight(&dest) == 0).await;
    let text = h.ext.encode_metrics();
    assert!(
        text.contains(&format!(
            "strata_epp_prompt_tokens_total{{endpoint=\"{dest}\"}} 9"
        )),
        "{text}"
    );
    assert!(text.contains(&format!(
        "strata_epp_completion_tokens_total{{endpoint=\"{dest}\"}} 3"
    )));
    assert!(text.ends_with("# EOF\n") && text.matches("# EOF").count() == 1);
}

#[tokio::test]
async fn without_fallbacks_header_and_metadata_name_the_pick_alone() {
    // The default, for an ORIGINAL_DST data plane that reads one address.
    let h = harness(3, |_| {}).await;
    for i in 0..3 {
        let mut x = h.open().await;
        x.request("/v1/completions", &[], &completion(&format!("p{i}")), 64)
            .await;
        let p = x.picked().await;
        assert_eq!(p.destination(), p.metadata);
        assert!(!p.metadata.contains(','), "{}", p.metadata);
        assert!((0..3).any(|i| h.addr_of(i) == p.metadata));
    }
    // A request without a body too.
    let mut x = h.open().await;
    x.send(request_headers("/v1/models", &[], true)).await;
    let p = x.picked().await;
    assert_eq!(p.destination(), p.metadata);
    assert!(!p.metadata.contains(','));
}

#[tokio::test]
async fn large_bodies_come_back_in_bounded_chunks() {
    let h = harness(1, |_| {}).await;
    let mut x = h.open().await;
    let words: String = (0..40_000).map(|i| format!("w{i} ")).collect();
    let body = completion(&words);
    assert!(body.len() > 200_000);
    x.request("/v1/completions", &[], &body, 16_384).await;
    let p = x.picked().await;
    assert_eq!(
        p.header("content-length"),
        Some(body.len().to_string().as_str())
    );
    let chunks = x.body_chunks().await;
    assert!(chunks.len() >= 4);
    assert!(
        chunks.iter().all(|(c, _)| c.len() <= 62_000),
        "chunks of at most 62,000 bytes"
    );
    assert!(chunks[..chunks.len() - 1].iter().all(|(_, eos)| !eos));
    let joined: Vec<u8> = chunks.into_iter().flat_map(|(c, _)| c).collect();
    assert_eq!(joined, body);
}

#[tokio::test]
async fn a_request_without_body_is_picked_at_once() {
    let h = harness(2, |_| {}).await;
    let mut x = h.open().await;
    x.send(request_headers("/v1/models", &[(":method", "GET")], true))
        .await;
    let p = x.picked().await;
    assert!(p.header("content-length").is_none());
    let dest = p.destination().to_string();
    assert_eq!(h.in_flight(&dest), 1);
    x.send(response_headers("200", "application/json", true))
        .await;
    let r = x.recv().await;
    assert!(matches!(
        r.response,
        Some(processing_response::Response::ResponseHeaders(_))
    ));
    wait_for("lease released", || h.in_flight(&dest) == 0).await;
}

#[tokio::test]
async fn bad_bodies_are_answered_400_and_never_reach_an_engine() {
    let h = harness(1, |c| c.max_body_bytes = 4096).await;
    let cases: Vec<(&str, Vec<u8>, i32, Option<&str>)> = vec![
        ("/v1/completions", b"{not json".to_vec(), 400, None),
        (
            "/v1/completions",
            br#"{"prompt":"hi"}"#.to_vec(),
            400,
            Some("model"),
        ),
        (
            "/v1/embeddings",
            br#"{"model":7,"input":"x"}"#.to_vec(),
            400,
            Some("model"),
        ),
        ("/v1/embeddings", br#"[1,2,3]"#.to_vec(), 400, None),
        ("/v1/completions", completion(&"x ".repeat(4000)), 413, None),
    ];
    for (path, body, status, param) in cases {
        let mut x = h.open().await;
        x.request(path, &[("x-request-id", "bad-1")], &body, 1000)
            .await;
        let (code, err, headers) = x.immediate().await;
        assert_eq!(code, status, "{path} {:?}", String::from_utf8_lossy(&body));
        assert!(err["error"]["message"].is_string(), "OpenAI-shaped: {err}");
        assert!(err["error"]["type"].is_string());
        if let Some(p) = param {
            assert_eq!(err["error"]["param"], p);
        }
        assert!(headers.contains(&("content-type".into(), "application/json".into())));
        assert!(headers.contains(&("x-request-id".into(), "bad-1".into())));
    }
    assert_eq!(h.mocks[0].requests(), 0);
    assert_eq!(h.in_flight(&h.addr_of(0)), 0);

    // What the engine validates is not judged here (issue 26): a chat request whose
    // `messages` is not a list is picked and goes on byte for byte; the engine answers
    // its own 400.
    let odd = br#"{"model":"m","messages":"nope"}"#;
    let mut x = h.open().await;
    x.request(
        "/v1/chat/completions",
        &[("x-request-id", "odd-1")],
        odd,
        1000,
    )
    .await;
    let p = x.picked().await;
    let body: Vec<u8> = x
        .body_chunks()
        .await
        .into_iter()
        .flat_map(|(b, _)| b)
        .collect();
    assert_eq!(body, odd.to_vec());
    let dest = p.destination().to_string();
    drop(x);
    wait_for("lease released", || h.in_flight(&dest) == 0).await;
}

#[tokio::test]
async fn no_ready_endpoint_is_503_and_shed_is_429() {
    // Held requests wait at most 300 ms here.
    let h = harness(2, |c| c.flow_control.default_ttl_ms = Some(300)).await;
    // Saturated pool: a sheddable request is refused with 429.
    for m in &h.mocks {
        m.set_gauges(20, 0, 0.1);
    }
    let r = h.router.clone();
    wait_for("saturation seen", || r.saturated()).await;
    let mut x = h.open().await;
    x.request(
        "/v1/completions",
        &[("x-gateway-inference-objective", "-1")],
        &completion("hi"),
        100,
    )
    .await;
    let (code, err, headers) = x.immediate().await;
    assert_eq!(code, 429);
    assert_eq!(err["error"]["type"], "rate_limit_error", "{err}");
    assert!(headers.contains(&("retry-after".into(), "1".into())));
    // No replica ready: held up to its time to live, then 503.
    for m in &h.mocks {
        m.set_gauges(0, 0, 0.0);
        m.set_fault(Fault::NotReady);
    }
    wait_for("nothing ready", || !r.any_ready()).await;
    let mut x = h.open().await;
    let sent = std::time::Instant::now();
    x.request("/v1/completions", &[], &completion("hi"), 100)
        .await;
    let (code, err, headers) = x.immediate().await;
    assert_eq!(code, 503);
    assert!(
        sent.elapsed() >= std::time::Duration::from_millis(250),
        "held first"
    );
    assert!(err["error"]["message"].as_str().unwrap().contains("ready"));
    assert!(headers.contains(&("retry-after".into(), "1".into())));
    assert_eq!(h.mocks.iter().map(|m| m.requests()).sum::<u64>(), 0);
    let text = r.metrics().encode();
    assert!(
        text.contains("strata_router_flow_evicted_total{reason=\"held_ttl\"} 1"),
        "{text}"
    );
}

#[tokio::test]
async fn a_request_to_an_empty_pool_is_held_and_picked_once_a_replica_is_ready() {
    let h = harness(1, |c| c.flow_control.default_ttl_ms = Some(10_000)).await;
    h.mocks[0].set_fault(Fault::NotReady);
    let r = h.router.clone();
    wait_for("nothing ready", || !r.any_ready()).await;
    let mut x = h.open().await;
    x.request(
        "/v1/completions",
        &[("x-gateway-inference-fairness-id", "tenant-a")],
        &completion("hi"),
        100,
    )
    .await;
    wait_for("held", || r.held_requests() == 1).await;
    let text = r.metrics().encode();
    assert!(
        text.contains("strata_router_flow_held_requests{pool=\"default\"} 1"),
        "{text}"
    );
    assert_eq!(
        r.flows_json()["flows"]["bands"][0]["flows"][0]["flow"],
        "tenant-a"
    );
    // The replica becomes ready: the held request is picked at once.
    h.mocks[0].set_fault(Fault::None);
    let p = x.picked().await;
    assert_eq!(p.destination(), h.addr_of(0));
    assert_eq!(r.held_requests(), 0);
}

#[tokio::test]
async fn the_subset_hint_and_selection_header_restrict_the_pick() {
    // With fallbacks on, so that the list is seen to stay inside the subset too.
    let h = harness_with_fallbacks(3, 2, |_| {}).await;
    let target = h.addr_of(2);
    for _ in 0..6 {
        let mut x = h.open().await;
        let mut hdr = request_headers("/v1/completions", &[], false);
        hdr.metadata_context = Some(subset_metadata(string_list(&[&target])));
        x.send(hdr).await;
        x.send(request_body(&completion("a b c"), true)).await;
        let p = x.picked().await;
        assert_eq!(p.destination(), target);
        assert_eq!(p.metadata, target, "fallbacks stay inside the subset");
    }
    // A comma-joined string works too, and the pick comes from it.
    let two = format!("{},{}", h.addr_of(0), h.addr_of(1));
    let mut x = h.open().await;
    let mut hdr = request_headers("/v1/completions", &[], false);
    hdr.metadata_context = Some(subset_metadata(Value {
        kind: Some(Kind::StringValue(two.clone())),
    }));
    x.send(hdr).await;
    x.send(request_body(&completion("a b c"), true)).await;
    let p = x.picked().await;
    let named: Vec<&str> = p.destination().split(',').collect();
    assert_eq!(named.len(), 2, "the pick and one fallback: {named:?}");
    assert!(named.iter().all(|a| two.split(',').any(|t| t == *a)));
    assert_eq!(p.metadata, p.destination());
    // A subset naming nothing we know, or an empty one: 503.
    for subset in [string_list(&["10.255.255.1:8000"]), string_list(&[])] {
        let mut x = h.open().await;
        let mut hdr = request_headers("/v1/completions", &[], false);
        hdr.metadata_context = Some(subset_metadata(subset));
        x.send(hdr).await;
        x.send(request_body(&completion("a b c"), true)).await;
        let (code, _, _) = x.immediate().await;
        assert_eq!(code, 503);
    }
    // The conformance header, with a port or a bare IP.
    let chosen = h.addr_of(1);
    for value in [chosen.clone(), format!("10.9.9.9,{chosen}")] {
        for _ in 0..4 {
            let mut x = h.open().await;
            x.request(
                "/v1/completions",
                &[("test-epp-endpoint-selection", &value)],
                &completion("z"),
                100,
            )
            .await;
            assert_eq!(x.picked().await.destination(), chosen);
        }
    }
    let mut x = h.open().await;
    x.request(
        "/v1/completions",
        &[("test-epp-endpoint-selection", "127.0.0.1")],
        &completion("z"),
        100,
    )
    .await;
    assert!(x.picked().await.destination().starts_with("127.0.0.1:"));
}

#[tokio::test]
async fn the_lease_is_released_exactly_once_also_when_the_client_goes_away() {
    let h = harness(1, |_| {}).await;
    let addr = h.addr_of(0);
    let mut a = h.open().await;
    a.request("/v1/completions", &[], &completion("one"), 100)
        .await;
    a.picked().await;
    a.body_chunks().await;
    let mut b = h.open().await;
    b.request("/v1/completions", &[], &completion("two"), 100)
        .await;
    b.picked().await;
    b.body_chunks().await;
    assert_eq!(h.in_flight(&addr), 2);
    // `a` goes away mid-response: Envoy closes its stream.
    a.send(response_headers("200", "text/event-stream", false))
        .await;
    a.recv().await;
    a.send(response_body(b"data: {\"choices\":[]}\n\n", false))
        .await;
    a.recv().await;
    a.tx = None;
    drop(a);
    wait_for("a's lease released", || h.in_flight(&addr) == 1).await;
    // Released once: `b`'s lease still counts.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.in_flight(&addr), 1);
    let back = b
        .respond(
            "text/event-stream",
            &[
                b"data: {\"choices\":[{\"text\":\" tok\"}]}\n\n",
                b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n",
            ],
        )
        .await;
    assert!(
        back.ends_with(b"data: [DONE]\n\n"),
        "SSE passes through intact"
    );
    wait_for("b's lease released", || h.in_flight(&addr) == 0).await;
    // Messages after the end change nothing.
    b.send(response_body(b"", true)).await;
    b.recv().await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(h.in_flight(&addr), 0);
    let text = h.ext.encode_metrics();
    assert!(text.contains("strata_epp_abandoned_total 1"), "{text}");
}

#[tokio::test]
async fn the_model_rewrite_header_re_encodes_the_body() {
    let h = harness(1, |_| {}).await;
    let mut x = h.open().await;
    let body =
        serde_json::to_vec(&json!({"model": "alias", "prompt": "hello", "max_tokens": 2})).unwrap();
    x.request(
        "/v1/completions",
        &[("x-gateway-model-name-rewrite", "m")],
        &body,
        7,
    )
    .await;
    let p = x.picked().await;
    let chunks = x.body_chunks().await;
    let joined: Vec<u8> = chunks.into_iter().flat_map(|(c, _)| c).collect();
    let v: serde_json::Value = serde_json::from_slice(&joined).unwrap();
    assert_eq!(v["model"], "m");
    assert_eq!(v["prompt"], "hello");
    assert_eq!(
        p.header("content-length"),
        Some(joined.len().to_string().as_str())
    );
}

#[tokio::test]
async fn health_follows_readiness() {
    let h = harness(1, |_| {}).await;
    let check = |service: &'static str| {
        let addr = h.addrs.health.unwrap();
        async move {
            let mut c = HealthClient::new(channel(&addr.to_string()).await);
            c.check(HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner()
            .status
        }
    };
    for s in [
        "liveness",
        "readiness",
        "inference-extension",
        "envoy.service.ext_proc.v3.ExternalProcessor",
    ] {
        assert_eq!(check(s).await, ServingStatus::Serving as i32, "{s}");
    }
    h.mocks[0].set_fault(Fault::NotReady);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while check("readiness").await != ServingStatus::NotServing as i32 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "readiness never dropped"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(check("liveness").await, ServingStatus::Serving as i32);
    // The metrics port serves both registries.
    let url = format!("http://{}/metrics", h.addrs.metrics.unwrap());
    let body = fetch(&url).await;
    assert!(
        body.contains("strata_router_") && body.contains("strata_epp_"),
        "{body}"
    );
    // And flow control's queues.
    let flows = fetch(&format!("http://{}/debug/flows", h.addrs.metrics.unwrap())).await;
    let flows: serde_json::Value = serde_json::from_str(&flows).unwrap();
    assert_eq!(flows["pool"], "default", "{flows}");
    assert_eq!(flows["flows"]["requests"], 0, "{flows}");
}

async fn fetch(url: &str) -> String {
    use http_body_util::{BodyExt, Empty};
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<bytes::Bytes>>();
    let resp = client.get(url.parse().unwrap()).await.unwrap();
    let b = resp.into_body().collect().await.unwrap().to_bytes();
    String::from_utf8_lossy(&b).into_owned()
}

async fn channel(addr: &str) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

#[tokio::test]
async fn a_fallback_that_served_takes_over_the_lease_and_the_pick_counts_a_failure() {
    let h = harness_with_fallbacks(2, 1, |_| {}).await;
    let mut x = h.open().await;
    x.request("/v1/completions", &[], &completion("fall back"), 100)
        .await;
    let p = x.picked().await;
    let (pick, fallback) = p.metadata.split_once(',').expect("a pick and a fallback");
    let (pick, fallback) = (pick.to_string(), fallback.to_string());
    x.body_chunks().await;
    assert_eq!((h.in_flight(&pick), h.in_flight(&fallback)), (1, 0));
    // Envoy could not reach the pick and says (the `upstream.address` attribute) that the
    // fallback answered.
    let mut resp = response_headers("200", "application/json", false);
    resp.attributes.insert(
        "envoy.filters.http.ext_proc".into(),
        Struct {
            fields: [(
                "upstream.address".to_string(),
                Value {
                    kind: Some(Kind::StringValue(fallback.clone())),
                },
            )]
            .into_iter()
            .collect(),
        },
    );
    x.send(resp).await;
    x.recv().await;
    assert_eq!((h.in_flight(&pick), h.in_flight(&fallback)), (0, 1));
    let circuit = |addr: &str| {
        h.router
            .status()
            .into_iter()
            .find(|s| s.spec.url.ends_with(addr))
            .unwrap()
            .circuit
    };
    assert_eq!(
        circuit(&pick),
        strata_router::circuit::Circuit::Closed { failures: 1 }
    );
    assert_eq!(
        circuit(&fallback),
        strata_router::circuit::Circuit::Closed { failures: 0 }
    );
    x.send(response_body(
        br#"{"usage":{"prompt_tokens":2,"completion_tokens":1}}"#,
        true,
    ))
    .await;
    x.recv().await;
    wait_for("released", || h.in_flight(&fallback) == 0).await;
    assert_eq!(h.in_flight(&pick), 0);
    let text = h.ext.encode_metrics();
    assert!(
        text.contains(&format!(
            "strata_epp_completion_tokens_total{{endpoint=\"{fallback}\"}} 1"
        )),
        "{text}"
    );
}

#[tokio::test]
async fn the_profile_pair_names_the_prefill_engine_in_x_prefiller_host_port() {
    // Mock 0 prefills, mocks 1 and 2 decode; a request is split at 50 uncached tokens.
    let h = harness(3, |c| {
        c.endpoints[0].role = Some("prefill".into());
        c.endpoints[1].role = Some("decode".into());
        c.endpoints[2].role = Some("decode".into());
        c.scheduling = Some(strata_router::EndpointPickerConfig::pd(50));
    })
    .await;
    let decoders = [h.addr_of(1), h.addr_of(2)];
    let long = |tag: usize| -> String { (0..200).map(|i| format!("w{tag}x{i} ")).collect() };
    let mut first_decoder = String::new();
    for tag in 0..3 {
        let mut x = h.open().await;
        x.request(
            "/v1/completions",
            // A client cannot name its own prefill engine.
            &[("x-prefiller-host-port", "10.9.9.9:1")],
            &completion(&long(tag)),
            4096,
        )
        .await;
        let p = x.picked().await;
        assert!(
            decoders.contains(&p.destination().to_string()),
            "decode pick"
        );
        assert_eq!(p.destination(), p.metadata);
        assert_eq!(
            p.header("x-prefiller-host-port"),
            Some(h.addr_of(0).as_str()),
            "the prefill pick"
        );
        if tag == 0 {
            first_decoder = p.destination().to_string();
        }
        let _ = x.body_chunks().await;
        let _ = x.respond("application/json", &[b"{}"]).await;
    }
    // The first long prompt again: cached on its decoder now, so no prefill hop.
    let mut x = h.open().await;
    x.request("/v1/completions", &[], &completion(&long(0)), 4096)
        .await;
    let p = x.picked().await;
    assert_eq!(p.destination(), first_decoder);
    assert_eq!(p.header("x-prefiller-host-port"), None);
    let _ = x.body_chunks().await;
    let _ = x.respond("application/json", &[b"{}"]).await;
    // Short: the decode pick alone, and the client's header removed.
    let mut x = h.open().await;
    x.request(
        "/v1/completions",
        &[("x-prefiller-host-port", "10.9.9.9:1")],
        &completion("hi"),
        4096,
    )
    .await;
    let p = x.picked().await;
    assert!(decoders.contains(&p.destination().to_string()));
    assert_eq!(p.header("x-prefiller-host-port"), None);
    assert!(p.removed.iter().any(|r| r == "x-prefiller-host-port"));
    let metrics = h.ext.encode_metrics();
    assert!(
        metrics.contains("strata_router_pd_requests_total{path=\"decode_only\"} 2")
            && metrics.contains("strata_router_pd_requests_total{path=\"disaggregated\"} 3"),
        "{metrics}"
    );
}
