//! `/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank` and `/classify` of an
//! engine serving an encoder, in vLLM's shapes ([`super::score_api`]).
//!
//! How a pair is scored depends on the model, as in vLLM:
//! - a sentence encoder (MiniLM) embeds every text once, the one `1:N` left text included,
//!   all in one worker job (so one batch through the same kernels as `/v1/embeddings`),
//!   and scores a pair by the cosine similarity of its two vectors;
//! - a cross-encoder (a classifier with one label) reads each pair as one input and scores
//!   it by its logit, through sigmoid unless `use_activation` is false;
//! - a classifier with several labels answers `/classify` only.
//!
//! Usage counts what vLLM counts: a cross-encoder's pair tokens; for a sentence encoder,
//! both texts of every pair plus the `[PAD]` vLLM places between them (the `1:N` left text
//! once per pair, though it runs once).

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Request, State};
use axum::response::Response;
use strata_api::types::{EmbeddingRequest, Usage};
use strata_api::validate::{parse_json, validate_embeddings, Truncation};
use strata_api::ApiError;

use super::classifier::sigmoid;
use super::http::{check_model, error_response, json_response, read_body, token_inputs, unix_now};
use super::input::EncoderInput;
use super::score_api::{
    read_rerank, read_score, ActivationField, ClassifyData, ClassifyResponse, RerankDocument,
    RerankResponse, RerankResult, RerankUsage, ScoreAsk, ScoreData, ScoreResponse,
};
use super::state::{EmbedState, InFlight};
use super::worker::EmbedFailure;

/// Scores in the request's pair order, and the tokens to count for them.
struct Scored {
    scores: Vec<f64>,
    prompt_tokens: usize,
}

/// `/score` and `/v1/score`.
pub async fn score(State(state): State<Arc<EmbedState>>, req: Request) -> Response {
    let started = Instant::now();
    let _guard = InFlight::new(&state);
    let result = async {
        let ask = read_score(&read_body(&state, req).await?)?;
        check_model(&state, ask.model.as_deref())?;
        let scored = score_pairs(&state, &ask).await?;
        let data = scored
            .scores
            .iter()
            .enumerate()
            .map(|(i, &score)| ScoreData {
                index: i as u32,
                object: "score".into(),
                score,
            })
            .collect();
        let tokens = count(scored.prompt_tokens);
        Ok::<_, ApiError>((
            tokens,
            ScoreResponse {
                id: random_id("score"),
                object: "list".into(),
                created: unix_now(),
                model: state.model_name.clone(),
                data,
                usage: Usage::new(tokens, 0),
            },
        ))
    }
    .await;
    answer(&state, started, result)
}

/// `/rerank`, `/v1/rerank` (Jina) and `/v2/rerank` (Cohere): the documents by relevance,
/// best first, cut to `top_n`.
pub async fn rerank(State(state): State<Arc<EmbedState>>, req: Request) -> Response {
    let started = Instant::now();
    let _guard = InFlight::new(&state);
    let result = async {
        let ask = read_rerank(&read_body(&state, req).await?)?;
        check_model(&state, ask.scoring.model.as_deref())?;
        let scored = score_pairs(&state, &ask.scoring).await?;
        let mut results: Vec<RerankResult> = ask
            .scoring
            .right
            .into_iter()
            .zip(scored.scores)
            .enumerate()
            .map(|(i, (text, relevance_score))| RerankResult {
                index: i as u32,
                document: ask.return_documents.then_some(RerankDocument {
                    text,
                    multi_modal: None,
                }),
                relevance_score,
            })
            .collect();
        // Stable, so equal scores keep the documents' order (as vLLM's sort does).
        results.sort_by(|a, b| b.relevance_score.total_cmp(&a.relevance_score));
        if let Some(n) = ask.top_n {
            results.truncate(n);
        }
        let tokens = count(scored.prompt_tokens);
        Ok::<_, ApiError>((
            tokens,
            RerankResponse {
                id: random_id("rerank"),
                model: state.model_name.clone(),
                usage: RerankUsage {
                    prompt_tokens: tokens,
                    total_tokens: tokens,
                },
                results,
            },
        ))
    }
    .await;
    answer(&state, started, result)
}

/// `/classify`: each input's label and per-label probabilities (`/v1/embeddings`' `input`
/// forms and `truncate_prompt_tokens`).
pub async fn classify(State(state): State<Arc<EmbedState>>, req: Request) -> Response {
    let started = Instant::now();
    let _guard = InFlight::new(&state);
    let result = async {
        let body = read_body(&state, req).await?;
        let v = validate_embeddings(parse_json::<EmbeddingRequest>(&body)?)?;
        let activation = parse_json::<ActivationField>(&body)?
            .use_activation
            .unwrap_or(true);
        check_model(&state, v.model.as_deref())?;
        let Some(head) = &state.classifier else {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "The model `{}` is an embedding model and does not support /classify; \
                     use /v1/embeddings, /score or /rerank.",
                    state.model_name
                ),
            ));
        };
        let inputs = token_inputs(&state, &v)?;
        let tokens = count(inputs.iter().map(Vec::len).sum());
        let logits = state.worker.embed(inputs).await.map_err(worker_error)?;
        let data = logits
            .iter()
            .enumerate()
            .map(|(i, logits)| {
                let probs = if activation {
                    head.probabilities(logits)
                } else {
                    logits.clone()
                };
                let best = probs
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(0, |(k, _)| k);
                ClassifyData {
                    index: i as u32,
                    label: head.labels[best].clone(),
                    probs,
                    num_classes: head.num_labels() as u32,
                }
            })
            .collect();
        Ok::<_, ApiError>((
            tokens,
            ClassifyResponse {
                id: random_id("classify"),
                object: "list".into(),
                created: unix_now(),
                model: state.model_name.clone(),
                data,
                usage: Usage::new(tokens, 0),
            },
        ))
    }
    .await;
    answer(&state, started, result)
}

/// A classifier's refusal of a route it does not serve (`/v1/embeddings`, generation).
pub(super) fn not_an_embedding_model(state: &EmbedState, path: &str) -> ApiError {
    let cross = state
        .classifier
        .as_ref()
        .is_some_and(|c| c.is_cross_encoder());
    ApiError::invalid(
        "model",
        format!(
            "The model `{}` is a classification model and does not support {path}; use {}.",
            state.model_name,
            if cross {
                "/score, /rerank or /classify"
            } else {
                "/classify"
            }
        ),
    )
}

/// The answer, with the request counted in the metrics when it succeeded.
fn answer<T: serde::Serialize>(
    state: &EmbedState,
    started: Instant,
    result: Result<(u32, T), ApiError>,
) -> Response {
    match result {
        Ok((tokens, body)) => {
            state.metrics.prompt_tokens.inc_by(tokens.into());
            state.metrics.record_finish("stop");
            state
                .metrics
                .e2e_request_latency
                .observe(started.elapsed().as_secs_f64());
            json_response(&body)
        }
        Err(e) => error_response(e),
    }
}

/// Scores every pair the model's way (see the module doc).
async fn score_pairs(state: &EmbedState, ask: &ScoreAsk) -> Result<Scored, ApiError> {
    let limit = truncation_limit(state, ask.truncation)?;
    match &state.classifier {
        None => by_cosine(state, ask, limit).await,
        Some(c) if c.is_cross_encoder() => by_cross_encoder(state, ask, limit).await,
        Some(c) => Err(ApiError::invalid(
            "model",
            format!(
                "The model `{}` is a classifier with {} labels; /score and /rerank need an \
                 embedding model or a cross-encoder (one label). Use /classify.",
                state.model_name,
                c.num_labels()
            ),
        )),
    }
}

/// A sentence encoder's scores: each text embedded once, pairs by cosine similarity.
async fn by_cosine(
    state: &EmbedState,
    ask: &ScoreAsk,
    limit: Option<usize>,
) -> Result<Scored, ApiError> {
    let single = |name: &str, i: usize, text: &str| -> Result<Vec<u32>, ApiError> {
        let param = side_param(ask, name, i);
        let ids = state
            .tokenizer
            .encode(text, true, limit)
            .map_err(|e| ApiError::invalid(&param, format!("Cannot tokenize: {e}")))?;
        check_length(state, &param, ids.len())?;
        Ok(ids)
    };
    let mut inputs = Vec::with_capacity(ask.left.len() + ask.right.len());
    for (i, text) in ask.left.iter().enumerate() {
        inputs.push(single(ask.names[0], i, text)?);
    }
    for (i, text) in ask.right.iter().enumerate() {
        inputs.push(single(ask.names[1], i, text)?);
    }
    let lens: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let vectors = state.worker.embed(inputs).await.map_err(worker_error)?;
    let (left, right) = vectors.split_at(ask.left.len());
    let n_left = ask.left.len();
    let mut prompt_tokens = 0;
    let scores = right
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let l = ask.left_of(i);
            prompt_tokens += lens[l] + 1 + lens[n_left + i];
            cosine(&left[l], r)
        })
        .collect();
    Ok(Scored {
        scores,
        prompt_tokens,
    })
}

/// A cross-encoder's scores: each pair one input, scored by its logit.
async fn by_cross_encoder(
    state: &EmbedState,
    ask: &ScoreAsk,
    limit: Option<usize>,
) -> Result<Scored, ApiError> {
    let mut pairs = Vec::with_capacity(ask.right.len());
    for (i, right) in ask.right.iter().enumerate() {
        let param = side_param(ask, ask.names[1], i);
        let pair = state
            .tokenizer
            .encode_pair(&ask.left[ask.left_of(i)], right, limit)
            .map_err(|e| ApiError::invalid(&param, format!("Cannot tokenize: {e}")))?;
        check_length(state, &param, pair.ids.len())?;
        pairs.push(pair);
    }
    let prompt_tokens: usize = pairs.iter().map(|p: &EncoderInput| p.ids.len()).sum();
    let logits = state.worker.forward(pairs).await.map_err(worker_error)?;
    let scores = logits
        .iter()
        .map(|l| {
            let z = l.first().copied().unwrap_or(0.0);
            f64::from(if ask.activation { sigmoid(z) } else { z })
        })
        .collect();
    Ok(Scored {
        scores,
        prompt_tokens,
    })
}

/// `a·b / (|a||b|)` in f64 (the vectors are unit length already; the norms keep it exact
/// for any vector).
fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    let norm = (na * nb).sqrt();
    if norm > 0.0 {
        dot / norm
    } else {
        0.0
    }
}

/// The error param of one text of a side: the side's name alone for a single text of the
/// left side (`query`), else with its index.
fn side_param(ask: &ScoreAsk, name: &str, i: usize) -> String {
    if name == ask.names[0] && ask.left.len() == 1 {
        name.to_string()
    } else {
        format!("{name}[{i}]")
    }
}

/// The longest input `truncate_prompt_tokens` asks for, if any (as `/v1/embeddings`).
fn truncation_limit(state: &EmbedState, t: Truncation) -> Result<Option<usize>, ApiError> {
    match t {
        Truncation::Refuse => Ok(None),
        Truncation::ModelLimit => Ok(Some(state.max_len)),
        Truncation::Tokens(k) if k <= state.max_len => Ok(Some(k)),
        Truncation::Tokens(k) => Err(ApiError::invalid(
            "truncate_prompt_tokens",
            format!(
                "truncate_prompt_tokens ({k}) is larger than the model's maximum input length \
                 ({}).",
                state.max_len
            ),
        )),
    }
}

/// vLLM's refusal of an input over the model's length.
fn check_length(state: &EmbedState, param: &str, n: usize) -> Result<(), ApiError> {
    if n <= state.max_len {
        return Ok(());
    }
    Err(ApiError::invalid(
        param,
        format!(
            "You passed {n} input tokens and requested 0 output tokens. However, the model's \
             context length is only {max} tokens, resulting in a maximum input length of {max} \
             tokens. Please reduce the length of the input prompt.",
            max = state.max_len
        ),
    ))
}

fn worker_error(e: EmbedFailure) -> ApiError {
    match e {
        EmbedFailure::QueueFull(n) => ApiError::unavailable(format!(
            "The server is busy ({n} embedding requests waiting); retry shortly."
        )),
        EmbedFailure::Stopped => ApiError::unavailable("The embedding worker has stopped."),
        EmbedFailure::Model(err) => {
            tracing::error!(error = %err, "encoder forward failed");
            ApiError::internal("The encoder's forward pass failed.")
        }
    }
}

fn count(tokens: usize) -> u32 {
    u32::try_from(tokens).unwrap_or(u32::MAX)
}

fn random_id(prefix: &str) -> String {
    let n: u128 = rand::random();
    format!("{prefix}-{n:032x}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn cosine_is_scale_free_and_zero_safe() {
        let c = super::cosine(&[1.0, 0.0], &[3.0, 3.0]);
        assert!((c - std::f64::consts::FRAC_1_SQRT_2).abs() < 1e-12);
        assert_eq!(super::cosine(&[0.0, 0.0], &[1.0, 0.0]), 0.0);
    }
}
