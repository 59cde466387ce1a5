//! Reading a GGUF file: typed metadata values and checked tensors (the hyper-parameters
//! each family reads are in [`crate::model::config`]).
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

    /// A tensor's dimensions in row-major order, if the file has it.
    pub fn tensor_dims(&self, name: &str) -> Option<Vec<usize>> {
        self.content
            .tensor_infos
            .get(name)
            .map(|i| i.shape.dims().to_vec())
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

/// A metadata value, or an error naming the missing key.
pub fn metadata<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a Value, ModelError> {
    md.get(key).ok_or_else(|| ModelError::Metadata {
        key: key.to_string(),
        reason: "missing".into(),
    })
}

/// Reads a non-negative integer metadata value.
pub fn metadata_usize(md: &HashMap<String, Value>, key: &str) -> Result<usize, ModelError> {
    let v = metadata(md, key)?;
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

/// Reads a float metadata value.
pub fn metadata_f32(md: &HashMap<String, Value>, key: &str) -> Result<f32, ModelError> {
    match metadata(md, key)? {
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
