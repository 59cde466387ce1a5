//! Errors that stop a benchmark before or after it runs. Failures of individual requests
//! are not errors: they are counted in the report by [`crate::record::FailureKind`].

use std::path::PathBuf;

/// Why a benchmark could not run or its results could not be written.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag value or a combination of flags makes no sense.
    #[error("invalid arguments: {0}")]
    InvalidArgs(String),
    /// A trace file line could not be used.
    #[error("trace {source_name}, line {line}: {message}")]
    Trace {
        /// The trace file.
        source_name: String,
        /// 1-based line number (0 for the whole file).
        line: usize,
        /// What was wrong.
        message: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A saved report could not be read.
    #[error("{path}: not a strata bench report: {source}")]
    BadReport {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The HTTP client could not be built.
    #[error("HTTP client: {0}")]
    Client(String),
    /// No `--model` was given and the server did not name one.
    #[error("could not discover the model from {url}/v1/models: {message} (pass --model)")]
    ModelDiscovery {
        /// The server's base URL.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// Drawing a plot failed.
    #[error("plot {path}: {message}")]
    Plot {
        /// The output file.
        path: PathBuf,
        /// The drawing backend's message.
        message: String,
    },
}
