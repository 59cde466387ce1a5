//! Distributed traces across processes: a real `strata engine` (default model), `strata
//! router` and `strata gateway`, each exporting OTLP/HTTP to a minimal receiver in this
//! test (axum on loopback, decoding the protobuf `ExportTraceServiceRequest`). One request
//! with a W3C `traceparent` must come back as one trace that covers all three services,
//! with every span's parent the span that caused it: the client's span → the gateway's
//! request → its stages and its try → the router's request → its pick and proxy → the
//! engine's request → queue, prefill, decode. A malformed `traceparent` is no error: the
//! request is served and starts a trace of its own.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use common::{free_port, http, http_with_headers, read_until, strata};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use prost::Message;

/// One received span, its ids in lowercase hex.
#[derive(Debug, Clone)]
struct Rec {
    service: String,
    trace: String,
    id: String,
    parent: String,
    name: String,
    start: u64,
    end: u64,
    attrs: HashMap<String, String>,
}

type Received = Arc<Mutex<Vec<Rec>>>;

fn value_text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        _ => String::new(),
    }
}

async fn receive(State(got): State<Received>, body: Bytes) -> (axum::http::StatusCode, Vec<u8>) {
    let Ok(req) = ExportTraceServiceRequest::decode(body) else {
        return (axum::http::StatusCode::BAD_REQUEST, Vec::new());
    };
    let mut out = Vec::new();
    for rs in req.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .map(value_text)
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(Rec {
                    service: service.clone(),
                    trace: hex(&s.trace_id),
                    id: hex(&s.span_id),
                    parent: hex(&s.parent_span_id),
                    name: s.name,
                    start: s.start_time_unix_nano,
                    end: s.end_time_unix_nano,
                    attrs: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), value_text(kv)))
                        .collect(),
                });
            }
        }
    }
    got.lock().unwrap().extend(out);
    // An empty ExportTraceServiceResponse encodes to no bytes.
    (axum::http::StatusCode::OK, Vec::new())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A child process killed on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `strata <args>` with no OTLP settings inherited from the test's environment and short
/// batch delays, so spans leave within a fraction of a second.
fn spawn(args: &[&str], env: &[(&str, &str)], stdout: Stdio) -> Proc {
    let mut cmd = strata();
    for k in [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SERVICE_NAME",
        "OTEL_SDK_DISABLED",
        "STRATA_ROUTER_HOST",
        "STRATA_ROUTER_PORT",
        "STRATA_ROUTER_HTTP_PORT",
    ] {
        cmd.env_remove(k);
    }
    cmd.env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .envs(env.iter().copied())
        .args(args)
        .stdout(stdout)
        .stderr(Stdio::inherit());
    Proc(cmd.spawn().expect("spawn strata"))
}

fn wait_ready(p: &mut Proc, addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some((200, _)) = http(addr, "GET", "/health", "") {
            return;
        }
        if let Ok(Some(status)) = p.0.try_wait() {
            panic!("{what} exited early with {status}");
        }
        assert!(Instant::now() < deadline, "{what} not ready in 120 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// The spans of `trace` once every name in `want` has arrived (or what arrived in 20 s).
fn spans_of(got: &Received, trace: &str, want: &[&str]) -> Vec<Rec> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let spans: Vec<Rec> = got
            .lock()
            .unwrap()
            .iter()
            .filter(|s| s.trace == trace)
            .cloned()
            .collect();
        if want.iter().all(|w| spans.iter().any(|s| s.name == *w)) || Instant::now() > deadline {
            return spans;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn one<'a>(spans: &'a [Rec], name: &str) -> &'a Rec {
    let found: Vec<&Rec> = spans.iter().filter(|s| s.name == name).collect();
    assert_eq!(found.len(), 1, "exactly one `{name}` span in {spans:#?}");
    found[0]
}

/// Every span a request through gateway → router → engine leaves.
const ALL: &[&str] = &[
    "gateway.request",
    "gateway.admit",
    "gateway.lookup",
    "gateway.plan",
    "gateway.try",
    "gateway.respond",
    "gateway.settle",
    "router.request",
    "router.pick",
    "router.proxy",
    "engine.request",
    "engine.queue",
    "engine.prefill",
    "engine.decode",
];

/// Asserts one whole trace: services, parent links, timing and the pick's attributes.
fn check_trace(spans: &[Rec], client_span: Option<&str>, engine_addr: SocketAddr) {
    let services: std::collections::BTreeSet<&str> =
        spans.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services.into_iter().collect::<Vec<_>>(),
        ["strata-engine", "strata-gateway", "strata-router"],
        "one trace covers the three processes: {spans:#?}"
    );
    let gw = one(spans, "gateway.request");
    assert_eq!(gw.service, "strata-gateway");
    match client_span {
        Some(p) => assert_eq!(gw.parent, p, "the client's span is the gateway's parent"),
        None => assert!(gw.parent.is_empty(), "a new trace starts at the gateway"),
    }
    for stage in [
        "gateway.admit",
        "gateway.lookup",
        "gateway.plan",
        "gateway.try",
        "gateway.respond",
        "gateway.settle",
    ] {
        assert_eq!(
            one(spans, stage).parent,
            gw.id,
            "{stage} is a stage of the request"
        );
    }
    let gw_try = one(spans, "gateway.try");
    assert_eq!(
        gw_try
            .attrs
            .get("http.response.status_code")
            .map(String::as_str),
        Some("200")
    );
    let rt = one(spans, "router.request");
    assert_eq!(rt.service, "strata-router");
    assert_eq!(
        rt.parent, gw_try.id,
        "the router's request is the gateway try's child"
    );
    let pick = one(spans, "router.pick");
    let proxy = one(spans, "router.proxy");
    assert_eq!(pick.parent, rt.id);
    assert_eq!(proxy.parent, rt.id);
    let engine_url = format!("http://{engine_addr}");
    assert_eq!(pick.attrs.get("endpoint"), Some(&engine_url), "{pick:?}");
    assert_eq!(pick.attrs.get("candidates").map(String::as_str), Some("1"));
    assert!(
        pick.attrs
            .get("scores")
            .is_some_and(|s| s.starts_with(&format!("{engine_addr}="))),
        "{pick:?}"
    );
    let en = one(spans, "engine.request");
    assert_eq!(en.service, "strata-engine");
    assert_eq!(
        en.parent, proxy.id,
        "the engine's request is the router proxy's child"
    );
    let (queue, prefill, decode) = (
        one(spans, "engine.queue"),
        one(spans, "engine.prefill"),
        one(spans, "engine.decode"),
    );
    for phase in [queue, prefill, decode] {
        assert_eq!(phase.parent, en.id);
        assert_eq!(phase.service, "strata-engine");
        assert!(phase.start <= phase.end, "{phase:?}");
        // Times come from another clock reading (Instant → wall clock): allow 5 ms.
        let slack = 5_000_000;
        assert!(
            phase.start + slack >= en.start && phase.end <= en.end + slack,
            "{phase:?} inside {en:?}"
        );
    }
    assert!(queue.end <= prefill.start + 1_000_000 && prefill.end <= decode.start + 1_000_000);
    assert!(prefill
        .attrs
        .get("prompt_tokens")
        .is_some_and(|n| n.parse::<u64>().unwrap() > 0));
    // Nested in time across processes too (one machine, one clock).
    assert!(
        gw.start <= rt.start && rt.start <= en.start,
        "{gw:?} {rt:?} {en:?}"
    );
}

#[test]
fn one_trace_covers_gateway_router_and_engine() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let got: Received = Arc::default();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let otlp = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route("/v1/traces", post(receive))
        .with_state(got.clone());
    rt.spawn(async move { axum::serve(listener, app).await });

    // Each process finds the endpoint a different supported way.
    let (ep, rp, gp) = (free_port(), free_port(), free_port());
    let mut engine = spawn(
        &[
            "engine",
            "--port",
            &ep.to_string(),
            "--served-model-name",
            "traced",
            "--kv-cache-memory",
            "268435456",
            "--otlp-endpoint",
            &otlp,
        ],
        &[],
        Stdio::null(),
    );
    let engine_addr = loopback(ep);
    let engine_url = format!("http://{engine_addr}");
    let mut router = spawn(
        &[
            "router",
            "--port",
            &rp.to_string(),
            "--endpoints",
            &engine_url,
        ],
        &[("OTEL_EXPORTER_OTLP_ENDPOINT", &otlp)],
        Stdio::null(),
    );
    // A router that does not export: it must pass the caller's `traceparent` on as is.
    let dark_port = free_port();
    let mut dark_router = spawn(
        &[
            "router",
            "--port",
            &dark_port.to_string(),
            "--endpoints",
            &engine_url,
            "--otlp-endpoint",
            &otlp,
        ],
        &[("OTEL_SDK_DISABLED", "true")],
        Stdio::null(),
    );
    let traces_url = format!("{otlp}/v1/traces");
    let mut gateway = spawn(
        &[
            "gateway",
            "--port",
            &gp.to_string(),
            "--db",
            ":memory:",
            "--upstream",
            &format!("http://127.0.0.1:{rp}"),
            "--model",
            "traced",
            "--create-key-for",
            "tracing",
        ],
        &[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", &traces_url)],
        Stdio::piped(),
    );
    let lines = read_until(&mut gateway.0, "gateway API key", Duration::from_secs(60))
        .expect("the gateway prints its key");
    let key = lines
        .last()
        .and_then(|l| l.rsplit(": ").next())
        .unwrap()
        .trim()
        .to_string();
    wait_ready(&mut engine, engine_addr, "engine");
    wait_ready(&mut router, loopback(rp), "router");
    wait_ready(&mut gateway, loopback(gp), "gateway");
    wait_ready(
        &mut dark_router,
        loopback(dark_port),
        "router without export",
    );

    let auth = format!("Bearer {key}");
    // Each request asks something new, so no cache answers for the engine.
    let ask = |traceparent: &str, stream: bool, content: &str| {
        let body = serde_json::json!({
            "model": "traced",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 4,
            "temperature": 0,
            "stream": stream,
        })
        .to_string();
        let mut headers = vec![("Authorization", auth.as_str())];
        if !traceparent.is_empty() {
            headers.push(("traceparent", traceparent));
        }
        let (status, text) = http_with_headers(
            loopback(gp),
            "POST",
            "/v1/chat/completions",
            &body,
            &headers,
        )
        .expect("the gateway answers");
        assert_eq!(status, 200, "{text}");
        text
    };

    // A whole answer, then a stream, each in the client's own trace.
    let trace_a = "4bf92f3577b34da6a3ce929d0e0e4736";
    let client_a = "00f067aa0ba902b7";
    ask(&format!("00-{trace_a}-{client_a}-01"), false, "Say hello.");
    let trace_b = "0af7651916cd43dd8448eb211c80319c";
    let client_b = "b7ad6b7169203331";
    let streamed = ask(
        &format!("00-{trace_b}-{client_b}-01"),
        true,
        "Count to three.",
    );
    assert!(streamed.contains("[DONE]"), "{streamed}");

    let spans = spans_of(&got, trace_a, ALL);
    check_trace(&spans, Some(client_a), engine_addr);
    let decode = one(&spans, "engine.decode");
    let n: u64 = decode.attrs["completion_tokens"].parse().unwrap();
    assert!((1..=4).contains(&n), "{decode:?}");
    check_trace(&spans_of(&got, trace_b, ALL), Some(client_b), engine_addr);

    // A malformed traceparent (uppercase hex) is served and starts a new trace at the
    // gateway, which still reaches the engine whole.
    let before: std::collections::HashSet<String> = got
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.trace.clone())
        .collect();
    ask(
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",
        false,
        "Name a colour.",
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    let fresh = loop {
        let found = got
            .lock()
            .unwrap()
            .iter()
            .find(|s| s.name == "gateway.request" && !before.contains(&s.trace))
            .map(|s| s.trace.clone());
        if let Some(t) = found {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "no new trace for the malformed header"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_ne!(fresh, trace_a);
    check_trace(&spans_of(&got, &fresh, ALL), None, engine_addr);

    // The router and the engine treat bad headers the same way when they are the edge.
    let body = |content: &str| {
        serde_json::json!({
            "model": "traced",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": 2,
        })
        .to_string()
    };
    let version_ff = "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    for (addr, header, content) in [
        (loopback(rp), "garbage", "Name a fruit."),
        (engine_addr, version_ff, "Name a tree."),
    ] {
        let (status, text) = http_with_headers(
            addr,
            "POST",
            "/v1/chat/completions",
            &body(content),
            &[("traceparent", header)],
        )
        .expect("an answer");
        assert_eq!(status, 200, "{addr} {header:?}: {text}");
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let edge = loop {
        let found = got
            .lock()
            .unwrap()
            .iter()
            .find(|s| s.name == "router.request" && !before.contains(&s.trace) && s.trace != fresh)
            .cloned();
        if let Some(r) = found {
            break r;
        }
        assert!(
            Instant::now() < deadline,
            "no trace for the router's bad header"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(edge.parent.is_empty(), "{edge:?}");
    let spans = spans_of(&got, &edge.trace, &["router.proxy", "engine.request"]);
    assert_eq!(
        one(&spans, "engine.request").parent,
        one(&spans, "router.proxy").id
    );

    // Through the router that does not export, the engine's parent is the caller's span.
    let trace_c = "a3ce929d0e0e47364bf92f3577b34da6";
    let client_c = "0ba902b700f067aa";
    let (status, text) = http_with_headers(
        loopback(dark_port),
        "POST",
        "/v1/chat/completions",
        &body("Name a river."),
        &[("traceparent", &format!("00-{trace_c}-{client_c}-01"))],
    )
    .expect("an answer");
    assert_eq!(status, 200, "{text}");
    let spans = spans_of(&got, trace_c, &["engine.request", "engine.decode"]);
    assert!(
        spans.iter().all(|s| s.service == "strata-engine"),
        "{spans:#?}"
    );
    assert_eq!(one(&spans, "engine.request").parent, client_c);
}
