//! What the picker reads from one buffered request: the API kind from the path, the body
//! parsed once (model, priority, prompt text for the prefix indexes) and the headers that
//! steer the pick.

use std::sync::Arc;

use bytes::Bytes;
use strata_api::types::{ChatCompletionRequest, CompletionRequest};
use strata_api::validate::{parse_json, validate_chat, validate_completion, PromptInput};
use strata_api::ApiError;
use xxhash_rust::xxh64::xxh64;

use crate::router::Router;
use crate::scheduling::SchedRequest;

pub use crate::headers::{FAIRNESS_ID, MODEL_REWRITE, TEST_SELECTION};

/// The OpenAI API a path asks for, from its suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiKind {
    Chat,
    Completions,
    Embeddings,
    Responses,
    /// Anything else with a JSON body that names a `model`.
    Other,
}

impl ApiKind {
    pub fn of_path(path: &str) -> ApiKind {
        let path = path.split('?').next().unwrap_or("").trim_end_matches('/');
        if path.ends_with("chat/completions") {
            ApiKind::Chat
        } else if path.ends_with("completions") {
            ApiKind::Completions
        } else if path.ends_with("embeddings") {
            ApiKind::Embeddings
        } else if path.ends_with("responses") {
            ApiKind::Responses
        } else {
            ApiKind::Other
        }
    }
}

/// A parsed request body.
#[derive(Debug, Clone, Default)]
pub struct ParsedBody {
    pub model: String,
    pub priority: i32,
    /// Text for the approximate prefix index.
    pub prefix_text: String,
    /// Token ids when the prompt came as ids.
    pub tokens: Option<Vec<u32>>,
    pub salt: Option<String>,
    /// What to send `/tokenize` when the precise index needs token ids.
    pub tokenize_body: Option<serde_json::Value>,
    /// The body to forward (the original bytes unless the model was rewritten).
    pub body: Bytes,
    /// Estimated prompt tokens of a chat or completion request that does not carry its
    /// own `kv_transfer_params` (what a prefill/decode pair may split).
    pub prompt_tokens: Option<usize>,
}

fn missing_model() -> ApiError {
    ApiError::invalid("model", "The request body must name a `model`.")
}

/// Parses `body` once for `kind`. Chat and completions are validated as the HTTP front
/// validates them; every kind must be a JSON object with a string `model`. With `rewrite`
/// the body's `model` is replaced (and the forwarded bytes re-encoded).
pub fn parse_body(
    kind: ApiKind,
    body: Bytes,
    rewrite: Option<&str>,
    want_tokenize: bool,
) -> Result<ParsedBody, ApiError> {
    // Chat and completions without a rewrite are parsed once, straight into their types.
    if rewrite.is_none_or(str::is_empty) && matches!(kind, ApiKind::Chat | ApiKind::Completions) {
        let mut parsed = if kind == ApiKind::Chat {
            parse_chat(&body, want_tokenize)?
        } else {
            parse_completion(&body, want_tokenize)?
        };
        if parsed.model.is_empty() {
            return Err(missing_model());
        }
        parsed.body = body;
        return Ok(parsed);
    }
    let mut value: serde_json::Value = parse_json(&body)?;
    let Some(obj) = value.as_object_mut() else {
        return Err(ApiError::invalid_no_param(
            "The request body must be a JSON object.",
        ));
    };
    match obj.get("model") {
        Some(serde_json::Value::String(m)) if !m.is_empty() => {}
        Some(serde_json::Value::String(_)) | None | Some(serde_json::Value::Null) => {
            return Err(missing_model())
        }
        Some(_) => return Err(ApiError::invalid("model", "`model` must be a string.")),
    }
    let body = match rewrite {
        Some(m) if !m.is_empty() && obj.get("model").and_then(|v| v.as_str()) != Some(m) => {
            obj.insert("model".into(), serde_json::Value::String(m.to_string()));
            Bytes::from(value.to_string())
        }
        _ => body,
    };
    let mut parsed = match kind {
        ApiKind::Chat => parse_chat(&body, want_tokenize)?,
        ApiKind::Completions => parse_completion(&body, want_tokenize)?,
        _ => ParsedBody {
            model: value
                .get("model")
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_string(),
            ..Default::default()
        },
    };
    if parsed.model.is_empty() {
        return Err(missing_model());
    }
    parsed.body = body;
    Ok(parsed)
}

fn parse_chat(body: &[u8], want_tokenize: bool) -> Result<ParsedBody, ApiError> {
    let req: ChatCompletionRequest = parse_json(body)?;
    let tokenize_body = want_tokenize.then(|| {
        serde_json::json!({
            "model": req.model,
            "messages": req.messages,
            "add_generation_prompt": req.add_generation_prompt.unwrap_or(true),
        })
    });
    let own_kv_transfer = req.kv_transfer_params.is_some();
    let v = validate_chat(req)?;
    let mut prefix_text = String::new();
    for m in &v.messages {
        prefix_text.push_str(m.role.as_str());
        prefix_text.push('\n');
        prefix_text.push_str(&m.content);
        prefix_text.push('\n');
    }
    Ok(ParsedBody {
        model: v.model.unwrap_or_default(),
        priority: v.sampling.priority,
        prompt_tokens: (!own_kv_transfer)
            .then(|| crate::scheduling::pd::estimate_prompt_tokens(prefix_text.len(), None)),
        prefix_text,
        salt: v.sampling.cache_salt,
        tokenize_body,
        ..Default::default()
    })
}

fn parse_completion(body: &[u8], want_tokenize: bool) -> Result<ParsedBody, ApiError> {
    let req: CompletionRequest = parse_json(body)?;
    let own_kv_transfer = req.kv_transfer_params.is_some();
    let v = validate_completion(req)?;
    let (prefix_text, tokens, tokenize_body) = match &v.prompt {
        PromptInput::Text(t) => (
            t.clone(),
            None,
            want_tokenize.then(|| {
                serde_json::json!({"model": v.model, "prompt": t, "add_special_tokens": v.add_special_tokens})
            }),
        ),
        PromptInput::Tokens(ids) => {
            let mut s = String::with_capacity(ids.len() * 6);
            for id in ids {
                s.push_str(&id.to_string());
                s.push(' ');
            }
            (s, Some(ids.clone()), None)
        }
    };
    Ok(ParsedBody {
        model: v.model.unwrap_or_default(),
        priority: v.sampling.priority,
        prompt_tokens: (!own_kv_transfer).then(|| {
            crate::scheduling::pd::estimate_prompt_tokens(
                prefix_text.len(),
                tokens.as_ref().map(Vec::len),
            )
        }),
        prefix_text,
        tokens,
        salt: v.sampling.cache_salt,
        tokenize_body,
        ..Default::default()
    })
}

/// A header's value as text, when it is valid UTF-8 and not empty.
pub fn header<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
        .map(str::trim)
        .filter(|v| !v.is_empty())
}

/// The priority: the objective header (a configured objective name or an integer), else
/// the body's `priority`.
pub fn priority(router: &Router, headers: &[(String, Vec<u8>)], body_priority: i32) -> i32 {
    match header(headers, crate::headers::OBJECTIVE) {
        Some(name) => router
            .config()
            .admission
            .objectives
            .get(name)
            .copied()
            .or_else(|| name.parse().ok())
            .unwrap_or(body_priority),
        None => body_priority,
    }
}

/// The scheduling request for a parsed body, with prefix keys (token blocks too when a
/// precise scorer is configured).
pub async fn sched_request(
    router: &Router,
    headers: &[(String, Vec<u8>)],
    parsed: &ParsedBody,
    priority: i32,
) -> SchedRequest {
    let model = parsed.model.clone();
    let mut sreq = SchedRequest {
        approx_blocks: router.approx_blocks(&model, &parsed.prefix_text),
        model,
        priority,
        session: header(headers, router.config().session_header.as_str()).map(str::to_string),
        profile: header(headers, crate::headers::PROFILE).map(str::to_string),
        prompt_tokens: parsed.prompt_tokens,
        ..Default::default()
    };
    sreq.lora = router.lora_adapter(&sreq.model);
    if router.uses_precise() {
        let tokens = match (&parsed.tokens, &parsed.tokenize_body) {
            (Some(t), _) => Some(Arc::new(t.clone())),
            (None, Some(tb)) => {
                let tb = Bytes::from(tb.to_string());
                router.tokenize(xxh64(&tb, 0), tb).await
            }
            _ => None,
        };
        if let (Some(t), Some(_)) = (&tokens, sreq.prompt_tokens) {
            sreq.prompt_tokens = Some(t.len());
        }
        sreq.precise_blocks =
            tokens.map(|t| router.precise_blocks(&t, sreq.lora.as_deref(), parsed.salt.as_deref()));
    }
    sreq
}

/// `host:port` of an endpoint's base URL.
pub fn address_of(url: &str) -> &str {
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_end_matches('/')
}

/// Whether `addr` (`host:port`) is one of `allowed` (each `host:port`, or a bare host that
/// matches every port).
pub fn address_allowed(addr: &str, allowed: &[String]) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let bare = |s: &str| s.trim_start_matches('[').trim_end_matches(']').to_string();
    let host = bare(host);
    allowed.iter().any(|a| {
        let a = a.trim();
        a == addr || bare(a) == host
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_kind_from_the_path_suffix() {
        assert_eq!(ApiKind::of_path("/v1/chat/completions"), ApiKind::Chat);
        assert_eq!(
            ApiKind::of_path("/v1/completions?x=1"),
            ApiKind::Completions
        );
        assert_eq!(ApiKind::of_path("/v1/embeddings"), ApiKind::Embeddings);
        assert_eq!(ApiKind::of_path("/v1/responses/"), ApiKind::Responses);
        assert_eq!(ApiKind::of_path("/tokenize"), ApiKind::Other);
    }

    #[test]
    fn model_is_required_and_must_be_a_string() {
        let p = |b: &str| parse_body(ApiKind::Embeddings, Bytes::from(b.to_string()), None, false);
        assert_eq!(
            p(r#"{"input":"x"}"#).unwrap_err().param.as_deref(),
            Some("model")
        );
        assert_eq!(p(r#"{"model":""}"#).unwrap_err().status, 400);
        assert_eq!(p(r#"{"model":3}"#).unwrap_err().status, 400);
        assert_eq!(p(r#"[1,2]"#).unwrap_err().status, 400);
        assert_eq!(p("{not json").unwrap_err().status, 400);
        assert_eq!(p(r#"{"model":"m","input":"x"}"#).unwrap().model, "m");
        let chat = |b: &str| parse_body(ApiKind::Chat, Bytes::from(b.to_string()), None, false);
        assert_eq!(
            chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#)
                .unwrap_err()
                .param
                .as_deref(),
            Some("model")
        );
        // Validated like the HTTP front: a chat request with no messages is refused.
        assert_eq!(
            chat(r#"{"model":"m","messages":[]}"#).unwrap_err().status,
            400
        );
    }

    #[test]
    fn rewrite_replaces_the_model_and_re_encodes() {
        let body = Bytes::from_static(br#"{"model":"a","prompt":"hello there"}"#);
        let p = parse_body(ApiKind::Completions, body.clone(), Some("b"), false).unwrap();
        assert_eq!(p.model, "b");
        let v: serde_json::Value = serde_json::from_slice(&p.body).unwrap();
        assert_eq!(v["model"], "b");
        assert_eq!(v["prompt"], "hello there");
        // Same model: the original bytes are kept.
        let p = parse_body(ApiKind::Completions, body.clone(), Some("a"), false).unwrap();
        assert_eq!(p.body, body);
    }

    #[test]
    fn addresses_match_with_or_without_port() {
        let allowed = vec!["10.0.0.1".to_string(), "10.0.0.2:8000".to_string()];
        assert!(address_allowed("10.0.0.1:9000", &allowed));
        assert!(address_allowed("10.0.0.2:8000", &allowed));
        assert!(!address_allowed("10.0.0.2:8001", &allowed));
        assert!(!address_allowed("10.0.0.3:8000", &allowed));
        assert!(address_allowed("[::1]:80", &["::1".to_string()]));
        assert_eq!(address_of("http://127.0.0.1:80"), "127.0.0.1:80");
    }
}
