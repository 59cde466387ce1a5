use super::byte_level::byte_level_alphabet;
use super::*;

fn s(x: &str) -> Value {
    Value::String(x.to_string())
}

/// A tiny SPM vocabulary: control tokens, byte fallback for a few bytes,
/// and scored pieces.
fn spm_metadata() -> HashMap<String, Value> {
    let mut toks: Vec<(&str, f32, i32)> =
        vec![("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)];
    // Byte tokens for all 256 bytes.
    let byte_names: Vec<String> = (0..=255u8).map(|b| format!("<0x{b:02X}>")).collect();
    for b in &byte_names {
        toks.push((b.as_str(), 0.0, 6));
    }
    let pieces: &[(&str, f32)] = &[
        ("▁", -1.0),
        ("h", -2.0),
        ("e", -2.0),
        ("l", -2.0),
        ("o", -2.0),
        ("w", -2.0),
        ("r", -2.0),
        ("d", -2.0),
        ("he", -3.0),
        ("ll", -3.0),
        ("llo", -4.0),
        ("hello", -5.0),
        ("▁hello", -6.0),
        ("▁w", -7.0),
        ("or", -7.5),
        ("▁wor", -8.0),
        ("ld", -8.5),
        ("▁world", -9.0),
        ("é", -2.0),
        ("<|user|>", 0.0),
    ];
    for (p, sc) in pieces {
        let ty = if *p == "<|user|>" { 4 } else { 1 };
        toks.push((p, *sc, ty));
    }
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), s("llama"));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(toks.iter().map(|t| s(t.0)).collect()),
    );
    md.insert(
        "tokenizer.ggml.scores".into(),
        Value::Array(toks.iter().map(|t| Value::F32(t.1)).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(toks.iter().map(|t| Value::I32(t.2)).collect()),
    );
    md.insert("tokenizer.ggml.bos_token_id".into(), Value::U32(1));
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(2));
    md.insert("tokenizer.ggml.unknown_token_id".into(), Value::U32(0));
    md
}

#[test]
fn shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<IncrementalDecoder>();
    assert_send_sync::<TokenizerError>();
}

fn ids_to_strs(tk: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| tk.token_str(i).unwrap_or_default())
        .collect()
}

#[test]
fn spm_merges_by_score_with_dummy_prefix() {
    let tk = Tokenizer::from_metadata(&spm_metadata()).expect("tokenizer");
    assert_eq!(tk.vocab_type(), VocabType::Spm);
    let ids = tk.encode("hello world", true, false).expect("encode");
    assert_eq!(ids_to_strs(&tk, &ids), ["<s>", "▁hello", "▁world"]);
    assert_eq!(tk.decode(&ids, true).expect("decode"), "hello world");
    assert_eq!(tk.decode(&ids, false).expect("decode"), "<s>hello world");
    let no_bos = tk.encode("hello world", false, false).expect("encode");
    assert_eq!(ids_to_strs(&tk, &no_bos), ["▁hello", "▁world"]);
    assert_eq!(tk.decode(&no_bos, false).expect("decode"), "hello world");
}

#[test]
fn spm_prefers_higher_scores() {
    let tk = Tokenizer::from_metadata(&spm_metadata()).expect("tokenizer");
    // "hell": he(-3) and ll(-3) tie; leftmost first: he + ll.
    let ids = tk.encode("hell", false, false).expect("encode");
    assert_eq!(ids_to_strs(&tk, &ids), ["▁", "he", "ll"]);
    // "world" without the space: w, or, ld.
    let mut md = spm_metadata();
    md.insert("tokenizer.ggml.add_space_prefix".into(), Value::Bool(false));
    let tk = Tokenizer::from_metadata(&md).expect("tokenizer");
    let ids = tk.encode("world", false, false).expect("encode");
    assert_eq!(ids_to_strs(&tk, &ids), ["w", "or", "ld"]);
}

#[test]
fn spm_byte_fallback() {
    let tk = Tokenizer::from_metadata(&spm_metadata()).expect("tokenizer");
    // 'é' is in the vocabulary, '€' (E2 82 AC) and 'z' are not.
    let ids = tk.encode("é€z", false, false).expect("encode");
    assert_eq!(
        ids_to_strs(&tk, &ids),
        ["▁", "é", "<0xE2>", "<0x82>", "<0xAC>", "<0x7A>"]
    );
    assert_eq!(tk.decode(&ids, false).expect("decode"), "é€z");
    assert_eq!(tk.token_bytes(ids[2]).expect("bytes"), vec![0xE2]);
    // Streaming holds the partial euro sign until it is complete.
    let mut dec = IncrementalDecoder::new(false);
    let mut got = Vec::new();
    for &id in &ids {
        got.push(dec.push(&tk, id).expect("push"));
    }
    assert_eq!(got, ["", "é", "", "", "€", "z"]);
    assert_eq!(dec.finish(), "");
}

#[test]
fn spm_special_tokens() {
    let tk = Tokenizer::from_metadata(&spm_metadata()).expect("tokenizer");
    let ids = tk.encode("hello</s>hello", false, true).expect("encode");
    // A dummy prefix is added after the special token too.
    assert_eq!(ids_to_strs(&tk, &ids), ["▁hello", "</s>", "▁hello"]);
    let ids = tk.encode("hello</s>", false, false).expect("encode");
    assert!(
        !ids.contains(&2),
        "control token parsed without parse_special"
    );
    // User-defined tokens are always matched.
    let ids = tk.encode("<|user|>hello", false, false).expect("encode");
    assert_eq!(ids_to_strs(&tk, &ids), ["<|user|>", "▁hello"]);
    assert_eq!(tk.stop_ids(), [2]);
    assert!(tk.is_special(1) && tk.is_special(0) && !tk.is_special(300));
}

#[test]
fn spm_empty_and_errors() {
    let tk = Tokenizer::from_metadata(&spm_metadata()).expect("tokenizer");
    assert_eq!(tk.encode("", true, true).expect("encode"), vec![1]);
    assert!(tk.encode("", false, true).expect("encode").is_empty());
    let n = tk.vocab_size() as u32;
    assert!(matches!(
        tk.decode(&[n], false),
        Err(TokenizerError::IdOutOfRange { .. })
    ));
    assert!(tk.token_bytes(n + 5).is_err());
    assert!(tk.token_str(u32::MAX).is_err());
    let mut dec = IncrementalDecoder::new(true);
    assert!(dec.push(&tk, n).is_err());
}

#[test]
fn spm_without_byte_tokens_uses_unk() {
    let mut md = spm_metadata();
    let keep = |v: &Value| !matches!(v, Value::String(t) if t.starts_with("<0x"));
    let Some(Value::Array(toks)) = md.get("tokenizer.ggml.tokens").cloned() else {
        panic!("tokens");
    };
    let mask: Vec<bool> = toks.iter().map(keep).collect();
    for key in [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
    ] {
        let Some(Value::Array(a)) = md.get(key).cloned() else {
            panic!("{key}");
        };
        let filtered = a
            .into_iter()
            .zip(&mask)
            .filter(|(_, &k)| k)
            .map(|(v, _)| v)
            .collect();
        md.insert(key.to_string(), Value::Array(filtered));
    }
    let tk = Tokenizer::from_metadata(&md).expect("tokenizer");
    let ids = tk.encode("z", false, false).expect("encode");
    assert_eq!(ids_to_strs(&tk, &ids), ["▁", "<unk>"]);
}

fn bpe_metadata(pre: &str) -> HashMap<String, Value> {
    let alphabet = byte_level_alphabet();
    let mut toks: Vec<String> = vec!["<|endoftext|>".into(), "<|im_end|>".into()];
    let mut types = vec![3, 3];
    for c in alphabet {
        toks.push(c.to_string());
        types.push(1);
    }
    let merges = ["Ġ t", "h e", "Ġt he", "1 2"];
    for m in merges {
        toks.push(m.replace(' ', ""));
        types.push(1);
    }
    let mut md = HashMap::new();
    md.insert("tokenizer.ggml.model".into(), s("gpt2"));
    md.insert("tokenizer.ggml.pre".into(), s(pre));
    md.insert(
        "tokenizer.ggml.tokens".into(),
        Value::Array(toks.iter().map(|t| s(t)).collect()),
    );
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    md.insert(
        "tokenizer.ggml.merges".into(),
        Value::Array(merges.iter().map(|m| s(m)).collect()),
    );
    md.insert("tokenizer.ggml.eos_token_id".into(), Value::U32(0));
    md
}

#[test]
fn bpe_synthetic_pretokenizers() {
    let gpt2 = Tokenizer::from_metadata(&bpe_metadata("gpt-2")).expect("gpt2");
    let ids = gpt2.encode("the 12", false, true).expect("encode");
    assert_eq!(ids_to_strs(&gpt2, &ids), ["t", "he", "Ġ", "12"]);
    let smol = Tokenizer::from_metadata(&bpe_metadata("smollm")).expect("smollm");
    let ids = smol
        .encode(" the 12<|im_end|>", false, true)
        .expect("encode");
    assert_eq!(
        ids_to_strs(&smol, &ids),
        ["Ġthe", "Ġ", "1", "2", "<|im_end|>"]
    );
    assert_eq!(
        smol.decode(&ids, false).expect("decode"),
        " the 12<|im_end|>"
    );
    assert_eq!(smol.decode(&ids, true).expect("decode"), " the 12");
    assert_eq!(smol.stop_ids(), [0, 1]);
    assert_eq!(smol.bos_id(), None);
    assert!(!smol.add_bos());
    for pre in [
        "llama-bpe",
        "qwen2",
        "default",
        "deepseek-v3",
        "tekken",
        "gpt-4o",
    ] {
        let tk = Tokenizer::from_metadata(&bpe_metadata(pre)).expect(pre);
        let text = "Hello, world! 12345 \n\n  x";
        let ids = tk.encode(text, false, true).expect("encode");
        assert_eq!(tk.decode(&ids, false).expect("decode"), text, "{pre}");
    }
}

#[test]
fn bpe_unknown_pre_tokenizer_is_an_error() {
    let err = Tokenizer::from_metadata(&bpe_metadata("no-such-pre")).expect_err("unknown pre");
    assert!(matches!(err, TokenizerError::UnknownPreTokenizer(ref n) if n == "no-such-pre"));
    assert!(err.to_string().contains("no-such-pre"));
    let mut md = bpe_metadata("gpt-2");
    md.insert("tokenizer.ggml.model".into(), s("t5"));
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::UnsupportedModel(_))
    ));
    let mut md = bpe_metadata("gpt-2");
    md.remove("tokenizer.ggml.merges");
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::MissingKey(_))
    ));
    let mut md = bpe_metadata("gpt-2");
    md.insert(
        "tokenizer.ggml.token_type".into(),
        Value::Array(vec![Value::I32(1)]),
    );
    assert!(matches!(
        Tokenizer::from_metadata(&md),
        Err(TokenizerError::InvalidVocab(_))
    ));
}

#[test]
fn incremental_decoder_handles_invalid_and_partial_utf8() {
    let tk = Tokenizer::from_metadata(&bpe_metadata("gpt-2")).expect("tokenizer");
    let alphabet = byte_level_alphabet();
    let id_of_byte = |b: u8| {
        tk.id_of(&alphabet[usize::from(b)].to_string())
            .expect("byte")
    };
    // "€" split over 3 tokens, then an invalid byte, then a truncated char.
    let ids: Vec<u32> = [0xE2u8, 0x82, 0xAC, 0xFF, b'a', 0xF0, 0x9F]
        .iter()
        .map(|&b| id_of_byte(b))
        .collect();
    let full = tk.decode(&ids, false).expect("decode");
    assert_eq!(full, "€\u{FFFD}a\u{FFFD}");
    let mut dec = IncrementalDecoder::new(false);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&dec.push(&tk, id).expect("push"));
    }
    assert_eq!(dec.pending_bytes(), &[0xF0, 0x9F]);
    out.push_str(&dec.finish());
    assert_eq!(out, full);
}
