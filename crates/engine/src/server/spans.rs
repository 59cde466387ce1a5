//! A request's trace spans (`docs/GATEWAY.md`, "Traces"): the request's own span, a child
//! of the caller's `traceparent`, and each choice's queue, prefill and decode phases.

use std::time::Instant;

use axum::http::HeaderMap;
use strata_api::trace;

use crate::sequence::SeqTimes;

/// The request's trace span, child of the caller's `traceparent` (a malformed one starts a
/// new trace). Exported only when the binary exports traces; otherwise disabled.
pub(super) fn trace_span(headers: &HeaderMap, route: &'static str) -> tracing::Span {
    let span = tracing::info_span!(
        target: trace::SPAN_TARGET,
        "engine.request",
        otel.kind = "server",
        http.route = route
    );
    trace::accept(&span, headers.get(trace::TRACEPARENT).map(|v| v.as_bytes()));
    span
}

/// One choice's queue, prefill and decode as child spans of the request's, from the
/// engine thread's timestamps (taken there, emitted here once the choice is over).
pub(super) fn trace_phases(
    span: &tracing::Span,
    choice: usize,
    t: &SeqTimes,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
) {
    if !trace::exporting() {
        return;
    }
    let choice = ("choice", choice as i64);
    let end = t.first_scheduled.unwrap_or_else(Instant::now);
    trace::record_child(
        span,
        trace::ChildSpan {
            name: "engine.queue",
            start: t.arrival,
            end,
            attributes: &[choice],
        },
    );
    let (Some(scheduled), Some(first)) = (t.first_scheduled, t.first_token) else {
        return;
    };
    trace::record_child(
        span,
        trace::ChildSpan {
            name: "engine.prefill",
            start: scheduled,
            end: first,
            attributes: &[
                choice,
                ("prompt_tokens", prompt_tokens as i64),
                ("cached_tokens", cached_tokens as i64),
            ],
        },
    );
    trace::record_child(
        span,
        trace::ChildSpan {
            name: "engine.decode",
            start: first,
            end: t.last_token.unwrap_or(first),
            attributes: &[choice, ("completion_tokens", completion_tokens as i64)],
        },
    );
}
