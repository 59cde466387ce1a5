//! Sending one streamed request and timing its chunks.
//!
//! Every request is sent with `stream: true` and `stream_options.include_usage`, so token
//! counts come from the server's `usage` while timing comes from the chunks: TTFT is the
//! arrival of the first chunk with content, and each later chunk with content is one ITL
//! sample. Chunks are parsed leniently (only `choices[].delta.content` / `choices[].text`,
//! `finish_reason`, `usage` and `error` are read) so any OpenAI-compatible server works.

use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use strata_api::sse::{SseDecoder, SseEvent};

use crate::error::BenchError;
use crate::prompt::{ids_of, text_of, Segment};
use crate::record::{Failure, FailureKind, RequestRecord};

/// Response headers that name the replica that served a request, in order of preference:
/// Strata's router (the Gateway API inference extension's name) and the mock engine.
pub const SERVED_BY_HEADERS: [&str; 2] =
    ["x-gateway-destination-endpoint-served", "x-mock-replica"];
/// Request header carrying a conversation id, for session-affine routing (the router's
/// default `session_header`).
pub const SESSION_HEADER: &str = "x-session-id";

/// Which OpenAI route to call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Endpoint {
    /// `POST /v1/chat/completions` with messages.
    Chat,
    /// `POST /v1/completions` with a prompt.
    Completions,
}

impl Endpoint {
    /// The route's path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// How prompts are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PromptMode {
    /// Words, about one token each.
    Text,
    /// Token ids on `/v1/completions` (exact lengths).
    TokenIds,
}

/// Settings for the HTTP side of a run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ClientConfig {
    /// Server base URL, e.g. `http://127.0.0.1:8000` (a trailing `/v1` is accepted).
    pub url: String,
    /// Model name sent in every request.
    pub model: String,
    /// The route.
    pub endpoint: Endpoint,
    /// Text or token-id prompts.
    pub prompt_mode: PromptMode,
    /// Send `ignore_eos: true`, so every reply runs to `max_tokens`.
    pub ignore_eos: bool,
    /// Reuse connections; when false, each request opens a fresh one (`Connection: close`).
    pub keepalive: bool,
    /// Bound on one request, from send to the end of its stream.
    #[serde(skip)]
    pub timeout: Duration,
    /// Sent as `Authorization: Bearer ...` when set.
    #[serde(skip)]
    pub api_key: Option<String>,
}

/// A request's prompt: a system prompt, earlier turns (user segments and reply texts), and
/// the new user message.
#[derive(Debug, Clone, Copy)]
pub struct Prompt<'a> {
    /// System prompt (may be empty).
    pub system: &'a [Segment],
    /// Earlier turns: what the user said and what the server replied.
    pub history: &'a [(Vec<Segment>, String)],
    /// The new user message.
    pub user: &'a [Segment],
    /// Conversation id, sent as [`SESSION_HEADER`] (multi-turn only).
    pub session: Option<u64>,
}

impl Prompt<'_> {
    /// Planned prompt length in tokens, not counting the replies in the history (whose
    /// token counts only the server knows) nor any chat template.
    pub fn planned_tokens(&self) -> u32 {
        let seg = |s: &[Segment]| s.iter().map(|x| x.len).sum::<u32>();
        seg(self.system) + self.history.iter().map(|(u, _)| seg(u)).sum::<u32>() + seg(self.user)
    }
}

/// A reusable client for one server.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    url: String,
    config: ClientConfig,
}

impl Client {
    /// Builds the HTTP client. Proxies from the environment are ignored: a benchmark talks
    /// to the URL it is given.
    pub fn new(config: ClientConfig) -> Result<Self, BenchError> {
        let mut builder = reqwest::Client::builder()
            .no_proxy()
            .tcp_nodelay(true)
            .connect_timeout(config.timeout.min(Duration::from_secs(10)));
        if !config.keepalive {
            builder = builder.pool_max_idle_per_host(0);
        }
        let http = builder
            .build()
            .map_err(|e| BenchError::Client(e.to_string()))?;
        let url = format!("{}{}", base_url(&config.url), config.endpoint.path());
        Ok(Client { http, url, config })
    }

    /// The configuration.
    pub fn config(&self) -> &ClientConfig {
        &self.config
    }

    /// The request body for `prompt`.
    pub fn body(&self, prompt: &Prompt<'_>, max_tokens: u32) -> Value {
        let mut body = json!({
            "model": self.config.model,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match (self.config.endpoint, self.config.prompt_mode) {
            (Endpoint::Chat, _) => {
                let mut messages = Vec::with_capacity(2 + 2 * prompt.history.len());
                if !prompt.system.is_empty() {
                    messages.push(json!({"role": "system", "content": text_of(prompt.system)}));
                }
                for (user, reply) in prompt.history {
                    messages.push(json!({"role": "user", "content": text_of(user)}));
                    messages.push(json!({"role": "assistant", "content": reply}));
                }
                messages.push(json!({"role": "user", "content": text_of(prompt.user)}));
                body["messages"] = Value::Array(messages);
            }
            (Endpoint::Completions, PromptMode::Text) => {
                let mut text = text_of(prompt.system);
                for (user, reply) in prompt.history {
                    text.push_str(&text_of(user));
                    text.push_str(reply);
                }
                text.push_str(&text_of(prompt.user));
                body["prompt"] = Value::String(text);
            }
            (Endpoint::Completions, PromptMode::TokenIds) => {
                // History is rejected with token ids at configuration time (replies come
                // back as text, whose ids only the server knows).
                let mut segments = prompt.system.to_vec();
                segments.extend_from_slice(prompt.user);
                body["prompt"] = json!(ids_of(&segments));
            }
        }
        if self.config.ignore_eos {
            body["ignore_eos"] = Value::Bool(true);
        }
        body
    }

    /// Sends `body`, streams the reply and returns what was measured. Never fails: a
    /// failure is recorded in the returned record. `run_start` anchors `start` and the
    /// chunk times; `keep_text` keeps the reply text (for multi-turn history).
    pub async fn send(
        &self,
        body: &Value,
        planned_prompt_tokens: u32,
        session: Option<u64>,
        run_start: Instant,
        keep_text: bool,
    ) -> RequestRecord {
        let sent = Instant::now();
        let mut record = RequestRecord {
            start: sent.saturating_duration_since(run_start),
            planned_prompt_tokens,
            ..Default::default()
        };
        let outcome = tokio::time::timeout(
            self.config.timeout,
            self.stream_into(body, session, sent, run_start, keep_text, &mut record),
        )
        .await;
        record.e2e = sent.elapsed();
        let failure = match outcome {
            Err(_) => Some(Failure {
                kind: FailureKind::Timeout,
                message: format!("no complete response within {:?}", self.config.timeout),
            }),
            Ok(result) => result.err(),
        };
        record.failure = failure;
        record
    }

    /// The HTTP request for `body`: bearer token, `Connection: close` without keep-alive,
    /// and the session header for conversations.
    fn request(&self, body: &Value, session: Option<u64>) -> reqwest::RequestBuilder {
        let mut request = self.http.post(&self.url).json(body);
        if !self.config.keepalive {
            request = request.header(reqwest::header::CONNECTION, "close");
        }
        if let Some(key) = &self.config.api_key {
            request = request.bearer_auth(key);
        }
        if let Some(session) = session {
            request = request.header(SESSION_HEADER, format!("bench-{session}"));
        }
        request
    }

    /// Sends `body` and reads the reply into `record`: an event stream chunk by chunk, or
    /// one JSON body from a server that ignored `stream: true`.
    async fn stream_into(
        &self,
        body: &Value,
        session: Option<u64>,
        sent: Instant,
        run_start: Instant,
        keep_text: bool,
        record: &mut RequestRecord,
    ) -> Result<(), Failure> {
        let request = self.request(body, session);
        let response = request.send().await.map_err(transport_failure)?;
        record.served_by = SERVED_BY_HEADERS
            .iter()
            .find_map(|h| response.headers().get(*h))
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        let response = successful(response).await?;
        let content_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        if content_type.starts_with("application/json") {
            return self
                .whole_response(response, sent, run_start, keep_text, record)
                .await;
        }
        let mut stream = StreamRead {
            sent,
            run_start,
            keep_text,
            events: 0,
            finished: false,
            done: false,
        };
        stream.read(response, record).await?;
        stream.check_end(&content_type, record)
    }

    /// A server that ignored `stream: true` and answered with one JSON body: the whole
    /// reply arrives at once, so TTFT is the full latency and there are no ITL samples.
    async fn whole_response(
        &self,
        response: reqwest::Response,
        sent: Instant,
        run_start: Instant,
        keep_text: bool,
        record: &mut RequestRecord,
    ) -> Result<(), Failure> {
        let bytes = response.bytes().await.map_err(|e| {
            let mut f = transport_failure(e);
            f.kind = FailureKind::StreamCut;
            f
        })?;
        let now = Instant::now();
        let whole: Whole = serde_json::from_slice(&bytes).map_err(|e| Failure {
            kind: FailureKind::InvalidResponse,
            message: format!("unparseable response: {e}"),
        })?;
        if let Some(error) = whole.error {
            return Err(Failure {
                kind: FailureKind::StreamError,
                message: error_message(&error.to_string()).unwrap_or_else(|| error.to_string()),
            });
        }
        let text: String = whole
            .choices
            .iter()
            .map(|c| {
                c.text
                    .as_deref()
                    .or(c.message.as_ref().and_then(|m| m.content.as_deref()))
                    .unwrap_or("")
            })
            .collect();
        if whole.choices.is_empty() {
            return Err(Failure {
                kind: FailureKind::InvalidResponse,
                message: "the response has no choices".into(),
            });
        }
        if let Some(usage) = whole.usage {
            record.prompt_tokens = usage.prompt_tokens;
            record.completion_tokens = usage.completion_tokens;
            record.cached_tokens = usage.prompt_tokens_details.and_then(|d| d.cached_tokens);
        }
        record.ttft = Some(now.saturating_duration_since(sent));
        record.token_times = vec![now.saturating_duration_since(run_start)];
        if keep_text {
            record.text = text;
        }
        Ok(())
    }

    /// Asks `GET /v1/models` for the first served model.
    pub async fn discover_model(url: &str, timeout: Duration) -> Result<String, BenchError> {
        let base = base_url(url);
        let fail = |message: String| BenchError::ModelDiscovery {
            url: base.clone(),
            message,
        };
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(timeout.min(Duration::from_secs(30)))
            .build()
            .map_err(|e| BenchError::Client(e.to_string()))?;
        let response = http
            .get(format!("{base}/v1/models"))
            .send()
            .await
            .map_err(|e| fail(transport_failure(e).message))?;
        if !response.status().is_success() {
            return Err(fail(format!("HTTP {}", response.status())));
        }
        let list: Value = response.json().await.map_err(|e| fail(e.to_string()))?;
        list["data"]
            .as_array()
            .and_then(|d| d.first())
            .and_then(|m| m["id"].as_str())
            .map(str::to_string)
            .ok_or_else(|| fail("the server lists no models".into()))
    }
}

/// The response if its status is a success; otherwise the failure, with the server's
/// error message when its body carries one.
async fn successful(response: reqwest::Response) -> Result<reqwest::Response, Failure> {
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let text = read_prefix(response, 2048).await;
    Err(Failure {
        kind: FailureKind::HttpStatus(status.as_u16()),
        message: error_message(&text).unwrap_or(text),
    })
}

/// An event stream being read: what is needed to time its chunks, and what it has shown
/// so far.
struct StreamRead {
    sent: Instant,
    run_start: Instant,
    keep_text: bool,
    /// Events decoded, `[DONE]` included.
    events: usize,
    /// A choice carried a `finish_reason`.
    finished: bool,
    /// `[DONE]` arrived.
    done: bool,
}

impl StreamRead {
    /// Reads events until `[DONE]` or the end of the body. Every event of one network
    /// chunk is timed at that chunk's arrival.
    async fn read(
        &mut self,
        response: reqwest::Response,
        record: &mut RequestRecord,
    ) -> Result<(), Failure> {
        let mut decoder = SseDecoder::new();
        let mut stream = response.bytes_stream();
        while let Some(bytes) = stream.next().await {
            let bytes = bytes.map_err(|e| {
                let mut f = transport_failure(e);
                f.kind = FailureKind::StreamCut;
                f
            })?;
            let now = Instant::now();
            let decoded = decoder.feed(&bytes).map_err(|e| Failure {
                kind: FailureKind::InvalidResponse,
                message: e.to_string(),
            })?;
            for event in decoded {
                self.events += 1;
                if event.is_done() {
                    self.done = true;
                    continue;
                }
                self.chunk(&event, now, record)?;
            }
            if self.done {
                break;
            }
        }
        Ok(())
    }

    /// One chunk: an error object fails the request; usage is kept; content arriving at
    /// `now` is one token time (the first also the TTFT), and kept when asked for.
    fn chunk(
        &mut self,
        event: &SseEvent,
        now: Instant,
        record: &mut RequestRecord,
    ) -> Result<(), Failure> {
        let chunk: Chunk = event.json().map_err(|e| Failure {
            kind: FailureKind::InvalidResponse,
            message: format!("unparseable chunk: {e}"),
        })?;
        if let Some(error) = chunk.error {
            return Err(Failure {
                kind: FailureKind::StreamError,
                message: error_message(&error.to_string()).unwrap_or_else(|| error.to_string()),
            });
        }
        if let Some(usage) = chunk.usage {
            record.prompt_tokens = usage.prompt_tokens.or(record.prompt_tokens);
            record.completion_tokens = usage.completion_tokens.or(record.completion_tokens);
            if let Some(cached) = usage.prompt_tokens_details.and_then(|d| d.cached_tokens) {
                record.cached_tokens = Some(cached);
            }
        }
        let mut has_content = false;
        for choice in &chunk.choices {
            let piece = choice.content();
            if !piece.is_empty() {
                has_content = true;
                if self.keep_text {
                    record.text.push_str(piece);
                }
            }
            if choice.finish_reason.is_some() {
                self.finished = true;
            }
        }
        if has_content {
            if record.ttft.is_none() {
                record.ttft = Some(now.saturating_duration_since(self.sent));
            }
            record
                .token_times
                .push(now.saturating_duration_since(self.run_start));
        }
        Ok(())
    }

    /// Whether what was read is a complete response: an event stream at all, ended by
    /// `[DONE]` or a finish reason, with content if tokens were reported.
    fn check_end(&self, content_type: &str, record: &RequestRecord) -> Result<(), Failure> {
        if self.events == 0 && !content_type.starts_with("text/event-stream") {
            return Err(Failure {
                kind: FailureKind::InvalidResponse,
                message: format!("expected an event stream, got content-type `{content_type}`"),
            });
        }
        if !self.done && !self.finished {
            return Err(Failure {
                kind: FailureKind::StreamCut,
                message: "the stream ended before [DONE]".into(),
            });
        }
        if record.ttft.is_none() && record.completion_tokens.unwrap_or(0) > 0 {
            return Err(Failure {
                kind: FailureKind::InvalidResponse,
                message: "tokens were reported but no chunk carried content".into(),
            });
        }
        Ok(())
    }
}

/// `url` without a trailing slash or `/v1`.
pub fn base_url(url: &str) -> String {
    let trimmed = url.trim_end_matches('/');
    trimmed.strip_suffix("/v1").unwrap_or(trimmed).to_string()
}

/// Classifies a transport error; a refused connection is told apart so a benchmark of a
/// server that is not running says so.
fn transport_failure(e: reqwest::Error) -> Failure {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    let mut refused = false;
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                refused = true;
            }
        }
        source = err.source();
    }
    let kind = if refused {
        FailureKind::ConnectionRefused
    } else if e.is_timeout() {
        FailureKind::Timeout
    } else if e.is_connect() {
        FailureKind::Connect
    } else if e.is_body() || e.is_decode() {
        FailureKind::StreamCut
    } else {
        FailureKind::Transport
    };
    Failure {
        kind,
        message: chain_message(&e),
    }
}

/// An error and its sources, joined with `: `.
fn chain_message(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(err) = source {
        let text = err.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = err.source();
    }
    out
}

/// Up to `limit` bytes of a response body, as text.
async fn read_prefix(response: reqwest::Response, limit: usize) -> String {
    let mut out = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(Ok(bytes)) = stream.next().await {
        out.extend_from_slice(&bytes);
        if out.len() >= limit {
            out.truncate(limit);
            break;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The `message` of an OpenAI-shaped error body (`{"error": {"message": ...}}` or
/// `{"message": ...}`).
fn error_message(text: &str) -> Option<String> {
    let v: Value = serde_json::from_str(text).ok()?;
    let inner = if v.get("error").is_some() {
        &v["error"]
    } else {
        &v
    };
    inner
        .get("message")
        .and_then(Value::as_str)
        .or_else(|| inner.as_str())
        .map(str::to_string)
}

/// The parts of a streamed chunk the benchmark reads.
#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<Value>,
}

/// The parts of a non-streamed response the benchmark reads.
#[derive(Debug, Deserialize)]
struct Whole {
    #[serde(default)]
    choices: Vec<WholeChoice>,
    #[serde(default)]
    usage: Option<ChunkUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct WholeChoice {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    message: Option<Delta>,
}

#[derive(Debug, Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    delta: Option<Delta>,
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

impl ChunkChoice {
    /// Streamed text: completions' `text`, or chat's `content`, falling back to reasoning
    /// text (reasoning tokens are output tokens too).
    fn content(&self) -> &str {
        if let Some(text) = self.text.as_deref().filter(|t| !t.is_empty()) {
            return text;
        }
        let Some(delta) = &self.delta else {
            return "";
        };
        [&delta.content, &delta.reasoning_content, &delta.reasoning]
            .into_iter()
            .filter_map(|s| s.as_deref())
            .find(|s| !s.is_empty())
            .unwrap_or("")
    }
}

#[derive(Debug, Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    reasoning: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ChunkUsage {
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    completion_tokens: Option<u32>,
    #[serde(default)]
    prompt_tokens_details: Option<PromptDetails>,
}

#[derive(Debug, Deserialize)]
struct PromptDetails {
    #[serde(default)]
    cached_tokens: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(endpoint: Endpoint, prompt_mode: PromptMode) -> Client {
        Client::new(ClientConfig {
            url: "http://127.0.0.1:1/v1/".into(),
            model: "m".into(),
            endpoint,
            prompt_mode,
            ignore_eos: true,
            keepalive: true,
            timeout: Duration::from_secs(1),
            api_key: None,
        })
        .unwrap()
    }

    #[test]
    fn base_url_strips_slash_and_v1() {
        assert_eq!(base_url("http://h:1/v1/"), "http://h:1");
        assert_eq!(base_url("http://h:1"), "http://h:1");
        assert_eq!(
            client(Endpoint::Chat, PromptMode::Text).url,
            "http://h:1/v1/chat/completions".replace("h:1", "127.0.0.1:1")
        );
    }

    #[test]
    fn chat_body_carries_history_and_usage_request() {
        let c = client(Endpoint::Chat, PromptMode::Text);
        let sys = [Segment::new(1, 3)];
        let hist = [(vec![Segment::new(2, 2)], " reply".to_string())];
        let user = [Segment::new(3, 4)];
        let prompt = Prompt {
            system: &sys,
            history: &hist,
            user: &user,
            session: None,
        };
        assert_eq!(prompt.planned_tokens(), 9);
        let body = c.body(&prompt, 16);
        let msgs = body["messages"].as_array().unwrap();
        let roles: Vec<_> = msgs.iter().map(|m| m["role"].as_str().unwrap()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert_eq!(msgs[2]["content"], " reply");
        assert_eq!(body["max_tokens"], 16);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["ignore_eos"], true);
    }

    #[test]
    fn requests_carry_session_key_and_connection_headers() {
        let mut c = client(Endpoint::Chat, PromptMode::Text);
        let r = c.request(&json!({}), Some(7)).build().unwrap();
        assert_eq!(r.headers()[SESSION_HEADER], "bench-7");
        assert!(r.headers().get(reqwest::header::CONNECTION).is_none());
        assert!(r.headers().get(reqwest::header::AUTHORIZATION).is_none());
        c.config.keepalive = false;
        c.config.api_key = Some("k".into());
        let r = c.request(&json!({}), None).build().unwrap();
        assert!(r.headers().get(SESSION_HEADER).is_none());
        assert_eq!(r.headers()[reqwest::header::CONNECTION], "close");
        assert_eq!(r.headers()[reqwest::header::AUTHORIZATION], "Bearer k");
    }

    #[test]
    fn token_id_body_is_exact() {
        let c = client(Endpoint::Completions, PromptMode::TokenIds);
        let sys = [Segment::new(1, 30)];
        let user = [Segment::new(3, 4)];
        let body = c.body(
            &Prompt {
                system: &sys,
                history: &[],
                user: &user,
                session: None,
            },
            5,
        );
        assert_eq!(body["prompt"].as_array().unwrap().len(), 34);
    }

    #[test]
    fn chunk_content_reads_text_delta_and_reasoning() {
        let c: Chunk = serde_json::from_str(r#"{"choices":[{"text":"a"}]}"#).unwrap();
        assert_eq!(c.choices[0].content(), "a");
        let c: Chunk = serde_json::from_str(
            r#"{"choices":[{"delta":{"content":"","reasoning_content":"r"}}]}"#,
        )
        .unwrap();
        assert_eq!(c.choices[0].content(), "r");
        let c: Chunk = serde_json::from_str(
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}}"#,
        )
        .unwrap();
        assert_eq!(c.usage.unwrap().completion_tokens, Some(2));
    }

    #[test]
    fn error_messages_are_extracted() {
        assert_eq!(
            error_message(r#"{"error":{"message":"overloaded","type":"x"}}"#).as_deref(),
            Some("overloaded")
        );
        assert_eq!(error_message("<html>").as_deref(), None);
    }
}
