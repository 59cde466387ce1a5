//! Disaggregated requests (a prefill/decode profile pair in the scheduling config,
//! PROTOCOLS §11, vLLM's proxy protocol): when the pick names a prefill engine, phase 1
//! sends it the request with `kv_transfer_params: {do_remote_decode: true, ...}`,
//! `max_tokens: 1`, `stream: false` and the same `x-request-id`, bounded by
//! `pd.prefill_timeout_ms`; the `kv_transfer_params` of its answer go into the original
//! body, which phase 2 sends to the decode pick (streamed or not, as the client asked). The
//! prefill engine's lease lasts for phase 1 only. Any phase-1 failure (an error status, a
//! timeout, an answer without `kv_transfer_params`) sends the original request to the
//! decode pick, which computes the prompt itself: the client never sees it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::header;
use http_body_util::Full;
use strata_api::trace;
use tracing::Instrument;

use super::upstream::{collect_limited, forwarded_headers, Upstream};
use super::REQUEST_ID;
use crate::router::Picked;
use crate::scheduling::PdChoice;
use crate::telemetry::{PD_PATH_DECODE_ONLY, PD_PATH_DISAGGREGATED, PD_PATH_FALLBACK};

/// Phase 1 of a disaggregated request, when the pick named prefill engines; returns the
/// body the decode pick gets and the prefill engine that computed the prompt. A failed
/// phase 1 leaves the original body: the decode pick computes the prompt itself.
pub(super) async fn disaggregate(
    up: &Upstream<'_>,
    picked: &Picked,
    body: Bytes,
    proxy_span: &tracing::Span,
) -> (Bytes, Option<Arc<str>>) {
    let metrics = up.router.metrics();
    match (&picked.prefill, picked.pd) {
        (Some(prefill), _) => {
            let phase1 = prefill_phase(up, &body, prefill)
                .instrument(tracing::info_span!(
                    target: trace::SPAN_TARGET,
                    parent: proxy_span,
                    "router.prefill"
                ))
                .await;
            match phase1.and_then(|(params, url)| Ok((with_kv_params(&body, params)?, url))) {
                Ok((b, url)) => {
                    metrics.pd_path(PD_PATH_DISAGGREGATED);
                    (b, Some(url))
                }
                Err(e) => {
                    tracing::warn!(request_id = ?up.rid, error = %e, "remote prefill failed; the decode pick computes the prompt");
                    metrics.pd_path(PD_PATH_FALLBACK);
                    (body, None)
                }
            }
        }
        (None, PdChoice::DecodeOnly | PdChoice::NoPrefill) => {
            metrics.pd_path(PD_PATH_DECODE_ONLY);
            (body, None)
        }
        (None, _) => (body, None),
    }
}

/// The phase-1 body (PROTOCOLS §11): the client's request asking the prefill engine to
/// compute the prompt and keep its KV for a remote decoder, one token, not streamed.
fn prefill_body(body: &[u8]) -> Result<Bytes, String> {
    let mut value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| "the body is not a JSON object".to_string())?;
    obj.insert(
        "kv_transfer_params".into(),
        serde_json::json!({
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        }),
    );
    obj.insert("max_tokens".into(), 1.into());
    if obj.contains_key("max_completion_tokens") {
        obj.insert("max_completion_tokens".into(), 1.into());
    }
    obj.insert("stream".into(), false.into());
    obj.remove("stream_options");
    serde_json::to_vec(&value)
        .map(Bytes::from)
        .map_err(|e| format!("encoding the phase-1 body: {e}"))
}

/// The phase-2 body: the client's request with the prefill engine's `kv_transfer_params`.
fn with_kv_params(body: &[u8], params: serde_json::Value) -> Result<Bytes, String> {
    let mut value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| format!("body: {e}"))?;
    let obj = value
        .as_object_mut()
        .ok_or_else(|| "the body is not a JSON object".to_string())?;
    obj.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&value)
        .map(Bytes::from)
        .map_err(|e| format!("encoding the phase-2 body: {e}"))
}

/// Phase 1 on the first prefill engine whose circuit lets it through: one attempt,
/// bounded by `pd.prefill_timeout_ms`, its lease (in-flight count, circuit) held for this
/// phase only. Returns the answer's top-level `kv_transfer_params` and the engine's URL,
/// or why there are none.
async fn prefill_phase(
    up: &Upstream<'_>,
    body: &Bytes,
    prefill: &[(crate::endpoint::EndpointId, Arc<str>)],
) -> Result<(serde_json::Value, Arc<str>), String> {
    let router = up.router;
    let phase1 = prefill_body(body)?;
    let Some((mut lease, url)) = prefill
        .iter()
        .find_map(|(id, url)| router.lease(*id, url).map(|l| (l, url.clone())))
    else {
        return Err("no prefill engine could take the request".into());
    };
    let mut builder = hyper::Request::builder()
        .method(hyper::Method::POST)
        .uri(format!("{url}{}", up.path));
    for (name, value) in forwarded_headers(up.parts) {
        if name != header::CONTENT_TYPE {
            builder = builder.header(name, value);
        }
    }
    builder = builder
        .header(REQUEST_ID, up.rid.clone())
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(tp) = &up.traceparent {
        builder = builder.header(trace::TRACEPARENT, tp.clone());
    }
    let req = builder
        .body(Full::new(phase1))
        .map_err(|e| format!("building the phase-1 request: {e}"))?;
    let started = std::time::Instant::now();
    let exchange = async {
        let resp = router
            .inner
            .client
            .request(req)
            .await
            .map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        let bytes = collect_limited(resp.into_body())
            .await
            .ok_or_else(|| format!("{url}: the answer broke off"))?;
        Ok::<_, String>((status, bytes))
    };
    let outcome = tokio::time::timeout(router.config().prefill_timeout(), exchange).await;
    router
        .metrics()
        .pd_prefill_seconds
        .observe(started.elapsed().as_secs_f64());
    let (status, bytes) = match outcome {
        Err(_) => {
            lease.failure();
            return Err(format!("{url}: no answer within the prefill timeout"));
        }
        Ok(Err(e)) => {
            lease.failure();
            return Err(e);
        }
        Ok(Ok(answer)) => answer,
    };
    if status.is_server_error() {
        lease.failure();
        return Err(format!("{url} answered {status}"));
    }
    lease.success();
    if !status.is_success() {
        return Err(format!("{url} answered {status}"));
    }
    let answer: serde_json::Value = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{url}: the answer is not JSON: {e}"))?;
    match answer.get("kv_transfer_params") {
        Some(p @ serde_json::Value::Object(_)) => Ok((p.clone(), url)),
        _ => Err(format!("{url}: the answer has no kv_transfer_params")),
    }
}
