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
mod byte_level;
mod incremental;
mod metadata;
mod pre_tokenizer;
mod special;
mod spm;

pub use incremental::IncrementalDecoder;

use bpe::build_bpe;
use byte_level::{byte_level_alphabet, byte_level_decode, parse_byte_token};
use incremental::StripState;
use metadata::{get_array, get_bool, get_id, get_str, value_as_f32, value_as_i64};
use pre_tokenizer::pre_tokenizer_spec;
use special::{END_OF_TURN_TEXTS, EOT_TEXTS};

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
        let model = get_str(md, "tokenizer.ggml.model")?
            .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.model".into()))?;
        let vocab_type = match model {
            "gpt2" => VocabType::Bpe,
            "llama" => VocabType::Spm,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        let pre = get_str(md, "tokenizer.ggml.pre")?.map(str::to_string);

        // Vocabulary.
        let token_values = get_array(md, "tokenizer.ggml.tokens")?
            .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.tokens".into()))?;
        if token_values.is_empty() {
            return Err(TokenizerError::InvalidVocab("empty token list".into()));
        }
        if u32::try_from(token_values.len()).is_err() {
            return Err(TokenizerError::InvalidVocab("too many tokens".into()));
        }
        let mut tokens = Vec::with_capacity(token_values.len());
        for (i, v) in token_values.iter().enumerate() {
            match v {
                Value::String(s) if s.is_empty() => tokens.push(format!("[EMPTY_{i}]")),
                Value::String(s) => tokens.push(s.clone()),
                _ => {
                    return Err(TokenizerError::BadType {
                        key: "tokenizer.ggml.tokens".into(),
                        expected: "array of strings",
                    })
                }
            }
        }
        let n = tokens.len();

        let mut types = vec![TokenType::Normal; n];
        if let Some(arr) = get_array(md, "tokenizer.ggml.token_type")? {
            if arr.len() != n {
                return Err(TokenizerError::InvalidVocab(format!(
                    "tokenizer.ggml.token_type has {} entries for {n} tokens",
                    arr.len()
                )));
            }
            for (slot, v) in types.iter_mut().zip(arr) {
                let code = value_as_i64(v).ok_or_else(|| TokenizerError::BadType {
                    key: "tokenizer.ggml.token_type".into(),
                    expected: "array of integers",
                })?;
                *slot = TokenType::from_code(code);
            }
        }

        let mut scores = vec![0.0f32; n];
        if let Some(arr) = get_array(md, "tokenizer.ggml.scores")? {
            if arr.len() != n {
                return Err(TokenizerError::InvalidVocab(format!(
                    "tokenizer.ggml.scores has {} entries for {n} tokens",
                    arr.len()
                )));
            }
            for (slot, v) in scores.iter_mut().zip(arr) {
                *slot = value_as_f32(v).ok_or_else(|| TokenizerError::BadType {
                    key: "tokenizer.ggml.scores".into(),
                    expected: "array of floats",
                })?;
            }
        }

        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            // Later duplicates win, as in llama.cpp.
            token_to_id.insert(t.clone(), i as u32);
        }

        // Model-dependent defaults.
        let mut spec = None;
        let (mut bos, mut eos, mut unk, mut add_bos, mut add_space_prefix) = match vocab_type {
            VocabType::Spm => (Some(1i64), Some(2i64), Some(0i64), true, true),
            VocabType::Bpe => {
                let name = pre.as_deref().unwrap_or("default");
                let s = pre_tokenizer_spec(name)
                    .ok_or_else(|| TokenizerError::UnknownPreTokenizer(name.to_string()))?;
                let add_bos = s.add_bos;
                spec = Some(s);
                (None, None, None, add_bos, false)
            }
        };
        let mut add_eos = false;
        if let Some(v) = get_bool(md, "tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }
        let in_range = |id: i64| id >= 0 && (id as u64) < n as u64;
        let read_id = |key: &str, default: Option<i64>| -> Result<Option<i64>> {
            // An out-of-range id in the file is ignored (llama.cpp keeps its default).
            Ok(match get_id(md, key)? {
                Some(id) if in_range(id) => Some(id),
                _ => default,
            })
        };
        bos = read_id("tokenizer.ggml.bos_token_id", bos)?;
        if spec.as_ref().is_some_and(|s| s.no_default_bos)
            && get_id(md, "tokenizer.ggml.bos_token_id")?.is_none()
        {
            bos = None;
        }
        eos = read_id("tokenizer.ggml.eos_token_id", eos)?;
        unk = read_id("tokenizer.ggml.unknown_token_id", unk)?;
        let mut eot = read_id("tokenizer.ggml.eot_token_id", None)?;
        let mut eom = read_id("tokenizer.ggml.eom_token_id", None)?;
        let pad = read_id("tokenizer.ggml.padding_token_id", None)?;
        if let Some(v) = get_bool(md, "tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = get_bool(md, "tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }
        let to_id = |x: Option<i64>| x.filter(|&i| in_range(i)).map(|i| i as u32);

        // End-of-turn tokens found by text, as llama.cpp does.
        let mut stop = Vec::new();
        let found = |texts: &[&str]| -> Vec<u32> {
            texts
                .iter()
                .filter_map(|t| token_to_id.get(*t).copied())
                .collect()
        };
        if eot.is_none() {
            // llama.cpp takes the first match in its (unordered) map; take the
            // first in list order for determinism.
            eot = found(EOT_TEXTS).first().map(|&i| i64::from(i));
        }
        if eom.is_none() {
            eom = token_to_id.get("<|eom_id|>").map(|&i| i64::from(i));
        }
        let mut end_of_turn = found(END_OF_TURN_TEXTS);
        // gpt-oss: `<|end|>` separates messages when `<|return|>`/`<|call|>` exist.
        if token_to_id.contains_key("<|return|>") && token_to_id.contains_key("<|call|>") {
            if let Some(&end) = token_to_id.get("<|end|>") {
                end_of_turn.retain(|&i| i != end);
                if eot == Some(i64::from(end)) {
                    eot = None;
                }
            }
        }
        for &id in &end_of_turn {
            types[id as usize] = TokenType::Control;
        }
        for id in [eot, eom].into_iter().flatten() {
            if let Some(t) = types.get_mut(id as usize) {
                *t = TokenType::Control;
            }
        }
        stop.extend(end_of_turn);
        let (bos, eos, eot, eom, unk, pad) = (
            to_id(bos),
            to_id(eos),
            to_id(eot),
            to_id(eom),
            to_id(unk),
            to_id(pad),
        );
        stop.extend([eos, eot, eom].into_iter().flatten());
        stop.sort_unstable();
        stop.dedup();

        // Bytes per token.
        let pieces: Vec<Vec<u8>> = match vocab_type {
            VocabType::Bpe => {
                let alphabet = byte_level_alphabet();
                let reverse: HashMap<char, u8> = alphabet
                    .iter()
                    .enumerate()
                    .map(|(b, &c)| (c, b as u8))
                    .collect();
                tokens
                    .iter()
                    .zip(&types)
                    .map(|(t, ty)| match ty {
                        TokenType::Normal => byte_level_decode(t, &reverse),
                        TokenType::Unused | TokenType::Undefined | TokenType::Byte => Vec::new(),
                        _ => t.as_bytes().to_vec(),
                    })
                    .collect()
            }
            VocabType::Spm => tokens
                .iter()
                .zip(&types)
                .map(|(t, ty)| match ty {
                    TokenType::Normal => t.replace(SPM_SPACE, " ").into_bytes(),
                    TokenType::Byte => parse_byte_token(t).map(|b| vec![b]).unwrap_or_default(),
                    TokenType::Unused | TokenType::Undefined => Vec::new(),
                    _ => t.as_bytes().to_vec(),
                })
                .collect(),
        };

        let mut special_order: Vec<u32> = types
            .iter()
            .enumerate()
            .filter(|(_, ty)| {
                matches!(
                    ty,
                    TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                )
            })
            .map(|(i, _)| i as u32)
            .collect();
        special_order.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let rstrip = rstrip_tokens(md, &special_order, &token_to_id)?;

        let bpe = match (&spec, vocab_type) {
            (Some(spec), VocabType::Bpe) => Some(build_bpe(md, &tokens, spec)?),
            _ => None,
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
            bos,
            eos,
            eot,
            eom,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix: add_space_prefix && vocab_type == VocabType::Spm,
            stop_ids: stop,
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

/// The special tokens that strip the whitespace after them: llama.cpp gives every special
/// token of a model whose `general.name` says Phi-3 (and `</s>`) that attribute, except
/// `<unk>`, `<s>` and `<|endoftext|>` (Phi-3's tokenizer marks its added tokens so).
fn rstrip_tokens(
    md: &HashMap<String, Value>,
    special: &[u32],
    token_to_id: &HashMap<String, u32>,
) -> Result<std::collections::HashSet<u32>> {
    let name = get_str(md, "general.name")?.unwrap_or("").to_lowercase();
    let mut set = std::collections::HashSet::new();
    if !(name.contains("phi-3") || name.contains("phi3")) {
        return Ok(set);
    }
    set.extend(special.iter().copied());
    set.extend(token_to_id.get("</s>").copied());
    for keep in ["<unk>", "<s>", "<|endoftext|>"] {
        if let Some(id) = token_to_id.get(keep) {
            set.remove(id);
        }
    }
    Ok(set)
}
