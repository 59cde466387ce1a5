//! Property tests: parsers and validation never panic on arbitrary input, every failure is
//! a well-formed 400, and the SSE decoder is independent of how its input is chunked.

use proptest::prelude::*;
use serde_json::{Map, Value};
use strata_api::types::{
    ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest,
};
use strata_api::{
    check_context, parse_json, validate_chat, validate_completion, validate_tokenize, ApiError,
    SseDecoder, SseEvent,
};

/// Field names the request types know, so generated objects often hit real fields.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "prompt",
    "role",
    "content",
    "type",
    "text",
    "temperature",
    "top_p",
    "n",
    "stop",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "response_format",
    "user",
    "stream",
    "stream_options",
    "include_usage",
    "tools",
    "tool_choice",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "include_stop_str_in_output",
    "ignore_eos",
    "min_tokens",
    "skip_special_tokens",
    "priority",
    "cache_salt",
    "echo",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "suffix",
    "best_of",
    "tokens",
    "input",
    "image_url",
];

fn arb_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1000i64..1000).prop_map(Value::from),
        any::<f64>().prop_map(Value::from), // non-finite become null
        (-3.0f64..3.0).prop_map(Value::from),
    ]
}

fn arb_key() -> impl Strategy<Value = String> {
    prop_oneof![
        3 => proptest::sample::select(FIELDS).prop_map(str::to_string),
        1 => "[a-z_]{0,8}",
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        arb_number(),
        prop_oneof![
            Just("user".to_string()),
            Just("assistant".to_string()),
            Just("text".to_string()),
            Just(String::new()),
            ".{0,12}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(arb_key(), inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

/// Top-level objects: mostly known fields with arbitrary values.
fn arb_request_object() -> impl Strategy<Value = Map<String, Value>> {
    proptest::collection::btree_map(arb_key(), arb_json(), 0..10)
        .prop_map(|m| m.into_iter().collect())
}

#[track_caller]
fn assert_bad_request(err: &ApiError) {
    assert_eq!(err.status, 400, "{err:?}");
    assert_eq!(err.type_str(), "invalid_request_error");
    // The body is always serializable and always carries param and code.
    let body = err.body();
    assert!(body["error"].get("param").is_some());
    assert!(body["error"].get("code").is_some());
}

/// The `param` of a parse failure is a field the client sent, or a required one it left out.
#[track_caller]
fn assert_param_is_plausible(err: &ApiError, obj: &Map<String, Value>, required: &[&str]) {
    if let Some(param) = &err.param {
        assert!(
            obj.contains_key(param) || required.contains(&param.as_str()),
            "param {param:?} not in body {obj:?}"
        );
    }
}

fn decode_whole(bytes: &[u8]) -> Result<Vec<SseEvent>, ()> {
    let mut d = SseDecoder::new();
    let mut events = d.feed(bytes).map_err(|_| ())?;
    events.extend(d.finish());
    Ok(events)
}

fn decode_split(bytes: &[u8], cuts: &[usize]) -> Result<Vec<SseEvent>, ()> {
    let mut d = SseDecoder::new();
    let mut events = Vec::new();
    let mut start = 0;
    for &cut in cuts {
        let cut = cut.clamp(start, bytes.len());
        events.extend(d.feed(&bytes[start..cut]).map_err(|_| ())?);
        start = cut;
    }
    events.extend(d.feed(&bytes[start..]).map_err(|_| ())?);
    events.extend(d.finish());
    Ok(events)
}

/// Bytes that look like SSE often enough to reach every branch of the decoder.
fn arb_sse_bytes() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"data:".to_vec()),
        Just(b"data: ".to_vec()),
        Just(b"event: e".to_vec()),
        Just(b"id: 7".to_vec()),
        Just(b"retry: 10".to_vec()),
        Just(b":c".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"[DONE]".to_vec()),
        Just("é👋".as_bytes().to_vec()),
        Just(b"\xEF\xBB\xBF".to_vec()),
        proptest::collection::vec(any::<u8>(), 0..4),
    ];
    proptest::collection::vec(piece, 0..40).prop_map(|v| v.concat())
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let errors = [
            parse_json::<ChatCompletionRequest>(&bytes).and_then(validate_chat).err(),
            parse_json::<CompletionRequest>(&bytes).and_then(validate_completion).err(),
            parse_json::<TokenizeRequest>(&bytes).and_then(validate_tokenize).err(),
        ];
        for err in errors.into_iter().flatten() {
            assert_bad_request(&err);
        }
    }

    #[test]
    fn arbitrary_json_never_panics(value in arb_json()) {
        let bytes = serde_json::to_vec(&value).unwrap();
        if let Err(err) = parse_json::<ChatCompletionRequest>(&bytes) {
            assert_bad_request(&err);
        }
        if let Err(err) = parse_json::<CompletionRequest>(&bytes) {
            assert_bad_request(&err);
        }
        if let Err(err) = parse_json::<EmbeddingRequest>(&bytes) {
            assert_bad_request(&err);
        }
        if !value.is_object() {
            prop_assert!(parse_json::<TokenizeRequest>(&bytes).is_err());
        }
    }

    #[test]
    fn chat_objects_parse_or_blame_a_field(obj in arb_request_object()) {
        let bytes = serde_json::to_vec(&obj).unwrap();
        match parse_json::<ChatCompletionRequest>(&bytes) {
            Ok(req) => {
                if let Err(err) = validate_chat(req) {
                    assert_bad_request(&err);
                    prop_assert!(err.param.is_some(), "validation errors name a field: {err:?}");
                }
            }
            Err(err) => {
                assert_bad_request(&err);
                prop_assert!(err.param.is_some(), "object bodies get a param: {err:?}");
                assert_param_is_plausible(&err, &obj, &["messages"]);
            }
        }
    }

    #[test]
    fn completion_objects_parse_or_blame_a_field(obj in arb_request_object()) {
        let bytes = serde_json::to_vec(&obj).unwrap();
        match parse_json::<CompletionRequest>(&bytes) {
            Ok(req) => {
                if let Err(err) = validate_completion(req) {
                    assert_bad_request(&err);
                    prop_assert!(err.param.is_some(), "validation errors name a field: {err:?}");
                }
            }
            Err(err) => {
                assert_bad_request(&err);
                prop_assert!(err.param.is_some(), "object bodies get a param: {err:?}");
                assert_param_is_plausible(&err, &obj, &["prompt"]);
            }
        }
    }

    #[test]
    fn tokenize_objects_never_panic(obj in arb_request_object()) {
        let bytes = serde_json::to_vec(&obj).unwrap();
        match parse_json::<TokenizeRequest>(&bytes) {
            Ok(req) => {
                if let Err(err) = validate_tokenize(req) {
                    assert_bad_request(&err);
                }
            }
            Err(err) => assert_param_is_plausible(&err, &obj, &[]),
        }
        if let Err(err) = parse_json::<DetokenizeRequest>(&bytes) {
            assert_param_is_plausible(&err, &obj, &["tokens"]);
        }
    }

    #[test]
    fn valid_chat_bodies_with_noise_validate(
        temperature in 0.0f64..=2.0,
        top_p in 0.001f64..=1.0,
        n in 1i64..=16,
        max_tokens in 1i64..100_000,
        noise in arb_request_object(),
    ) {
        // Unknown fields never break an otherwise valid request.
        let mut obj: Map<String, Value> = noise
            .into_iter()
            .filter(|(k, _)| !FIELDS.contains(&k.as_str()))
            .collect();
        obj.insert("model".into(), "m".into());
        obj.insert(
            "messages".into(),
            serde_json::json!([{"role": "user", "content": "hi"}]),
        );
        obj.insert("temperature".into(), temperature.into());
        obj.insert("top_p".into(), top_p.into());
        obj.insert("n".into(), n.into());
        obj.insert("max_tokens".into(), max_tokens.into());
        let bytes = serde_json::to_vec(&obj).unwrap();
        let v = validate_chat(parse_json(&bytes).unwrap()).unwrap();
        prop_assert_eq!(v.sampling.n as i64, n);
        prop_assert_eq!(v.sampling.max_tokens.map(i64::from), Some(max_tokens));
        // serde_json's default float parsing may differ from the printed value by an ulp.
        prop_assert!((v.sampling.temperature - temperature as f32).abs() < 1e-6);
    }

    #[test]
    fn check_context_never_panics(
        prompt in any::<usize>(),
        max in proptest::option::of(any::<u32>()),
        ctx in any::<usize>(),
    ) {
        match check_context(prompt, max, ctx, "prompt") {
            Ok(effective) => {
                prop_assert!(prompt < ctx);
                prop_assert!(effective >= 1);
                prop_assert!((effective as usize) <= ctx - prompt);
                if let Some(m) = max {
                    prop_assert_eq!(effective, m);
                }
            }
            Err(err) => assert_bad_request(&err),
        }
    }

    #[test]
    fn sse_decoder_chunking_invariant_arbitrary_bytes(
        bytes in proptest::collection::vec(any::<u8>(), 0..300),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        prop_assert_eq!(decode_split(&bytes, &cuts), decode_whole(&bytes));
    }

    #[test]
    fn sse_decoder_chunking_invariant_sse_like(
        bytes in arb_sse_bytes(),
        cuts in proptest::collection::vec(any::<usize>(), 0..12),
    ) {
        let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
        cuts.sort_unstable();
        let whole = decode_whole(&bytes);
        prop_assert!(whole.is_ok());
        prop_assert_eq!(decode_split(&bytes, &cuts), whole);
    }

    #[test]
    fn sse_encode_decode_round_trip(payloads in proptest::collection::vec(".{0,40}", 0..8)) {
        let mut wire = String::new();
        for p in &payloads {
            wire.push_str(&strata_api::sse::encode_data(p));
        }
        let events = decode_whole(wire.as_bytes()).unwrap();
        // Line breaks are normalized to "\n"; everything else survives.
        let want: Vec<String> = payloads
            .iter()
            .map(|p| p.replace("\r\n", "\n").replace('\r', "\n"))
            .collect();
        let got: Vec<String> = events.into_iter().map(|e| e.data).collect();
        prop_assert_eq!(got, want);
    }
}
