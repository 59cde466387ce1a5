//! SSE encoding and decoding, including a stream split at every byte offset.

use strata_api::sse::{encode_data, encode_json, DONE};
use strata_api::{SseDecoder, SseEvent};

/// A stream exercising every line ending, multi-line data, fields, comments, a BOM and
/// multi-byte characters.
const STREAM: &[u8] = b"\xEF\xBB\xBF: hello\r\n\
event: note\r\nid: 1\r\ndata: first \xC3\xA9\r\n\r\n\
data: a\rdata: b\r\r\
data:{\"x\":\"\xF0\x9F\x91\x8B\"}\n\n\
retry: 300\nid\ndata\n\n\
data: [DONE]\n\n";

fn expected() -> Vec<SseEvent> {
    vec![
        SseEvent {
            event: Some("note".into()),
            data: "first é".into(),
            id: Some("1".into()),
        },
        SseEvent {
            event: None,
            data: "a\nb".into(),
            id: Some("1".into()),
        },
        SseEvent {
            event: None,
            data: "{\"x\":\"👋\"}".into(),
            id: Some("1".into()),
        },
        SseEvent {
            event: None,
            data: String::new(),
            id: Some(String::new()),
        },
        SseEvent {
            event: None,
            data: "[DONE]".into(),
            id: Some(String::new()),
        },
    ]
}

fn decode_chunks(chunks: &[&[u8]]) -> Vec<SseEvent> {
    let mut d = SseDecoder::new();
    let mut out = Vec::new();
    for chunk in chunks {
        out.extend(d.feed(chunk).unwrap());
    }
    out.extend(d.finish());
    out
}

#[test]
fn whole_stream_decodes() {
    let events = decode_chunks(&[STREAM]);
    assert_eq!(events, expected());
    assert!(events.last().unwrap().is_done());
}

#[test]
fn split_at_every_offset() {
    for cut in 0..=STREAM.len() {
        let (a, b) = STREAM.split_at(cut);
        assert_eq!(decode_chunks(&[a, b]), expected(), "split at {cut}");
    }
}

#[test]
fn split_at_every_pair_of_offsets() {
    for i in 0..=STREAM.len() {
        for j in i..=STREAM.len() {
            let chunks = [&STREAM[..i], &STREAM[i..j], &STREAM[j..]];
            assert_eq!(decode_chunks(&chunks), expected(), "split at {i}, {j}");
        }
    }
}

#[test]
fn byte_at_a_time() {
    let chunks: Vec<&[u8]> = STREAM.chunks(1).collect();
    assert_eq!(decode_chunks(&chunks), expected());
}

#[test]
fn retry_recorded() {
    let mut d = SseDecoder::new();
    d.feed(STREAM).unwrap();
    assert_eq!(d.retry(), Some(300));
}

#[test]
fn encoded_events_decode_to_their_payloads() {
    let payloads = [
        "{}",
        "{\"a\":\"line1\\nline2\"}",
        "plain",
        "multi\nline\r\nvalue",
        "",
    ];
    let mut wire = String::new();
    for p in payloads {
        wire.push_str(&encode_data(p));
    }
    wire.push_str(DONE);
    let events = decode_chunks(&[wire.as_bytes()]);
    let data: Vec<&str> = events.iter().map(|e| e.data.as_str()).collect();
    assert_eq!(
        data,
        vec![
            "{}",
            "{\"a\":\"line1\\nline2\"}",
            "plain",
            "multi\nline\nvalue",
            "",
            "[DONE]"
        ]
    );
    assert_eq!(events.iter().filter(|e| e.is_done()).count(), 1);
}

#[test]
fn encode_json_uses_data_prefix_and_blank_line() {
    let text = encode_json(&serde_json::json!({"choices": []})).unwrap();
    assert_eq!(text, "data: {\"choices\":[]}\n\n");
}

#[test]
fn trailing_event_without_blank_line_flushed_by_finish() {
    let mut d = SseDecoder::new();
    assert!(d.feed(b"data: {\"a\":1}\n").unwrap().is_empty());
    assert_eq!(d.finish().unwrap().data, "{\"a\":1}");
}

#[test]
fn oversized_line_is_an_error_not_growth() {
    let mut d = SseDecoder::with_max_buffer(1024);
    let big = vec![b'x'; 600];
    d.feed(b"data: ").unwrap();
    d.feed(&big).unwrap();
    assert!(d.feed(&big).is_err());
}

#[test]
fn events_within_limit_pass() {
    let mut d = SseDecoder::with_max_buffer(64);
    for _ in 0..100 {
        let events = d
            .feed(b"data: 0123456789012345678901234567890123456789\n\n")
            .unwrap();
        assert_eq!(events.len(), 1);
    }
}
