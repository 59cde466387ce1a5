//! The intake: what the router reads from a request before it routes it, the same for
//! both transports (the HTTP front in `proxy`, the ext_proc picker in `extproc`) and for
//! `strata up`'s front.
//!
//! Routing reads, it does not judge. The engine validates its own requests (and answers
//! its own errors, which come back unchanged); the router only needs a lean routing view:
//! the API (from the path, [`routes`]), the `model`, the prompt text and token ids the
//! prefix indexes hash with a key for each non-text part ([`view`]), the body's
//! `priority` and `cache_salt`, and the stored response a request continues. A view
//! tolerates every field and part type; the body goes upstream byte for byte.
//!
//! Refused here, as OpenAI-shaped errors, only what cannot be routed:
//! - a body over `max_body_bytes` (413, by the transport while it reads);
//! - a body that is not JSON, or not a JSON object, on an API whose body is JSON (400);
//! - a `model` that is not a string, or none on an API that runs a model (400).
//!
//! Headers read: the objective (priority), the session header, the scheduling profile,
//! the fairness id (logged) and, on the picker, the model rewrite ([`crate::headers`]).

pub mod json;
pub mod multipart;
pub mod routes;
pub mod view;

use std::sync::Arc;

use bytes::Bytes;
use strata_api::ApiError;
use xxhash_rust::xxh64::xxh64;

use crate::router::Router;
use crate::scheduling::SchedRequest;
pub use routes::{route, Api, BodyForm, Route};
pub use view::{ModelField, ReadLimits, RoutingView, Shape};

/// A request's headers, however a transport holds them.
pub trait Headers {
    /// The value of `name` (lower case), trimmed, when it is UTF-8 and not empty.
    fn header(&self, name: &str) -> Option<&str>;
}

impl Headers for axum::http::HeaderMap {
    fn header(&self, name: &str) -> Option<&str> {
        self.get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    }
}

impl Headers for [(String, Vec<u8>)] {
    fn header(&self, name: &str) -> Option<&str> {
        self.iter()
            .find(|(k, _)| k == name)
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    }
}

/// What the intake made of one request.
#[derive(Debug, Clone)]
pub struct Intake {
    pub api: Api,
    pub view: RoutingView,
    /// The model routed on; empty: any replica.
    pub model: String,
    /// The stored response this request needs (named by the path, or `previous_response_id`):
    /// only the replica that holds it can answer.
    pub home: Option<String>,
    /// The body to send: the bytes that came, unless the picker rewrote the model.
    pub body: Bytes,
}

fn missing_model() -> ApiError {
    ApiError::invalid("model", "The request body must name a `model`.")
}

/// What a request is, for the intake.
#[derive(Debug, Clone, Copy)]
pub struct Incoming<'a> {
    /// Whether it carries a body to read (a POST, PUT or PATCH).
    pub has_body: bool,
    pub path: &'a str,
    pub content_type: Option<&'a str>,
}

/// Reads one request: its route, its routing view, the model it is routed by. Refuses
/// only what cannot be routed (see the module docs). With `rewrite` (the picker's model
/// rewrite header) the body's `model` is replaced in place: the other bytes stay as sent.
pub fn read(
    req: Incoming<'_>,
    body: Bytes,
    limits: ReadLimits,
    rewrite: Option<&str>,
) -> Result<Intake, ApiError> {
    let route = routes::route(req.path);
    let api = route.api;
    let mut view = RoutingView::default();
    let mut json_object = false;
    if req.has_body {
        match api.form() {
            BodyForm::Json => {
                view = view::read_json(api.shape(), &body, limits).map_err(not_json)?;
                if !view.object {
                    return Err(ApiError::invalid_no_param(
                        "The request body must be a JSON object.",
                    ));
                }
                json_object = true;
            }
            BodyForm::Multipart | BodyForm::Any => {
                match req
                    .content_type
                    .and_then(|ct| multipart::boundary(ct).map(|_| ct))
                {
                    Some(ct) => {
                        if let Some(m) = multipart::model_field(ct, &body) {
                            view.model = ModelField::Named(m);
                        }
                    }
                    // Anything else is read as JSON when it is: a body that is not goes on
                    // as it came, for the engine to judge.
                    None => {
                        if let Ok(v) = view::read_json(api.shape(), &body, limits) {
                            json_object = v.object;
                            view = v;
                        }
                    }
                }
            }
        }
    }
    let mut model = match &view.model {
        ModelField::Named(m) => m.clone(),
        ModelField::NotAString if json_object && api.form() == BodyForm::Json => {
            return Err(ApiError::invalid("model", "`model` must be a string."))
        }
        _ => String::new(),
    };
    let body = match rewrite.filter(|m| !m.is_empty()) {
        Some(m) if json_object && m != model => {
            let b = rewrite_model(&body, m).ok_or_else(|| not_json_text("the model rewrite"))?;
            model = m.to_string();
            b
        }
        _ => body,
    };
    let body = if view.kv_transfer_names_peer && !limits.trust_client_kv_transfer {
        // A client may not name a host an engine connects to (docs/SECURITY.md): the
        // member becomes `null` and the request is routed as any other.
        view.own_kv_transfer = false;
        view.kv_transfer_names_peer = false;
        set_member(&body, "kv_transfer_params", "null")
            .ok_or_else(|| not_json_text("kv_transfer_params"))?
    } else {
        body
    };
    if model.is_empty() && req.has_body && api.needs_model() {
        return Err(missing_model());
    }
    let home = route
        .response_id
        .map(str::to_string)
        .or_else(|| view.previous_response_id.clone());
    Ok(Intake {
        api,
        view,
        model,
        home,
        body,
    })
}

/// The `model` a body names, read as lean as routing reads it: a form's `model` field, or
/// a JSON object's `model` member. `None` when the body is neither.
pub fn probe_model(content_type: Option<&str>, body: &[u8]) -> Option<ModelField> {
    if let Some(ct) = content_type.filter(|ct| multipart::boundary(ct).is_some()) {
        return Some(
            multipart::model_field(ct, body).map_or(ModelField::Missing, ModelField::Named),
        );
    }
    let limits = ReadLimits {
        prefix_window: 0,
        want_tokenize: false,
        trust_client_kv_transfer: true,
    };
    view::read_json(Shape::ModelOnly, body, limits)
        .ok()
        .filter(|v| v.object)
        .map(|v| v.model)
}

fn not_json(e: json::SyntaxError) -> ApiError {
    ApiError::invalid_no_param(format!("Request body is not valid JSON: {e}."))
}

fn not_json_text(what: &str) -> ApiError {
    ApiError::invalid_no_param(format!("Request body is not valid JSON for {what}."))
}

/// `body` (a JSON object) with its top-level `model` set to `model`: the old value's
/// bytes replaced, or the member added first. Nothing else changes.
pub fn rewrite_model(body: &[u8], model: &str) -> Option<Bytes> {
    set_member(body, "model", &serde_json::to_string(model).ok()?)
}

/// `body` (a JSON object) with its top-level member `key` set to the JSON text `value`: the
/// old value's bytes replaced, or the member added first. Nothing else changes.
fn set_member(body: &[u8], key: &str, value: &str) -> Option<Bytes> {
    let mut s = json::Scanner::new(body).ok()?;
    let mut span: Option<(usize, usize)> = None;
    let mut open = None;
    if s.kind().ok()? == json::Kind::Object {
        open = Some(s.offset());
    }
    s.object(|s, name| {
        if name.is(key) {
            s.kind()?;
            let start = s.offset();
            s.skip()?;
            span = Some((start, s.offset()));
        } else {
            s.skip()?;
        }
        Ok(())
    })
    .ok()?;
    let mut out = Vec::with_capacity(body.len() + key.len() + value.len() + 4);
    match (span, open) {
        (Some((start, end)), _) => {
            out.extend_from_slice(&body[..start]);
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(&body[end..]);
        }
        (None, Some(open)) => {
            let empty = body[open + 1..].iter().find(|c| !c.is_ascii_whitespace()) == Some(&b'}');
            out.extend_from_slice(&body[..=open]);
            out.push(b'"');
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(b"\":");
            out.extend_from_slice(value.as_bytes());
            if !empty {
                out.push(b',');
            }
            out.extend_from_slice(&body[open + 1..]);
        }
        (None, None) => return None,
    }
    Some(Bytes::from(out))
}

/// What the intake reads for `router`: its prefix window, and the `/tokenize` body when
/// a precise prefix scorer is configured.
pub fn limits(router: &Router) -> ReadLimits {
    ReadLimits {
        trust_client_kv_transfer: router.config().pd.trust_client_kv_transfer,
        prefix_window: router.prefix_window(),
        want_tokenize: router.uses_precise(),
    }
}

/// The priority: the objective header (an objective the cluster or router.yaml defines, or
/// an integer), else the body's `priority`, else 0.
pub fn priority(router: &Router, headers: &(impl Headers + ?Sized), body: Option<i32>) -> i32 {
    let body = body.unwrap_or(0);
    match headers.header(crate::headers::OBJECTIVE) {
        Some(name) => router.objective_priority(name).unwrap_or(body),
        None => body,
    }
}

/// The scheduling request: model (and the LoRA adapter it names), priority, session,
/// profile, prefix keys (token blocks too when a precise scorer is configured) and, for
/// the APIs disaggregation can split, the estimated prompt tokens.
pub async fn sched_request(
    router: &Router,
    headers: &(impl Headers + ?Sized),
    intake: &Intake,
    priority: i32,
) -> SchedRequest {
    let view = &intake.view;
    let model = intake.model.clone();
    let mut sreq = SchedRequest {
        approx_blocks: router.approx_blocks(&model, &view.prefix_text),
        model,
        priority,
        session: headers
            .header(router.config().session_header.as_str())
            .map(str::to_string),
        profile: headers.header(crate::headers::PROFILE).map(str::to_string),
        ..Default::default()
    };
    // A request for a LoRA adapter: the adapter name is the blocks' extra key (PROTOCOLS
    // §3), in the precise hashes as the engine computes them, and in the approximate
    // ones through the model-name seed (which is the adapter name), so its prefixes never
    // match the base model's.
    sreq.lora = router.lora_adapter(&sreq.model);
    let mut tokens_len = view.tokens.as_ref().map(Vec::len);
    if router.uses_precise() {
        let tokens = match (&view.tokens, &view.tokenize_body) {
            (Some(t), _) => Some(Arc::new(t.clone())),
            (None, Some(tb)) => router.tokenize(xxh64(tb, 0), tb.clone()).await,
            _ => None,
        };
        if let Some(t) = &tokens {
            tokens_len = Some(t.len());
        }
        sreq.precise_blocks =
            tokens.map(|t| router.precise_blocks(&t, sreq.lora.as_deref(), view.salt.as_deref()));
    }
    if intake.api.disaggregable() && !view.own_kv_transfer {
        sreq.prompt_tokens = Some(crate::scheduling::pd::estimate_prompt_tokens(
            view.prompt_bytes,
            tokens_len,
        ));
    }
    sreq
}

#[cfg(test)]
mod tests;
