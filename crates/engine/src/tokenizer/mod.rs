//! Tokenizer built from GGUF metadata, following llama.cpp's tokenization semantics.
//!
//! Two vocabulary kinds are supported, selected by `tokenizer.ggml.model`:
//!
//! * `gpt2`: byte-level BPE. Text is split by the pre-tokenizer regexes that
//!   `tokenizer.ggml.pre` names (applied one after another, each splitting the pieces
//!   left by the previous one, matches and gaps both kept), every piece is mapped to
//!   GPT-2's byte-to-unicode alphabet and BPE-merged by merge rank (the `tokenizers`
//!   crate does the splitting and the merging). An unknown pre-tokenizer name is an
//!   error; a missing one means llama.cpp's `default`.
//! * `llama`: SentencePiece (SPM) vocabularies, tokenized the way llama.cpp does it:
//!   spaces become `▁`, a dummy-prefix space is added at the start of the text and
//!   after every special token (`tokenizer.ggml.add_space_prefix`, default true),
//!   adjacent symbols are merged greedily by the score of the merged piece, and any
//!   character left that is not in the vocabulary is emitted as byte-fallback tokens
//!   `<0xNN>`.
//!
//! Special tokens: control (type 3), user-defined (type 4) and unknown (type 2)
//! tokens are cut out of the text as whole tokens before the text is tokenized,
//! longest token text first. Control and unknown tokens are only recognised when
//! `parse_special` is true; user-defined tokens are always recognised (they are
//! ordinary vocabulary entries, as in llama.cpp and HF `tokenizers`).
//!
//! Decoding concatenates the bytes each token stands for ([`Tokenizer::token_bytes`])
//! and replaces invalid UTF-8 lossily. llama.cpp's `clean_up_tokenization_spaces`
//! pass is not applied (llama-server does not apply it to generated text either).

use std::collections::HashMap;
use std::fmt;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};

/// Errors from building a tokenizer or from encoding/decoding.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF metadata has no `{0}`")]
    MissingKey(String),
    #[error("GGUF metadata `{key}` has an unexpected type (expected {expected})")]
    BadType { key: String, expected: &'static str },
    #[error("unsupported tokenizer model `{0}` (tokenizer.ggml.model); supported: gpt2, llama")]
    UnsupportedModel(String),
    #[error("unknown pre-tokenizer `{0}` (tokenizer.ggml.pre)")]
    UnknownPreTokenizer(String),
    #[error("invalid vocabulary: {0}")]
    InvalidVocab(String),
    #[error("token id {id} is out of range (vocabulary has {vocab_size} tokens)")]
    IdOutOfRange { id: u32, vocab_size: usize },
    #[error("the vocabulary has no token for byte 0x{0:02X} and no unknown token")]
    NoByteToken(u8),
    #[error("the model asks for a {0} token but defines none")]
    MissingSpecialToken(&'static str),
    #[error("BPE tokenizer error: {0}")]
    Backend(String),
    #[error("cannot read GGUF file {path}: {message}")]
    Gguf { path: String, message: String },
}

type Result<T> = std::result::Result<T, TokenizerError>;

/// Token types as stored in `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// 1: an ordinary vocabulary piece.
    Normal,
    /// 2: the unknown token.
    Unknown,
    /// 3: control tokens (BOS, EOS, `<|im_start|>`, ...).
    Control,
    /// 4: user-defined tokens: added tokens that are not special.
    UserDefined,
    /// 5: unused slots.
    Unused,
    /// 6: SPM byte-fallback tokens `<0xNN>`.
    Byte,
    /// 0 or any other value.
    Undefined,
}

impl TokenType {
    fn from_code(code: i64) -> Self {
        match code {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}

/// Which tokenization algorithm the vocabulary uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabType {
    /// `tokenizer.ggml.model = gpt2`: byte-level BPE.
    Bpe,
    /// `tokenizer.ggml.model = llama`: SentencePiece with scores and byte fallback.
    Spm,
}

/// GPT-2's split regex (llama.cpp's form: no trailing `|\s+`).
mod bpe;
mod build;
mod byte_level;
mod incremental;
mod metadata;
mod pre_tokenizer;
mod special;
mod spm;

pub use incremental::IncrementalDecoder;

use bpe::build_bpe;
use incremental::StripState;
use metadata::{get_str, value_as_f32, value_as_i64};

const SPM_SPACE: char = '\u{2581}';

/// The text pieces and special tokens of an input, after special-token splitting.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// A tokenizer for one model's vocabulary. Cheap to share: `Send + Sync`.
pub struct Tokenizer {
    vocab_type: VocabType,
    pre: Option<String>,
    tokens: Vec<String>,
    types: Vec<TokenType>,
    scores: Vec<f32>,
    /// The bytes each token decodes to (for every type, including control tokens).
    pieces: Vec<Vec<u8>>,
    token_to_id: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first.
    special_order: Vec<u32>,
    /// Special tokens that swallow the whitespace after them when parsed from text
    /// (llama.cpp's RSTRIP attribute: every special token of a Phi-3 file but `<unk>`,
    /// `<s>` and `<|endoftext|>`).
    rstrip: std::collections::HashSet<u32>,
    bpe: Option<tokenizers::Tokenizer>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    eom: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    stop_ids: Vec<u32>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_type", &self.vocab_type)
            .field("pre", &self.pre)
            .field("vocab_size", &self.tokens.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("stop_ids", &self.stop_ids)
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Builds the tokenizer from a parsed GGUF file's metadata.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        Self::from_metadata(&content.metadata)
    }

    /// Reads the GGUF header of `path` and builds the tokenizer from its metadata.
    pub fn from_gguf_path(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let gguf_err = |message: String| TokenizerError::Gguf {
            path: path.display().to_string(),
            message,
        };
        let mut file = std::fs::File::open(path).map_err(|e| gguf_err(e.to_string()))?;
        let content = Content::read(&mut file).map_err(|e| gguf_err(e.to_string()))?;
        Self::from_gguf(&content)
    }

    /// Builds the tokenizer from GGUF-style metadata (`tokenizer.ggml.*` keys).
    ///
    /// Defaults follow llama.cpp, except that a BPE vocabulary without
    /// `bos_token_id`/`eos_token_id` has no BOS/EOS (llama.cpp assumes id 11).
    pub fn from_metadata(md: &HashMap<String, Value>) -> Result<Self> {
        let vocab_type = build::vocab_type(md)?;
        let pre = get_str(md, "tokenizer.ggml.pre")?.map(str::to_string);
        let tokens = build::read_tokens(md)?;
        let n = tokens.len();
        let mut types = build::per_token(
            md,
            "tokenizer.ggml.token_type",
            n,
            TokenType::Normal,
            "array of integers",
            |v| value_as_i64(v).map(TokenType::from_code),
        )?;
        let scores = build::per_token(
            md,
            "tokenizer.ggml.scores",
            n,
            0.0f32,
            "array of floats",
            value_as_f32,
        )?;
        let token_to_id = build::index_tokens(&tokens);
        let spec = match vocab_type {
            VocabType::Bpe => Some(build::bpe_pre_tokenizer(pre.as_deref())?),
            VocabType::Spm => None,
        };
        let specials = build::FileSpecials::read(md, vocab_type, spec.as_ref(), n)?
            .settle(&token_to_id, &mut types);
        let pieces = build::token_pieces(vocab_type, &tokens, &types);
        let special_order = build::special_order(&tokens, &types);
        let rstrip = build::rstrip_tokens(md, &special_order, &token_to_id)?;
        let bpe = match &spec {
            Some(spec) => Some(build_bpe(md, &tokens, spec)?),
            None => None,
        };
        Ok(Self {
            vocab_type,
            pre,
            tokens,
            types,
            scores,
            pieces,
            token_to_id,
            special_order,
            rstrip,
            bpe,
            bos: specials.bos,
            eos: specials.eos,
            eot: specials.eot,
            eom: specials.eom,
            unk: specials.unk,
            pad: specials.pad,
            add_bos: specials.add_bos,
            add_eos: specials.add_eos,
            add_space_prefix: specials.add_space_prefix && vocab_type == VocabType::Spm,
            stop_ids: specials.stop,
        })
    }

    /// Encodes `text`. `add_special` adds BOS (and EOS) where the model asks for them
    /// (`tokenizer.ggml.add_bos_token` / `add_eos_token`); `parse_special` lets control
    /// tokens written in the text (e.g. `<|im_start|>`) become those tokens.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.push(self.bos.ok_or(TokenizerError::MissingSpecialToken("BOS"))?);
        }
        match self.vocab_type {
            VocabType::Bpe => {
                for f in fragments {
                    match f {
                        Fragment::Text(t) => self.bpe_encode(t, &mut out)?,
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
            VocabType::Spm => {
                let mut prev_special = true;
                for f in fragments {
                    match f {
                        Fragment::Text(t) => {
                            let mut s = String::with_capacity(t.len() + 3);
                            if self.add_space_prefix && prev_special {
                                s.push(SPM_SPACE);
                            }
                            for c in t.chars() {
                                s.push(if c == ' ' { SPM_SPACE } else { c });
                            }
                            self.spm_encode(&s, &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.push(self.eos.ok_or(TokenizerError::MissingSpecialToken("EOS"))?);
        }
        Ok(out)
    }

    /// Decodes `ids` to text (invalid UTF-8 replaced by U+FFFD). With `skip_special`,
    /// control and unknown tokens produce nothing. For SPM vocabularies with a dummy
    /// prefix, one leading space is removed from the first token after the start of
    /// the sequence (or after a leading BOS), so `decode(encode(x)) == x`.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut strip = StripState::new(true);
        for &id in ids {
            let piece = self.piece(id)?;
            let piece = strip.apply(self, id, piece);
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(piece);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The vocabulary entry of `id` (e.g. `Ġthe`, `▁the`, `<|im_start|>`).
    pub fn token_str(&self, id: u32) -> Result<String> {
        self.check(id)?;
        Ok(self.tokens[id as usize].clone())
    }

    /// The raw bytes `id` stands for in decoded text (control tokens: their text).
    /// A byte-level token may be part of a multi-byte character.
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>> {
        Ok(self.piece(id)?.to_vec())
    }

    /// The stored type of `id` (end-of-turn tokens are reported as control).
    pub fn token_type(&self, id: u32) -> Result<TokenType> {
        self.check(id)?;
        Ok(self.types[id as usize])
    }

    /// The SentencePiece score of `id` (0 when the file has none).
    pub fn score(&self, id: u32) -> Result<f32> {
        self.check(id)?;
        Ok(self.scores[id as usize])
    }

    /// Whether `id` is a control or unknown token: hidden by `skip_special`.
    /// Out-of-range ids are not special.
    pub fn is_special(&self, id: u32) -> bool {
        matches!(
            self.types.get(id as usize),
            Some(TokenType::Control | TokenType::Unknown)
        )
    }

    /// Id of the vocabulary entry whose text is exactly `token`.
    pub fn id_of(&self, token: &str) -> Option<u32> {
        self.token_to_id.get(token).copied()
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn vocab_type(&self) -> VocabType {
        self.vocab_type
    }

    /// The `tokenizer.ggml.pre` name, if the file has one.
    pub fn pre_tokenizer(&self) -> Option<&str> {
        self.pre.as_deref()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// End-of-turn token: `tokenizer.ggml.eot_token_id`, else found by text.
    pub fn eot_id(&self) -> Option<u32> {
        self.eot
    }

    /// End-of-message token (`tokenizer.ggml.eom_token_id`, else `<|eom_id|>`).
    pub fn eom_id(&self) -> Option<u32> {
        self.eom
    }

    pub fn unk_id(&self) -> Option<u32> {
        self.unk
    }

    pub fn pad_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(.., add_special = true, ..)` appends EOS.
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// Tokens that end generation, sorted: EOS, EOT (`eot_token_id`), EOM
    /// (`eom_token_id`), and every token whose text is one of `<|eot_id|>`,
    /// `<|im_end|>`, `<|end|>`, `<|return|>`, `<|call|>`, `<end_of_turn>`,
    /// `<|endoftext|>`, `<|eom_id|>`, `<EOT>`, `_<EOT>`, `<|end_of_text|>`,
    /// `<end_of_utterance>` (such tokens are treated as control tokens). As in
    /// llama.cpp, `<|end|>` is not a stop token when both `<|return|>` and `<|call|>`
    /// exist (gpt-oss).
    pub fn stop_ids(&self) -> Vec<u32> {
        self.stop_ids.clone()
    }

    fn check(&self, id: u32) -> Result<()> {
        if (id as usize) < self.tokens.len() {
            Ok(())
        } else {
            Err(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.tokens.len(),
            })
        }
    }

    fn piece(&self, id: u32) -> Result<&[u8]> {
        self.check(id)?;
        Ok(&self.pieces[id as usize])
    }

    /// Cuts special tokens out of `text`: for each special token, longest text
    /// first, every occurrence inside the remaining text pieces is split off.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(text));
        for &id in &self.special_order {
            let ty = self.types[id as usize];
            if !parse_special && matches!(ty, TokenType::Control | TokenType::Unknown) {
                continue;
            }
            let pat = self.tokens[id as usize].as_str();
            // Every fragment is a substring of `text`: skip tokens absent from it.
            if !text.contains(pat) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                match f {
                    Fragment::Text(mut rest) => {
                        while let Some(pos) = rest.find(pat) {
                            if pos > 0 {
                                next.push(Fragment::Text(&rest[..pos]));
                            }
                            next.push(Fragment::Token(id));
                            rest = &rest[pos + pat.len()..];
                            if self.rstrip.contains(&id) {
                                rest = rest.trim_start_matches(is_c_space);
                            }
                        }
                        if !rest.is_empty() {
                            next.push(Fragment::Text(rest));
                        }
                    }
                    tok => next.push(tok),
                }
            }
            frags = next;
        }
        frags
    }

    fn bpe_encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let Some(bpe) = &self.bpe else {
            return Err(TokenizerError::Backend("BPE model not initialised".into()));
        };
        let enc = bpe
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Backend(e.to_string()))?;
        out.extend_from_slice(enc.get_ids());
        Ok(())
    }

    fn byte_token(&self, byte: u8) -> Result<u32> {
        let hex = format!("<0x{byte:02X}>");
        if let Some(&id) = self.token_to_id.get(&hex) {
            return Ok(id);
        }
        if byte.is_ascii() {
            let single = char::from(byte).to_string();
            if let Some(&id) = self.token_to_id.get(&single) {
                return Ok(id);
            }
        }
        self.unk.ok_or(TokenizerError::NoByteToken(byte))
    }
}

#[cfg(test)]
mod tests;

/// C's `isspace` over ASCII: what llama.cpp strips next to a special token.
fn is_c_space(c: char) -> bool {
    matches!(c, ' ' | '\t' | '\n' | '\x0b' | '\x0c' | '\r')
}
