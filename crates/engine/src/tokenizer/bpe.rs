//! Byte-level BPE built from GGUF merges over the `tokenizers` crate.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use super::metadata::get_array;
use super::pre_tokenizer::PreTokenizerSpec;
use super::{Result, TokenizerError};

pub(super) fn build_bpe(
    md: &HashMap<String, Value>,
    tokens: &[String],
    spec: &PreTokenizerSpec,
) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::BPE;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::sequence::Sequence;
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::pre_tokenizers::PreTokenizerWrapper;
    use tokenizers::SplitDelimiterBehavior;

    let merge_values = get_array(md, "tokenizer.ggml.merges")?
        .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.merges".into()))?;

    let mut vocab: tokenizers::models::bpe::Vocab = Default::default();
    for (i, t) in tokens.iter().enumerate() {
        vocab.insert(t.clone(), i as u32);
    }
    let mut merges = Vec::with_capacity(merge_values.len());
    for v in merge_values {
        let Value::String(m) = v else {
            return Err(TokenizerError::BadType {
                key: "tokenizer.ggml.merges".into(),
                expected: "array of strings",
            });
        };
        // Split at the first space after the first character (llama.cpp: find(' ', 1)).
        let first_len = m.chars().next().map_or(0, char::len_utf8);
        let Some(pos) = m.get(first_len..).and_then(|r| r.find(' ')) else {
            continue;
        };
        let pos = pos + first_len;
        let (a, b) = (&m[..pos], &m[pos + 1..]);
        // Rules the BPE model cannot represent (parts or result missing from the
        // vocabulary) could never produce a token; drop them, keeping rank order.
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&format!("{a}{b}"))
        {
            merges.push((a.to_string(), b.to_string()));
        }
    }

    let model = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Backend(e.to_string()))?;

    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
    for re in &spec.regexes {
        let split = Split::new(
            SplitPattern::Regex((*re).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Backend(format!("pre-tokenizer regex {re:?}: {e}")))?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());

    let mut tk = tokenizers::Tokenizer::new(model);
    tk.with_pre_tokenizer(Some(Sequence::new(steps)));
    Ok(tk)
}
