//! vLLM's scoring APIs on the wire: the bodies of `/score` (and `/v1/score`), of `/rerank`
//! (`/v1/rerank` in Jina's shape, `/v2/rerank` in Cohere's: one body for all three, as vLLM
//! takes them) and the answers of those and of `/classify`.
//!
//! A body is read into a checked [`ScoreAsk`]: which texts are scored against which, with
//! vLLM's rules and messages for the counts (`1:1`, `1:N` or `N:N`; neither side empty).
//! `/classify` takes `/v1/embeddings`' `input`, checked by the same code.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use strata_api::types::Usage;
use strata_api::validate::{parse_json, Truncation};
use strata_api::ApiError;

/// Most pairs one request may score: a bound on one request's share of the worker.
pub const MAX_PAIRS: usize = 4096;

/// What a `/score` or `/rerank` body asks: every `right` text scored against the `left`
/// one (`1:N`) or against the `left` text at its position (`N:N`).
#[derive(Debug, Clone, PartialEq)]
pub struct ScoreAsk {
    /// Requested model; `None` means the served one.
    pub model: Option<String>,
    pub left: Vec<String>,
    pub right: Vec<String>,
    /// The body's names for the two sides, for errors (`text_1` and `text_2`, or `query`
    /// and `documents`, ...).
    pub names: [&'static str; 2],
    pub truncation: Truncation,
    /// vLLM's `use_activation` (default true): a cross-encoder's logit through sigmoid.
    pub activation: bool,
}

impl ScoreAsk {
    /// The `left` index scored against `right[i]`.
    #[inline]
    pub fn left_of(&self, i: usize) -> usize {
        if self.left.len() == 1 {
            0
        } else {
            i
        }
    }
}

/// A `/rerank` body: its scoring, and how the answer is cut and shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct RerankAsk {
    pub scoring: ScoreAsk,
    /// Results to return, best first; `None` (no `top_n` in the body) means all. An explicit
    /// `top_n` below 1 is refused.
    pub top_n: Option<usize>,
    /// Cohere's `return_documents` (default true, as vLLM always returns them).
    pub return_documents: bool,
}

#[derive(Deserialize)]
struct ScoreBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    text_1: Option<Value>,
    #[serde(default)]
    text_2: Option<Value>,
    #[serde(default)]
    data_1: Option<Value>,
    #[serde(default)]
    data_2: Option<Value>,
    #[serde(default)]
    queries: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    items: Option<Value>,
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    use_activation: Option<bool>,
}

#[derive(Deserialize)]
struct RerankBody {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    query: Option<Value>,
    #[serde(default)]
    documents: Option<Value>,
    #[serde(default)]
    top_n: Option<i64>,
    #[serde(default)]
    return_documents: Option<bool>,
    #[serde(default)]
    truncate_prompt_tokens: Option<i64>,
    #[serde(default)]
    use_activation: Option<bool>,
}

/// Reads a `/score` body: `text_1`/`text_2`, or vLLM's other names for the two sides
/// (`data_1`/`data_2`, `queries`/`documents`, `queries`/`items`).
pub fn read_score(body: &[u8]) -> Result<ScoreAsk, ApiError> {
    let b: ScoreBody = parse_json(body)?;
    let (names, left, right) = match b {
        ScoreBody {
            text_1: Some(l),
            text_2: Some(r),
            ..
        } => (["text_1", "text_2"], l, r),
        ScoreBody {
            data_1: Some(l),
            data_2: Some(r),
            ..
        } => (["data_1", "data_2"], l, r),
        ScoreBody {
            queries: Some(l),
            documents: Some(r),
            ..
        } => (["queries", "documents"], l, r),
        ScoreBody {
            queries: Some(l),
            items: Some(r),
            ..
        } => (["queries", "items"], l, r),
        _ => {
            return Err(ApiError::invalid(
                "text_1",
                "text_1 and text_2 are required (or data_1 and data_2, queries and \
                 documents, queries and items).",
            ))
        }
    };
    let ask = ScoreAsk {
        model: b.model,
        left: texts(names[0], left)?,
        right: texts(names[1], right)?,
        names,
        truncation: truncation(b.truncate_prompt_tokens)?,
        activation: b.use_activation.unwrap_or(true),
    };
    check_counts(&ask)?;
    Ok(ask)
}

/// Reads a `/rerank` body: `query` (one text), `documents`, `top_n`, `return_documents`.
pub fn read_rerank(body: &[u8]) -> Result<RerankAsk, ApiError> {
    let b: RerankBody = parse_json(body)?;
    let query = match b.query {
        Some(Value::String(q)) if q.trim().is_empty() => {
            return Err(ApiError::invalid("query", "query must not be empty."))
        }
        Some(Value::String(q)) => q,
        Some(Value::Object(_)) => return Err(multimodal("query")),
        Some(_) => return Err(ApiError::invalid("query", "query must be a string.")),
        None => return Err(ApiError::invalid("query", "query is required.")),
    };
    let Some(documents) = b.documents else {
        return Err(ApiError::invalid("documents", "documents is required."));
    };
    let scoring = ScoreAsk {
        model: b.model,
        left: vec![query],
        right: texts("documents", documents)?,
        names: ["query", "documents"],
        truncation: truncation(b.truncate_prompt_tokens)?,
        activation: b.use_activation.unwrap_or(true),
    };
    check_counts(&scoring)?;
    Ok(RerankAsk {
        scoring,
        top_n: top_n(b.top_n)?,
        return_documents: b.return_documents.unwrap_or(true),
    })
}

/// An explicit `top_n` must be at least 1; absent means every document.
fn top_n(n: Option<i64>) -> Result<Option<usize>, ApiError> {
    match n {
        None => Ok(None),
        Some(n) if n >= 1 => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
        Some(n) => Err(ApiError::invalid(
            "top_n",
            format!(
                "top_n must be a positive integer, got {n}; leave it out to get every document."
            ),
        )),
    }
}

/// A side as a list of texts: one string, or a list of strings.
fn texts(param: &str, v: Value) -> Result<Vec<String>, ApiError> {
    match v {
        Value::String(s) => Ok(vec![s]),
        Value::Array(items) => items
            .into_iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s),
                Value::Object(_) => Err(multimodal(&format!("{param}[{i}]"))),
                _ => Err(ApiError::invalid(
                    format!("{param}[{i}]"),
                    format!("{param}[{i}] must be a string."),
                )),
            })
            .collect(),
        Value::Object(_) => Err(multimodal(param)),
        _ => Err(ApiError::invalid(
            param,
            format!("{param} must be a string or a list of strings."),
        )),
    }
}

fn multimodal(param: &str) -> ApiError {
    ApiError::invalid(
        param,
        "MultiModalParam is not supported for this model; send text.",
    )
}

/// vLLM's count rules and messages, then the bound on pairs.
fn check_counts(ask: &ScoreAsk) -> Result<(), ApiError> {
    let (n_left, n_right) = (ask.left.len(), ask.right.len());
    if n_left > 1 && n_left != n_right {
        return Err(ApiError::invalid(
            ask.names[0],
            "Input lengths must be either 1:1, 1:N or N:N",
        ));
    }
    if n_left == 0 {
        return Err(ApiError::invalid(
            ask.names[0],
            "At least one text element must be given",
        ));
    }
    if n_right == 0 {
        return Err(ApiError::invalid(
            ask.names[1],
            "At least one text_pair element must be given",
        ));
    }
    if n_right > MAX_PAIRS {
        return Err(ApiError::invalid(
            ask.names[1],
            format!(
                "{} holds {n_right} items; at most {MAX_PAIRS} are scored per request.",
                ask.names[1]
            ),
        ));
    }
    Ok(())
}

/// `truncate_prompt_tokens` as `/v1/embeddings` reads it.
fn truncation(k: Option<i64>) -> Result<Truncation, ApiError> {
    match k {
        None => Ok(Truncation::Refuse),
        Some(-1) => Ok(Truncation::ModelLimit),
        Some(k) if k > 0 => Ok(Truncation::Tokens(usize::try_from(k).unwrap_or(usize::MAX))),
        Some(k) => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!("truncate_prompt_tokens must be -1 or a positive integer, got {k}."),
        )),
    }
}

/// vLLM's `use_activation` of a `/classify` body (the rest is `/v1/embeddings`' shape).
#[derive(Deserialize)]
pub struct ActivationField {
    #[serde(default)]
    pub use_activation: Option<bool>,
}

/// The answer of `/score`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreResponse {
    pub id: String,
    /// Always `list`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub data: Vec<ScoreData>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ScoreData {
    pub index: u32,
    /// Always `score`.
    pub object: String,
    pub score: f64,
}

/// The answer of `/rerank`, `/v1/rerank` and `/v2/rerank`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankResponse {
    pub id: String,
    pub model: String,
    pub usage: RerankUsage,
    /// Best first.
    pub results: Vec<RerankResult>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RerankUsage {
    pub prompt_tokens: u32,
    pub total_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankResult {
    /// The document's position in the request.
    pub index: u32,
    /// Absent when the request said `return_documents: false`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub document: Option<RerankDocument>,
    pub relevance_score: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RerankDocument {
    pub text: String,
    /// Always null: only text is scored (vLLM's field for image documents).
    #[serde(default)]
    pub multi_modal: Option<Vec<Value>>,
}

/// The answer of `/classify`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassifyResponse {
    pub id: String,
    /// Always `list`.
    pub object: String,
    pub created: u64,
    pub model: String,
    pub data: Vec<ClassifyData>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClassifyData {
    pub index: u32,
    /// The most probable label's name (`id2label`).
    pub label: String,
    /// Per label, in id order.
    pub probs: Vec<f32>,
    pub num_classes: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(r: Result<impl std::fmt::Debug, ApiError>) -> (Option<String>, String) {
        let e = r.expect_err("an error");
        (e.param.clone(), e.message.clone())
    }

    #[test]
    fn score_bodies_take_each_of_vllm_s_names() {
        let a = read_score(br#"{"text_1": "q", "text_2": ["a", "b"]}"#).unwrap();
        assert_eq!((a.left.len(), a.right.len(), a.names[1]), (1, 2, "text_2"));
        assert_eq!(a.left_of(1), 0);
        let a = read_score(br#"{"queries": ["x", "y"], "documents": ["a", "b"]}"#).unwrap();
        assert_eq!((a.names[0], a.left_of(1)), ("queries", 1));
        let a = read_score(br#"{"data_1": "x", "data_2": "a", "use_activation": false}"#).unwrap();
        assert!(!a.activation);
        assert!(read_score(br#"{"queries": "x", "items": ["a"]}"#).is_ok());
    }

    #[test]
    fn vllm_s_count_rules_and_messages() {
        let (p, m) = err(read_score(br#"{"text_1": ["a", "b"], "text_2": ["c"]}"#));
        assert_eq!(
            (p.as_deref(), m.as_str()),
            (
                Some("text_1"),
                "Input lengths must be either 1:1, 1:N or N:N"
            )
        );
        let (_, m) = err(read_score(br#"{"text_1": [], "text_2": ["c"]}"#));
        assert_eq!(m, "At least one text element must be given");
        let (p, m) = err(read_rerank(br#"{"query": "q", "documents": []}"#));
        assert_eq!(
            (p.as_deref(), m.as_str()),
            (
                Some("documents"),
                "At least one text_pair element must be given"
            )
        );
        let (p, _) = err(read_rerank(
            br#"{"query": "q", "documents": ["a", {"content": []}]}"#,
        ));
        assert_eq!(p.as_deref(), Some("documents[1]"));
        let (p, _) = err(read_rerank(br#"{"query": ["q"], "documents": ["a"]}"#));
        assert_eq!(p.as_deref(), Some("query"));
        let (p, _) = err(read_rerank(br#"{"query": "q"}"#));
        assert_eq!(p.as_deref(), Some("documents"));
        let (p, _) = err(read_rerank(
            br#"{"query": "q", "documents": ["a"], "truncate_prompt_tokens": 0}"#,
        ));
        assert_eq!(p.as_deref(), Some("truncate_prompt_tokens"));
    }

    #[test]
    fn top_n_absent_means_every_document_and_below_one_is_refused() {
        let body = br#"{"query": "q", "documents": ["a", "b", "c"], "top_n": 2}"#;
        assert_eq!(read_rerank(body).unwrap().top_n, Some(2));
        for top_n in ["0", "-3"] {
            let body =
                format!(r#"{{"query": "q", "documents": ["a", "b", "c"], "top_n": {top_n}}}"#);
            let (p, m) = err(read_rerank(body.as_bytes()));
            assert_eq!(p.as_deref(), Some("top_n"));
            assert!(m.contains(&format!("got {top_n}")), "{m}");
        }
        let r =
            read_rerank(br#"{"query": "q", "documents": "a", "return_documents": false}"#).unwrap();
        assert_eq!(r.top_n, None);
        assert!(!r.return_documents);
        assert_eq!(r.scoring.right, ["a"]);
    }

    #[test]
    fn an_empty_query_is_refused() {
        for q in ["\"\"", "\"  \""] {
            let body = format!(r#"{{"query": {q}, "documents": ["a"]}}"#);
            let (p, m) = err(read_rerank(body.as_bytes()));
            assert_eq!(
                (p.as_deref(), m.as_str()),
                (Some("query"), "query must not be empty.")
            );
        }
    }
}
