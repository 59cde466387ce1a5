//! Realistic request and response bodies: what the OpenAI Python client and vLLM send and
//! expect, parsed, validated and serialized back.

use serde_json::{json, Value};
use strata_api::sse;
use strata_api::types::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatTokenLogprob, CompletionChoice,
    CompletionChunk, CompletionLogprobs, CompletionRequest, CompletionResponse, DetokenizeRequest,
    DetokenizeResponse, EmbeddingRequest, FinishReason, MessageContent, ModelCard, ModelList,
    Prompt, ResponseMessage, Role, Stop, StopReason, TokenizeRequest, TokenizeResponse, TopLogprob,
    TopLogprobMap, Usage,
};
use strata_api::{parse_json, validate_chat, validate_completion, PromptInput};

/// What `client.chat.completions.create(..., stream=True,
/// stream_options={"include_usage": True}, tools=[...])` puts on the wire, plus vLLM
/// `extra_body` fields and fields we do not know.
const OPENAI_STREAMING_CHAT: &str = r#"{
  "messages": [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": [{"type": "text", "text": "What's the weather in Paris?"}]},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_abc", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "call_abc", "content": "18C, cloudy"}
  ],
  "model": "meta-llama/Llama-3.2-1B-Instruct",
  "frequency_penalty": 0.1,
  "logit_bias": {"128001": -100},
  "logprobs": true,
  "top_logprobs": 2,
  "max_completion_tokens": 256,
  "n": 1,
  "parallel_tool_calls": false,
  "presence_penalty": 0,
  "response_format": {"type": "text"},
  "seed": 42,
  "stop": ["</answer>"],
  "stream": true,
  "stream_options": {"include_usage": true},
  "temperature": 0.7,
  "tool_choice": "auto",
  "tools": [{"type": "function", "function": {"name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}],
  "top_p": 0.95,
  "user": "user-1234",
  "store": false,
  "metadata": {"trace": "abc"},
  "top_k": 50,
  "min_p": 0.05,
  "repetition_penalty": 1.1,
  "stop_token_ids": [128009],
  "include_stop_str_in_output": false,
  "ignore_eos": false,
  "min_tokens": 1,
  "skip_special_tokens": true,
  "priority": 3,
  "cache_salt": "tenant-7",
  "echo": false,
  "add_generation_prompt": true,
  "guided_json": null
}"#;

#[test]
fn openai_streaming_chat_request_parses_and_validates() {
    let req: ChatCompletionRequest = parse_json(OPENAI_STREAMING_CHAT.as_bytes()).unwrap();
    assert_eq!(req.messages.len(), 4);
    assert_eq!(req.stop, Some(Stop::Many(vec!["</answer>".into()])));
    assert!(matches!(
        req.messages[1].content,
        Some(MessageContent::Parts(_))
    ));
    assert_eq!(req.tool_choice, Some(json!("auto")));

    // Serializing and re-parsing the typed request is lossless.
    let again: ChatCompletionRequest =
        serde_json::from_str(&serde_json::to_string(&req).unwrap()).unwrap();
    assert_eq!(again, req);

    let v = validate_chat(req).unwrap();
    assert_eq!(v.model.as_deref(), Some("meta-llama/Llama-3.2-1B-Instruct"));
    assert_eq!(v.messages[1].content, "What's the weather in Paris?");
    assert_eq!(v.messages[2].role, Role::Assistant);
    assert_eq!(v.messages[2].content, "");
    assert!(v.stream && v.include_usage && !v.continuous_usage_stats);
    let s = &v.sampling;
    assert_eq!(s.max_tokens, Some(256));
    assert_eq!(s.logprobs, Some(2));
    assert_eq!(s.seed, Some(42));
    assert_eq!(s.temperature, 0.7);
    assert_eq!(s.top_k, Some(50));
    assert_eq!(s.stop_token_ids, vec![128009]);
    assert_eq!(s.min_tokens, 1);
    assert_eq!(s.priority, 3);
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-7"));
    assert_eq!(s.logit_bias, vec![(128001, -100.0)]);
    assert_eq!(v.user.as_deref(), Some("user-1234"));
    assert!(v.tools.is_some());
}

#[test]
fn minimal_chat_request_serializes_without_nulls() {
    let req: ChatCompletionRequest =
        parse_json(br#"{"model": "m", "messages": [{"role": "user", "content": "Hello!"}]}"#)
            .unwrap();
    assert_eq!(
        serde_json::to_value(&req).unwrap(),
        json!({"model": "m", "messages": [{"role": "user", "content": "Hello!"}]})
    );
}

#[test]
fn legacy_completion_requests_parse() {
    let bodies = [
        (
            r#"{"model": "m", "prompt": "Say this is a test", "max_tokens": 7, "temperature": 0,
                "echo": true, "logprobs": 3, "stream": false, "best_of": 1, "suffix": null}"#,
            PromptInput::Text("Say this is a test".into()),
        ),
        (
            r#"{"model": "m", "prompt": [128000, 9906], "max_tokens": 16, "stream": true,
                "stream_options": {"include_usage": true, "continuous_usage_stats": true},
                "add_special_tokens": false}"#,
            PromptInput::Tokens(vec![128000, 9906]),
        ),
        (
            r#"{"prompt": ["one prompt in a list"], "stop": "\n", "n": 2}"#,
            PromptInput::Text("one prompt in a list".into()),
        ),
    ];
    for (body, prompt) in bodies {
        let req: CompletionRequest = parse_json(body.as_bytes()).unwrap();
        let again: CompletionRequest =
            serde_json::from_str(&serde_json::to_string(&req).unwrap()).unwrap();
        assert_eq!(again, req);
        let v = validate_completion(req).unwrap();
        assert_eq!(v.prompt, prompt, "{body}");
    }
}

#[test]
fn completion_flags_from_real_body() {
    let req: CompletionRequest = parse_json(
        br#"{"model": "m", "prompt": "x", "echo": true, "logprobs": 3, "max_tokens": 7}"#,
    )
    .unwrap();
    let v = validate_completion(req).unwrap();
    assert!(v.echo);
    assert_eq!(v.sampling.logprobs, Some(3));
    assert_eq!(v.sampling.max_tokens, Some(7));
}

#[test]
fn chat_response_matches_openai_shape() {
    let mut resp = ChatCompletionResponse::new(
        "chatcmpl-123",
        1_694_268_190,
        "llama",
        vec![ChatChoice {
            index: 0,
            message: ResponseMessage::assistant("Hello there, how may I assist you today?"),
            logprobs: None,
            finish_reason: Some(FinishReason::Stop),
            stop_reason: None,
        }],
        Usage::new(9, 12).with_cached_tokens(0),
    );
    resp.system_fingerprint = Some("fp_strata".into());
    let value = serde_json::to_value(&resp).unwrap();
    assert_eq!(
        value,
        json!({
            "id": "chatcmpl-123",
            "object": "chat.completion",
            "created": 1_694_268_190,
            "model": "llama",
            "system_fingerprint": "fp_strata",
            "choices": [{
                "index": 0,
                "message": {"role": "assistant",
                            "content": "Hello there, how may I assist you today?",
                            "refusal": null},
                "logprobs": null,
                "finish_reason": "stop"
            }],
            "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21,
                      "prompt_tokens_details": {"cached_tokens": 0}}
        })
    );
    assert_eq!(
        serde_json::from_value::<ChatCompletionResponse>(value).unwrap(),
        resp
    );
}

#[test]
fn vllm_chat_response_parses() {
    // A body as vLLM returns it, with fields we do not model.
    let body = json!({
        "id": "chatcmpl-9d3", "object": "chat.completion", "created": 1_722_000_000,
        "model": "m",
        "choices": [{"index": 0,
                     "message": {"role": "assistant", "reasoning_content": null,
                                 "content": "Hi", "tool_calls": []},
                     "logprobs": null, "finish_reason": "length", "stop_reason": null}],
        "usage": {"prompt_tokens": 5, "total_tokens": 6, "completion_tokens": 1,
                  "prompt_tokens_details": null},
        "prompt_logprobs": null, "kv_transfer_params": null
    });
    let resp: ChatCompletionResponse = serde_json::from_value(body).unwrap();
    assert_eq!(resp.choices[0].finish_reason, Some(FinishReason::Length));
    assert_eq!(resp.usage.total_tokens, 6);
    assert_eq!(resp.choices[0].message.tool_calls, Some(vec![]));
}

#[test]
fn chat_stream_sequence_encodes_and_decodes() {
    let first = ChatCompletionChunk::new(
        "chatcmpl-1",
        1,
        "m",
        vec![ChatChunkChoice {
            index: 0,
            delta: ChatDelta {
                role: Some(Role::Assistant),
                content: Some(String::new()),
                ..Default::default()
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        }],
    );
    let middle = ChatCompletionChunk::new(
        "chatcmpl-1",
        1,
        "m",
        vec![ChatChunkChoice {
            index: 0,
            delta: ChatDelta {
                content: Some("Hi".into()),
                ..Default::default()
            },
            logprobs: Some(ChatLogprobs {
                content: Some(vec![ChatTokenLogprob {
                    token: "Hi".into(),
                    logprob: -0.25,
                    bytes: Some(b"Hi".to_vec()),
                    top_logprobs: vec![TopLogprob {
                        token: "Hi".into(),
                        logprob: -0.25,
                        bytes: Some(b"Hi".to_vec()),
                    }],
                }]),
            }),
            finish_reason: None,
            stop_reason: None,
        }],
    );
    let last = ChatCompletionChunk::new(
        "chatcmpl-1",
        1,
        "m",
        vec![ChatChunkChoice {
            index: 0,
            delta: ChatDelta::default(),
            logprobs: None,
            finish_reason: Some(FinishReason::Stop),
            stop_reason: Some(StopReason::TokenId(128009)),
        }],
    );
    let usage = ChatCompletionChunk::usage_only("chatcmpl-1", 1, "m", Usage::new(5, 1));

    let mut wire = String::new();
    for chunk in [&first, &middle, &last, &usage] {
        wire.push_str(&sse::encode_json(chunk).unwrap());
    }
    wire.push_str(sse::DONE);

    let mut decoder = strata_api::SseDecoder::new();
    let events = decoder.feed(wire.as_bytes()).unwrap();
    assert_eq!(events.len(), 5);
    assert!(events[4].is_done());
    let parsed: Vec<ChatCompletionChunk> = events[..4].iter().map(|e| e.json().unwrap()).collect();
    assert_eq!(parsed, vec![first, middle, last, usage]);

    // Wire-level details clients depend on.
    let first_json: Value = serde_json::from_str(&events[0].data).unwrap();
    assert_eq!(
        first_json["choices"][0]["delta"],
        json!({"role": "assistant", "content": ""})
    );
    assert_eq!(first_json["choices"][0]["finish_reason"], Value::Null);
    assert!(first_json.get("usage").is_none());
    let last_json: Value = serde_json::from_str(&events[2].data).unwrap();
    assert_eq!(last_json["choices"][0]["delta"], json!({}));
    let usage_json: Value = serde_json::from_str(&events[3].data).unwrap();
    assert_eq!(usage_json["choices"], json!([]));
    assert_eq!(usage_json["usage"]["total_tokens"], 6);
}

#[test]
fn completion_response_and_chunk_shapes() {
    let resp = CompletionResponse::new(
        "cmpl-1",
        2,
        "m",
        vec![CompletionChoice {
            index: 0,
            text: "This is a test".into(),
            logprobs: Some(CompletionLogprobs {
                tokens: vec!["This".into(), " is".into()],
                token_logprobs: vec![None, Some(-0.5)],
                top_logprobs: vec![None, Some(TopLogprobMap(vec![(" is".into(), -0.5)]))],
                text_offset: vec![0, 4],
            }),
            finish_reason: Some(FinishReason::Length),
            stop_reason: None,
        }],
        Usage::new(5, 7),
    );
    let value = serde_json::to_value(&resp).unwrap();
    assert_eq!(value["object"], "text_completion");
    assert_eq!(
        value["choices"][0]["logprobs"]["token_logprobs"],
        json!([null, -0.5])
    );
    assert_eq!(
        serde_json::from_value::<CompletionResponse>(value).unwrap(),
        resp
    );

    let chunk = CompletionChunk::new(
        "cmpl-1",
        2,
        "m",
        vec![CompletionChoice {
            index: 0,
            text: " test".into(),
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        }],
    );
    let value = serde_json::to_value(&chunk).unwrap();
    assert_eq!(value["choices"][0]["finish_reason"], Value::Null);
    assert!(value.get("usage").is_none());
    let usage_chunk = CompletionChunk::usage_only("cmpl-1", 2, "m", Usage::new(5, 7));
    let value = serde_json::to_value(&usage_chunk).unwrap();
    assert_eq!(value["choices"], json!([]));
    assert_eq!(value["usage"]["completion_tokens"], 7);
}

#[test]
fn models_embeddings_tokenize_detokenize() {
    let list: ModelList = serde_json::from_value(json!({
        "object": "list",
        "data": [{"id": "m", "object": "model", "created": 1, "owned_by": "vllm",
                  "root": "/models/m", "parent": null, "max_model_len": 4096,
                  "permission": [{"id": "modelperm-1"}]}]
    }))
    .unwrap();
    let mut card = ModelCard::new("m", 1, "vllm");
    card.root = Some("/models/m".into());
    card.max_model_len = Some(4096);
    assert_eq!(list, ModelList::new(vec![card]));

    let emb: EmbeddingRequest = parse_json(
        br#"{"input": "The food was delicious", "model": "e5", "encoding_format": "float"}"#,
    )
    .unwrap();
    assert_eq!(emb.input, Prompt::Text("The food was delicious".into()));

    let tok: TokenizeRequest =
        parse_json(br#"{"model": "m", "prompt": "Hello", "add_special_tokens": true}"#).unwrap();
    assert_eq!(tok.add_special_tokens, Some(true));
    let resp = TokenizeResponse::new(vec![128000, 9906], 4096);
    assert_eq!(
        serde_json::to_string(&resp).unwrap(),
        r#"{"count":2,"max_model_len":4096,"tokens":[128000,9906]}"#
    );

    let detok: DetokenizeRequest = parse_json(br#"{"model": "m", "tokens": [9906]}"#).unwrap();
    assert_eq!(detok.tokens, vec![9906]);
    let err = parse_json::<DetokenizeRequest>(br#"{"tokens": [-3]}"#).unwrap_err();
    assert_eq!(err.param.as_deref(), Some("tokens"));
    assert_eq!(
        serde_json::to_value(DetokenizeResponse {
            prompt: "Hello".into()
        })
        .unwrap(),
        json!({"prompt": "Hello"})
    );
}

#[test]
fn error_body_round_trip_through_sse_consumers() {
    // Errors mid-stream are sent as a data event carrying the error envelope.
    let err = strata_api::ApiError::unavailable("draining");
    let wire = sse::encode_data(&err.to_json_string());
    let mut d = strata_api::SseDecoder::new();
    let events = d.feed(wire.as_bytes()).unwrap();
    let parsed: strata_api::ErrorResponse = events[0].json().unwrap();
    assert_eq!(
        parsed.error.kind.as_deref(),
        Some("service_unavailable_error")
    );
    assert_eq!(parsed.into_api_error(503), err);
}
