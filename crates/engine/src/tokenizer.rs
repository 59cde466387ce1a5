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

use std::collections::{BinaryHeap, HashMap};
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
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3's split regex (case-insensitive contractions spelled out).
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split regex: Llama 3's with single digits.
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_BLOOM: &str = r" ?[^(\s|.,!?…。，、।۔،)]+";
const RE_TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What a `tokenizer.ggml.pre` name implies for a BPE vocabulary.
struct PreTokenizerSpec {
    regexes: Vec<&'static str>,
    /// A word that is itself a vocabulary entry becomes that token without merging.
    ignore_merges: bool,
    /// Default for `add_bos_token` when the metadata does not say.
    add_bos: bool,
    /// The pre-tokenizer's model has no BOS token unless the metadata names one.
    no_default_bos: bool,
}

/// The split regexes llama.cpp uses for each pre-tokenizer name (llama-vocab.cpp).
fn pre_tokenizer_spec(name: &str) -> Option<PreTokenizerSpec> {
    let spec = |regexes: Vec<&'static str>| PreTokenizerSpec {
        regexes,
        ignore_merges: false,
        add_bos: false,
        no_default_bos: false,
    };
    let spec = match name {
        "default" => spec(vec![
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            "[0-9][0-9][0-9]",
        ]),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" => PreTokenizerSpec {
            ignore_merges: true,
            add_bos: true,
            ..spec(vec![RE_LLAMA3])
        },
        "dbrx" | "smaug-bpe" => spec(vec![RE_LLAMA3]),
        "glm4" | "chatglm-bpe" => PreTokenizerSpec {
            no_default_bos: true,
            ..spec(vec![RE_LLAMA3])
        },
        "deepseek-llm" => spec(vec![
            "[\r\n]",
            r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+$",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}+",
        ]),
        "deepseek-coder" => spec(vec![
            "[\r\n]",
            r"\s?\p{L}+",
            r"\s?\p{P}+",
            "[一-龥ࠀ-一가-퟿]+",
            r"\p{N}",
        ]),
        "deepseek-v3" | "hunyuan-dense" => spec(vec![
            r"\p{N}{1,3}",
            "[一-龥぀-ゟ゠-ヿ]+",
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
        ]),
        "falcon" => spec(vec![
            r"[\p{P}\$\+<=>\^~\|`]+",
            RE_GPT2,
            "[0-9][0-9][0-9]",
        ]),
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => {
            spec(vec![r"\p{N}", RE_GPT2])
        }
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de"
        | "a.x-4.0" | "mellum" | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" | "mpt" | "olmo"
        | "jais" | "exaone4" | "trillion" => spec(vec![RE_GPT2]),
        "qwen2" | "deepseek-r1-qwen" | "stablelm2" | "megrez" | "hunyuan" => spec(vec![RE_QWEN2]),
        "poro-chat" | "bloom" | "gpt3-finnish" => spec(vec![RE_BLOOM]),
        "viking" => spec(vec![RE_BLOOM, r"\p{N}"]),
        "tekken" => PreTokenizerSpec {
            ignore_merges: true,
            add_bos: true,
            ..spec(vec![RE_TEKKEN])
        },
        "chameleon" => PreTokenizerSpec {
            add_bos: true,
            ..spec(vec![
                "<sentinel:[0-9]+>",
                "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
                "([\\t\\n]|    |  )",
                r"\p{N}",
                r"[\p{P}!-/:-@\[-`{-~]",
                RE_GPT2,
            ])
        },
        "gpt-4o" | "llama4" => spec(vec![RE_GPT4O]),
        "bailingmoe" => spec(vec![
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ]),
        "seed-coder" => spec(vec![
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
        ]),
        _ => return None,
    };
    Some(spec)
}

/// Token texts that end a turn. Tokens with these texts are stop tokens and are
/// treated as control tokens whatever their stored type (as llama.cpp does).
const END_OF_TURN_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
];

/// Texts llama.cpp takes as the end-of-turn token when `eot_token_id` is absent.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<EOT>",
    "_<EOT>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// GPT-2's reversible byte <-> printable-character mapping.
fn byte_level_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next_extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(b)
        } else {
            let code = 256 + next_extra;
            next_extra += 1;
            code
        };
        table[usize::from(b)] = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

/// Bytes a byte-level BPE token text stands for. Characters outside the byte
/// alphabet are kept as their own UTF-8 bytes.
fn byte_level_decode(text: &str, reverse: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match reverse.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// Parses an SPM byte token text `<0xNN>`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

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

fn get<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a Value> {
    md.get(key)
}

fn value_as_i64(v: &Value) -> Option<i64> {
    Some(match v {
        Value::U8(x) => i64::from(*x),
        Value::I8(x) => i64::from(*x),
        Value::U16(x) => i64::from(*x),
        Value::I16(x) => i64::from(*x),
        Value::U32(x) => i64::from(*x),
        Value::I32(x) => i64::from(*x),
        Value::U64(x) => i64::try_from(*x).ok()?,
        Value::I64(x) => *x,
        _ => return None,
    })
}

fn value_as_f32(v: &Value) -> Option<f32> {
    match v {
        Value::F32(x) => Some(*x),
        Value::F64(x) => Some(*x as f32),
        other => value_as_i64(other).map(|x| x as f32),
    }
}

fn get_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a str>> {
    match get(md, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.as_str())),
        Some(_) => Err(TokenizerError::BadType {
            key: key.to_string(),
            expected: "string",
        }),
    }
}

fn get_bool(md: &HashMap<String, Value>, key: &str) -> Result<Option<bool>> {
    match get(md, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => match value_as_i64(v) {
            Some(i) => Ok(Some(i != 0)),
            None => Err(TokenizerError::BadType {
                key: key.to_string(),
                expected: "bool",
            }),
        },
    }
}

fn get_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Option<&'a [Value]>> {
    match get(md, key) {
        None => Ok(None),
        Some(Value::Array(a)) => Ok(Some(a.as_slice())),
        Some(_) => Err(TokenizerError::BadType {
            key: key.to_string(),
            expected: "array",
        }),
    }
}

fn get_id(md: &HashMap<String, Value>, key: &str) -> Result<Option<i64>> {
    match get(md, key) {
        None => Ok(None),
        Some(v) => value_as_i64(v)
            .map(Some)
            .ok_or_else(|| TokenizerError::BadType {
                key: key.to_string(),
                expected: "integer",
            }),
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

    /// llama.cpp's SPM algorithm: start from single characters, repeatedly merge the
    /// adjacent pair whose concatenation is the best-scoring vocabulary entry
    /// (leftmost on ties), then emit pieces, with byte fallback for characters
    /// missing from the vocabulary.
    fn spm_encode(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        let mut st = SpmState {
            text,
            syms: Vec::with_capacity(text.len()),
            heap: BinaryHeap::new(),
            rev_merge: HashMap::new(),
        };
        for (start, c) in text.char_indices() {
            let idx = st.syms.len();
            st.syms.push(SpmSymbol {
                start,
                len: c.len_utf8(),
                prev: idx.checked_sub(1),
                next: None,
            });
            if idx > 0 {
                st.syms[idx - 1].next = Some(idx);
            }
        }
        if st.syms.is_empty() {
            return Ok(());
        }
        for i in 1..st.syms.len() {
            self.spm_try_add(&mut st, Some(i - 1), Some(i));
        }
        while let Some(b) = st.heap.pop() {
            let (l, r) = (b.left, b.right);
            let (ll, rl) = (st.syms[l].len, st.syms[r].len);
            // Skip pairs whose symbols changed since the pair was queued.
            if ll == 0 || rl == 0 || ll + rl != b.size {
                continue;
            }
            st.syms[l].len += rl;
            st.syms[r].len = 0;
            let after = st.syms[r].next;
            st.syms[l].next = after;
            if let Some(a) = after {
                st.syms[a].prev = Some(l);
            }
            let before = st.syms[l].prev;
            self.spm_try_add(&mut st, before, Some(l));
            self.spm_try_add(&mut st, Some(l), after);
        }

        let mut cur = Some(0usize);
        let mut stack = Vec::new();
        while let Some(i) = cur {
            stack.push(i);
            while let Some(k) = stack.pop() {
                let sym = &st.syms[k];
                let piece = &text[sym.start..sym.start + sym.len];
                if let Some(&id) = self.token_to_id.get(piece) {
                    out.push(id);
                } else if let Some(&(l, r)) = st.rev_merge.get(piece) {
                    stack.push(r);
                    stack.push(l);
                } else {
                    for &byte in piece.as_bytes() {
                        out.push(self.byte_token(byte)?);
                    }
                }
            }
            cur = st.syms[i].next;
        }
        Ok(())
    }

    /// Queues the pair (left, right) if their concatenation is a vocabulary entry.
    fn spm_try_add<'t>(&self, st: &mut SpmState<'t>, left: Option<usize>, right: Option<usize>) {
        let (Some(l), Some(r)) = (left, right) else {
            return;
        };
        let start = st.syms[l].start;
        let end = st.syms[r].start + st.syms[r].len;
        let text: &'t str = st.text;
        let Some(piece) = text.get(start..end) else {
            return;
        };
        if let Some(&id) = self.token_to_id.get(piece) {
            st.heap.push(SpmBigram {
                score: self.scores[id as usize],
                left: l,
                right: r,
                size: end - start,
            });
            st.rev_merge.insert(piece, (l, r));
        }
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

struct SpmSymbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct SpmBigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl PartialEq for SpmBigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for SpmBigram {}

impl PartialOrd for SpmBigram {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for SpmBigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

/// Working state of one SPM tokenization.
struct SpmState<'t> {
    text: &'t str,
    syms: Vec<SpmSymbol>,
    heap: BinaryHeap<SpmBigram>,
    /// Which pair produced a piece (last one wins, as in llama.cpp).
    rev_merge: HashMap<&'t str, (usize, usize)>,
}

/// Tracks the removal of an SPM dummy-prefix space at the start of a sequence.
#[derive(Debug, Clone, Copy)]
struct StripState {
    pending: bool,
}

impl StripState {
    fn new(enabled: bool) -> Self {
        Self { pending: enabled }
    }

    fn apply<'a>(&mut self, tok: &Tokenizer, id: u32, piece: &'a [u8]) -> &'a [u8] {
        if !self.pending || !tok.add_space_prefix {
            return piece;
        }
        if Some(id) == tok.bos {
            return piece;
        }
        self.pending = false;
        piece.strip_prefix(b" ").unwrap_or(piece)
    }
}

fn build_bpe(
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

/// Streaming detokenizer: turns ids into text as they arrive, emitting only
/// complete UTF-8 characters. Constant work per token.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    skip_special: bool,
    strip: StripState,
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// Decodes a sequence from its start: the concatenated output equals
    /// [`Tokenizer::decode`] of the same ids.
    pub fn new(skip_special: bool) -> Self {
        Self {
            skip_special,
            strip: StripState::new(true),
            pending: Vec::new(),
        }
    }

    /// Decodes tokens that continue earlier text (e.g. generated after a prompt):
    /// no SPM dummy-prefix space is removed.
    pub fn continuing(skip_special: bool) -> Self {
        Self {
            strip: StripState::new(false),
            ..Self::new(skip_special)
        }
    }

    /// Adds one token; returns the text completed by it (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        let piece = tok.piece(id)?;
        let piece = self.strip.apply(tok, id, piece);
        if self.skip_special && tok.is_special(id) {
            return Ok(String::new());
        }
        self.pending.extend_from_slice(piece);
        Ok(self.drain_complete())
    }

    /// Whatever is still held (an incomplete character), lossily replaced.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }

    /// Bytes held back because they do not yet form a complete character.
    pub fn pending_bytes(&self) -> &[u8] {
        &self.pending
    }

    fn drain_complete(&mut self) -> String {
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&rest[..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += valid + bad;
                        }
                        None => {
                            // Incomplete character at the end: hold it.
                            consumed += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }
}

#[cfg(test)]
mod tests {
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
}
