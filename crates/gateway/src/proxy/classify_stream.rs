//! Output classifier rules over a streamed answer: the stream is held until it ends (the
//! client receives nothing before), its texts are assembled from the events (chat and
//! text-completion deltas, the Messages API's text deltas, the Responses API's output text
//! deltas), the output rules classify them as they would a whole answer
//! ([`super::classify_guard::check_output_texts`]), and then the held events are released
//! to the client as one stream (through the pattern guardrails, usage and cache watcher as
//! any stream) or the answer is withheld with the rule's error. So a client cannot pass an
//! output rule by asking for `stream: true`; it gets its stream at the end, not as it is
//! generated.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::http::Response;
use http_body_util::{BodyExt, Full};
use serde_json::Value;
use strata_api::{ApiError, SseDecoder};

use super::classify_guard::{check_output_texts, latest};
use super::send::read_limited;
use super::shape::usage_from_json;
use super::values::Admitted;
use crate::routing::Failure;
use crate::state::Gateway;
use crate::upstream::{BodyError, UpstreamBody};

/// Largest streamed answer held for classification; a longer one is refused (503).
pub const HELD_STREAM_LIMIT: usize = 16 << 20;

/// Why a held stream could not be read, in words for the client.
fn why(f: &Failure) -> String {
    match f {
        Failure::Timeout => "outlasted the model's timeout".into(),
        Failure::Status(_, why) => format!("was refused: {why}"),
        _ => "broke".into(),
    }
}

/// A held stream that is not released: the error the client gets instead, and the usage
/// its events reported (the model did the work).
pub(crate) struct Withheld {
    pub error: ApiError,
    pub usage: Option<(u64, u64)>,
}

/// Holds `resp` (a streamed answer) until it ends, classifies its texts with the output
/// rules, and gives back the same stream to relay, or why it is withheld.
pub(crate) async fn hold(
    gw: &Gateway,
    req: &Admitted,
    resp: Response<UpstreamBody>,
) -> Result<Response<UpstreamBody>, Withheld> {
    let (head, body) = resp.into_parts();
    let deadline = Instant::now() + Duration::from_millis(req.model().timeout_ms);
    let held = axum::http::Response::from_parts(head.clone(), body);
    let (_, _, bytes) = read_limited(held, HELD_STREAM_LIMIT, deadline)
        .await
        .map_err(|f| Withheld {
            error: ApiError::unavailable(format!(
                "The streamed answer could not be held for the guardrail classifier (it {}); \
                 nothing was sent.",
                why(&f)
            )),
            usage: None,
        })?;
    let read = StreamTexts::read(&bytes);
    if let Err(error) = check_output_texts(gw, req, &read.texts).await {
        return Err(Withheld {
            error,
            usage: read.usage,
        });
    }
    let body = Full::new(bytes)
        .map_err(|never| -> BodyError { match never {} })
        .boxed_unsync();
    Ok(Response::from_parts(head, body))
}

/// What a stream's events said: its texts (one per choice, content block or output item,
/// the latest [`super::classify_guard::MAX_TEXTS`]) and the last usage reported.
#[derive(Debug, Default, PartialEq)]
struct StreamTexts {
    texts: Vec<String>,
    usage: Option<(u64, u64)>,
}

impl StreamTexts {
    fn read(sse: &[u8]) -> StreamTexts {
        let mut decoder = SseDecoder::new();
        let mut events = decoder.feed(sse).unwrap_or_default();
        events.extend(decoder.finish());
        // Keyed by (API, index) so that each choice or block is joined in order.
        let mut parts: BTreeMap<(u8, u64), String> = BTreeMap::new();
        let mut usage = None;
        for ev in events.iter().filter(|e| !e.is_done()) {
            let Ok(v) = serde_json::from_str::<Value>(&ev.data) else {
                continue;
            };
            for (key, text) in deltas(&v) {
                parts.entry(key).or_default().push_str(text);
            }
            if let Some(u) = usage_from_json(ev.data.as_bytes()) {
                usage = Some(u);
            }
        }
        let texts = parts
            .into_values()
            .filter(|t| !t.trim().is_empty())
            .collect();
        StreamTexts {
            texts: latest(texts),
            usage,
        }
    }
}

/// The text pieces of one event, each with the (API, index) it belongs to.
fn deltas(v: &Value) -> Vec<((u8, u64), &str)> {
    let index = |v: &Value, field: &str| v.get(field).and_then(Value::as_u64).unwrap_or(0);
    let mut out = Vec::new();
    if let Some(choices) = v.get("choices").and_then(Value::as_array) {
        for c in choices {
            let text = c
                .get("delta")
                .and_then(|d| d.get("content"))
                .or_else(|| c.get("text"))
                .and_then(Value::as_str);
            if let Some(t) = text {
                out.push(((0, index(c, "index")), t));
            }
        }
    }
    match v.get("type").and_then(Value::as_str) {
        Some("content_block_delta") => {
            if let Some(t) = v.pointer("/delta/text").and_then(Value::as_str) {
                out.push(((1, index(v, "index")), t));
            }
        }
        Some("response.output_text.delta") => {
            if let Some(t) = v.get("delta").and_then(Value::as_str) {
                out.push(((2, index(v, "output_index")), t));
            }
        }
        _ => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn texts_of_every_stream_shape() {
        let chat = concat!(
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hel\"}},{\"index\":1,\"delta\":{\"content\":\"b\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":3,\"total_tokens\":8}}\n\n",
            "data: [DONE]\n\n",
        );
        assert_eq!(
            StreamTexts::read(chat.as_bytes()),
            StreamTexts {
                texts: vec!["hello".into(), "b".into()],
                usage: Some((5, 3)),
            }
        );
        let completion = "data: {\"choices\":[{\"index\":0,\"text\":\" tok\"}]}\n\ndata: {\"choices\":[{\"index\":0,\"text\":\" tok\"}]}\n\n";
        assert_eq!(StreamTexts::read(completion.as_bytes()).texts, [" tok tok"]);
        let messages = concat!(
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"cl\"}}\n\n",
            "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"aude\"}}\n\n",
        );
        assert_eq!(StreamTexts::read(messages.as_bytes()).texts, ["claude"]);
        let responses = "data: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"delta\":\"r\"}\n\ndata: {\"type\":\"response.output_text.delta\",\"output_index\":0,\"delta\":\"s\"}";
        assert_eq!(StreamTexts::read(responses.as_bytes()).texts, ["rs"]);
        assert_eq!(StreamTexts::read(b"not sse at all"), StreamTexts::default());
    }
}
