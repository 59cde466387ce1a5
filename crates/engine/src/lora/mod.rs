//! LoRA adapters for the llama model (PROTOCOLS §8): PEFT adapters read and checked
//! against the base model, the per-row low-rank update, and the registry behind
//! `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`.
//!
//! A request's `model` names an adapter; its sequence holds an `Arc` of it while it runs.
//! [`crate::model::Llama::forward_rows_lora`] takes one adapter (or none) per sequence of
//! the step and, after each projection an adapter targets, adds that row's
//! `scale · B (A x)` ([`apply_rows_strided`]), so one batch mixes adapters and the base
//! model and each row's result is what it would be alone.
//!
//! - [`adapter`]: `adapter_config.json` + `adapter_model.safetensors` into f32 `A`/`B`
//!   pairs per (layer, module), every shape checked; `scale · B(A x)`; the merged
//!   `W + scale·B·A` used as the reference in tests.
//! - [`allowed`]: the `--lora-dir` fence around runtime loads.
//! - [`registry`]: which adapters are loaded, vLLM's request shapes and errors.

pub mod adapter;
pub mod allowed;
pub mod registry;

pub use adapter::{apply_rows, apply_rows_strided, LoraAdapter, LoraError, Module};
pub use allowed::AllowedDirs;
pub use registry::{LoadLoraRequest, LoraRegistry, UnloadLoraRequest};

use std::path::PathBuf;

use serde::Deserialize;

/// `--enable-lora` and its limits, as vLLM names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraOptions {
    /// Distinct adapters in one step (`--max-loras`); a request for another adapter waits
    /// until a running one's requests finish.
    pub max_loras: usize,
    /// Highest adapter rank accepted (`--max-lora-rank`).
    pub max_lora_rank: usize,
    /// Adapters held in memory at once (`--max-cpu-loras`); `None`: `max_loras` or the
    /// number of `--lora-modules`, whichever is larger.
    pub max_cpu_loras: Option<usize>,
    /// Adapters loaded at start-up (`--lora-modules`).
    pub modules: Vec<LoraModule>,
    /// The only directories `POST /v1/load_lora_adapter` may read from (`--lora-dir`);
    /// empty: no runtime loads. Start-up `modules` are the operator's own and need none.
    pub dirs: Vec<PathBuf>,
}

impl Default for LoraOptions {
    fn default() -> Self {
        // vLLM's defaults.
        Self {
            max_loras: 1,
            max_lora_rank: 16,
            max_cpu_loras: None,
            modules: Vec::new(),
            dirs: Vec::new(),
        }
    }
}

impl LoraOptions {
    /// Checks the limits; the error says which flag is wrong.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_loras == 0 {
            return Err("--max-loras must be at least 1".into());
        }
        if self.max_lora_rank == 0 {
            return Err("--max-lora-rank must be at least 1".into());
        }
        if let Some(cpu) = self.max_cpu_loras {
            if cpu < self.max_loras {
                return Err(format!(
                    "--max-cpu-loras ({cpu}) must be at least --max-loras ({})",
                    self.max_loras
                ));
            }
        }
        Ok(())
    }

    /// Adapters held at once.
    pub fn cpu_loras(&self) -> usize {
        self.max_cpu_loras
            .unwrap_or_else(|| self.max_loras.max(self.modules.len()))
    }
}

/// One `--lora-modules` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
}

impl std::str::FromStr for LoraModule {
    type Err = String;

    /// `name=path`, or vLLM's JSON form `{"name": ..., "path": ...}` (its optional
    /// `base_model_name` is accepted and ignored: there is one base model).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        if s.starts_with('{') {
            #[derive(Deserialize)]
            #[serde(deny_unknown_fields)]
            struct Json {
                name: String,
                path: String,
                #[serde(default)]
                #[allow(dead_code)]
                base_model_name: Option<String>,
            }
            let j: Json =
                serde_json::from_str(s).map_err(|e| format!("--lora-modules JSON `{s}`: {e}"))?;
            return Self::checked(j.name, j.path);
        }
        let (name, path) = s
            .split_once('=')
            .ok_or_else(|| format!("--lora-modules `{s}`: expected name=path or JSON"))?;
        Self::checked(name.trim().to_string(), path.trim().to_string())
    }
}

impl LoraModule {
    fn checked(name: String, path: String) -> Result<Self, String> {
        if name.is_empty() || path.is_empty() {
            return Err("--lora-modules: both the name and the path must be non-empty".into());
        }
        Ok(Self { name, path })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_modules_parse_in_both_of_vllms_forms() {
        let m: LoraModule = "sql=/tmp/a".parse().unwrap();
        assert_eq!((m.name.as_str(), m.path.as_str()), ("sql", "/tmp/a"));
        let m: LoraModule = r#"{"name": "x", "path": "/p", "base_model_name": "b"}"#
            .parse()
            .unwrap();
        assert_eq!((m.name.as_str(), m.path.as_str()), ("x", "/p"));
        assert!("noequals".parse::<LoraModule>().is_err());
        assert!("=p".parse::<LoraModule>().is_err());
        assert!(r#"{"name": "x"}"#.parse::<LoraModule>().is_err());
        let o = LoraOptions {
            max_loras: 4,
            max_cpu_loras: Some(2),
            ..LoraOptions::default()
        };
        assert!(o.validate().unwrap_err().contains("max-cpu-loras"));
        assert_eq!(LoraOptions::default().cpu_loras(), 1);
    }
}
