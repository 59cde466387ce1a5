//! Tokenizer and chat template checks against the real SmolLM2 GGUF and the
//! llama.cpp reference fixture (tools/reference/tokenizer_fixture.py).
//!
//! The model is found via `STRATA_TEST_MODEL`, else
//! `$STRATA_HOME/models/smollm2-135m-instruct.gguf` (STRATA_HOME defaults to
//! `~/.cache/strata`). CI pulls it before the tests: a missing model fails.

use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::Content;
use strata_engine::chat_template::{ChatMessage, ChatTemplate, TemplateError};
use strata_engine::tokenizer::{IncrementalDecoder, TokenType, Tokenizer, TokenizerError};

fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("STRATA_TEST_MODEL") {
        return PathBuf::from(p);
    }
    let home = std::env::var_os("STRATA_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let user_home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            user_home.join(".cache").join("strata")
        });
    home.join("models").join("smollm2-135m-instruct.gguf")
}

struct Model {
    content: Content,
    tokenizer: Tokenizer,
}

fn model() -> &'static Model {
    static MODEL: OnceLock<Model> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = model_path();
        let mut file = std::fs::File::open(&path).unwrap_or_else(|e| {
            panic!(
                "test model not found at {} ({e}); set STRATA_TEST_MODEL or STRATA_HOME, \
                 or pull smollm2-135m-instruct.gguf into $STRATA_HOME/models",
                path.display()
            )
        });
        let content = Content::read(&mut file)
            .unwrap_or_else(|e| panic!("cannot parse GGUF {}: {e}", path.display()));
        let tokenizer = Tokenizer::from_gguf(&content).expect("tokenizer from GGUF");
        Model { content, tokenizer }
    })
}

fn tok() -> &'static Tokenizer {
    &model().tokenizer
}

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    add_special: bool,
    parse_special: bool,
    ids: Vec<u32>,
}

/// The llama.cpp reference ids; `STRATA_TOKENIZER_FIXTURE` points at another fixture
/// file of the same format (e.g. a larger generated corpus) for ad-hoc checks.
fn fixture() -> Fixture {
    let path = std::env::var_os("STRATA_TOKENIZER_FIXTURE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tokenizer_smollm2.json")
        });
    let raw = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&raw).unwrap_or_else(|e| panic!("bad fixture {}: {e}", path.display()))
}

#[test]
fn metadata_and_special_ids() {
    let t = tok();
    assert_eq!(t.vocab_size(), 49152);
    assert_eq!(t.pre_tokenizer(), Some("smollm"));
    assert_eq!(t.bos_id(), Some(1));
    assert_eq!(t.eos_id(), Some(2));
    assert!(!t.add_bos());
    assert_eq!(t.id_of("<|im_start|>"), Some(1));
    assert_eq!(t.id_of("<|im_end|>"), Some(2));
    assert_eq!(t.id_of("<|endoftext|>"), Some(0));
    assert_eq!(t.stop_ids(), [0, 2]);
    assert_eq!(t.eot_id(), Some(2));
    assert!(t.is_special(1) && t.is_special(16) && !t.is_special(17));
    assert_eq!(t.token_type(1).expect("type"), TokenType::Control);
    assert_eq!(t.token_str(1).expect("str"), "<|im_start|>");
    assert_eq!(t.token_bytes(1).expect("bytes"), b"<|im_start|>");
    // `Ġ` stands for a space.
    let space_the = t.id_of("Ġthe").expect("Ġthe");
    assert_eq!(t.token_bytes(space_the).expect("bytes"), b" the");
}

#[test]
fn out_of_range_ids_are_errors() {
    let t = tok();
    let n = t.vocab_size() as u32;
    for id in [n, n + 1, u32::MAX] {
        assert!(matches!(
            t.decode(&[17, id], false),
            Err(TokenizerError::IdOutOfRange { .. })
        ));
        assert!(t.token_bytes(id).is_err());
        assert!(t.token_str(id).is_err());
        assert!(t.token_type(id).is_err());
        assert!(!t.is_special(id));
        assert!(IncrementalDecoder::new(false).push(t, id).is_err());
    }
}

#[test]
fn ids_match_llama_cpp_fixture() {
    let t = tok();
    let fx = fixture();
    let custom = std::env::var_os("STRATA_TOKENIZER_FIXTURE").is_some();
    assert!(
        custom || fx.cases.len() >= 40,
        "fixture has only {} cases",
        fx.cases.len()
    );
    let mut failures = Vec::new();
    for case in &fx.cases {
        match t.encode(&case.text, case.add_special, case.parse_special) {
            Ok(ids) if ids == case.ids => {}
            Ok(ids) => failures.push(format!(
                "text {:?} (parse_special={}):\n  llama.cpp {:?}\n  strata    {:?}",
                case.text, case.parse_special, case.ids, ids
            )),
            Err(e) => failures.push(format!("text {:?}: error {e}", case.text)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} fixture strings differ from llama.cpp:\n{}",
        failures.len(),
        fx.cases.len(),
        failures.join("\n")
    );
}

#[test]
fn decode_round_trips_the_corpus() {
    let t = tok();
    let mut failures = Vec::new();
    for case in fixture().cases {
        let ids = t
            .encode(&case.text, false, case.parse_special)
            .expect("encode");
        let back = t.decode(&ids, false).expect("decode");
        if back != case.text {
            failures.push(format!("{:?} -> {:?}", case.text, back));
        }
    }
    assert!(
        failures.is_empty(),
        "round trip failed:\n{}",
        failures.join("\n")
    );
}

#[test]
fn skip_special_hides_control_tokens() {
    let t = tok();
    let text = "<|im_start|>user\nHi<|im_end|>\n";
    let ids = t.encode(text, false, true).expect("encode");
    assert_eq!(t.decode(&ids, true).expect("decode"), "user\nHi\n");
    assert_eq!(t.decode(&ids, false).expect("decode"), text);
}

fn stream(t: &Tokenizer, ids: &[u32], skip_special: bool) -> (String, Vec<String>) {
    let mut dec = IncrementalDecoder::new(skip_special);
    let mut out = String::new();
    let mut chunks = Vec::new();
    for &id in ids {
        let chunk = dec.push(t, id).expect("push");
        out.push_str(&chunk);
        chunks.push(chunk);
    }
    let rest = dec.finish();
    out.push_str(&rest);
    chunks.push(rest);
    (out, chunks)
}

#[test]
fn incremental_decoder_matches_full_decode() {
    let t = tok();
    let mut failures = Vec::new();
    for case in fixture().cases {
        let ids = t
            .encode(&case.text, case.add_special, case.parse_special)
            .expect("encode");
        for skip in [false, true] {
            let full = t.decode(&ids, skip).expect("decode");
            let (streamed, chunks) = stream(t, &ids, skip);
            if streamed != full {
                failures.push(format!(
                    "{:?} (skip_special={skip}): full {full:?}, streamed {streamed:?}",
                    case.text
                ));
            }
            // Every chunk is complete text: no replacement characters appear
            // when the input was valid.
            if chunks.iter().any(|c| c.contains('\u{FFFD}')) {
                failures.push(format!("{:?}: chunk with U+FFFD: {chunks:?}", case.text));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn incremental_decoder_holds_split_characters() {
    let t = tok();
    // Emoji are split over several byte-level tokens by this vocabulary.
    let text = "🍕👨‍👩‍👧";
    let ids = t.encode(text, false, false).expect("encode");
    assert!(
        ids.len() > 2,
        "expected the emoji to need several tokens: {ids:?}"
    );
    let mut dec = IncrementalDecoder::new(false);
    let mut emitted = Vec::new();
    for &id in &ids {
        let chunk = dec.push(t, id).expect("push");
        if !chunk.is_empty() {
            emitted.push(chunk);
        }
    }
    assert!(dec.pending_bytes().is_empty());
    assert_eq!(emitted.concat(), text);
    // Chunks only ever hold whole characters.
    for chunk in &emitted {
        assert!(chunk.chars().all(|c| text.contains(c)), "{chunk:?}");
    }
}

fn template() -> ChatTemplate {
    let m = model();
    ChatTemplate::from_gguf(&m.content).expect("chat template")
}

#[test]
fn chat_template_renders_chatml_with_system() {
    let t = template();
    assert!(!t.is_fallback());
    assert_eq!(t.bos_token(), "<|im_start|>");
    assert_eq!(t.eos_token(), "<|im_end|>");
    let msgs = [
        ChatMessage::system("You are terse."),
        ChatMessage::user("Hi!"),
        ChatMessage::assistant("Hello."),
        ChatMessage::user("2+2?"),
    ];
    let expected = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                    <|im_start|>user\nHi!<|im_end|>\n\
                    <|im_start|>assistant\nHello.<|im_end|>\n\
                    <|im_start|>user\n2+2?<|im_end|>\n";
    assert_eq!(t.render(&msgs, false).expect("render"), expected);
    assert_eq!(
        t.render(&msgs, true).expect("render"),
        format!("{expected}<|im_start|>assistant\n")
    );
}

#[test]
fn chat_template_injects_default_system_prompt() {
    // SmolLM2's template adds its own system message when the first one is not.
    let t = template();
    let out = t.render(&[ChatMessage::user("Hi")], true).expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face\
         <|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
    // The rendered prompt tokenizes with the control tokens recognised.
    let ids = tok().encode(&out, true, true).expect("encode");
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.iter().filter(|&&i| i == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&i| i == 2).count(), 2);
}

#[test]
fn chat_template_errors_are_typed() {
    let raising = ChatTemplate::new(
        "{% for m in messages %}{% if m.role == 'tool' %}\
         {{ raise_exception('tool messages are not supported') }}{% endif %}\
         {{ m.content }}{% endfor %}",
        "",
        "",
    )
    .expect("compile");
    assert_eq!(
        raising
            .render(&[ChatMessage::user("ok")], false)
            .expect("render"),
        "ok"
    );
    match raising.render(&[ChatMessage::new("tool", "x")], false) {
        Err(TemplateError::Raised(msg)) => assert_eq!(msg, "tool messages are not supported"),
        other => panic!("expected Raised, got {other:?}"),
    }
    match ChatTemplate::new("{% if messages %}unclosed", "", "") {
        Err(TemplateError::Syntax(msg)) => assert!(!msg.is_empty()),
        other => panic!("expected Syntax, got {other:?}"),
    }
    assert!(matches!(
        ChatTemplate::new("{{ messages[0].content | nosuchfilter }}", "", "")
            .and_then(|t| t.render(&[ChatMessage::user("x")], false)),
        Err(TemplateError::Syntax(_) | TemplateError::Render(_))
    ));
}

#[test]
fn chatml_fallback_without_template_metadata() {
    let m = model();
    let mut md = m.content.metadata.clone();
    md.remove("tokenizer.chat_template");
    let t = ChatTemplate::from_metadata(&md).expect("fallback");
    assert!(t.is_fallback());
    let out = t.render(&[ChatMessage::user("Hi")], true).expect("render");
    assert_eq!(
        out,
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    );
}

// ---------------------------------------------------------------------------
// SentencePiece: a synthetic vocabulary checked against llama.cpp (no model file).

#[derive(serde::Deserialize)]
struct SpmFixture {
    vocab: serde_json::Map<String, serde_json::Value>,
    cases: Vec<Case>,
}

fn spm_fixture() -> (Tokenizer, Vec<Case>) {
    use candle_core::quantized::gguf_file::Value;
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer_spm_synthetic.json");
    let raw = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let fx: SpmFixture = serde_json::from_str(&raw)
        .unwrap_or_else(|e| panic!("bad fixture {}: {e}", path.display()));
    let mut md = std::collections::HashMap::new();
    for (key, v) in fx.vocab {
        let value = match (key.as_str(), v) {
            (_, serde_json::Value::String(s)) => Value::String(s),
            ("tokenizer.ggml.tokens", serde_json::Value::Array(a)) => Value::Array(
                a.into_iter()
                    .map(|t| Value::String(t.as_str().expect("token").to_string()))
                    .collect(),
            ),
            ("tokenizer.ggml.scores", serde_json::Value::Array(a)) => Value::Array(
                a.into_iter()
                    .map(|x| Value::F32(x.as_f64().expect("score") as f32))
                    .collect(),
            ),
            ("tokenizer.ggml.token_type", serde_json::Value::Array(a)) => Value::Array(
                a.into_iter()
                    .map(|x| Value::I32(x.as_i64().expect("type") as i32))
                    .collect(),
            ),
            (_, serde_json::Value::Number(n)) => Value::U32(n.as_u64().expect("id") as u32),
            (k, other) => panic!("unexpected vocab entry {k}: {other:?}"),
        };
        md.insert(key, value);
    }
    let tk = Tokenizer::from_metadata(&md).expect("SPM tokenizer from fixture vocabulary");
    (tk, fx.cases)
}

#[test]
fn spm_ids_match_llama_cpp_fixture() {
    let (t, cases) = spm_fixture();
    assert!(t.add_bos());
    let mut failures = Vec::new();
    for case in &cases {
        match t.encode(&case.text, case.add_special, case.parse_special) {
            Ok(ids) if ids == case.ids => {}
            Ok(ids) => failures.push(format!(
                "text {:?} (add_special={}, parse_special={}):\n  llama.cpp {:?}\n  strata    {:?}",
                case.text, case.add_special, case.parse_special, case.ids, ids
            )),
            Err(e) => failures.push(format!("text {:?}: error {e}", case.text)),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} SPM fixture cases differ from llama.cpp:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn spm_decode_and_streaming() {
    let (t, cases) = spm_fixture();
    let mut failures = Vec::new();
    for case in &cases {
        // The dummy prefix after a special token is not undone, so round trips
        // hold for text without special tokens.
        let body = if case.add_special && t.add_bos() {
            &case.ids[1..]
        } else {
            &case.ids[..]
        };
        let has_special = body.iter().any(|&id| t.is_special(id));
        if !has_special {
            let back = t.decode(&case.ids, true).expect("decode");
            if back != case.text {
                failures.push(format!("round trip {:?} -> {back:?}", case.text));
            }
        }
        for skip in [false, true] {
            let full = t.decode(&case.ids, skip).expect("decode");
            let (streamed, _) = stream(&t, &case.ids, skip);
            if streamed != full {
                failures.push(format!("stream {:?}: {full:?} vs {streamed:?}", case.text));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
