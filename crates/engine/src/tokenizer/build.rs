//! The steps of [`Tokenizer::from_metadata`](super::Tokenizer::from_metadata): the
//! vocabulary, its special tokens and the bytes each token stands for, read from GGUF
//! metadata with llama.cpp's defaults.

use std::collections::{HashMap, HashSet};

use candle_core::quantized::gguf_file::Value;

use super::byte_level::{byte_level_alphabet, byte_level_decode, parse_byte_token};
use super::metadata::{get_array, get_bool, get_id, get_str};
use super::pre_tokenizer::{pre_tokenizer_spec, PreTokenizerSpec};
use super::special::{END_OF_TURN_TEXTS, EOT_TEXTS};
use super::{Result, TokenType, TokenizerError, VocabType, SPM_SPACE};

/// The algorithm `tokenizer.ggml.model` names.
pub(super) fn vocab_type(md: &HashMap<String, Value>) -> Result<VocabType> {
    let model = get_str(md, "tokenizer.ggml.model")?
        .ok_or_else(|| TokenizerError::MissingKey("tokenizer.ggml.model".into()))?;
    match model {
        "gpt2" => Ok(VocabType::Bpe),
        "llama" => Ok(VocabType::Spm),
        other => Err(TokenizerError::UnsupportedModel(other.to_string())),
    }
}

/// `tokenizer.ggml.tokens`. An empty entry gets the text `[EMPTY_{i}]`, as in llama.cpp,
/// so it can never match text.
pub(super) fn read_tokens(md: &HashMap<String, Value>) -> Result<Vec<String>> {
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
    Ok(tokens)
}

/// One value per token from the array at `key` (`token_type`, `scores`), each read by
/// `read`; `default` for every token when the file has no such array. An array of another
/// length, or an entry `read` refuses, is an error (`expected` names the array's type).
pub(super) fn per_token<T: Copy>(
    md: &HashMap<String, Value>,
    key: &str,
    n: usize,
    default: T,
    expected: &'static str,
    read: impl Fn(&Value) -> Option<T>,
) -> Result<Vec<T>> {
    let mut out = vec![default; n];
    if let Some(arr) = get_array(md, key)? {
        if arr.len() != n {
            return Err(TokenizerError::InvalidVocab(format!(
                "{key} has {} entries for {n} tokens",
                arr.len()
            )));
        }
        for (slot, v) in out.iter_mut().zip(arr) {
            *slot = read(v).ok_or_else(|| TokenizerError::BadType {
                key: key.into(),
                expected,
            })?;
        }
    }
    Ok(out)
}

/// Each token's id by its text.
pub(super) fn index_tokens(tokens: &[String]) -> HashMap<String, u32> {
    let mut token_to_id = HashMap::with_capacity(tokens.len());
    for (i, t) in tokens.iter().enumerate() {
        // Later duplicates win, as in llama.cpp.
        token_to_id.insert(t.clone(), i as u32);
    }
    token_to_id
}

/// What `tokenizer.ggml.pre` (llama.cpp's `default` when absent) implies for a BPE
/// vocabulary; an unknown name is an error.
pub(super) fn bpe_pre_tokenizer(pre: Option<&str>) -> Result<PreTokenizerSpec> {
    let name = pre.unwrap_or("default");
    pre_tokenizer_spec(name).ok_or_else(|| TokenizerError::UnknownPreTokenizer(name.to_string()))
}

/// The special-token ids and the add-BOS/EOS/space flags as the file sets them over the
/// model's defaults. Ids stay as read (`i64`) until [`FileSpecials::settle`] has found the
/// end-of-turn tokens.
pub(super) struct FileSpecials {
    bos: Option<i64>,
    eos: Option<i64>,
    unk: Option<i64>,
    eot: Option<i64>,
    eom: Option<i64>,
    pad: Option<i64>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

/// The settled special tokens of a vocabulary.
pub(super) struct Specials {
    pub(super) bos: Option<u32>,
    pub(super) eos: Option<u32>,
    pub(super) eot: Option<u32>,
    pub(super) eom: Option<u32>,
    pub(super) unk: Option<u32>,
    pub(super) pad: Option<u32>,
    pub(super) add_bos: bool,
    pub(super) add_eos: bool,
    pub(super) add_space_prefix: bool,
    /// Sorted, without duplicates.
    pub(super) stop: Vec<u32>,
}

impl FileSpecials {
    /// Reads the `tokenizer.ggml.*_token_id` and `add_*` keys of a vocabulary of `n`
    /// tokens. The defaults are llama.cpp's: SPM has BOS 1, EOS 2, UNK 0 and adds BOS and
    /// a space prefix; BPE has none of these ids and adds BOS where its pre-tokenizer
    /// (`spec`) says so.
    pub(super) fn read(
        md: &HashMap<String, Value>,
        vocab_type: VocabType,
        spec: Option<&PreTokenizerSpec>,
        n: usize,
    ) -> Result<Self> {
        let (bos, eos, unk, mut add_bos, mut add_space_prefix) = match vocab_type {
            VocabType::Spm => (Some(1i64), Some(2i64), Some(0i64), true, true),
            VocabType::Bpe => (None, None, None, spec.is_some_and(|s| s.add_bos), false),
        };
        let mut add_eos = false;
        if let Some(v) = get_bool(md, "tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }
        let read_id = |key: &str, default: Option<i64>| -> Result<Option<i64>> {
            // An out-of-range id in the file is ignored (llama.cpp keeps its default).
            Ok(match get_id(md, key)? {
                Some(id) if in_range(id, n) => Some(id),
                _ => default,
            })
        };
        let mut bos = read_id("tokenizer.ggml.bos_token_id", bos)?;
        if spec.is_some_and(|s| s.no_default_bos)
            && get_id(md, "tokenizer.ggml.bos_token_id")?.is_none()
        {
            bos = None;
        }
        let eos = read_id("tokenizer.ggml.eos_token_id", eos)?;
        let unk = read_id("tokenizer.ggml.unknown_token_id", unk)?;
        let eot = read_id("tokenizer.ggml.eot_token_id", None)?;
        let eom = read_id("tokenizer.ggml.eom_token_id", None)?;
        let pad = read_id("tokenizer.ggml.padding_token_id", None)?;
        if let Some(v) = get_bool(md, "tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = get_bool(md, "tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }
        Ok(Self {
            bos,
            eos,
            unk,
            eot,
            eom,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// Finds the end-of-turn tokens by text, as llama.cpp does (and EOT and EOM where the
    /// file names none), marks them control in `types`, and collects the stop tokens: the
    /// end-of-turn ones, EOS, EOT and EOM. Ids outside the vocabulary are dropped.
    pub(super) fn settle(
        self,
        token_to_id: &HashMap<String, u32>,
        types: &mut [TokenType],
    ) -> Specials {
        let (mut eot, mut eom) = (self.eot, self.eom);
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
        let n = types.len();
        let to_id = |x: Option<i64>| x.filter(|&i| in_range(i, n)).map(|i| i as u32);
        let (eos, eot, eom) = (to_id(self.eos), to_id(eot), to_id(eom));
        let mut stop = end_of_turn;
        stop.extend([eos, eot, eom].into_iter().flatten());
        stop.sort_unstable();
        stop.dedup();
        Specials {
            bos: to_id(self.bos),
            eos,
            eot,
            eom,
            unk: to_id(self.unk),
            pad: to_id(self.pad),
            add_bos: self.add_bos,
            add_eos: self.add_eos,
            add_space_prefix: self.add_space_prefix,
            stop,
        }
    }
}

/// Whether `id` names one of a vocabulary's `n` tokens.
fn in_range(id: i64, n: usize) -> bool {
    id >= 0 && (id as u64) < n as u64
}

/// The bytes each token stands for in decoded text: byte-level BPE pieces mapped back
/// from GPT-2's alphabet, SPM pieces with `▁` as a space and `<0xNN>` as its byte, special
/// tokens as their text, unused slots as nothing.
pub(super) fn token_pieces(
    vocab_type: VocabType,
    tokens: &[String],
    types: &[TokenType],
) -> Vec<Vec<u8>> {
    match vocab_type {
        VocabType::Bpe => {
            let alphabet = byte_level_alphabet();
            let reverse: HashMap<char, u8> = alphabet
                .iter()
                .enumerate()
                .map(|(b, &c)| (c, b as u8))
                .collect();
            tokens
                .iter()
                .zip(types)
                .map(|(t, ty)| match ty {
                    TokenType::Normal => byte_level_decode(t, &reverse),
                    TokenType::Unused | TokenType::Undefined | TokenType::Byte => Vec::new(),
                    _ => t.as_bytes().to_vec(),
                })
                .collect()
        }
        VocabType::Spm => tokens
            .iter()
            .zip(types)
            .map(|(t, ty)| match ty {
                TokenType::Normal => t.replace(SPM_SPACE, " ").into_bytes(),
                TokenType::Byte => parse_byte_token(t).map(|b| vec![b]).unwrap_or_default(),
                TokenType::Unused | TokenType::Undefined => Vec::new(),
                _ => t.as_bytes().to_vec(),
            })
            .collect(),
    }
}

/// Control, user-defined and unknown tokens, longest text first (then by id): the order in
/// which they are cut out of the text, so a longer token is never split by a shorter one.
pub(super) fn special_order(tokens: &[String], types: &[TokenType]) -> Vec<u32> {
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
    special_order
}

/// The special tokens that strip the whitespace after them: llama.cpp gives every special
/// token of a model whose `general.name` says Phi-3 (and `</s>`) that attribute, except
/// `<unk>`, `<s>` and `<|endoftext|>` (Phi-3's tokenizer marks its added tokens so).
pub(super) fn rstrip_tokens(
    md: &HashMap<String, Value>,
    special: &[u32],
    token_to_id: &HashMap<String, u32>,
) -> Result<HashSet<u32>> {
    let name = get_str(md, "general.name")?.unwrap_or("").to_lowercase();
    let mut set = HashSet::new();
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
