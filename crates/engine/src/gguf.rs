//! Reading a GGUF file: the llama hyper-parameters from its metadata and its tensors.
//!
//! Every problem with the file (not GGUF, truncated, a missing key or tensor, an
//! architecture or tensor type Strata does not run) becomes a [`ModelError`] that names
//! what is wrong; nothing here panics on file contents.

use std::collections::HashMap;
use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot open model file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a readable GGUF file: {reason}")]
    NotGguf { path: PathBuf, reason: String },
    #[error("GGUF metadata key `{key}`: {reason}")]
    Metadata { key: String, reason: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("tensor `{name}`: {reason}")]
    Tensor { name: String, reason: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("compute error: {0}")]
    Compute(#[from] candle_core::Error),
}

/// Tensor types the engine accepts in a GGUF file.
pub const SUPPORTED_TENSOR_TYPES: &[GgmlDType] = &[
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Hyper-parameters of a llama-architecture model, read from GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub hidden: usize,
    pub ffn_hidden: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_len: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub tied_embeddings: bool,
}

/// An opened GGUF file: parsed header and a reader positioned anywhere.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| ModelError::NotGguf {
            path: path.to_path_buf(),
            reason: error_message(&e),
        })?;
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads one tensor, checking its type is supported and its shape is `expected`
    /// (dims in row-major order, e.g. `[out, in]` for a weight matrix).
    pub fn tensor(&mut self, name: &str, expected: &[usize]) -> Result<QTensor, ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Tensor {
                name: name.to_string(),
                reason: "missing from the file".into(),
            })?;
        if !SUPPORTED_TENSOR_TYPES.contains(&info.ggml_dtype) {
            return Err(ModelError::Tensor {
                name: name.to_string(),
                reason: format!("tensor type {:?} is not supported", info.ggml_dtype),
            });
        }
        if info.shape.dims() != expected {
            return Err(ModelError::Tensor {
                name: name.to_string(),
                reason: format!("shape {:?}, expected {:?}", info.shape.dims(), expected),
            });
        }
        self.content
            .tensor(&mut self.reader, name, &Device::Cpu)
            .map_err(|e| ModelError::Tensor {
                name: name.to_string(),
                reason: format!("cannot read data (truncated file?): {e}"),
            })
    }
}

fn get<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a Value, ModelError> {
    md.get(key).ok_or_else(|| ModelError::Metadata {
        key: key.to_string(),
        reason: "missing".into(),
    })
}

fn as_usize(md: &HashMap<String, Value>, key: &str) -> Result<usize, ModelError> {
    let v = get(md, key)?;
    let n = match v {
        Value::U8(x) => *x as u64,
        Value::U16(x) => *x as u64,
        Value::U32(x) => *x as u64,
        Value::U64(x) => *x,
        Value::I8(x) if *x >= 0 => *x as u64,
        Value::I16(x) if *x >= 0 => *x as u64,
        Value::I32(x) if *x >= 0 => *x as u64,
        Value::I64(x) if *x >= 0 => *x as u64,
        other => {
            return Err(ModelError::Metadata {
                key: key.to_string(),
                reason: format!("expected a non-negative integer, found {other:?}"),
            })
        }
    };
    usize::try_from(n).map_err(|_| ModelError::Metadata {
        key: key.to_string(),
        reason: "value too large".into(),
    })
}

fn as_f32(md: &HashMap<String, Value>, key: &str) -> Result<f32, ModelError> {
    match get(md, key)? {
        Value::F32(x) => Ok(*x),
        Value::F64(x) => Ok(*x as f32),
        other => Err(ModelError::Metadata {
            key: key.to_string(),
            reason: format!("expected a float, found {other:?}"),
        }),
    }
}

/// Reads a metadata string, if present.
pub fn metadata_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Option<&'a str> {
    match md.get(key) {
        Some(Value::String(s)) => Some(s.as_str()),
        _ => None,
    }
}

impl LlamaConfig {
    /// Reads and checks the llama hyper-parameters.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let md = file.metadata();
        let arch =
            metadata_str(md, "general.architecture").ok_or_else(|| ModelError::Metadata {
                key: "general.architecture".into(),
                reason: "missing".into(),
            })?;
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "architecture `{arch}` (this engine runs `llama`)"
            )));
        }
        let n_layer = as_usize(md, "llama.block_count")?;
        let hidden = as_usize(md, "llama.embedding_length")?;
        let ffn_hidden = as_usize(md, "llama.feed_forward_length")?;
        let n_head = as_usize(md, "llama.attention.head_count")?;
        let n_kv_head = match md.get("llama.attention.head_count_kv") {
            Some(_) => as_usize(md, "llama.attention.head_count_kv")?,
            None => n_head,
        };
        let context_len = as_usize(md, "llama.context_length")?;
        let rope_theta = match md.get("llama.rope.freq_base") {
            Some(_) => as_f32(md, "llama.rope.freq_base")?,
            None => 10_000.0,
        };
        let rms_eps = as_f32(md, "llama.attention.layer_norm_rms_epsilon")?;
        let bad = |key: &str, reason: &str| ModelError::Metadata {
            key: key.into(),
            reason: reason.into(),
        };
        if n_layer == 0 || hidden == 0 || ffn_hidden == 0 || context_len == 0 {
            return Err(bad("llama.*", "a size is zero"));
        }
        if n_head == 0 || hidden % n_head != 0 {
            return Err(bad(
                "llama.attention.head_count",
                "must be non-zero and divide embedding_length",
            ));
        }
        if n_kv_head == 0 || n_head % n_kv_head != 0 {
            return Err(bad(
                "llama.attention.head_count_kv",
                "must be non-zero and divide head_count",
            ));
        }
        let head_dim = hidden / n_head;
        if head_dim % 2 != 0 {
            return Err(bad(
                "llama.attention.head_count",
                "head dimension must be even",
            ));
        }
        if md.contains_key("llama.rope.dimension_count") {
            let rope_dim = as_usize(md, "llama.rope.dimension_count")?;
            if rope_dim != head_dim {
                return Err(ModelError::Unsupported(format!(
                    "partial rotary embeddings (rope dimension {rope_dim}, head dimension {head_dim})"
                )));
            }
        }
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(bad(
                "llama.attention.layer_norm_rms_epsilon",
                "out of range",
            ));
        }
        if !(rope_theta > 0.0 && rope_theta.is_finite()) {
            return Err(bad("llama.rope.freq_base", "out of range"));
        }
        let embd = file
            .content
            .tensor_infos
            .get("token_embd.weight")
            .ok_or_else(|| ModelError::Tensor {
                name: "token_embd.weight".into(),
                reason: "missing from the file".into(),
            })?;
        let vocab_size = match embd.shape.dims() {
            [v, h] if *h == hidden => *v,
            dims => {
                return Err(ModelError::Tensor {
                    name: "token_embd.weight".into(),
                    reason: format!("shape {dims:?}, expected [vocab, {hidden}]"),
                })
            }
        };
        Ok(Self {
            n_layer,
            hidden,
            ffn_hidden,
            n_head,
            n_kv_head,
            head_dim,
            vocab_size,
            context_len,
            rope_theta,
            rms_eps,
            tied_embeddings: !file.has_tensor("output.weight"),
        })
    }
}

/// A candle error's message without the backtrace candle attaches to it when
/// `RUST_BACKTRACE` is set (its `Display` prints every frame): messages end up in logs and
/// HTTP answers, frames belong in neither.
pub fn error_message(e: &candle_core::Error) -> String {
    match e {
        candle_core::Error::WithBacktrace { inner, .. } => error_message(inner),
        candle_core::Error::Context { inner, context } => {
            format!("{context}: {}", error_message(inner))
        }
        candle_core::Error::WithPath { inner, path } => {
            format!("{}: {}", path.display(), error_message(inner))
        }
        other => other.to_string(),
    }
}
