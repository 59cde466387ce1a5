//! Default sampling parameters per served model (`--generation-config`, vLLM's flag).
//!
//! `auto` reads the model's own defaults: a Hugging Face `generation_config.json` beside
//! the model file (or `<model stem>.generation_config.json`), else the sampling keys
//! llama.cpp writes into GGUF metadata (`general.sampling.*`). `vllm` (or `none`) uses
//! none. Anything else is a folder holding `generation_config.json` or a JSON file. The
//! defaults fill only the fields a request leaves out, before validation, so a request
//! that sends a value always wins and every default is range-checked like a sent value.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde::Deserialize;
use strata_api::types::{ChatCompletionRequest, CompletionRequest, Prompt};
use strata_api::validate::validate_completion;

/// The defaults a model's generation config may set.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct GenerationDefaults {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub repetition_penalty: Option<f64>,
    /// Hugging Face's name for the output limit.
    #[serde(alias = "max_tokens")]
    pub max_new_tokens: Option<i64>,
}

/// A generation config that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum GenerationConfigError {
    #[error("cannot read the generation config {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the generation config {path} is not valid: {reason}")]
    Parse { path: PathBuf, reason: String },
    /// A default a request could not send either (e.g. `temperature` 5): refused at
    /// startup rather than turning every request that omits the field into a 400.
    #[error("the generation config from {origin} sets a value out of range: {reason}")]
    Invalid { origin: String, reason: String },
}

impl GenerationDefaults {
    /// True when no default is set.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }

    /// Resolves `--generation-config` for the model at `model_path` whose GGUF metadata is
    /// `metadata`. Every default is checked as if a request had sent it.
    pub fn resolve(
        spec: &str,
        model_path: &Path,
        metadata: &HashMap<String, GgufValue>,
    ) -> Result<Self, GenerationConfigError> {
        let (defaults, origin) = match spec {
            "vllm" | "none" | "" => return Ok(Self::default()),
            "auto" => {
                let beside = model_path.with_file_name("generation_config.json");
                let named = model_path.with_extension("generation_config.json");
                match [named, beside].into_iter().find(|p| p.is_file()) {
                    Some(p) => (Self::from_file(&p)?, p.display().to_string()),
                    None => (
                        Self::from_gguf(metadata),
                        format!("the GGUF metadata of {}", model_path.display()),
                    ),
                }
            }
            path => {
                let p = Path::new(path);
                let file = if p.is_dir() {
                    p.join("generation_config.json")
                } else {
                    p.to_path_buf()
                };
                (Self::from_file(&file)?, file.display().to_string())
            }
        };
        defaults.check(&origin)?;
        Ok(defaults)
    }

    /// Validates the defaults exactly as a request carrying them would be validated, so
    /// an out-of-range default fails at startup, naming the field.
    pub fn check(&self, origin: &str) -> Result<(), GenerationConfigError> {
        let mut probe = CompletionRequest {
            prompt: Prompt::Text("probe".to_string()),
            ..Default::default()
        };
        self.apply_completion(&mut probe);
        match validate_completion(probe) {
            Ok(_) => Ok(()),
            Err(e) => Err(GenerationConfigError::Invalid {
                origin: origin.to_string(),
                reason: e.message,
            }),
        }
    }

    /// Reads a Hugging Face `generation_config.json` (unknown keys are ignored, as
    /// transformers does; keys with the wrong type are an error).
    pub fn from_file(path: &Path) -> Result<Self, GenerationConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| GenerationConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut d: Self =
            serde_json::from_str(&text).map_err(|e| GenerationConfigError::Parse {
                path: path.to_path_buf(),
                reason: e.to_string(),
            })?;
        // transformers' `do_sample: false` means greedy whatever the temperature says.
        let raw: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        if raw.get("do_sample") == Some(&serde_json::Value::Bool(false)) {
            d.temperature = Some(0.0);
        }
        Ok(d)
    }

    /// The sampling keys llama.cpp stores in GGUF metadata.
    pub fn from_gguf(metadata: &HashMap<String, GgufValue>) -> Self {
        let float = |k: &str| match metadata.get(k) {
            Some(GgufValue::F32(x)) => Some(f64::from(*x)),
            Some(GgufValue::F64(x)) => Some(*x),
            _ => None,
        };
        let int = |k: &str| match metadata.get(k) {
            Some(GgufValue::I32(x)) => Some(i64::from(*x)),
            Some(GgufValue::U32(x)) => Some(i64::from(*x)),
            Some(GgufValue::I64(x)) => Some(*x),
            Some(GgufValue::U64(x)) => i64::try_from(*x).ok(),
            _ => None,
        };
        Self {
            temperature: float("general.sampling.temp"),
            top_p: float("general.sampling.top_p"),
            top_k: int("general.sampling.top_k"),
            min_p: float("general.sampling.min_p"),
            repetition_penalty: float("general.sampling.penalty_repeat"),
            max_new_tokens: None,
        }
    }

    /// Fills what a chat request left out.
    pub fn apply_chat(&self, req: &mut ChatCompletionRequest) {
        fill(&mut req.temperature, self.temperature);
        fill(&mut req.top_p, self.top_p);
        fill(&mut req.top_k, self.top_k);
        fill(&mut req.min_p, self.min_p);
        fill(&mut req.repetition_penalty, self.repetition_penalty);
        if req.max_tokens.is_none() && req.max_completion_tokens.is_none() {
            req.max_tokens = self.max_new_tokens;
        }
    }

    /// Fills what a completion request left out.
    pub fn apply_completion(&self, req: &mut CompletionRequest) {
        fill(&mut req.temperature, self.temperature);
        fill(&mut req.top_p, self.top_p);
        fill(&mut req.top_k, self.top_k);
        fill(&mut req.min_p, self.min_p);
        fill(&mut req.repetition_penalty, self.repetition_penalty);
        if req.max_tokens.is_none() && req.max_completion_tokens.is_none() {
            req.max_tokens = self.max_new_tokens;
        }
    }
}

fn fill<T: Copy>(field: &mut Option<T>, default: Option<T>) {
    if field.is_none() {
        *field = default;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_hugging_face_files_and_fills_only_what_is_missing() {
        let dir = std::env::temp_dir().join(format!("strata-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("generation_config.json");
        std::fs::write(
            &file,
            r#"{"temperature": 0.2, "top_p": 0.9, "top_k": 50, "max_new_tokens": 64,
                "bos_token_id": 1, "transformers_version": "4.0"}"#,
        )
        .unwrap();
        let model = dir.join("model.gguf");
        let d =
            GenerationDefaults::resolve(dir.to_str().unwrap(), &model, &HashMap::new()).unwrap();
        assert_eq!(d.temperature, Some(0.2));
        assert_eq!(d.top_k, Some(50));
        // `auto` finds the file beside the model.
        let auto = GenerationDefaults::resolve("auto", &model, &HashMap::new()).unwrap();
        assert_eq!(auto, d);
        assert!(GenerationDefaults::resolve("vllm", &model, &HashMap::new())
            .unwrap()
            .is_empty());

        let mut req = ChatCompletionRequest {
            temperature: Some(1.0),
            ..Default::default()
        };
        d.apply_chat(&mut req);
        assert_eq!(req.temperature, Some(1.0), "a sent value wins");
        assert_eq!(req.top_p, Some(0.9));
        assert_eq!(req.max_tokens, Some(64));
        let mut req = CompletionRequest {
            max_completion_tokens: Some(5),
            ..Default::default()
        };
        d.apply_completion(&mut req);
        assert_eq!(req.max_tokens, None, "max_completion_tokens was sent");

        std::fs::write(&file, r#"{"temperature": 0.7, "do_sample": false}"#).unwrap();
        let d = GenerationDefaults::from_file(&file).unwrap();
        assert_eq!(d.temperature, Some(0.0));
        std::fs::write(&file, r#"{"temperature": "hot"}"#).unwrap();
        assert!(matches!(
            GenerationDefaults::from_file(&file),
            Err(GenerationConfigError::Parse { .. })
        ));
        assert!(matches!(
            GenerationDefaults::from_file(&dir.join("missing.json")),
            Err(GenerationConfigError::Read { .. })
        ));
        // Defaults are checked as a request's values would be.
        let hot = GenerationDefaults {
            temperature: Some(5.0),
            ..Default::default()
        };
        match hot.check("test") {
            Err(GenerationConfigError::Invalid { origin, reason }) => {
                assert_eq!(origin, "test");
                assert!(reason.contains("temperature"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(d.check("test").is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reads_llama_cpp_sampling_metadata() {
        let mut md = HashMap::new();
        md.insert("general.sampling.temp".to_string(), GgufValue::F32(0.5));
        md.insert("general.sampling.top_k".to_string(), GgufValue::I32(20));
        let d = GenerationDefaults::from_gguf(&md);
        assert_eq!(d.temperature, Some(0.5));
        assert_eq!(d.top_k, Some(20));
        assert_eq!(d.top_p, None);
    }
}
