//! Structured outputs (PROTOCOLS §10) through `llguidance`.
//!
//! [`GrammarCompiler`] is built once per model: it turns the tokenizer's byte strings into
//! the token trie `llguidance` walks to compute masks. Per request it compiles the
//! request's [`StructuredOutput`] (a JSON schema, any JSON object, a regex or a list of
//! choices) into a [`GrammarState`], which the sequence carries: before each sample it
//! masks every token the grammar does not allow, after it advances the grammar by the
//! sampled token and says whether the output is complete.
//!
//! Compilation runs in the HTTP handler, so a schema that cannot be enforced is a 400
//! before anything reaches the engine thread; masks are computed on the engine's pool,
//! one sequence per task, alongside the other sequences' sampling.

use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use strata_api::validate::StructuredOutput;

use crate::tokenizer::{Tokenizer, VocabType};

/// Longest error text passed on to a client (llguidance errors can quote the grammar).
const MAX_ERROR_CHARS: usize = 600;

/// Why a constraint could not be compiled or followed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StructuredError {
    /// The schema, regex or choices cannot be enforced (names the feature at fault).
    #[error("{0}")]
    Unsupported(String),
    /// The tokenizer could not be turned into a token trie.
    #[error("structured outputs are unavailable for this tokenizer: {0}")]
    Tokenizer(String),
    /// The grammar refused a token or failed while computing a mask.
    #[error("grammar error: {0}")]
    Grammar(String),
}

fn short(msg: impl std::fmt::Display) -> String {
    let s = msg.to_string();
    match s.char_indices().nth(MAX_ERROR_CHARS) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// The tokenizer as llguidance sees it: a trie over every token's bytes (special tokens
/// behind llguidance's 0xFF marker, so text can never spell them) and our own encoder.
struct TokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
    canonical: bool,
}

impl TokenizerEnv for TokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => self
                .tokenizer
                .encode(text, false, false)
                .unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    fn tokenize_is_canonical(&self) -> bool {
        self.canonical
    }
}

/// Compiles constraints for one model's tokenizer. Cheap to share.
pub struct GrammarCompiler {
    factory: ParserFactory,
    /// Tokens that end generation; all allowed when the grammar accepts.
    eos_ids: Arc<[u32]>,
    /// Tokens the trie knows (ids at or past it never pass a mask).
    trie_vocab: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("trie_vocab", &self.trie_vocab)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

impl GrammarCompiler {
    /// Builds the token trie from `tokenizer` (once per model: ~100 ms for 50k tokens).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, StructuredError> {
        let vocab = tokenizer.vocab_size();
        let mut words = Vec::with_capacity(vocab);
        for id in 0..vocab as u32 {
            let bytes = tokenizer
                .token_bytes(id)
                .map_err(|e| StructuredError::Tokenizer(e.to_string()))?;
            if tokenizer.is_special(id) {
                let mut w = Vec::with_capacity(bytes.len() + 1);
                w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                w.extend_from_slice(&bytes);
                words.push(w);
            } else {
                words.push(bytes);
            }
        }
        let eos_ids: Vec<u32> = tokenizer
            .stop_ids()
            .into_iter()
            .filter(|&t| (t as usize) < vocab)
            .collect();
        let Some(&first_eos) = eos_ids.first() else {
            return Err(StructuredError::Tokenizer(
                "the tokenizer has no end-of-sequence token".into(),
            ));
        };
        let mut info = TokRxInfo::new(vocab as u32, first_eos);
        info.tok_bos = tokenizer.bos_id();
        info.tok_pad = tokenizer.pad_id();
        info.tok_unk = tokenizer.unk_id();
        info.tok_end_of_turn = tokenizer.eot_id();
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos_ids);
        let canonical = tokenizer.vocab_type() == VocabType::Bpe;
        let env: llguidance::toktrie::TokEnv = Arc::new(TokEnv {
            trie,
            tokenizer,
            canonical,
        });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| StructuredError::Tokenizer(short(e)))?;
        factory.quiet();
        Ok(Self {
            factory,
            eos_ids: eos_ids.into(),
            trie_vocab: vocab,
        })
    }

    /// Compiles `constraint` into the state a sequence carries. Unsupported schema
    /// keywords, bad regexes and over-large grammars are [`StructuredError::Unsupported`].
    pub fn compile(&self, constraint: &StructuredOutput) -> Result<GrammarState, StructuredError> {
        let grammar = match constraint {
            StructuredOutput::JsonObject => json_grammar(json!({"type": "object"})),
            StructuredOutput::JsonSchema { schema, .. } => json_grammar(schema.clone()),
            StructuredOutput::Regex(rx) => TopLevelGrammar::from_regex(rx),
            StructuredOutput::Choice(choices) => {
                let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
        };
        self.compile_grammar(grammar)
    }

    /// Compiles a grammar in llguidance's lark syntax (the tool-call grammars).
    pub fn compile_lark(&self, lark: &str) -> Result<GrammarState, StructuredError> {
        self.compile_grammar(TopLevelGrammar::from_lark(lark.to_string()))
    }

    /// Whether `schema` is a JSON schema this compiler can enforce (the error says why
    /// not).
    pub fn check_json_schema(&self, schema: &Value) -> Result<(), StructuredError> {
        self.compile_grammar(json_grammar(schema.clone()))
            .map(|_| ())
    }

    fn compile_grammar(&self, grammar: TopLevelGrammar) -> Result<GrammarState, StructuredError> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Unsupported(short(e)))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(StructuredError::Unsupported(short(e)));
        }
        Ok(GrammarState {
            matcher,
            eos_ids: self.eos_ids.clone(),
            trie_vocab: self.trie_vocab,
            mask_time: Duration::ZERO,
            masks: 0,
        })
    }
}

/// A JSON-schema grammar with compact separators and no free whitespace: the model cannot
/// spend its token budget on blank lines, and outputs look like `json.dumps` writes them.
fn json_grammar(schema: Value) -> TopLevelGrammar {
    TopLevelGrammar::from_json_schema(with_json_options(schema))
}

/// `schema` with the JSON options every grammar here uses (compact separators, no free
/// whitespace, `oneOf` as `anyOf`), as llguidance reads them from `x-guidance`.
pub(crate) fn with_json_options(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        // The options are ours to choose, not the client's.
        obj.insert(
            "x-guidance".into(),
            json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
                // oneOf enforced as anyOf, as vLLM does: exclusivity cannot be checked
                // token by token.
                "coerce_one_of": true,
            }),
        );
    }
    schema
}

/// Escapes regex metacharacters so `s` matches itself literally.
pub(crate) fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// What the grammar says after a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarStep {
    /// More output may follow.
    Continue,
    /// The output is complete: the token was an end-of-sequence token the grammar
    /// allowed, or nothing can follow it.
    Done,
}

/// The tokens one mask allowed.
pub struct Allowed {
    mask: SimpleVob,
    eos_ok: bool,
    eos_ids: Arc<[u32]>,
    trie_vocab: usize,
    /// The allowed token with the highest raw logit.
    pub best: u32,
}

impl Allowed {
    /// Whether the grammar allows `id` next.
    pub fn contains(&self, id: u32) -> bool {
        (id as usize) < self.trie_vocab
            && (self.mask.is_allowed(id) || (self.eos_ok && self.eos_ids.contains(&id)))
    }
}

/// One sequence's grammar: masks logits, advances by sampled tokens.
#[derive(Clone)]
pub struct GrammarState {
    matcher: Matcher,
    eos_ids: Arc<[u32]>,
    trie_vocab: usize,
    /// Time spent computing masks, and how many were computed.
    pub mask_time: Duration,
    pub masks: u64,
}

impl std::fmt::Debug for GrammarState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarState")
            .field("masks", &self.masks)
            .field("mask_time", &self.mask_time)
            .finish()
    }
}

impl GrammarState {
    /// The tokens the grammar allows next (end-of-sequence ids included when it accepts).
    pub fn allowed(&mut self) -> Result<SimpleVob, StructuredError> {
        let t = Instant::now();
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| StructuredError::Grammar(short(e)))?;
        self.mask_time += t.elapsed();
        self.masks += 1;
        Ok(mask)
    }

    /// Sets every logit the grammar forbids to `-inf`. Returns the set it allowed and the
    /// best allowed token by raw logit, which the caller falls back to if sampling's own
    /// masks (e.g. `min_tokens` hiding EOS) leave nothing the grammar allows.
    pub fn mask_logits(&mut self, logits: &mut [f32]) -> Result<Allowed, StructuredError> {
        let mask = self.allowed()?;
        let allowed = Allowed {
            eos_ok: self.eos_ids.iter().any(|&t| mask.is_allowed(t)),
            mask,
            eos_ids: self.eos_ids.clone(),
            trie_vocab: self.trie_vocab,
            best: 0,
        };
        // End-of-sequence tokens pass together when the grammar accepts: keep their logits
        // to put back after the word-wise pass below.
        let eos: Vec<(usize, f32)> = if allowed.eos_ok {
            self.eos_ids
                .iter()
                .map(|&t| t as usize)
                .filter(|&t| t < self.trie_vocab.min(logits.len()))
                .map(|t| (t, logits[t]))
                .collect()
        } else {
            Vec::new()
        };
        // Word by word over the mask's bits: a whole word allowed (inside a JSON string,
        // most of the vocabulary) or refused (between tokens of structure, nearly all of
        // it) costs one check for 32 tokens instead of one per token.
        let words = allowed.mask.as_slice();
        let vocab = self.trie_vocab.min(logits.len());
        let (known, beyond) = logits.split_at_mut(vocab);
        beyond.fill(f32::NEG_INFINITY);
        for (w, chunk) in known.chunks_mut(32).enumerate() {
            match words.get(w).copied().unwrap_or(0) {
                0 => chunk.fill(f32::NEG_INFINITY),
                u32::MAX => {}
                bits => {
                    for (b, x) in chunk.iter_mut().enumerate() {
                        if bits & (1 << b) == 0 {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        for (t, x) in eos {
            logits[t] = x;
        }
        let mut best: Option<(u32, f32)> = None;
        for (w, chunk) in logits[..vocab].chunks(32).enumerate() {
            if words.get(w).copied().unwrap_or(0) == 0 && !allowed.eos_ok {
                continue;
            }
            for (b, &x) in chunk.iter().enumerate() {
                if x != f32::NEG_INFINITY && best.is_none_or(|(_, v)| x > v) {
                    best = Some(((w * 32 + b) as u32, x));
                }
            }
        }
        // A logit that was already -inf (a banned token) can still be the only one the
        // grammar allows: fall back to the first allowed token.
        if best.is_none() {
            best = (0..vocab as u32)
                .find(|&id| allowed.contains(id))
                .map(|id| (id, f32::NEG_INFINITY));
        }
        match best {
            Some((id, _)) => Ok(Allowed {
                best: id,
                ..allowed
            }),
            None => Err(StructuredError::Grammar(
                "the grammar allows no token of the model's vocabulary".into(),
            )),
        }
    }

    /// Whether `token` may come next (costs a mask computation).
    pub fn is_allowed(&mut self, token: u32) -> Result<bool, StructuredError> {
        let mask = self.allowed()?;
        if self.eos_ids.contains(&token) {
            return Ok(self.eos_ids.iter().any(|&t| mask.is_allowed(t)));
        }
        Ok((token as usize) < self.trie_vocab && mask.is_allowed(token))
    }

    /// Advances by the sampled `token` (which must have passed the last mask).
    pub fn accept(&mut self, token: u32) -> Result<GrammarStep, StructuredError> {
        if self.eos_ids.contains(&token) {
            return Ok(GrammarStep::Done);
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| StructuredError::Grammar(short(e)))?;
        if self.matcher.is_stopped() {
            if let Some(e) = self.matcher.get_error() {
                return Err(StructuredError::Grammar(short(e)));
            }
            return Ok(GrammarStep::Done);
        }
        Ok(GrammarStep::Continue)
    }

    /// Whether the output so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regex_escape_makes_literals() {
        assert_eq!(regex_escape("a.b(c)"), "a\\.b\\(c\\)");
        assert_eq!(regex_escape("plain words"), "plain words");
    }
}
