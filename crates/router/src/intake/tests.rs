use super::*;

fn limits() -> ReadLimits {
    ReadLimits {
        prefix_window: 1 << 20,
        want_tokenize: false,
        trust_client_kv_transfer: false,
    }
}

fn post(path: &str, body: &str) -> Result<Intake, ApiError> {
    read(
        Incoming {
            has_body: true,
            path,
            content_type: Some("application/json"),
        },
        Bytes::from(body.to_string()),
        limits(),
        None,
    )
}

#[test]
fn model_is_required_where_a_model_runs_and_must_be_a_string() {
    let p = |b: &str| post("/v1/embeddings", b);
    assert_eq!(
        p(r#"{"input":"x"}"#).unwrap_err().param.as_deref(),
        Some("model")
    );
    assert_eq!(p(r#"{"model":""}"#).unwrap_err().status, 400);
    assert_eq!(p(r#"{"model":3}"#).unwrap_err().status, 400);
    assert_eq!(p(r#"[1,2]"#).unwrap_err().status, 400);
    assert_eq!(p("{not json").unwrap_err().status, 400);
    assert_eq!(p("").unwrap_err().status, 400);
    assert_eq!(p(r#"{"model":"m","input":"x"}"#).unwrap().model, "m");
    let chat = |b: &str| post("/v1/chat/completions", b);
    assert_eq!(
        chat(r#"{"messages":[{"role":"user","content":"hi"}]}"#)
            .unwrap_err()
            .param
            .as_deref(),
        Some("model")
    );
    // Not judged here: the engine says what is wrong with an empty conversation.
    assert_eq!(chat(r#"{"model":"m","messages":[]}"#).unwrap().model, "m");
    // Tokenizing and unknown paths go to any replica when they name no model; a body
    // that is not JSON goes on to an unknown path as it is.
    assert_eq!(post("/tokenize", r#"{"prompt":"x"}"#).unwrap().model, "");
    assert_eq!(
        post("/v1/systemone", r#"{"model":"m"}"#).unwrap().model,
        "m"
    );
    assert_eq!(post("/scale_elastic_ep", "not json").unwrap().model, "");
    assert_eq!(post("/ping", "").unwrap().model, "");
}

#[test]
fn what_the_engine_validates_is_not_judged() {
    for body in [
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"what is it?"},{"type":"image_url","image_url":{"url":"https://example.com/cat.png"}}]}]}"#,
        r#"{"model":"m","messages":[{"role":"wizard","content":"x"}],"temperature":9,"guided_grammar":"root ::= \"a\""}"#,
        r#"{"model":"m","messages":[{"role":"user","content":"x"}],"structured_outputs":{"grammar":"root ::= x"},"chat_template_kwargs":{"a":1},"mm_processor_kwargs":{"b":2},"vllm_xargs":{"c":3},"some_future_field":[1,{"x":null}]}"#,
        r#"{"model":"m","messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"UklGRg==","format":"wav"}},{"type":"video_url","video_url":{"url":"file:///v.mp4"}},{"type":"file","file":{"file_data":"JVBERi0="}}]}]}"#,
        r#"{"model":"m","messages":"nope"}"#,
        r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"1","content":"42"}]}"#,
    ] {
        let i = post("/v1/chat/completions", body).unwrap_or_else(|e| panic!("{body}: {e:?}"));
        assert_eq!(i.model, "m");
        assert_eq!(i.body, body.as_bytes(), "the body goes on byte for byte");
    }
    for (path, body) in [
        (
            "/v1/completions",
            r#"{"model":"m","prompt":"","max_tokens":-1}"#,
        ),
        (
            "/v1/completions",
            r#"{"model":"m","prompt":["a","b"],"best_of":3}"#,
        ),
        ("/v1/completions", r#"{"model":"m","prompt":[[1,2],[3]]}"#),
        ("/v1/completions", r#"{"model":"m","prompt_embeds":"AAAA"}"#),
        (
            "/v1/responses",
            r#"{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"hi"},{"type":"input_image","image_url":"data:image/png;base64,iVBO"}]},{"type":"function_call_output","call_id":"c","output":"7"}],"instructions":"be brief"}"#,
        ),
        (
            "/v1/messages",
            r#"{"model":"m","max_tokens":8,"system":[{"type":"text","text":"sys"}],"messages":[{"role":"user","content":[{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBO"}},{"type":"text","text":"what?"}]}]}"#,
        ),
        (
            "/v1/messages/count_tokens",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            "/v1/chat/completions/batch",
            r#"{"model":"m","messages":[[{"role":"user","content":"a"}],[{"role":"user","content":"b"}]]}"#,
        ),
        (
            "/v1/rerank",
            r#"{"model":"m","query":"q","documents":["a","b"]}"#,
        ),
        (
            "/generative_scoring",
            r#"{"model":"m","query":"q","items":["a"],"label_token_ids":[1]}"#,
        ),
    ] {
        let i = post(path, body).unwrap_or_else(|e| panic!("{path} {body}: {e:?}"));
        assert_eq!(i.model, "m", "{path}");
        assert_eq!(i.body, body.as_bytes());
    }
}

#[test]
fn the_prefix_text_of_a_text_chat_is_role_and_content_lines() {
    let i = post(
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b\n"}]}]}"#,
    )
    .unwrap();
    assert_eq!(i.view.prefix_text, "system\nbe brief\nuser\na\nb\n\n");
    assert_eq!(
        i.view.prompt_bytes,
        i.view.prefix_text.len() + 1,
        "raw `\\n` is 2 bytes"
    );
    let i = post("/v1/completions", r#"{"model":"m","prompt":[1,2,3]}"#).unwrap();
    assert_eq!(i.view.tokens, Some(vec![1, 2, 3]));
    assert_eq!(i.view.prefix_text, "1 2 3 ");
    let i = post("/v1/completions", r#"{"model":"m","prompt":[[4,5],[6]]}"#).unwrap();
    assert_eq!(i.view.tokens, Some(vec![4, 5]));
    let i = post("/v1/completions", r#"{"model":"m","prompt":[1,-2]}"#).unwrap();
    assert_eq!(i.view.tokens, None);
}

#[test]
fn system_text_comes_first_whatever_the_key_order() {
    let a = post(
        "/v1/messages",
        r#"{"model":"m","system":"s","messages":[{"role":"user","content":"u"}]}"#,
    )
    .unwrap();
    let b = post(
        "/v1/messages",
        r#"{"messages":[{"role":"user","content":"u"}],"system":"s","model":"m"}"#,
    )
    .unwrap();
    assert_eq!(a.view.prefix_text, "system\ns\nuser\nu\n");
    assert_eq!(a.view.prefix_text, b.view.prefix_text);
    let r = post(
        "/v1/responses",
        r#"{"model":"m","input":"hi","instructions":"brief","previous_response_id":"resp_9"}"#,
    )
    .unwrap();
    assert_eq!(r.view.prefix_text, "system\nbrief\nuser\nhi\n");
    assert_eq!(r.home.as_deref(), Some("resp_9"));
}

#[test]
fn a_non_text_part_is_keyed_by_its_payload() {
    let chat = |url: &str, detail: &str| {
        post(
            "/v1/chat/completions",
            &format!(
                r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{{"url":"{url}","detail":"{detail}"}}}},{{"type":"text","text":"what is it?"}}]}}]}}"#
            ),
        )
        .unwrap()
        .view
    };
    let a = chat("data:image/png;base64,AAAA", "low");
    let b = chat("data:image/png;base64,AAAA", "high");
    let c = chat("data:image/png;base64,BBBB", "low");
    assert_eq!(a.parts, 1);
    assert!(
        a.prefix_text.starts_with("user\n<image_url:"),
        "{}",
        a.prefix_text
    );
    assert!(
        a.prefix_text.ends_with(">\nwhat is it?\n"),
        "{}",
        a.prefix_text
    );
    assert_eq!(
        a.prefix_text, b.prefix_text,
        "options do not change the key"
    );
    assert_ne!(a.prefix_text, c.prefix_text, "another image is another key");
}

#[test]
fn the_prefix_text_is_bounded_but_its_length_is_counted() {
    let long = "x".repeat(10_000);
    let i = read(
        Incoming {
            has_body: true,
            path: "/v1/chat/completions",
            content_type: None,
        },
        Bytes::from(format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{long}"}}]}}"#
        )),
        ReadLimits {
            prefix_window: 64,
            want_tokenize: false,
            trust_client_kv_transfer: false,
        },
        None,
    )
    .unwrap();
    assert_eq!(i.view.prefix_text.len(), 64);
    assert_eq!(i.view.prompt_bytes, 10_000 + "user\n\n".len());
}

#[test]
fn the_tokenize_body_is_built_from_the_request_text() {
    let read_t = |path: &str, body: &str| {
        read(
            Incoming {
                has_body: true,
                path,
                content_type: None,
            },
            Bytes::from(body.to_string()),
            ReadLimits {
                prefix_window: 1024,
                want_tokenize: true,
                trust_client_kv_transfer: false,
            },
            None,
        )
        .unwrap()
        .view
        .tokenize_body
    };
    let t = read_t(
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}"#,
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&t).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"model":"m","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false})
    );
    let t = read_t("/v1/completions", r#"{"model":"m","prompt":"a\"b"}"#).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&t).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"model":"m","prompt":"a\"b","add_special_tokens":true})
    );
    assert!(read_t("/v1/completions", r#"{"model":"m","prompt":[1]}"#).is_none());
}

#[test]
fn rewrite_replaces_the_model_and_keeps_every_other_byte() {
    let body = r#"{"model": "a", "prompt":"hello there" , "x":[1,2]}"#;
    let rewritten = |b: &str, m: &str| {
        read(
            Incoming {
                has_body: true,
                path: "/v1/completions",
                content_type: None,
            },
            Bytes::from(b.to_string()),
            limits(),
            Some(m),
        )
        .unwrap()
    };
    let p = rewritten(body, "b");
    assert_eq!(p.model, "b");
    assert_eq!(
        p.body,
        r#"{"model": "b", "prompt":"hello there" , "x":[1,2]}"#
    );
    // Same model: the original bytes are kept.
    let p = rewritten(body, "a");
    assert_eq!(p.body, body.as_bytes());
    // No model: one is added, and satisfies the requirement.
    let p = rewritten(r#"{"prompt":"x"}"#, "c");
    assert_eq!(p.body, r#"{"model":"c","prompt":"x"}"#);
    assert_eq!(rewrite_model(b" { } ", "d").unwrap(), r#" {"model":"d" } "#);
}

#[test]
fn multipart_bodies_are_routed_by_their_model_field() {
    let body = "--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n\r\nRIFF\r\n--B\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n--B--\r\n";
    let i = read(
        Incoming {
            has_body: true,
            path: "/v1/audio/transcriptions",
            content_type: Some("multipart/form-data; boundary=B"),
        },
        Bytes::from(body),
        limits(),
        None,
    )
    .unwrap();
    assert_eq!(i.model, "whisper");
    assert_eq!(i.api, Api::Transcription);
}

#[test]
fn a_get_reads_nothing_and_needs_no_model() {
    let i = read(
        Incoming {
            has_body: false,
            path: "/v1/responses/resp_1",
            content_type: None,
        },
        Bytes::new(),
        limits(),
        None,
    )
    .unwrap();
    assert_eq!(
        (i.api, i.home.as_deref()),
        (Api::ResponseById, Some("resp_1"))
    );
    let i = read(
        Incoming {
            has_body: false,
            path: "/v1/chat/completions",
            content_type: None,
        },
        Bytes::new(),
        limits(),
        None,
    )
    .unwrap();
    assert_eq!(i.model, "");
}

#[test]
fn a_role_after_its_content_still_leads_the_message() {
    let a = post(
        "/v1/chat/completions",
        r#"{"model":"m","messages":[{"content":"u","role":"user"},{"role":"assistant","content":"a"}]}"#,
    )
    .unwrap();
    assert_eq!(a.view.prefix_text, "user\nu\nassistant\na\n");
    assert_eq!(a.view.prompt_bytes, a.view.prefix_text.len());
}

#[test]
fn client_kv_transfer_params_that_name_a_peer_become_null_unless_trusted() {
    let chat = Incoming {
        has_body: true,
        path: "/v1/chat/completions",
        content_type: Some("application/json"),
    };
    let named = |host: &str, port: &str| {
        format!(
            r#"{{"model":"m", "kv_transfer_params": {{"do_remote_prefill": true, "remote_host": {host}, "remote_port": {port}, "remote_block_ids": [1]}}, "messages":[{{"role":"user","content":"hi"}}]}}"#
        )
    };
    for (host, port) in [
        (r#""10.0.0.9""#, "7000"),
        ("null", "7000"),
        (r#""evil""#, "null"),
    ] {
        let body = named(host, port);
        let got = read(chat, Bytes::from(body.clone()), limits(), None).unwrap();
        let sent: serde_json::Value = serde_json::from_slice(&got.body).unwrap();
        assert!(
            sent["kv_transfer_params"].is_null(),
            "{host}/{port}: {sent}"
        );
        assert!(!got.view.own_kv_transfer, "routed as any other request");
        // Every other byte is as sent: only the member's value changed.
        let start = body.find("{\"do_remote").unwrap();
        let end = body.find("]}").unwrap() + 2;
        let expected = format!("{}null{}", &body[..start], &body[end..]);
        assert_eq!(std::str::from_utf8(&got.body).unwrap(), expected);
        // Trusted callers (a P/D proxy of the operator's) keep them byte for byte.
        let trusted = ReadLimits {
            trust_client_kv_transfer: true,
            ..limits()
        };
        let kept = read(chat, Bytes::from(body.clone()), trusted, None).unwrap();
        assert_eq!(&kept.body[..], body.as_bytes());
        assert!(kept.view.own_kv_transfer);
    }
    // Parameters that name no peer (a proxy's phase-1 request) pass as sent.
    let phase1 = r#"{"model":"m","messages":[],"kv_transfer_params":{"do_remote_decode":true,"remote_host":null,"remote_port":null}}"#;
    let got = read(chat, Bytes::from(phase1), limits(), None).unwrap();
    assert_eq!(&got.body[..], phase1.as_bytes());
    assert!(got.view.own_kv_transfer);
    // Parameters that are not an object name nothing; unreadable ones count as naming one.
    assert!(
        !view::read_json(Shape::Chat, br#"{"kv_transfer_params": 5}"#, limits())
            .unwrap()
            .kv_transfer_names_peer
    );
}
