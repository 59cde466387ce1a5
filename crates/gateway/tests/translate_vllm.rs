//! vLLM 0.32's recorded Messages and Responses answers decode into the same values that
//! the gateway's translation makes of the chat answer saying the same thing (same text,
//! finish and usage), whole and streamed. Ids and timestamps are each server's own; the
//! Responses object's vLLM-only fields are not in the typed value.

use serde_json::{json, Value};
use strata_api::anthropic::{MessagesResponse, StreamEvent as MessagesEvent};
use strata_api::responses::{
    OutputItem, Response, ResponsesRequest, StreamEvent as ResponsesEvent,
};
use strata_api::{ChatCompletionChunk, ChatCompletionResponse, SseDecoder};
use strata_gateway::translate::{
    chat_to_messages, chat_to_response, ChatToMessagesEvents, ChatToResponseEvents, ResponseIds,
};

fn fixture(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/vllm-0.32/api")
        .join(name);
    std::fs::read_to_string(path).unwrap()
}

fn sse<T: serde::de::DeserializeOwned>(text: &str) -> Vec<T> {
    SseDecoder::new()
        .feed(text.as_bytes())
        .unwrap()
        .iter()
        .map(|e| e.json().unwrap())
        .collect()
}

fn chat_answer(text: &str, finish: &str, prompt: u32, completion: u32) -> ChatCompletionResponse {
    serde_json::from_value(json!({
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1,
        "model": "smollm2-135m-instruct",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    }))
    .unwrap()
}

/// The chat stream of `pieces`, then a finish chunk and a usage chunk.
fn chat_stream(
    pieces: &[&str],
    finish: &str,
    prompt: u32,
    completion: u32,
) -> Vec<ChatCompletionChunk> {
    let chunk = |v: Value| -> ChatCompletionChunk {
        let mut base = json!({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 1,
            "model": "smollm2-135m-instruct", "choices": []});
        for (k, x) in v.as_object().unwrap() {
            base[k] = x.clone();
        }
        serde_json::from_value(base).unwrap()
    };
    let mut out = vec![chunk(
        json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}),
    )];
    for p in pieces {
        out.push(chunk(
            json!({"choices": [{"index": 0, "delta": {"content": p}}]}),
        ));
    }
    out.push(chunk(
        json!({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}),
    ));
    out.push(chunk(json!({"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})));
    out
}

const PIECES: [&str; 8] = ["Hello", " there", "!", " I", "'m", " here", " to", " help"];

#[test]
fn messages_whole() {
    let recorded: MessagesResponse = serde_json::from_str(&fixture("messages.json")).unwrap();
    let text = "L'Alma, la France, la France. I am not a Frenchman. I am a human.";
    let ours = chat_to_messages(&chat_answer(text, "stop", 26, 24), &[], &recorded.id);
    assert_eq!(ours, recorded);
}

#[test]
fn messages_streamed() {
    let recorded: Vec<MessagesEvent> = sse(&fixture("messages-stream.sse"));
    let MessagesEvent::MessageStart { message } = &recorded[0] else {
        panic!("message_start first")
    };
    let mut t = ChatToMessagesEvents::new(&message.id, &message.model, vec![]);
    let mut ours: Vec<MessagesEvent> = chat_stream(&PIECES, "length", 33, 8)
        .iter()
        .flat_map(|c| t.push(c))
        .collect();
    ours.extend(t.finish());
    assert_eq!(ours.len(), recorded.len());
    // A chat stream reports the prompt's tokens at its end, so `message_start` says 0
    // where vLLM already knew 33; `message_delta` carries the count in both.
    let MessagesEvent::MessageStart { message: mine } = &ours[0] else {
        panic!("message_start first")
    };
    assert_eq!(mine.usage.input_tokens, 0);
    let mut fixed = mine.clone();
    fixed.usage = message.usage;
    assert_eq!(&fixed, message);
    assert_eq!(ours[1..], recorded[1..]);
}

fn responses_request(max_output_tokens: u64) -> ResponsesRequest {
    serde_json::from_value(json!({
        "model": "smollm2-135m-instruct", "input": "What is the capital of France?",
        "max_output_tokens": max_output_tokens, "temperature": 0.0
    }))
    .unwrap()
}

/// The parts both servers decide the same way: output items (ids aside), status and
/// its reason, usage, model and the echoed settings.
fn essentials(r: &Response) -> Value {
    let output: Vec<Value> = r
        .output
        .iter()
        .map(|item| match item {
            OutputItem::Message {
                role,
                status,
                content,
                ..
            } => json!({"type": "message", "role": role, "status": status, "content": content}),
            OutputItem::FunctionCall { .. } => serde_json::to_value(item).unwrap(),
        })
        .collect();
    let u = r.usage.unwrap();
    json!({
        "output": output, "status": r.status, "incomplete": r.incomplete_details,
        "usage": [u.input_tokens, u.output_tokens, u.total_tokens, u.input_tokens_details.cached_tokens],
        "model": r.model, "max_output_tokens": r.max_output_tokens, "temperature": r.temperature,
        "previous_response_id": r.previous_response_id, "object": r.object,
    })
}

#[test]
fn responses_whole() {
    let recorded: Response = serde_json::from_str(&fixture("responses.json")).unwrap();
    let ids = ResponseIds::new("x");
    let ours = chat_to_response(
        &chat_answer("The capital of France is Paris.", "stop", 42, 8),
        &responses_request(24),
        &ids,
        1,
    );
    assert_eq!(essentials(&ours), essentials(&recorded));
}

#[test]
fn responses_streamed() {
    let recorded: Vec<ResponsesEvent> = sse(&fixture("responses-stream.sse"));
    let req = responses_request(8);
    let ids = ResponseIds::new("x");
    let skeleton = strata_gateway::translate::response_skeleton(&req, &ids, 1);
    let mut t = ChatToResponseEvents::new(ids, skeleton);
    let mut ours: Vec<ResponsesEvent> = chat_stream(&PIECES, "length", 33, 8)
        .iter()
        .flat_map(|c| t.push(c))
        .collect();
    let (end, whole) = t.finish();
    ours.extend(end);
    let names = |evs: &[ResponsesEvent]| evs.iter().map(ResponsesEvent::name).collect::<Vec<_>>();
    assert_eq!(names(&ours), names(&recorded));
    // Deltas, sequence numbers and indexes agree event by event.
    for (a, b) in ours.iter().zip(&recorded) {
        let (mut a, mut b) = (
            serde_json::to_value(a).unwrap(),
            serde_json::to_value(b).unwrap(),
        );
        for v in [&mut a, &mut b] {
            let o = v.as_object_mut().unwrap();
            o.remove("response");
            o.remove("item_id");
            if let Some(item) = o.get_mut("item") {
                item.as_object_mut().unwrap().remove("id");
            }
        }
        assert_eq!(a, b);
    }
    let ResponsesEvent::Completed { response, .. } = recorded.last().unwrap() else {
        panic!("response.completed last")
    };
    assert_eq!(essentials(&whole), essentials(response));
}
