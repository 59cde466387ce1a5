//! One test per validation rule: each asserts the status, the OpenAI `type` and the `param`
//! of the rejection, or the typed value of the acceptance.

use serde_json::{json, Value};
use strata_api::types::{ChatCompletionRequest, CompletionRequest, TokenizeRequest};
use strata_api::{
    check_context, parse_json, validate_chat, validate_completion, validate_tokenize, ApiError,
    ChatMessage, PromptInput, Role, TokenizeInput, ValidatedChat, ValidatedCompletion, MAX_N,
    MAX_STOP,
};

fn chat(body: Value) -> Result<ValidatedChat, ApiError> {
    let req: ChatCompletionRequest = parse_json(&serde_json::to_vec(&body).unwrap())?;
    validate_chat(req)
}

/// A minimal valid chat body with `extra` merged in.
fn chat_with(extra: Value) -> Result<ValidatedChat, ApiError> {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    chat(body)
}

fn completion(body: Value) -> Result<ValidatedCompletion, ApiError> {
    let req: CompletionRequest = parse_json(&serde_json::to_vec(&body).unwrap())?;
    validate_completion(req)
}

fn completion_with(extra: Value) -> Result<ValidatedCompletion, ApiError> {
    let mut body = json!({"model": "m", "prompt": "Once upon a time"});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    completion(body)
}

#[track_caller]
fn assert_invalid<T: std::fmt::Debug>(
    result: Result<T, ApiError>,
    param: Option<&str>,
) -> ApiError {
    let err = result.expect_err("expected a 400");
    assert_eq!(err.status, 400, "{err:?}");
    assert_eq!(err.type_str(), "invalid_request_error", "{err:?}");
    assert_eq!(err.param.as_deref(), param, "{err:?}");
    assert_eq!(err.body()["error"]["param"], json!(param));
    err
}

// ---------------------------------------------------------------- defaults

#[test]
fn chat_defaults() {
    let v = chat_with(json!({})).unwrap();
    assert_eq!(v.model.as_deref(), Some("m"));
    assert_eq!(v.messages, vec![ChatMessage::new(Role::User, "hi")]);
    let s = &v.sampling;
    assert_eq!(s.temperature, 1.0);
    assert_eq!(s.top_p, 1.0);
    assert_eq!(s.top_k, None);
    assert_eq!(s.min_p, 0.0);
    assert_eq!(s.repetition_penalty, 1.0);
    assert_eq!(s.n, 1);
    assert_eq!(s.max_tokens, None);
    assert_eq!(s.min_tokens, 0);
    assert_eq!(s.logprobs, None);
    assert!(s.skip_special_tokens);
    assert!(s.spaces_between_special_tokens);
    assert_eq!(s.priority, 0);
    assert!(!v.stream && !v.include_usage && !v.echo);
    assert!(v.add_generation_prompt);
    assert!(!v.continue_final_message);
    assert!(!v.add_special_tokens);
}

#[test]
fn model_may_be_omitted() {
    let v = chat(json!({"messages": [{"role": "user", "content": "hi"}]})).unwrap();
    assert_eq!(v.model, None);
}

#[test]
fn completion_defaults() {
    let v = completion_with(json!({})).unwrap();
    assert_eq!(v.prompt, PromptInput::Text("Once upon a time".into()));
    assert!(v.add_special_tokens);
    assert!(!v.echo);
    assert_eq!(v.sampling.logprobs, None);
}

// ---------------------------------------------------------------- messages

#[test]
fn messages_must_not_be_empty() {
    assert_invalid(
        chat(json!({"model": "m", "messages": []})),
        Some("messages"),
    );
}

#[test]
fn messages_are_required() {
    assert_invalid(chat(json!({"model": "m"})), Some("messages"));
}

#[test]
fn messages_must_be_an_array() {
    assert_invalid(
        chat(json!({"model": "m", "messages": "hi"})),
        Some("messages"),
    );
}

#[test]
fn unknown_role_names_index() {
    let err = assert_invalid(
        chat(json!({"messages": [
            {"role": "user", "content": "a"},
            {"role": "wizard", "content": "b"}
        ]})),
        Some("messages[1].role"),
    );
    assert!(err.message.contains("wizard"), "{}", err.message);
}

#[test]
fn all_known_roles_accepted() {
    let v = chat(json!({"messages": [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool", "content": "t", "tool_call_id": "call_1"}
    ]}))
    .unwrap();
    let roles: Vec<Role> = v.messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, Role::ALL.to_vec());
}

#[test]
fn text_parts_joined_with_newline() {
    let v = chat(json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "first"},
        {"type": "text", "text": "second"}
    ]}]}))
    .unwrap();
    assert_eq!(v.messages[0].content, "first\nsecond");
}

#[test]
fn image_part_rejected_text_only() {
    let err = assert_invalid(
        chat(json!({"messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": [
                {"type": "text", "text": "what is this?"},
                {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
            ]}
        ]})),
        Some("messages[1].content"),
    );
    assert!(err.message.contains("text only"), "{}", err.message);
    assert!(err.message.contains("image_url"), "{}", err.message);
}

#[test]
fn audio_part_rejected() {
    assert_invalid(
        chat(json!({"messages": [{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
        ]}]})),
        Some("messages[0].content"),
    );
}

#[test]
fn text_part_without_text_rejected() {
    assert_invalid(
        chat(json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]})),
        Some("messages[0].content"),
    );
}

#[test]
fn null_content_rejected_for_user() {
    assert_invalid(
        chat(json!({"messages": [{"role": "user", "content": null}]})),
        Some("messages[0].content"),
    );
}

#[test]
fn null_content_allowed_for_assistant() {
    let v = chat(json!({"messages": [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}
    ]}))
    .unwrap();
    assert_eq!(v.messages[1], ChatMessage::new(Role::Assistant, ""));
}

// ---------------------------------------------------------------- streaming

#[test]
fn stream_options_require_stream() {
    let err = assert_invalid(
        chat_with(json!({"stream_options": {"include_usage": true}})),
        Some("stream_options"),
    );
    assert!(err.message.contains("stream"));
    assert_invalid(
        chat_with(json!({"stream": false, "stream_options": {"include_usage": true}})),
        Some("stream_options"),
    );
}

#[test]
fn stream_options_null_is_absent() {
    let v = chat_with(json!({"stream_options": null})).unwrap();
    assert!(!v.include_usage);
}

#[test]
fn stream_with_usage() {
    let v = chat_with(json!({
        "stream": true,
        "stream_options": {"include_usage": true, "continuous_usage_stats": true}
    }))
    .unwrap();
    assert!(v.stream && v.include_usage && v.continuous_usage_stats);
}

#[test]
fn completion_stream_options_require_stream() {
    assert_invalid(
        completion_with(json!({"stream_options": {"include_usage": true}})),
        Some("stream_options"),
    );
}

// ---------------------------------------------------------------- response_format

#[test]
fn response_format_text_accepted() {
    chat_with(json!({"response_format": {"type": "text"}})).unwrap();
}

#[test]
fn response_format_json_object_and_json_schema_become_constraints() {
    use strata_api::validate::StructuredOutput;
    let c = chat_with(json!({"response_format": {"type": "json_object"}})).unwrap();
    assert_eq!(c.sampling.structured, Some(StructuredOutput::JsonObject));
    let c = chat_with(json!({"response_format": {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": true}
    }}))
    .unwrap();
    assert_eq!(
        c.sampling.structured,
        Some(StructuredOutput::JsonSchema {
            name: Some("x".into()),
            schema: json!({"type": "object"}),
            strict: true
        })
    );
    let c = completion_with(json!({"guided_choice": ["yes", "no"]})).unwrap();
    assert_eq!(
        c.sampling.structured,
        Some(StructuredOutput::Choice(vec!["yes".into(), "no".into()]))
    );
    let c = completion_with(json!({"guided_regex": "[0-9]{3}"})).unwrap();
    assert_eq!(
        c.sampling.structured,
        Some(StructuredOutput::Regex("[0-9]{3}".into()))
    );
    // vLLM takes the schema as a string too, and the newer `structured_outputs` spelling.
    let c = chat_with(json!({"guided_json": "{\"type\": \"integer\"}"})).unwrap();
    assert!(matches!(
        c.sampling.structured,
        Some(StructuredOutput::JsonSchema { ref schema, .. }) if schema == &json!({"type": "integer"})
    ));
    let c = chat_with(json!({"structured_outputs": {"choice": ["a"]}})).unwrap();
    assert_eq!(
        c.sampling.structured,
        Some(StructuredOutput::Choice(vec!["a".into()]))
    );
    let c = chat_with(json!({"response_format": {"type": "text"}})).unwrap();
    assert_eq!(c.sampling.structured, None);
}

#[test]
fn response_format_json_schema_shape_errors_name_the_field() {
    for (body, param) in [
        (
            json!({"type": "json_schema"}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": 5}),
            "response_format.json_schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}),
            "response_format.json_schema.strict",
        ),
    ] {
        assert_invalid(chat_with(json!({ "response_format": body })), Some(param));
    }
}

#[test]
fn guided_fields_are_checked() {
    assert_invalid(chat_with(json!({"guided_json": 3})), Some("guided_json"));
    assert_invalid(
        chat_with(json!({"guided_json": "{nope"})),
        Some("guided_json"),
    );
    assert_invalid(chat_with(json!({"guided_regex": ""})), Some("guided_regex"));
    assert_invalid(
        chat_with(json!({"guided_regex": "a".repeat(5000)})),
        Some("guided_regex"),
    );
    assert_invalid(
        chat_with(json!({"guided_choice": []})),
        Some("guided_choice"),
    );
    assert_invalid(
        chat_with(json!({"guided_choice": ["ok", ""]})),
        Some("guided_choice[1]"),
    );
    let many: Vec<String> = (0..300).map(|i| i.to_string()).collect();
    assert_invalid(
        chat_with(json!({"guided_choice": many})),
        Some("guided_choice"),
    );
    let err = assert_invalid(
        chat_with(json!({"guided_grammar": "root ::= \"a\""})),
        Some("guided_grammar"),
    );
    assert!(err.message.contains("not supported"));
    assert_invalid(
        chat_with(json!({"structured_outputs": {"grammar": "x"}})),
        Some("structured_outputs.grammar"),
    );
    assert_invalid(
        chat_with(json!({"structured_outputs": {"colour": "x"}})),
        Some("structured_outputs.colour"),
    );
    assert_invalid(
        chat_with(json!({"structured_outputs": {"regex": "a", "choice": ["b"]}})),
        Some("structured_outputs"),
    );
    // Two constraints at once: refused, naming the second.
    assert_invalid(
        chat_with(json!({
            "response_format": {"type": "json_object"},
            "guided_regex": "a+"
        })),
        Some("guided_regex"),
    );
}

#[test]
fn oversized_or_too_deep_schemas_are_refused() {
    let mut props = serde_json::Map::new();
    for i in 0..2000 {
        props.insert(format!("field_{i:05}"), json!({"type": "string"}));
    }
    let err = assert_invalid(
        chat_with(json!({"guided_json": {"type": "object", "properties": props}})),
        Some("guided_json"),
    );
    assert!(err.message.contains("bytes"), "{}", err.message);
    let mut deep = json!({"type": "string"});
    for _ in 0..40 {
        deep = json!({"type": "array", "items": deep});
    }
    let err = assert_invalid(
        completion_with(json!({"response_format": {
            "type": "json_schema",
            "json_schema": {"name": "deep", "schema": deep}
        }})),
        Some("response_format.json_schema.schema"),
    );
    assert!(err.message.contains("levels"), "{}", err.message);
}

#[test]
fn response_format_unknown_type() {
    assert_invalid(
        completion_with(json!({"response_format": {"type": "yaml"}})),
        Some("response_format"),
    );
}

// ---------------------------------------------------------------- sampling ranges

#[test]
fn temperature_range() {
    assert_invalid(chat_with(json!({"temperature": -0.1})), Some("temperature"));
    assert_invalid(chat_with(json!({"temperature": 2.01})), Some("temperature"));
    assert_eq!(
        chat_with(json!({"temperature": 0}))
            .unwrap()
            .sampling
            .temperature,
        0.0
    );
    assert!(chat_with(json!({"temperature": 0}))
        .unwrap()
        .sampling
        .is_greedy());
    assert_eq!(
        chat_with(json!({"temperature": 2}))
            .unwrap()
            .sampling
            .temperature,
        2.0
    );
}

#[test]
fn temperature_wrong_type() {
    assert_invalid(
        chat_with(json!({"temperature": "hot"})),
        Some("temperature"),
    );
}

#[test]
fn top_p_range() {
    assert_invalid(chat_with(json!({"top_p": 0})), Some("top_p"));
    assert_invalid(chat_with(json!({"top_p": 1.5})), Some("top_p"));
    assert_invalid(chat_with(json!({"top_p": -0.5})), Some("top_p"));
    assert_eq!(
        chat_with(json!({"top_p": 0.9})).unwrap().sampling.top_p,
        0.9
    );
}

#[test]
fn top_k_disabled_values() {
    assert_eq!(
        chat_with(json!({"top_k": -1})).unwrap().sampling.top_k,
        None
    );
    assert_eq!(chat_with(json!({"top_k": 0})).unwrap().sampling.top_k, None);
    assert_eq!(
        chat_with(json!({"top_k": 40})).unwrap().sampling.top_k,
        Some(40)
    );
}

#[test]
fn top_k_range() {
    assert_invalid(chat_with(json!({"top_k": -2})), Some("top_k"));
    assert_invalid(chat_with(json!({"top_k": 5_000_000_000i64})), Some("top_k"));
}

#[test]
fn min_p_range() {
    assert_invalid(chat_with(json!({"min_p": 1.01})), Some("min_p"));
    assert_invalid(chat_with(json!({"min_p": -0.01})), Some("min_p"));
    assert_eq!(
        chat_with(json!({"min_p": 0.05})).unwrap().sampling.min_p,
        0.05
    );
}

#[test]
fn repetition_penalty_range() {
    assert_invalid(
        chat_with(json!({"repetition_penalty": 0})),
        Some("repetition_penalty"),
    );
    assert_invalid(
        chat_with(json!({"repetition_penalty": 2.5})),
        Some("repetition_penalty"),
    );
    assert_eq!(
        chat_with(json!({"repetition_penalty": 2}))
            .unwrap()
            .sampling
            .repetition_penalty,
        2.0
    );
}

#[test]
fn presence_penalty_range() {
    assert_invalid(
        chat_with(json!({"presence_penalty": 2.5})),
        Some("presence_penalty"),
    );
    assert_eq!(
        chat_with(json!({"presence_penalty": -2}))
            .unwrap()
            .sampling
            .presence_penalty,
        -2.0
    );
}

#[test]
fn frequency_penalty_range() {
    assert_invalid(
        chat_with(json!({"frequency_penalty": -2.1})),
        Some("frequency_penalty"),
    );
    assert_eq!(
        chat_with(json!({"frequency_penalty": 1.5}))
            .unwrap()
            .sampling
            .frequency_penalty,
        1.5
    );
}

#[test]
fn seed_accepts_i64_and_u64() {
    assert_eq!(
        chat_with(json!({"seed": -1})).unwrap().sampling.seed,
        Some(u64::MAX)
    );
    assert_eq!(
        chat_with(json!({"seed": u64::MAX})).unwrap().sampling.seed,
        Some(u64::MAX)
    );
    assert_eq!(
        chat_with(json!({"seed": 1234})).unwrap().sampling.seed,
        Some(1234)
    );
    assert_eq!(
        chat_with(json!({"seed": i64::MIN})).unwrap().sampling.seed,
        Some(i64::MIN as u64)
    );
}

#[test]
fn seed_must_be_integer() {
    assert_invalid(chat_with(json!({"seed": 1.5})), Some("seed"));
    assert_invalid(chat_with(json!({"seed": "7"})), Some("seed"));
}

// ---------------------------------------------------------------- lengths

#[test]
fn max_tokens_at_least_one() {
    assert_invalid(chat_with(json!({"max_tokens": 0})), Some("max_tokens"));
    assert_invalid(chat_with(json!({"max_tokens": -5})), Some("max_tokens"));
}

#[test]
fn max_tokens_fits_u32() {
    assert_invalid(
        chat_with(json!({"max_tokens": 1u64 << 33})),
        Some("max_tokens"),
    );
}

#[test]
fn max_completion_tokens_at_least_one() {
    assert_invalid(
        chat_with(json!({"max_completion_tokens": 0})),
        Some("max_completion_tokens"),
    );
}

#[test]
fn max_completion_tokens_wins() {
    let v = chat_with(json!({"max_tokens": 100, "max_completion_tokens": 20})).unwrap();
    assert_eq!(v.sampling.max_tokens, Some(20));
    let v = chat_with(json!({"max_tokens": 100})).unwrap();
    assert_eq!(v.sampling.max_tokens, Some(100));
    let v = completion_with(json!({"max_tokens": 7, "max_completion_tokens": 9})).unwrap();
    assert_eq!(v.sampling.max_tokens, Some(9));
}

#[test]
fn min_tokens_not_above_max_tokens() {
    assert_invalid(
        chat_with(json!({"max_tokens": 10, "min_tokens": 11})),
        Some("min_tokens"),
    );
    let v = chat_with(json!({"max_tokens": 10, "min_tokens": 10})).unwrap();
    assert_eq!(v.sampling.min_tokens, 10);
    // Without max_tokens any non-negative min_tokens passes here; check_context bounds it.
    assert_eq!(
        chat_with(json!({"min_tokens": 500}))
            .unwrap()
            .sampling
            .min_tokens,
        500
    );
}

#[test]
fn min_tokens_non_negative() {
    assert_invalid(chat_with(json!({"min_tokens": -1})), Some("min_tokens"));
}

// ---------------------------------------------------------------- n and stop

#[test]
fn n_range() {
    assert_invalid(chat_with(json!({"n": 0})), Some("n"));
    assert_invalid(chat_with(json!({"n": MAX_N + 1})), Some("n"));
    assert_eq!(chat_with(json!({"n": MAX_N})).unwrap().sampling.n, MAX_N);
}

#[test]
fn stop_string_or_list() {
    assert_eq!(
        chat_with(json!({"stop": "\n"})).unwrap().sampling.stop,
        vec!["\n"]
    );
    assert_eq!(
        chat_with(json!({"stop": ["a", "b"]}))
            .unwrap()
            .sampling
            .stop,
        vec!["a", "b"]
    );
    assert!(chat_with(json!({"stop": null}))
        .unwrap()
        .sampling
        .stop
        .is_empty());
}

#[test]
fn stop_at_most_max_stop() {
    let many: Vec<String> = (0..=MAX_STOP).map(|i| format!("s{i}")).collect();
    assert_invalid(chat_with(json!({"stop": many})), Some("stop"));
    let ok: Vec<String> = (0..MAX_STOP).map(|i| format!("s{i}")).collect();
    assert_eq!(
        chat_with(json!({"stop": ok})).unwrap().sampling.stop.len(),
        MAX_STOP
    );
}

#[test]
fn stop_entries_non_empty() {
    assert_invalid(chat_with(json!({"stop": ["ok", ""]})), Some("stop"));
    assert_invalid(chat_with(json!({"stop": ""})), Some("stop"));
}

#[test]
fn stop_wrong_type() {
    assert_invalid(chat_with(json!({"stop": 5})), Some("stop"));
}

#[test]
fn stop_token_ids_must_be_token_ids() {
    assert_invalid(
        chat_with(json!({"stop_token_ids": [2, -1]})),
        Some("stop_token_ids"),
    );
    assert_eq!(
        chat_with(json!({"stop_token_ids": [2, 128009]}))
            .unwrap()
            .sampling
            .stop_token_ids,
        vec![2, 128009]
    );
}

#[test]
fn vllm_boolean_flags() {
    let v = chat_with(json!({
        "include_stop_str_in_output": true,
        "ignore_eos": true,
        "skip_special_tokens": false,
        "spaces_between_special_tokens": false,
        "echo": true,
        "add_special_tokens": true
    }))
    .unwrap();
    assert!(v.sampling.include_stop_str_in_output);
    assert!(v.sampling.ignore_eos);
    assert!(!v.sampling.skip_special_tokens);
    assert!(!v.sampling.spaces_between_special_tokens);
    assert!(v.echo);
    assert!(v.add_special_tokens);
}

// ---------------------------------------------------------------- logprobs

#[test]
fn chat_logprobs_true_without_top() {
    assert_eq!(
        chat_with(json!({"logprobs": true}))
            .unwrap()
            .sampling
            .logprobs,
        Some(0)
    );
}

#[test]
fn chat_top_logprobs_range() {
    assert_eq!(
        chat_with(json!({"logprobs": true, "top_logprobs": 20}))
            .unwrap()
            .sampling
            .logprobs,
        Some(20)
    );
    assert_invalid(
        chat_with(json!({"logprobs": true, "top_logprobs": 21})),
        Some("top_logprobs"),
    );
    assert_invalid(
        chat_with(json!({"logprobs": true, "top_logprobs": -1})),
        Some("top_logprobs"),
    );
}

#[test]
fn chat_top_logprobs_requires_logprobs_true() {
    assert_invalid(chat_with(json!({"top_logprobs": 3})), Some("top_logprobs"));
    assert_invalid(
        chat_with(json!({"logprobs": false, "top_logprobs": 3})),
        Some("top_logprobs"),
    );
}

#[test]
fn chat_logprobs_false_is_none() {
    assert_eq!(
        chat_with(json!({"logprobs": false}))
            .unwrap()
            .sampling
            .logprobs,
        None
    );
}

#[test]
fn completion_logprobs_integer_range() {
    assert_eq!(
        completion_with(json!({"logprobs": 0}))
            .unwrap()
            .sampling
            .logprobs,
        Some(0)
    );
    assert_eq!(
        completion_with(json!({"logprobs": 5}))
            .unwrap()
            .sampling
            .logprobs,
        Some(5)
    );
    assert_invalid(completion_with(json!({"logprobs": 21})), Some("logprobs"));
    assert_invalid(completion_with(json!({"logprobs": -1})), Some("logprobs"));
}

#[test]
fn completion_logprobs_bool_is_type_error() {
    assert_invalid(completion_with(json!({"logprobs": true})), Some("logprobs"));
}

// ---------------------------------------------------------------- misc vLLM fields

#[test]
fn priority_fits_i32() {
    assert_eq!(
        chat_with(json!({"priority": -5}))
            .unwrap()
            .sampling
            .priority,
        -5
    );
    assert_invalid(chat_with(json!({"priority": 1u64 << 40})), Some("priority"));
}

#[test]
fn cache_salt_non_empty() {
    assert_invalid(chat_with(json!({"cache_salt": ""})), Some("cache_salt"));
    assert_eq!(
        chat_with(json!({"cache_salt": "tenant-a"}))
            .unwrap()
            .sampling
            .cache_salt
            .as_deref(),
        Some("tenant-a")
    );
}

#[test]
fn logit_bias_keys_and_values() {
    let v = chat_with(json!({"logit_bias": {"50256": -100, "7": 5.5}})).unwrap();
    assert_eq!(v.sampling.logit_bias, vec![(7, 5.5), (50256, -100.0)]);
    assert_invalid(
        chat_with(json!({"logit_bias": {"abc": 1}})),
        Some("logit_bias"),
    );
    assert_invalid(
        chat_with(json!({"logit_bias": {"5": 101}})),
        Some("logit_bias"),
    );
}

#[test]
fn tools_must_be_array() {
    assert_invalid(
        chat_with(json!({"tools": {"type": "function"}})),
        Some("tools"),
    );
    let v = chat_with(
        json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                            "tool_choice": "auto"}),
    )
    .unwrap();
    assert!(v.tools.unwrap().is_array());
}

#[test]
fn chat_template_kwargs_must_be_object() {
    assert_invalid(
        chat_with(json!({"chat_template_kwargs": [1]})),
        Some("chat_template_kwargs"),
    );
    let v = chat_with(json!({"chat_template_kwargs": {"enable_thinking": false}})).unwrap();
    assert_eq!(
        v.chat_template_kwargs,
        Some(json!({"enable_thinking": false}))
    );
}

#[test]
fn continue_final_message_flags() {
    let v = chat_with(json!({"continue_final_message": true})).unwrap();
    assert!(v.continue_final_message);
    assert!(!v.add_generation_prompt);
    assert_invalid(
        chat_with(json!({"continue_final_message": true, "add_generation_prompt": true})),
        Some("continue_final_message"),
    );
    assert!(
        !chat_with(json!({"add_generation_prompt": false}))
            .unwrap()
            .add_generation_prompt
    );
}

// ---------------------------------------------------------------- completion prompt

#[test]
fn prompt_token_ids() {
    let v = completion_with(json!({"prompt": [1, 15043, 3186]})).unwrap();
    assert_eq!(v.prompt, PromptInput::Tokens(vec![1, 15043, 3186]));
}

#[test]
fn prompt_single_element_batches() {
    let v = completion_with(json!({"prompt": ["only"]})).unwrap();
    assert_eq!(v.prompt, PromptInput::Text("only".into()));
    let v = completion_with(json!({"prompt": [[5, 6]]})).unwrap();
    assert_eq!(v.prompt, PromptInput::Tokens(vec![5, 6]));
}

#[test]
fn prompt_batch_of_texts_rejected() {
    let err = assert_invalid(
        completion_with(json!({"prompt": ["a", "b"]})),
        Some("prompt"),
    );
    assert!(err.message.contains("Batch prompts are not supported"));
}

#[test]
fn prompt_batch_of_token_lists_rejected() {
    assert_invalid(
        completion_with(json!({"prompt": [[1], [2]]})),
        Some("prompt"),
    );
}

#[test]
fn prompt_empty_rejected() {
    assert_invalid(completion_with(json!({"prompt": ""})), Some("prompt"));
    assert_invalid(completion_with(json!({"prompt": []})), Some("prompt"));
    assert_invalid(completion_with(json!({"prompt": [[]]})), Some("prompt"));
    assert_invalid(completion_with(json!({"prompt": [""]})), Some("prompt"));
}

#[test]
fn prompt_token_ids_must_fit_u32() {
    assert_invalid(completion_with(json!({"prompt": [1, -2]})), Some("prompt"));
    assert_invalid(
        completion_with(json!({"prompt": [1, 1u64 << 32]})),
        Some("prompt"),
    );
    assert_invalid(
        completion_with(json!({"prompt": [[1u64 << 32]]})),
        Some("prompt"),
    );
}

#[test]
fn prompt_required_and_typed() {
    assert_invalid(completion(json!({"model": "m"})), Some("prompt"));
    assert_invalid(completion_with(json!({"prompt": 5})), Some("prompt"));
    assert_invalid(completion_with(json!({"prompt": [1.5]})), Some("prompt"));
}

#[test]
fn suffix_not_supported() {
    assert_invalid(completion_with(json!({"suffix": "end"})), Some("suffix"));
    completion_with(json!({"suffix": ""})).unwrap();
}

#[test]
fn best_of_must_equal_n() {
    assert_invalid(completion_with(json!({"best_of": 3})), Some("best_of"));
    completion_with(json!({"best_of": 2, "n": 2})).unwrap();
    completion_with(json!({"best_of": 1})).unwrap();
}

#[test]
fn completion_shares_sampling_rules() {
    assert_invalid(completion_with(json!({"top_p": 0})), Some("top_p"));
    assert_invalid(completion_with(json!({"n": 17})), Some("n"));
    let v = completion_with(json!({"echo": true, "add_special_tokens": false})).unwrap();
    assert!(v.echo);
    assert!(!v.add_special_tokens);
}

// ---------------------------------------------------------------- parse_json

#[test]
fn invalid_utf8_body() {
    let err = assert_invalid(
        parse_json::<ChatCompletionRequest>(b"{\"model\": \"\xff\"}"),
        None,
    );
    assert!(err.message.contains("UTF-8"), "{}", err.message);
}

#[test]
fn malformed_json_body() {
    let err = assert_invalid(
        parse_json::<ChatCompletionRequest>(br#"{"model": "m", "messages": [}"#),
        None,
    );
    assert!(err.message.contains("not valid JSON"), "{}", err.message);
    assert!(
        err.message.contains("line 1"),
        "serde's message kept: {}",
        err.message
    );
}

#[test]
fn empty_body() {
    let err = assert_invalid(parse_json::<ChatCompletionRequest>(b"  \n"), None);
    assert!(err.message.contains("empty"));
}

#[test]
fn body_must_be_object() {
    for body in [&b"[1, 2]"[..], b"42", b"\"text\"", b"null", b"true"] {
        let err = assert_invalid(parse_json::<CompletionRequest>(body), None);
        assert!(
            err.message.contains("must be a JSON object"),
            "{}",
            err.message
        );
    }
}

#[test]
fn wrong_type_names_top_level_field() {
    let err = assert_invalid(
        parse_json::<ChatCompletionRequest>(
            br#"{"model": "m", "messages": [{"role": "user", "content": "x"}], "n": "two"}"#,
        ),
        Some("n"),
    );
    assert!(err.message.contains("'n'"), "{}", err.message);
}

#[test]
fn nested_error_blames_containing_field() {
    // A message without a role: the top-level field at fault is `messages`.
    assert_invalid(
        parse_json::<ChatCompletionRequest>(br#"{"messages": [{"content": "x"}]}"#),
        Some("messages"),
    );
}

#[test]
fn unknown_fields_tolerated() {
    let v = chat_with(json!({
        "store": true, "metadata": {"k": "v"}, "service_tier": "auto",
        "reasoning_effort": "low", "some_future_field": [1, {"x": null}]
    }))
    .unwrap();
    assert_eq!(v.messages.len(), 1);
}

#[test]
fn null_optional_fields_are_absent() {
    let v = chat_with(json!({
        "temperature": null, "top_p": null, "n": null, "max_tokens": null, "seed": null,
        "logprobs": null, "top_logprobs": null, "tools": null, "user": null
    }))
    .unwrap();
    assert_eq!(v.sampling.temperature, 1.0);
    assert_eq!(v.sampling.n, 1);
    assert_eq!(v.tools, None);
}

// ---------------------------------------------------------------- tokenize

#[test]
fn tokenize_prompt_defaults() {
    let req: TokenizeRequest = parse_json(br#"{"model": "m", "prompt": "Hello"}"#).unwrap();
    let v = validate_tokenize(req).unwrap();
    assert_eq!(v.input, TokenizeInput::Prompt("Hello".into()));
    assert!(v.add_special_tokens);
    assert!(!v.return_token_strs);
}

#[test]
fn tokenize_messages_defaults() {
    let req: TokenizeRequest =
        parse_json(br#"{"messages": [{"role": "user", "content": "Hi"}]}"#).unwrap();
    let v = validate_tokenize(req).unwrap();
    assert_eq!(
        v.input,
        TokenizeInput::Chat {
            messages: vec![ChatMessage::new(Role::User, "Hi")],
            add_generation_prompt: true,
            continue_final_message: false,
        }
    );
    assert!(!v.add_special_tokens);
}

#[test]
fn tokenize_needs_exactly_one_input() {
    let both: TokenizeRequest =
        parse_json(br#"{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}"#).unwrap();
    assert_invalid(validate_tokenize(both), Some("messages"));
    let neither: TokenizeRequest = parse_json(br#"{"model": "m"}"#).unwrap();
    assert_invalid(validate_tokenize(neither), Some("prompt"));
}

#[test]
fn tokenize_messages_validated() {
    let req: TokenizeRequest =
        parse_json(br#"{"messages": [{"role": "robot", "content": "b"}]}"#).unwrap();
    assert_invalid(validate_tokenize(req), Some("messages[0].role"));
}

// ---------------------------------------------------------------- context

#[test]
fn context_prompt_too_long_names_prompt_param() {
    let err = assert_invalid(check_context(2048, Some(1), 2048, "prompt"), Some("prompt"));
    assert!(err
        .message
        .starts_with("This model's maximum context length is 2048 tokens."));
    assert_invalid(
        check_context(3000, None, 2048, "messages"),
        Some("messages"),
    );
}

#[test]
fn context_max_tokens_too_large() {
    let err = assert_invalid(
        check_context(2047, Some(2), 2048, "prompt"),
        Some("max_tokens"),
    );
    assert!(err
        .message
        .contains("(2047 in the prompt, 2 in the completion)"));
    assert_eq!(check_context(2047, Some(1), 2048, "prompt").unwrap(), 1);
}

#[test]
fn context_default_max_tokens_is_remaining() {
    assert_eq!(check_context(48, None, 2048, "messages").unwrap(), 2000);
}
