//! The chat templates the family fixtures carry in `tokenizer.chat_template` (written in
//! tools/families/templates/ after the public Qwen2.5, Qwen3, Gemma, Phi-3, Mistral and
//! Llama 3.1 formats) render through minijinja as those formats lay out a conversation,
//! with tools, tool calls and tool results where the format has them.

use std::path::PathBuf;

use serde_json::json;
use strata_engine::chat_template::{ChatMessage, ChatTemplate, RenderExtras};
use strata_engine::gguf::GgufFile;

fn template(family: &str) -> ChatTemplate {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/families/{family}.gguf"));
    let file = GgufFile::open(&path).expect("open");
    let t = ChatTemplate::from_gguf(&file.content).expect("template");
    assert!(
        !t.is_fallback(),
        "{family}: the file's own template is used"
    );
    t
}

fn tools() -> RenderExtras {
    RenderExtras {
        tools: Some(json!([{
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}
            }
        }])),
        kwargs: None,
    }
}

fn tool_turns() -> Vec<ChatMessage> {
    let mut call = ChatMessage::assistant("");
    call.tool_calls = Some(json!([{
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}
    }]));
    let mut result = ChatMessage::new("tool", "{\"temp\": 21}");
    result.tool_call_id = Some("call_1".into());
    vec![
        ChatMessage::system("Be brief."),
        ChatMessage::user("Weather in Paris?"),
        call,
        result,
    ]
}

#[test]
fn qwen2_renders_chatml_with_hermes_tools() {
    let t = template("qwen2");
    let plain = t.render(&[ChatMessage::user("hi")], true).expect("render");
    assert_eq!(
        plain,
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful \
         assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    );
    let out = t
        .render_with(&tool_turns(), true, &tools())
        .expect("render tools");
    assert!(
        out.starts_with("<|im_start|>system\nBe brief.\n\n# Tools"),
        "{out}"
    );
    // One tool per line, as `tojson` writes it (keys in serde_json's order).
    let listed = out
        .split("<tools>\n")
        .nth(1)
        .and_then(|rest| rest.split("\n</tools>").next())
        .expect("a <tools> block");
    let tool: serde_json::Value = serde_json::from_str(listed).expect("one JSON tool");
    assert_eq!(tool["function"]["name"], "get_weather", "{out}");
    assert!(out.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>"), "{out}");
    assert!(
        out.contains(
            "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response><|im_end|>\n"
        ),
        "{out}"
    );
    assert!(out.ends_with("<|im_start|>assistant\n"), "{out}");
}

#[test]
fn qwen3_keeps_only_the_last_turns_reasoning_and_can_switch_thinking_off() {
    let t = template("qwen3");
    let msgs = vec![
        ChatMessage::user("one"),
        ChatMessage::assistant("<think>\nfirst thoughts\n</think>\n\nanswer one"),
        ChatMessage::user("two"),
    ];
    let out = t.render(&msgs, true).expect("render");
    assert_eq!(
        out,
        "<|im_start|>user\none<|im_end|>\n<|im_start|>assistant\nanswer one<|im_end|>\n\
         <|im_start|>user\ntwo<|im_end|>\n<|im_start|>assistant\n"
    );
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let off = t
        .render_with(
            &[ChatMessage::user("two")],
            true,
            &RenderExtras {
                tools: None,
                kwargs: Some(kwargs),
            },
        )
        .expect("render");
    assert!(
        off.ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "{off}"
    );
    let tools_out = t.render_with(&tool_turns(), true, &tools()).expect("tools");
    assert!(
        tools_out.starts_with("<|im_start|>system\nBe brief.\n\n# Tools"),
        "{tools_out}"
    );
    assert!(tools_out.contains("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"), "{tools_out}");
    assert!(
        tools_out.contains("<tool_response>\n{\"temp\": 21}\n</tool_response>"),
        "{tools_out}"
    );
}

#[test]
fn gemma_folds_the_system_prompt_into_the_first_user_turn() {
    let t = template("gemma2");
    let out = t
        .render(
            &[
                ChatMessage::system("Be brief."),
                ChatMessage::user("hi "),
                ChatMessage::assistant("hello"),
                ChatMessage::user("bye"),
            ],
            true,
        )
        .expect("render");
    assert_eq!(
        out,
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello\
         <end_of_turn>\n<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    );
    // Roles that do not alternate are refused by the template itself.
    let err = t
        .render(&[ChatMessage::user("a"), ChatMessage::user("b")], true)
        .expect_err("raise_exception");
    assert!(err.to_string().contains("alternate"), "{err}");
}

#[test]
fn phi3_mistral_and_llama3_render_their_formats() {
    let phi = template("phi3")
        .render(&[ChatMessage::system("s"), ChatMessage::user("hi")], true)
        .expect("phi3");
    assert_eq!(
        phi,
        "<|system|>\ns<|end|>\n<|user|>\nhi<|end|>\n<|assistant|>\n"
    );
    let mistral = template("llama_yarn")
        .render(
            &[
                ChatMessage::user("hi"),
                ChatMessage::assistant("yo"),
                ChatMessage::user("bye"),
            ],
            false,
        )
        .expect("mistral");
    assert_eq!(mistral, "<s> [INST] hi [/INST] yo</s> [INST] bye [/INST]");
    let llama = template("llama3")
        .render_with(&[ChatMessage::user("Weather in Paris?")], true, &tools())
        .expect("llama3");
    assert!(
        llama.starts_with(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        ),
        "{llama}"
    );
    // `tojson(indent=4)`: the tool pretty-printed with four spaces.
    assert!(
        llama.contains("{\n    \"function\": {\n        \"description\""),
        "{llama}"
    );
    assert!(
        llama.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"),
        "{llama}"
    );
}
