//! The endpoint picker transport: `envoy.service.ext_proc.v3.ExternalProcessor` over gRPC
//! (PROTOCOLS §5), so that an Envoy gateway (the Gateway API Inference Extension's data
//! plane) asks this router which replica gets each request. It drives the same
//! [`Router`] as the HTTP front (`proxy`) and reads requests through the same intake
//! ([`crate::intake`]): one pool, one scheduler, one routing view, two transports.
//!
//! One gRPC stream is one HTTP request. Envoy runs in `FULL_DUPLEX_STREAMED` mode for
//! bodies, so it forwards upstream only what the picker streams back:
//!
//! 1. request headers are kept, not answered yet (the pick needs the body);
//! 2. request body chunks are buffered (at most `max_body_bytes`, else 413) until end of
//!    stream, then read once into the routing view: only what cannot be routed (a body
//!    that is not JSON, no `model` where the API runs one) is answered 400 as an
//!    `ImmediateResponse`; everything else goes on to the engine, which judges it;
//! 3. admission for requests that name a model (a sheddable request while the pool is
//!    saturated: 429) and [`Router::pick_within`] restricted to the subset hint and the
//!    conformance selection header (none left: 503), or the replica holding the stored
//!    response the request needs; the pick's lease is taken here;
//! 4. the answer: a header response that sets `x-gateway-destination-endpoint` and the
//!    `envoy.lb` dynamic metadata to the same value (the protocol forbids them to differ):
//!    the pick, then up to [`ExtProc::with_fallbacks`] fallbacks in rank order
//!    (`ip:port,ip:port`); a corrected `Content-Length`, `clear_route_cache`; then the whole
//!    body in chunks of at most 62,000 bytes, the last one ending the stream (the bytes as
//!    they came, unless the model rewrite header replaced the `model` value);
//!    With a prefill/decode profile pair, the destination is the decode pick and a
//!    disaggregated request also gets `x-prefiller-host-port: <prefill host:port>` (llm-d's
//!    header): the decode side runs phase 1 against that engine itself. A client's own
//!    `x-prefiller-*` headers are always removed;
//! 5. the response passes straight through chunk by chunk; `usage` (JSON or any event of
//!    a stream, whatever the API) is read for the serving endpoint's token counters (a
//!    fallback that served takes the lease over, the pick's circuit counting a failure),
//!    a Responses answer's id is remembered with the endpoint that holds it, and the lease
//!    is released at the response's end, or when the stream goes away (the client or Envoy
//!    gave up), whichever comes first: it is an owned value dropped once.
//!
//! A request whose headers end the stream (no body) is picked at once: by the stored
//! response its path names, else among every ready replica (it names no model).

pub mod address;
pub mod messages;
pub mod serve;
pub mod tls;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use futures_util::Stream;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use rand::Rng;
use strata_api::ApiError;
use tonic::{Request, Response, Status, Streaming};

use crate::admission::Ticket;
use crate::endpoint::EndpointId;
use crate::headers::{MODEL_REWRITE, TEST_SELECTION};
use crate::intake::{self, Api, Headers, Incoming, Intake};
use crate::response_homes::ResponseIdScan;
use crate::router::{Lease, Picked, Router};
use crate::scheduling::SchedRequest;
use crate::usage::UsageScan;
use address::{address_allowed, address_of};
use messages::{DESTINATION, LB_NAMESPACE, SERVED, SUBSET_KEY, SUBSET_NAMESPACE};

/// The gRPC service name, also a health-check service name.
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

pub use crate::headers::PREFILLER;

/// Most fallbacks one answer may name after the pick.
pub const MAX_FALLBACKS: usize = 7;
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EndpointLabel {
    pub endpoint: String,
}

/// Counters of the ext_proc transport (`strata_epp_*`).
pub struct ExtProcMetrics {
    registry: Registry,
    /// Streams by outcome: `picked`, `passthrough` (no pick needed), or the HTTP status
    /// of an immediate response.
    pub requests: Family<CodeLabel, Counter>,
    pub prompt_tokens: Family<EndpointLabel, Counter>,
    pub completion_tokens: Family<EndpointLabel, Counter>,
    /// Streams that ended before the response did (the client or Envoy went away).
    pub abandoned: Counter,
    /// `requests{code="picked"}`, held so the hot path does not look it up.
    picked: Counter,
}

impl Default for ExtProcMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ExtProcMetrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("strata_epp");
        let m = ExtProcMetrics {
            registry: Registry::default(),
            requests: Family::default(),
            prompt_tokens: Family::default(),
            completion_tokens: Family::default(),
            abandoned: Counter::default(),
            picked: Counter::default(),
        };
        registry.register(
            "requests",
            "ext_proc streams by outcome",
            m.requests.clone(),
        );
        registry.register(
            "prompt_tokens",
            "Prompt tokens served, from the responses' usage",
            m.prompt_tokens.clone(),
        );
        registry.register(
            "completion_tokens",
            "Completion tokens served, from the responses' usage",
            m.completion_tokens.clone(),
        );
        registry.register(
            "abandoned",
            "Streams that ended before their response finished",
            m.abandoned.clone(),
        );
        let picked = m
            .requests
            .get_or_create(&CodeLabel {
                code: "picked".into(),
            })
            .clone();
        ExtProcMetrics {
            registry,
            picked,
            ..m
        }
    }

    fn outcome(&self, code: &str) {
        self.requests
            .get_or_create(&CodeLabel { code: code.into() })
            .inc();
    }

    /// Prometheus text, without the closing `# EOF` (the caller joins registries).
    pub fn encode_body(&self) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        strip_eof(out)
    }
}

pub(crate) fn strip_eof(mut s: String) -> String {
    if let Some(i) = s.rfind("# EOF") {
        s.truncate(i);
    }
    s
}

/// The ext_proc service over one [`Router`].
#[derive(Clone)]
pub struct ExtProc {
    router: Router,
    metrics: Arc<ExtProcMetrics>,
    fallbacks: usize,
}

impl ExtProc {
    pub fn new(router: Router) -> ExtProc {
        ExtProc {
            router,
            metrics: Arc::new(ExtProcMetrics::new()),
            fallbacks: 0,
        }
    }

    /// Names up to `n` fallbacks (capped at [`MAX_FALLBACKS`]) after each pick. The default,
    /// 0, suits Envoy's `ORIGINAL_DST` cluster, which reads exactly one address from the
    /// header (a list there is "no healthy upstream"); a data plane that walks the list on
    /// retries (Envoy's `override_host` load-balancing policy) can use more.
    pub fn with_fallbacks(mut self, n: usize) -> ExtProc {
        self.fallbacks = n.min(MAX_FALLBACKS);
        self
    }

    pub fn fallbacks(&self) -> usize {
        self.fallbacks
    }

    pub fn metrics(&self) -> &Arc<ExtProcMetrics> {
        &self.metrics
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// The tonic service, to add to a server.
    pub fn into_service(self) -> ExternalProcessorServer<ExtProc> {
        // 5 MB bodies arrive as 62 KB chunks, but Envoy's messages may be larger than
        // tonic's 4 MiB default when it is configured to buffer.
        ExternalProcessorServer::new(self)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20)
    }

    /// Prometheus text of the router and the transport together.
    pub fn encode_metrics(&self) -> String {
        let mut out = strip_eof(self.router.metrics().encode());
        out.push_str(&self.metrics.encode_body());
        out.push_str("# EOF\n");
        out
    }
}

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for ExtProc {
    type ProcessStream = ResponseStream;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let inbound = request.into_inner();
        let state = StreamState::new(self.router.clone(), self.metrics.clone(), self.fallbacks);
        // The answers are produced as tonic polls for them, on its task: no task or
        // channel per request. When Envoy or the client goes away, tonic drops this stream
        // and with it the state, whose `Drop` releases a lease still held.
        let answers = futures_util::stream::unfold(
            (state, inbound, VecDeque::new()),
            |(mut state, mut inbound, mut pending)| async move {
                loop {
                    if let Some(r) = pending.pop_front() {
                        return Some((Ok(r), (state, inbound, pending)));
                    }
                    match inbound.message().await {
                        Ok(Some(m)) => pending.extend(state.handle(m).await),
                        // Envoy closed the stream, or it broke: the request is over.
                        Ok(None) | Err(_) => {
                            let finished = state.phase == Phase::Done;
                            state.end(finished);
                            return None;
                        }
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(answers)))
    }
}

/// Where one stream is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for the request headers.
    Start,
    /// Buffering the request body.
    Body,
    /// Picked (or passed through); the response has not ended.
    Forwarded,
    /// The response ended, or an immediate response was sent.
    Done,
}

struct StreamState {
    router: Router,
    metrics: Arc<ExtProcMetrics>,
    /// Fallbacks named after the pick.
    fallbacks: usize,
    phase: Phase,
    headers: Vec<(String, Vec<u8>)>,
    request_id: String,
    /// The subset hint, when Envoy sent one.
    subset: Option<Vec<String>>,
    body: BytesMut,
    lease: Option<Lease>,
    /// `host:port` of the picked endpoint (accounting falls back to it).
    picked: Option<String>,
    /// The fallbacks named after the pick, for moving the lease to the one that served.
    fallback_ids: Vec<(EndpointId, Arc<str>)>,
    served: Option<String>,
    usage: UsageScan,
    /// The API the path asks for.
    api: Api,
    /// Looks for the id of a successful Responses answer (its home).
    ids: Option<ResponseIdScan>,
}

impl StreamState {
    fn new(router: Router, metrics: Arc<ExtProcMetrics>, fallbacks: usize) -> StreamState {
        StreamState {
            router,
            metrics,
            fallbacks,
            phase: Phase::Start,
            headers: Vec::new(),
            request_id: String::new(),
            subset: None,
            body: BytesMut::new(),
            lease: None,
            picked: None,
            fallback_ids: Vec::new(),
            served: None,
            usage: UsageScan::default(),
            api: Api::Other,
            ids: None,
        }
    }

    /// Releases the lease (once: it is taken) and records the outcome.
    fn end(&mut self, finished: bool) {
        if let Some(lease) = self.lease.take() {
            if !finished {
                self.metrics.abandoned.inc();
            }
            if let Some((prompt, completion)) = self.usage.finish() {
                let endpoint = self
                    .served
                    .clone()
                    .or_else(|| self.picked.clone())
                    .unwrap_or_else(|| address_of(lease.url()).to_string());
                let l = EndpointLabel { endpoint };
                self.metrics.prompt_tokens.get_or_create(&l).inc_by(prompt);
                self.metrics
                    .completion_tokens
                    .get_or_create(&l)
                    .inc_by(completion);
            }
            drop(lease);
        }
        self.phase = Phase::Done;
    }

    async fn handle(&mut self, msg: ProcessingRequest) -> Vec<ProcessingResponse> {
        use processing_request::Request as R;
        let Some(req) = msg.request else {
            return Vec::new();
        };
        match (self.phase, req) {
            (Phase::Start, R::RequestHeaders(h)) => {
                self.subset = messages::metadata_strings(
                    msg.metadata_context.as_ref(),
                    SUBSET_NAMESPACE,
                    SUBSET_KEY,
                );
                self.on_request_headers(h).await
            }
            (Phase::Body, R::RequestBody(b)) => self.on_request_body(b).await,
            // Trailers end a body that did not say so.
            (Phase::Body, R::RequestTrailers(_)) => {
                let mut out = self.finish_request(false).await;
                if self.phase != Phase::Done {
                    out.push(messages::request_trailers());
                }
                out
            }
            (Phase::Forwarded, R::RequestTrailers(_)) => vec![messages::request_trailers()],
            (Phase::Forwarded, R::ResponseHeaders(h)) => {
                self.on_response_headers(&h, &msg.attributes, msg.metadata_context.as_ref())
            }
            (Phase::Forwarded, R::ResponseBody(b)) => {
                self.usage.feed(&b.body);
                self.remember_home(&b.body);
                let eos = b.end_of_stream;
                let out = vec![messages::response_body_chunk(b.body, eos)];
                if eos {
                    self.end(true);
                }
                out
            }
            (Phase::Forwarded, R::ResponseTrailers(_)) => {
                self.end(true);
                vec![messages::response_trailers()]
            }
            // Body still arriving after an immediate response: Envoy drops the stream.
            (Phase::Done, R::RequestBody(_)) => Vec::new(),
            // Anything after the end (or out of order) is answered so Envoy is never left
            // waiting, and changes nothing.
            (_, R::RequestTrailers(_)) => vec![messages::request_trailers()],
            (_, R::ResponseTrailers(_)) => vec![messages::response_trailers()],
            (_, R::ResponseHeaders(_)) => vec![messages::response_headers()],
            (_, R::ResponseBody(b)) => vec![messages::response_body_chunk(b.body, b.end_of_stream)],
            (phase, other) => {
                tracing::warn!(?phase, message = ?kind_of(&other), "unexpected ext_proc message");
                self.phase = Phase::Done;
                vec![messages::immediate(
                    &ApiError::internal(
                        "The gateway sent the endpoint picker an unexpected message.",
                    ),
                    &self.request_id,
                )]
            }
        }
    }

    async fn on_request_headers(&mut self, h: HttpHeaders) -> Vec<ProcessingResponse> {
        self.headers = messages::headers_of(h.headers.as_ref());
        self.request_id = match self.headers.header(crate::headers::REQUEST_ID) {
            Some(id) if id.len() <= 256 => id.to_string(),
            _ => {
                let n: u128 = rand::rng().random();
                format!("{n:032x}")
            }
        };
        self.router.metrics().requests.inc();
        if h.end_of_stream {
            // No body: read what the path says (a stored response it names), then picked
            // at once; a POST to an API whose body is JSON has none and is refused.
            return self.finish_request(true).await;
        }
        self.phase = Phase::Body;
        Vec::new()
    }

    async fn on_request_body(&mut self, b: HttpBody) -> Vec<ProcessingResponse> {
        let max = self.router.config().max_body_bytes;
        if self.body.len() + b.body.len() > max {
            return self.fail(ApiError::body_too_large(max));
        }
        self.body.extend_from_slice(&b.body);
        if b.end_of_stream {
            self.finish_request(true).await
        } else {
            Vec::new()
        }
    }

    /// The request is complete: read, admit, pick, answer.
    async fn finish_request(&mut self, end_of_stream: bool) -> Vec<ProcessingResponse> {
        let had_body = self.phase == Phase::Body;
        let posted = had_body
            || matches!(
                self.headers.header(":method"),
                Some("POST" | "PUT" | "PATCH")
            );
        let req = Incoming {
            has_body: posted,
            path: self.headers.header(":path").unwrap_or("/"),
            content_type: self.headers.header("content-type"),
        };
        let body = std::mem::take(&mut self.body).freeze();
        let rewrite = self.headers.header(MODEL_REWRITE);
        let read = intake::read(req, body, intake::limits(&self.router), rewrite);
        let intake = match read {
            Ok(i) => i,
            Err(e) => {
                self.router.metrics().fail("invalid_request");
                return self.fail(e);
            }
        };
        self.api = intake.api;
        let ticket = Ticket::read(
            &self.router,
            self.headers.as_slice(),
            &intake.model,
            intake.view.priority,
            intake.body.len(),
        );
        tracing::debug!(request_id = %self.request_id, flow = %ticket.flow, priority = ticket.priority, model = %intake.model, "request");
        // Flow control is for work a model runs; a request naming none is not held back.
        let admitted = if intake.model.is_empty() {
            None
        } else {
            match self.router.admit_flow(&ticket).await {
                Ok(a) => Some(a),
                Err(e) => return self.fail(e.to_api_error()),
            }
        };
        let sreq = intake::sched_request(
            &self.router,
            self.headers.as_slice(),
            &intake,
            ticket.priority,
        )
        .await;
        let body = had_body.then(|| intake.body.clone());
        let out = self.answer(sreq, &intake, body, end_of_stream).await;
        // Picked (or refused): the pool's room counts it from here on.
        drop(admitted);
        out
    }

    /// Picks inside the allowed set, takes the lease, and builds the header response (and
    /// the body chunks when there is a body).
    async fn answer(
        &mut self,
        mut sreq: SchedRequest,
        intake: &Intake,
        body: Option<Bytes>,
        end_of_stream: bool,
    ) -> Vec<ProcessingResponse> {
        let picked = match self.pick_allowed(&mut sreq, intake) {
            Ok(p) => p,
            Err(e) => return self.fail(e),
        };
        let destinations = self.take_lease(&picked);
        if self.lease.is_none() {
            return self.fail(ApiError::unavailable("No replica could take the request."));
        }
        // Header and metadata carry the same value: a data plane may read either.
        let value = destinations.join(",");
        let mut set = vec![
            messages::set_header(DESTINATION, &value),
            messages::set_header("x-request-id", &self.request_id),
        ];
        if let Some(b) = &body {
            set.push(messages::set_header("content-length", &b.len().to_string()));
        }
        let prefiller = self.prefiller(&picked);
        if let Some(p) = &prefiller {
            set.push(messages::set_header(PREFILLER, p));
        }
        let remove = self.removed_headers(prefiller.is_some());
        let metadata = messages::dynamic_metadata(LB_NAMESPACE, DESTINATION, &value);
        let mut out = vec![messages::request_headers(set, remove, Some(metadata))];
        if let Some(b) = body {
            out.extend(messages::request_body_chunks(&b, end_of_stream));
        }
        self.metrics.picked.inc();
        self.phase = Phase::Forwarded;
        out
    }

    /// The pick among the endpoints the data plane allows (Envoy's subset hint and the
    /// conformance selection header): the replica that holds the stored response the
    /// request needs, when it is allowed, else a scheduling decision.
    fn pick_allowed(&self, sreq: &mut SchedRequest, intake: &Intake) -> Result<Picked, ApiError> {
        let selection: Option<Vec<String>> = self.headers.header(TEST_SELECTION).map(|v| {
            v.split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(str::to_string)
                .collect()
        });
        let subset = self.subset.clone();
        if subset.as_ref().is_some_and(|s| s.is_empty()) {
            return Err(ApiError::unavailable(
                "The gateway's endpoint subset is empty.",
            ));
        }
        let allow = move |url: &str| {
            let addr = address_of(url);
            subset.as_ref().is_none_or(|s| address_allowed(addr, s))
                && selection.as_ref().is_none_or(|s| address_allowed(addr, s))
        };
        let restricted = self.subset.is_some() || self.headers.header(TEST_SELECTION).is_some();
        // A stored response is answered by the replica that holds it, when the data
        // plane allows that one.
        let home = intake
            .home
            .as_deref()
            .and_then(|id| self.router.pick_home(id))
            .filter(|p| p.ranked.iter().all(|(_, url)| allow(url)));
        let picked = match home {
            Some(p) => Ok(p),
            None if restricted => self.router.pick_within(sreq, Some(&allow)),
            None => self.router.pick(sreq),
        };
        picked.map_err(|e| e.to_api_error())
    }

    /// Takes the lease on the first ranked endpoint whose circuit lets it through; the
    /// rest of the ranking, in order, are the fallbacks Envoy may try. The destinations
    /// (`host:port`): the leased pick, then up to `fallbacks` more.
    fn take_lease(&mut self, picked: &Picked) -> Vec<String> {
        let mut destinations: Vec<String> = Vec::new();
        for (id, url) in &picked.ranked {
            if self.lease.is_none() {
                match self.router.lease(*id, url) {
                    Some(l) => {
                        self.picked = Some(address_of(url).to_string());
                        self.lease = Some(l);
                    }
                    None => continue,
                }
            } else {
                self.fallback_ids.push((*id, url.clone()));
            }
            destinations.push(address_of(url).to_string());
            if destinations.len() > self.fallbacks {
                break;
            }
        }
        destinations
    }

    /// The prefill engine (`host:port`), when disaggregating: the decode side prefills
    /// there first. Its load is not counted here: this picker never sees phase 1 end. The
    /// request's path through the prefill/decode pair is counted.
    fn prefiller(&self, picked: &Picked) -> Option<String> {
        let prefiller = picked
            .prefill
            .as_ref()
            .and_then(|p| p.first())
            .map(|(_, url)| address_of(url).to_string());
        match (&prefiller, picked.pd) {
            (Some(_), _) => {
                self.router
                    .metrics()
                    .pd_path(crate::telemetry::PD_PATH_DISAGGREGATED);
            }
            (
                None,
                crate::scheduling::PdChoice::DecodeOnly | crate::scheduling::PdChoice::NoPrefill,
            ) => {
                self.router
                    .metrics()
                    .pd_path(crate::telemetry::PD_PATH_DECODE_ONLY);
            }
            (None, _) => {}
        }
        prefiller
    }

    /// The request headers to remove: a client must not name its own destination, its
    /// prefill engine (any header of the prefill protocol; [`PREFILLER`] stays when this
    /// picker sets it), or claim who served.
    fn removed_headers(&self, prefilling: bool) -> Vec<String> {
        let mut remove = vec![SERVED.to_string()];
        if !prefilling {
            remove.push(PREFILLER.to_string());
        }
        for (name, _) in &self.headers {
            if crate::headers::is_prefiller(name) && name != PREFILLER && !remove.contains(name) {
                remove.push(name.clone());
            }
        }
        remove
    }

    fn on_response_headers(
        &mut self,
        h: &HttpHeaders,
        attrs: &std::collections::HashMap<String, envoy_types::pb::google::protobuf::Struct>,
        md: Option<&envoy_types::pb::envoy::config::core::v3::Metadata>,
    ) -> Vec<ProcessingResponse> {
        let headers = messages::headers_of(h.headers.as_ref());
        // Who served: the data plane's `envoy.lb` answer when it gives one, else the
        // upstream address attribute, else the pick.
        self.served = messages::metadata_strings(md, LB_NAMESPACE, SERVED)
            .and_then(|v| v.into_iter().next())
            .or_else(|| messages::attribute_string(attrs, "upstream.address"));
        let status: u16 = headers
            .header(":status")
            .and_then(|s| s.parse().ok())
            .unwrap_or(200);
        self.usage.set_sse(
            headers
                .header("content-type")
                .is_some_and(|c| c.starts_with("text/event-stream")),
        );
        if self.api == Api::Responses && (200..300).contains(&status) {
            self.ids = Some(ResponseIdScan::default());
        }
        self.move_lease_to_served();
        if let Some(lease) = self.lease.as_mut() {
            let served_elsewhere = self
                .served
                .as_ref()
                .is_some_and(|s| Some(s) != self.picked.as_ref());
            // The circuit of the pick learns only from answers the pick gave.
            if !served_elsewhere {
                if status >= 500 {
                    lease.failure();
                } else {
                    lease.success();
                }
            }
        }
        let out = vec![messages::response_headers()];
        if h.end_of_stream {
            self.end(true);
        }
        out
    }

    /// Reads a Responses answer's id as it passes, and remembers the endpoint that served
    /// it as the response's home.
    fn remember_home(&mut self, chunk: &[u8]) {
        let Some(id) = self.ids.as_mut().and_then(|s| s.feed(chunk)) else {
            return;
        };
        if let Some(lease) = &self.lease {
            self.router.remember_response(&id, lease.url());
        }
    }

    /// When the data plane fell back to one of the named fallbacks, the pick gave it no
    /// answer (a data plane walks the list on connect failures and resets): the pick's
    /// circuit learns that, and the in-flight count moves to the endpoint that serves.
    fn move_lease_to_served(&mut self) {
        let Some(served) = self.served.clone() else {
            return;
        };
        if self.picked.as_deref() == Some(served.as_str()) {
            return;
        }
        let Some((id, url)) = self
            .fallback_ids
            .iter()
            .find(|(_, u)| address_of(u) == served)
            .cloned()
        else {
            return;
        };
        let Some(moved) = self.router.lease(id, &url) else {
            return;
        };
        if let Some(mut old) = self.lease.replace(moved) {
            old.failure();
        }
        self.picked = Some(served);
    }

    fn fail(&mut self, err: ApiError) -> Vec<ProcessingResponse> {
        self.metrics.outcome(&err.status.to_string());
        self.phase = Phase::Done;
        self.lease = None;
        vec![messages::immediate(&err, &self.request_id)]
    }
}

impl Drop for StreamState {
    fn drop(&mut self) {
        // Dropped with the lease still held: the stream went away before the response
        // ended.
        if self.lease.is_some() {
            self.end(false);
        }
    }
}

fn kind_of(r: &processing_request::Request) -> &'static str {
    use processing_request::Request as R;
    match r {
        R::RequestHeaders(_) => "request_headers",
        R::ResponseHeaders(_) => "response_headers",
        R::RequestBody(_) => "request_body",
        R::ResponseBody(_) => "response_body",
        R::RequestTrailers(_) => "request_trailers",
        R::ResponseTrailers(_) => "response_trailers",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn eof_is_stripped_once() {
        assert_eq!(strip_eof("a 1\n# EOF\n".into()), "a 1\n");
        assert_eq!(strip_eof("a 1\n".into()), "a 1\n");
    }
}
