//! The completion routes (`/v1/chat/completions`, `/v1/completions`): read just enough of
//! the request, record it, then answer with fixed text, whole or streamed, misbehaving as
//! the current [`Fault`] says.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use strata_api::error::ApiError;
use strata_api::sse;

use crate::{error, unix_now, Fault, Received, Shared};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Text,
}

pub(crate) async fn chat(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    complete(s, Api::Chat, &headers, body).await
}

pub(crate) async fn completions(
    State(s): State<Arc<Shared>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    complete(s, Api::Text, &headers, body).await
}

/// Counts words in the prompt (or token ids), the mock's notion of prompt tokens.
fn prompt_tokens(api: Api, req: &Value) -> Result<u64, ApiError> {
    fn words(v: &Value) -> u64 {
        match v {
            Value::String(s) => s.split_whitespace().count() as u64,
            Value::Array(items) if items.iter().all(Value::is_number) => items.len() as u64,
            Value::Array(items) => items.iter().map(words).sum(),
            Value::Object(o) => o.get("text").map(words).unwrap_or(0),
            _ => 0,
        }
    }
    match api {
        Api::Chat => match req.get("messages") {
            Some(Value::Array(msgs)) if !msgs.is_empty() => Ok(msgs
                .iter()
                .map(|m| m.get("content").map(words).unwrap_or(0))
                .sum()),
            _ => Err(ApiError::invalid(
                "messages",
                "`messages` must be a non-empty array",
            )),
        },
        Api::Text => match req.get("prompt") {
            Some(p @ (Value::String(_) | Value::Array(_))) => Ok(words(p)),
            _ => Err(ApiError::invalid(
                "prompt",
                "`prompt` must be a string or an array",
            )),
        },
    }
}

/// Counts a request in flight until dropped (its answer is finished or abandoned).
struct InFlight(Arc<Shared>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn complete(s: Arc<Shared>, api: Api, headers: &HeaderMap, body: Bytes) -> Response {
    s.requests.fetch_add(1, Ordering::SeqCst);
    s.in_flight.fetch_add(1, Ordering::SeqCst);
    let guard = InFlight(s.clone());
    let (req, prompt_tokens) = match read_request(&s, api, &body) {
        Ok(read) => read,
        Err(e) => return error(e),
    };
    let received = received(api, headers, &req, prompt_tokens);
    let kv_answer = prefill_answer(&s, &received);
    s.record(received);
    let fault = s.fault();
    if let Some(failure) = injected_failure(fault).await {
        return failure;
    }
    let reply = Reply::plan(&s, api, &req, prompt_tokens);
    let replica = HeaderValue::from_str(&s.replica).unwrap_or(HeaderValue::from_static("mock"));

    if !reply.stream {
        if matches!(fault, Fault::CloseMidStream { .. }) {
            return cut_response();
        }
        let body = whole_body(&s, reply, kv_answer).await;
        drop(guard);
        let mut resp = axum::Json(body).into_response();
        resp.headers_mut().insert("x-mock-replica", replica);
        return resp;
    }
    let cut_after = match fault {
        Fault::CloseMidStream { after_chunks } => Some(after_chunks),
        _ => None,
    };
    streamed(&s, reply, cut_after, guard, replica)
}

/// The body as far as the mock reads it: a JSON object naming the served model, and its
/// prompt's token count.
fn read_request(s: &Shared, api: Api, body: &[u8]) -> Result<(Value, u64), ApiError> {
    let req: Value = match serde_json::from_slice(body) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => return Err(ApiError::invalid_no_param("the body must be a JSON object")),
        Err(e) => return Err(ApiError::invalid_no_param(format!("malformed JSON: {e}"))),
    };
    match req.get("model").and_then(Value::as_str) {
        Some(m) if m == s.config.model => {}
        Some(m) => return Err(ApiError::model_not_found(m)),
        None => return Err(ApiError::invalid("model", "`model` is required")),
    }
    let prompt_tokens = prompt_tokens(api, &req)?;
    Ok((req, prompt_tokens))
}

/// What the request carried, for [`crate::MockEngine::received`]: what a proxy in front
/// of the mock sent.
fn received(api: Api, headers: &HeaderMap, req: &Value, prompt_tokens: u64) -> Received {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    Received {
        api: if api == Api::Chat {
            "chat"
        } else {
            "completions"
        }
        .to_string(),
        request_id: header("x-request-id"),
        prompt_tokens,
        kv_transfer_params: req
            .get("kv_transfer_params")
            .filter(|v| !v.is_null())
            .cloned(),
        max_tokens: req.get("max_tokens").and_then(Value::as_u64),
        max_completion_tokens: req.get("max_completion_tokens").and_then(Value::as_u64),
        stream: req.get("stream").and_then(Value::as_bool).unwrap_or(false),
        stream_options: req.get("stream_options").is_some_and(|v| !v.is_null()),
        prefiller: header("x-prefiller-host-port"),
    }
}

/// Phase 1 of a disaggregated request (`kv_transfer_params.do_remote_decode`): the
/// top-level `kv_transfer_params` a prefill engine answers with, one block id per
/// `block_size` prompt tokens. `None` for any other request, or when the mock does not
/// speak the protocol ([`crate::MockConfig::kv_transfer`] off).
fn prefill_answer(s: &Shared, received: &Received) -> Option<Value> {
    let remote_prefill = s.config.kv_transfer
        && received
            .kv_transfer_params
            .as_ref()
            .and_then(|p| p.get("do_remote_decode"))
            .and_then(Value::as_bool)
            .unwrap_or(false);
    remote_prefill.then(|| {
        let blocks = received
            .prompt_tokens
            .div_ceil(u64::from(s.config.block_size.max(1)));
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": s.replica,
            "remote_block_ids": (0..blocks).collect::<Vec<u64>>(),
            "remote_host": s.addr.map(|a| a.ip().to_string()),
            "remote_port": s.addr.map(|a| a.port()),
            "remote_request_id": received.request_id,
        })
    })
}

/// The faults that strike before any token: an error status, or no answer at all (the
/// request stays in flight until the client goes away).
async fn injected_failure(fault: Fault) -> Option<Response> {
    match fault {
        Fault::Status(code) => {
            let mut err = ApiError::internal(format!("injected failure {code}"));
            err.status = code;
            Some(error(err))
        }
        Fault::Hang => std::future::pending::<Option<Response>>().await,
        _ => None,
    }
}

/// The answer to give: its id, length, finish reason and usage, and how to send it.
struct Reply {
    api: Api,
    id: String,
    model: String,
    /// Tokens to generate: the configured count, capped by the request's limit.
    n_out: usize,
    /// `length` when the request's limit cut the reply, else `stop`.
    finish: &'static str,
    usage: Value,
    stream: bool,
    include_usage: bool,
}

impl Reply {
    /// Plans the answer to `req`; takes the next response id.
    fn plan(s: &Shared, api: Api, req: &Value, prompt_tokens: u64) -> Reply {
        let limit = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|k| req.get(*k).and_then(Value::as_u64));
        let n_out = limit.map_or(s.config.output_tokens, |l| {
            s.config.output_tokens.min(l as usize)
        });
        let seq = s.next_id.fetch_add(1, Ordering::SeqCst);
        Reply {
            api,
            id: format!(
                "{}-{}-{seq}",
                if api == Api::Chat { "chatcmpl" } else { "cmpl" },
                s.replica
            ),
            model: s.config.model.clone(),
            n_out,
            finish: if limit.is_some_and(|l| (l as usize) <= s.config.output_tokens) {
                "length"
            } else {
                "stop"
            },
            usage: json!({
                "prompt_tokens": prompt_tokens,
                "completion_tokens": n_out,
                "total_tokens": prompt_tokens + n_out as u64,
            }),
            stream: req.get("stream").and_then(Value::as_bool).unwrap_or(false),
            include_usage: req
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false),
        }
    }
}

/// A non-streamed answer, given after the time its tokens would have taken to stream.
async fn whole_body(s: &Shared, reply: Reply, kv_answer: Option<Value>) -> Value {
    let (ttft, itl) = (s.config.ttft, s.config.itl);
    tokio::time::sleep(ttft + itl * (reply.n_out.saturating_sub(1) as u32)).await;
    let text = s.config.token_text.repeat(reply.n_out);
    let Reply {
        id,
        model,
        finish,
        usage,
        ..
    } = reply;
    let mut body = match reply.api {
        Api::Chat => json!({
            "id": id, "object": "chat.completion", "created": unix_now(), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": null, "finish_reason": finish}],
            "usage": usage,
        }),
        Api::Text => json!({
            "id": id, "object": "text_completion", "created": unix_now(), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish}],
            "usage": usage,
        }),
    };
    if let (Some(kv), Some(obj)) = (kv_answer, body.as_object_mut()) {
        obj.insert("kv_transfer_params".into(), kv);
    }
    body
}

/// A streamed answer on its way: the reply, its creation time, and the text and pace of
/// its tokens. `cut_after`: cut the connection after this many token chunks.
struct Stream {
    reply: Reply,
    created: u64,
    token_text: String,
    ttft: Duration,
    itl: Duration,
    cut_after: Option<usize>,
}

/// A streamed answer, produced by a task of its own that holds `guard` until it ends.
fn streamed(
    s: &Shared,
    reply: Reply,
    cut_after: Option<usize>,
    guard: InFlight,
    replica: HeaderValue,
) -> Response {
    let stream = Stream {
        reply,
        created: unix_now(),
        token_text: s.config.token_text.clone(),
        ttft: s.config.ttft,
        itl: s.config.itl,
        cut_after,
    };
    let body = async_stream(s.config.split_stream_bytes, move |tx| async move {
        let _guard = guard;
        stream.produce(tx).await;
    });
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp.headers_mut().insert("x-mock-replica", replica);
    resp
}

impl Stream {
    /// Sends the role chunk (chat), one chunk per token at the configured pace, the finish
    /// chunk, the usage chunk when asked for, and `[DONE]`; or cuts the connection where
    /// [`Fault::CloseMidStream`] says. Stops when the client goes away.
    async fn produce(self, tx: tokio::sync::mpsc::Sender<Result<String, ()>>) {
        let Reply {
            api,
            n_out,
            finish,
            include_usage,
            ..
        } = self.reply;
        let role = json!({"role": "assistant", "content": ""});
        if api == Api::Chat
            && tx
                .send(Ok(self.event(role, Value::Null, &Value::Null)))
                .await
                .is_err()
        {
            return;
        }
        for k in 0..n_out {
            if self.cut_after == Some(k) {
                // Let what was sent reach the wire before the connection goes.
                tokio::time::sleep(Duration::from_millis(30)).await;
                let _ = tx.send(Err(())).await;
                return;
            }
            tokio::time::sleep(if k == 0 { self.ttft } else { self.itl }).await;
            let c = self.event(
                json!({ "content": self.token_text }),
                Value::Null,
                &Value::Null,
            );
            if tx.send(Ok(c)).await.is_err() {
                return;
            }
        }
        if self.cut_after.is_some_and(|c| c >= n_out) {
            tokio::time::sleep(Duration::from_millis(30)).await;
            let _ = tx.send(Err(())).await;
            return;
        }
        let last = self.event(json!({}), json!(finish), &Value::Null);
        if tx.send(Ok(last)).await.is_err() {
            return;
        }
        if include_usage
            && tx
                .send(Ok(self.event(Value::Null, Value::Null, &self.reply.usage)))
                .await
                .is_err()
        {
            return;
        }
        let _ = tx.send(Ok(sse::encode_data("[DONE]"))).await;
    }

    /// One chunk: `delta` with `finish` (a null `delta`: the usage chunk's empty
    /// `choices`), and `usage`.
    fn event(&self, delta: Value, finish: Value, usage: &Value) -> String {
        let Reply { api, id, model, .. } = &self.reply;
        let created = self.created;
        let v = match api {
            Api::Chat => json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": if delta.is_null() { json!([]) } else {
                    json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}])
                },
                "usage": usage,
            }),
            Api::Text => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": if delta.is_null() { json!([]) } else {
                    json!([{"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")),
                            "logprobs": null, "finish_reason": finish}])
                },
                "usage": usage,
            }),
        };
        sse::encode_data(&v.to_string())
    }
}

/// A body that fails at once: hyper aborts the connection before sending anything.
fn cut_response() -> Response {
    let stream = futures_util::stream::once(async {
        Err::<Bytes, std::io::Error>(std::io::Error::other("injected cut"))
    });
    Response::new(Body::from_stream(stream))
}

/// A streaming body fed by a producer task; `Err(())` cuts the connection. With
/// `split_bytes`, every byte goes out as a body chunk of its own.
fn async_stream<F, Fut>(split_bytes: bool, produce: F) -> Body
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<String, ()>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<String, ()>>(4);
    tokio::spawn(produce(tx));
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        let item = rx.recv().await?;
        let out: Result<Bytes, std::io::Error> = match item {
            Ok(s) => Ok(Bytes::from(s)),
            Err(()) => Err(std::io::Error::other("injected cut")),
        };
        Some((out, rx))
    });
    if !split_bytes {
        return Body::from_stream(stream);
    }
    use futures_util::StreamExt;
    let split = stream.flat_map(|item| {
        let parts: Vec<Result<Bytes, std::io::Error>> = match item {
            Ok(b) => (0..b.len()).map(|i| Ok(b.slice(i..i + 1))).collect(),
            Err(e) => vec![Err(e)],
        };
        futures_util::stream::iter(parts)
    });
    Body::from_stream(split)
}
