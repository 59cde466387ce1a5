//! Stage 2, lookup: answers that need no model.
//! * The exact-match response cache (deterministic requests, keyed per tenant).
//! * The semantic cache ([`crate::semantic`]): the last user message is embedded by the
//!   configured embedding model and compared with stored ones of the same tenant, model
//!   and context.
//!
//! `Cache-Control: no-cache` (or `no-store`) skips both lookups but still stores the
//! answer; `x-strata-semantic-cache: off` skips the semantic cache.
//!
//! Streamed requests use both caches too: a hit is answered as SSE events
//! ([`crate::sse_answer::to_sse`]), and a fresh streamed answer is stored only once it
//! completed ([`super::stream`]). Each request's outcome (`x-strata-cache`) is counted by
//! tenant in `strata_gateway_cache_outcomes_total`.
//!
//! The caches' other half is here too: [`store_answer`] puts a fresh answer where the
//! lookup said it goes (called by *respond* for a whole answer, by the stream watcher for
//! a streamed one).

use std::time::Instant;

use axum::body::Bytes;
use axum::http::{header, HeaderValue};
use serde_json::json;

use super::headers::CACHE_HEADER;
use super::route::Route;
use super::side_call::{self, SideCall};
use super::values::{Admitted, Lookup, Store};
use crate::cache;
use crate::config::Resolved;
use crate::semantic::{self, HeaderAsk, SEMANTIC_HEADER};
use crate::state::Gateway;

/// Largest embedding answer read.
const EMBEDDING_ANSWER_LIMIT: usize = 1 << 20;

/// A stored answer as this request wants it: as stored, or as SSE events for a streamed
/// request (`None`: it cannot be streamed, so it is not a hit).
fn as_reply(req: &Admitted, stored: Bytes) -> Option<Bytes> {
    if !req.stream {
        return Some(stored);
    }
    crate::sse_answer::to_sse(&stored).map(Bytes::from)
}

fn no_cache(req: &Admitted) -> bool {
    req.headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("no-cache") || v.contains("no-store"))
}

pub(crate) async fn lookup(gw: &Gateway, req: &mut Admitted) -> Lookup {
    let found = find(gw, req).await;
    let outcome = match &found {
        Lookup::Hit(_) => Some("hit"),
        Lookup::Semantic(_) => Some("semantic"),
        Lookup::Miss(store) => store.is_some().then_some("miss"),
    };
    if let Some(outcome) = outcome {
        gw.metrics
            .cache_outcomes
            .get_or_create(&vec![
                ("tenant", req.key.record.tenant.clone()),
                ("outcome", outcome.into()),
            ])
            .inc();
    }
    found
}

async fn find(gw: &Gateway, req: &mut Admitted) -> Lookup {
    let skip_lookup = no_cache(req);
    let mut store = Store::default();
    if !req.route.cacheable() {
        return Lookup::Miss(store);
    }
    if let Some(c) = &gw.cache {
        if cache::is_deterministic(&req.body) {
            let key = cache::cache_key(&req.key.record.tenant, req.route.name(), &req.body);
            if !skip_lookup {
                let stored = match c.get(&key).await {
                    Ok(stored) => stored,
                    Err(e) => {
                        gw.metrics.backend_error("cache");
                        tracing::warn!(error = %e, "cache lookup failed; treating as a miss");
                        None
                    }
                };
                if let Some(hit) = stored.and_then(|b| as_reply(req, b)) {
                    count(gw, "hit");
                    return Lookup::Hit(hit);
                }
            }
            count(gw, "miss");
            req.extra
                .insert(CACHE_HEADER, HeaderValue::from_static("miss"));
            store.cache_key = Some(key);
        }
    }
    if let Some(index) = &gw.semantic {
        let resolved = req.resolved.clone();
        let cfg = &resolved.config.cache.semantic;
        let ask = HeaderAsk::parse(
            req.headers
                .get(SEMANTIC_HEADER)
                .and_then(|v| v.to_str().ok()),
        );
        let key = (cfg.enabled && req.route == Route::Chat && ask != HeaderAsk::Off)
            .then(|| {
                semantic::request_key(&req.key.record.tenant, &req.model().name, &req.body, cfg)
                    .ok()
            })
            .flatten();
        if let Some(key) = key {
            if let Some(vector) = embed(gw, &resolved, &cfg.embedding_model, req, &key.text).await {
                let tenant = req.key.record.tenant.clone();
                if !skip_lookup {
                    let threshold = ask.threshold(cfg.threshold);
                    let found = index.get(&key.bucket, &vector, threshold, Instant::now());
                    if let Some(hit) = found.and_then(|(b, _)| as_reply(req, b)) {
                        count(gw, "semantic");
                        count_semantic(gw, tenant, "hit");
                        return Lookup::Semantic(hit);
                    }
                }
                count_semantic(gw, tenant, "miss");
                req.extra
                    .insert(CACHE_HEADER, HeaderValue::from_static("miss"));
                store.semantic = Some((key.bucket, vector));
            }
        }
    }
    Lookup::Miss(store)
}

/// Stores a fresh 200 answer (a whole body, or a stream assembled into one) in the exact
/// cache and the semantic cache, where the lookup said it goes.
pub(crate) async fn store_answer(gw: &Gateway, store: Store, bytes: Bytes) {
    if let (Some(c), Some(k)) = (&gw.cache, store.cache_key) {
        if let Err(e) = c.put(k, bytes.clone()).await {
            gw.metrics.backend_error("cache");
            tracing::warn!(error = %e, "cache: storing an answer failed");
        }
    }
    if let (Some(index), Some((bucket, vector))) = (&gw.semantic, store.semantic) {
        if let Some(share) = &gw.semantic_share {
            if let Err(e) = share.publish(&bucket, &vector, &bytes).await {
                gw.metrics.backend_error("semantic_cache");
                tracing::warn!(error = %e, "semantic cache: sharing an entry failed");
            }
        }
        index.put(bucket, vector, bytes, Instant::now());
    }
}

fn count(gw: &Gateway, result: &str) {
    gw.metrics
        .cache
        .get_or_create(&vec![("result", result.into())])
        .inc();
}

fn count_semantic(gw: &Gateway, tenant: String, result: &str) {
    gw.metrics
        .semantic
        .get_or_create(&vec![("tenant", tenant), ("result", result.into())])
        .inc();
}

/// The unit-length embedding of `text` from the embedding model
/// ([`side_call::call_model`]); `None` when no target answers one (the request then goes
/// uncached).
async fn embed(
    gw: &Gateway,
    resolved: &Resolved,
    model: &str,
    req: &Admitted,
    text: &str,
) -> Option<Vec<f32>> {
    let call = SideCall {
        route: Route::Embeddings,
        headers: &req.headers,
        tenant: &req.key.record.tenant,
        request_id: &req.request_id,
        answer_limit: EMBEDDING_ANSWER_LIMIT,
    };
    let body = |upstream_model: &str| {
        Bytes::from(json!({"model": upstream_model, "input": text}).to_string())
    };
    let read =
        |answer: &Bytes| semantic::embedding_from_json(answer).and_then(semantic::normalized);
    match side_call::call_model(gw, resolved, model, &call, body, read).await {
        Ok(vector) => Some(vector),
        Err(why) => {
            tracing::debug!(%why, "no embedding; semantic cache skipped");
            None
        }
    }
}
