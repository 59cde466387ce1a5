//! Sentence embeddings: a BERT-style encoder served on `/v1/embeddings` (PROTOCOLS §9).
//!
//! An encoder model is a directory (what `strata model pull all-minilm-l6-v2` installs):
//! `config.json` (the Hugging Face BERT hyper-parameters), `model.safetensors` (f32 or
//! f16/bf16 weights), `tokenizer.json` (WordPiece), and optionally
//! `sentence_bert_config.json` (the longest input the model was trained for) and
//! `pooling_config.json` (sentence-transformers' pooling mode).
//!
//! - [`bert`]: the encoder; one forward over a ragged batch (no padding: the dense layers
//!   run over every token of every input at once, attention per input), then pooling and
//!   L2 normalisation.
//! - [`classifier`]: `BertForSequenceClassification` checkpoints, the encoder with its
//!   pooler and classifier (cross-encoders with one label, classifiers with several);
//!   [`encoder`] is either model, as the worker runs it; [`input`] one input, a single
//!   segment or a pair.
//! - `attention`: its self-attention, each input over its own tokens, in register tiles.
//! - [`linear`]: its dense layers, 8-bit weights and activations on the decoder's integer
//!   kernels by default, f32 on candle's GEMM with `STRATA_EMBED_WEIGHTS=f32`.
//! - [`tokenizer`]: the WordPiece tokenizer from `tokenizer.json`, with the file's own
//!   padding and truncation switched off (the server decides what is too long).
//! - [`worker`]: the thread that owns the model and coalesces queued requests into one
//!   forward.
//! - [`server`]: the HTTP routes of an engine serving an encoder; [`scoring`] its
//!   `/score`, `/rerank` and `/classify` (vLLM's shapes, [`score_api`]); `state` what
//!   the handlers share, `http` the edge (bodies, errors, checked inputs).

mod attention;
pub mod bert;
pub mod classifier;
pub mod encoder;
mod http;
pub mod input;
pub mod linear;
pub mod score_api;
pub mod scoring;
pub mod server;
mod state;
pub mod tokenizer;
pub mod worker;

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Problems loading or running an encoder model; each names the file or tensor at fault.
#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("tokenizer {path}: {reason}")]
    Tokenizer { path: PathBuf, reason: String },
    #[error("weights: tensor `{name}`: {reason}")]
    Weights { name: String, reason: String },
    #[error("tokenization failed: {0}")]
    Encode(String),
    #[error("forward pass failed: {0}")]
    Forward(String),
    /// A setting (an environment variable) with a value it does not take.
    #[error("{0}")]
    Setting(String),
}

impl From<candle_core::Error> for EmbedError {
    fn from(e: candle_core::Error) -> Self {
        EmbedError::Forward(e.to_string())
    }
}

/// The activation of the feed-forward layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// The exact GELU, `x·Φ(x)` (BERT's `gelu`).
    Gelu,
    /// The tanh approximation (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    Relu,
}

/// How token vectors become one sentence vector.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The mean over every token of the input, `[CLS]` and `[SEP]` included.
    Mean,
    /// The first token's vector.
    Cls,
}

/// What the engine needs from `config.json` and the sentence-transformers side files.
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub activation: Activation,
    pub pooling: Pooling,
    /// The longest input served, special tokens included: sentence-transformers'
    /// `max_seq_length` when given (what the model was trained on), else the position table.
    pub max_len: usize,
}

#[derive(Deserialize)]
struct RawConfig {
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    type_vocab_size: usize,
    #[serde(default = "default_eps")]
    layer_norm_eps: f64,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default)]
    position_embedding_type: Option<String>,
}

fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_act() -> String {
    "gelu".into()
}

#[derive(Deserialize)]
struct SentenceBertConfig {
    max_seq_length: Option<usize>,
}

#[derive(Deserialize)]
struct PoolingConfig {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

/// Whether `path` is an encoder model directory (a `config.json` naming a BERT model).
pub fn is_encoder_model(path: &Path) -> bool {
    if !path.is_dir() {
        return false;
    }
    let Ok(text) = std::fs::read_to_string(path.join("config.json")) else {
        return false;
    };
    serde_json::from_str::<RawConfig>(&text).is_ok_and(|c| is_bert(&c))
}

fn is_bert(c: &RawConfig) -> bool {
    c.model_type.as_deref() == Some("bert") || c.architectures.iter().any(|a| a.starts_with("Bert"))
}

fn read(path: &Path) -> Result<String, EmbedError> {
    std::fs::read_to_string(path).map_err(|source| EmbedError::Io {
        path: path.to_path_buf(),
        source,
    })
}

impl EncoderConfig {
    /// Reads `config.json` (and the optional side files) from a model directory.
    pub fn from_dir(dir: &Path) -> Result<Self, EmbedError> {
        let path = dir.join("config.json");
        let bad = |reason: String| EmbedError::Config {
            path: path.clone(),
            reason,
        };
        let raw: RawConfig = serde_json::from_str(&read(&path)?)
            .map_err(|e| bad(format!("not a BERT config: {e}")))?;
        if !is_bert(&raw) {
            return Err(bad(format!(
                "model_type {:?} / architectures {:?} is not a BERT encoder",
                raw.model_type, raw.architectures
            )));
        }
        if let Some(kind) = raw.position_embedding_type.as_deref() {
            if kind != "absolute" {
                return Err(bad(format!(
                    "position_embedding_type `{kind}` is not supported (only `absolute`)"
                )));
            }
        }
        let activation = match raw.hidden_act.as_str() {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            other => return Err(bad(format!("hidden_act `{other}` is not supported"))),
        };
        let positive = [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("intermediate_size", raw.intermediate_size),
            ("max_position_embeddings", raw.max_position_embeddings),
            ("type_vocab_size", raw.type_vocab_size),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(bad(format!("`{name}` must be positive")));
        }
        if !raw.hidden_size.is_multiple_of(raw.num_attention_heads) {
            return Err(bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                raw.hidden_size, raw.num_attention_heads
            )));
        }
        let mut max_len = raw.max_position_embeddings;
        let st_path = dir.join("sentence_bert_config.json");
        if st_path.is_file() {
            let st: SentenceBertConfig =
                serde_json::from_str(&read(&st_path)?).map_err(|e| EmbedError::Config {
                    path: st_path.clone(),
                    reason: e.to_string(),
                })?;
            if let Some(n) = st.max_seq_length.filter(|&n| n > 0) {
                max_len = max_len.min(n);
            }
        }
        let pooling = Self::pooling(dir)?;
        Ok(EncoderConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            intermediate_size: raw.intermediate_size,
            max_position_embeddings: raw.max_position_embeddings,
            type_vocab_size: raw.type_vocab_size,
            layer_norm_eps: raw.layer_norm_eps,
            activation,
            pooling,
            max_len,
        })
    }

    /// sentence-transformers' pooling mode; mean pooling when the file is absent (what
    /// sentence-transformers itself falls back to).
    fn pooling(dir: &Path) -> Result<Pooling, EmbedError> {
        let path = dir.join("pooling_config.json");
        if !path.is_file() {
            return Ok(Pooling::Mean);
        }
        let p: PoolingConfig =
            serde_json::from_str(&read(&path)?).map_err(|e| EmbedError::Config {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        match (
            p.pooling_mode_mean_tokens,
            p.pooling_mode_cls_token,
            p.pooling_mode_max_tokens || p.pooling_mode_mean_sqrt_len_tokens,
        ) {
            (true, false, false) => Ok(Pooling::Mean),
            (false, true, false) => Ok(Pooling::Cls),
            _ => Err(EmbedError::Config {
                path,
                reason: "only one of mean or CLS pooling is supported".into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(name: &str, files: &[(&str, &str)]) -> PathBuf {
        let d = std::env::temp_dir().join(format!("strata-embed-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        for (f, text) in files {
            std::fs::write(d.join(f), text).unwrap();
        }
        d
    }

    const MINI: &str = r#"{"architectures":["BertModel"],"model_type":"bert","vocab_size":30522,
        "hidden_size":384,"num_hidden_layers":6,"num_attention_heads":12,"intermediate_size":1536,
        "max_position_embeddings":512,"type_vocab_size":2,"layer_norm_eps":1e-12,"hidden_act":"gelu"}"#;

    #[test]
    fn reads_a_bert_config_and_the_sentence_transformers_limits() {
        let d = dir_with(
            "cfg",
            &[
                ("config.json", MINI),
                ("sentence_bert_config.json", r#"{"max_seq_length": 256}"#),
                (
                    "pooling_config.json",
                    r#"{"pooling_mode_mean_tokens": true, "pooling_mode_cls_token": false}"#,
                ),
            ],
        );
        assert!(is_encoder_model(&d));
        let c = EncoderConfig::from_dir(&d).unwrap();
        assert_eq!(c.hidden_size, 384);
        assert_eq!(c.max_len, 256);
        assert_eq!(c.pooling, Pooling::Mean);
        assert_eq!(c.activation, Activation::Gelu);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn rejects_what_it_cannot_run() {
        let llama = MINI
            .replace("\"bert\"", "\"llama\"")
            .replace("BertModel", "LlamaModel");
        let d = dir_with("llama", &[("config.json", &llama)]);
        assert!(!is_encoder_model(&d));
        let err = EncoderConfig::from_dir(&d).unwrap_err();
        assert!(err.to_string().contains("not a BERT encoder"), "{err}");

        let odd = MINI.replace("\"num_attention_heads\":12", "\"num_attention_heads\":7");
        let d2 = dir_with("odd", &[("config.json", &odd)]);
        let err = EncoderConfig::from_dir(&d2).unwrap_err();
        assert!(err.to_string().contains("multiple"), "{err}");

        let act = MINI.replace("\"gelu\"", "\"swish\"");
        let d3 = dir_with("act", &[("config.json", &act)]);
        let err = EncoderConfig::from_dir(&d3).unwrap_err();
        assert!(err.to_string().contains("swish"), "{err}");

        let d4 = dir_with(
            "maxpool",
            &[
                ("config.json", MINI),
                (
                    "pooling_config.json",
                    r#"{"pooling_mode_max_tokens": true}"#,
                ),
            ],
        );
        assert!(EncoderConfig::from_dir(&d4).is_err());
        for d in [d, d2, d3, d4] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}
