//! The adapters an engine holds, behind vLLM's runtime endpoints (PROTOCOLS §8):
//! `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and
//! `POST /v1/unload_lora_adapter {"lora_name"}`.
//!
//! Errors follow vLLM: a missing field, a name already loaded, or an adapter that cannot be
//! used is a 400; a path with no adapter is a 404; unloading an unknown name is a 404.
//! Unloading an adapter that requests still use is refused with a 400 that says so (the
//! request holds an `Arc` of it, so the count of holders is exact).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use serde::Deserialize;
use strata_api::ApiError;

use super::adapter::{LoraAdapter, LoraError};
use super::allowed::AllowedDirs;
use crate::model::config::ModelConfig;

/// Body of `POST /v1/load_lora_adapter` (fields optional here so a missing one earns a
/// precise 400).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct LoadLoraRequest {
    pub lora_name: Option<String>,
    pub lora_path: Option<String>,
}

/// Body of `POST /v1/unload_lora_adapter`.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct UnloadLoraRequest {
    pub lora_name: Option<String>,
}

/// The loaded adapters and the limits they are held to.
pub struct LoraRegistry {
    base: ModelConfig,
    base_name: String,
    max_rank: usize,
    /// Adapters held at once (`--max-cpu-loras`).
    max_cpu_loras: usize,
    adapters: BTreeMap<String, Arc<LoraAdapter>>,
    /// The id the next load gets (vLLM numbers adapters from 1).
    next_id: u32,
    /// Where runtime loads may read from (`--lora-dir`).
    allowed: AllowedDirs,
}

impl LoraRegistry {
    pub fn new(base: ModelConfig, base_name: &str, max_rank: usize, max_cpu_loras: usize) -> Self {
        Self {
            base,
            base_name: base_name.to_string(),
            max_rank,
            max_cpu_loras: max_cpu_loras.max(1),
            adapters: BTreeMap::new(),
            next_id: 1,
            allowed: AllowedDirs::default(),
        }
    }

    /// The registry with runtime loads fenced to `allowed`.
    pub fn with_allowed_dirs(mut self, allowed: AllowedDirs) -> Self {
        self.allowed = allowed;
        self
    }

    /// The checks of a client's load ([`check_load`](Self::check_load)), then its path
    /// fenced to `--lora-dir`: the name and the canonical path to read.
    pub fn check_runtime_load(&self, req: LoadLoraRequest) -> Result<(String, String), ApiError> {
        let (name, path) = self.check_load(req)?;
        let path = self.allowed.check(&path)?;
        Ok((name, path.to_string_lossy().into_owned()))
    }

    /// Loads an adapter (`--lora-modules name=path` at start-up, or the endpoint).
    pub fn load(&mut self, req: LoadLoraRequest) -> Result<Arc<LoraAdapter>, ApiError> {
        let (name, path) = self.check_load(req)?;
        let adapter = self.read(&name, &path)?;
        self.insert(adapter)
    }

    /// The checks of a load that need no file: both fields, a new name, room. Returns the
    /// name and path to read (the reading can then happen without holding the registry).
    pub fn check_load(&self, req: LoadLoraRequest) -> Result<(String, String), ApiError> {
        let name = req
            .lora_name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| ApiError::invalid("lora_name", "lora_name is required."))?;
        let path = req
            .lora_path
            .filter(|p| !p.is_empty())
            .ok_or_else(|| ApiError::invalid("lora_path", "lora_path is required."))?;
        self.check_room(&name)?;
        Ok((name, path))
    }

    fn check_room(&self, name: &str) -> Result<(), ApiError> {
        if name == self.base_name {
            return Err(ApiError::invalid(
                "lora_name",
                format!("`{name}` is the base model's name; choose another adapter name."),
            ));
        }
        if self.adapters.contains_key(name) {
            return Err(ApiError::invalid(
                "lora_name",
                format!("The lora adapter '{name}' has already been loaded."),
            ));
        }
        if self.adapters.len() >= self.max_cpu_loras {
            return Err(ApiError::invalid(
                "lora_name",
                format!(
                    "Cannot load '{name}': {} adapters are loaded, the limit (--max-cpu-loras); \
                     unload one first.",
                    self.adapters.len()
                ),
            ));
        }
        Ok(())
    }

    /// Reads and checks an adapter against the base model; touches nothing in the registry.
    pub fn read(&self, name: &str, path: &str) -> Result<LoraAdapter, ApiError> {
        read_adapter(name, path, &self.base, self.max_rank)
    }

    /// The base model's shapes and the rank limit, for reading adapters elsewhere.
    pub fn limits(&self) -> (ModelConfig, usize) {
        (self.base.clone(), self.max_rank)
    }

    /// Adds a read adapter, checking again that its name is free (another load may have
    /// taken it meanwhile), and numbers it.
    pub fn insert(&mut self, mut adapter: LoraAdapter) -> Result<Arc<LoraAdapter>, ApiError> {
        self.check_room(&adapter.name)?;
        adapter.id = self.next_id;
        self.next_id = self.next_id.saturating_add(1);
        let adapter = Arc::new(adapter);
        self.adapters.insert(adapter.name.clone(), adapter.clone());
        Ok(adapter)
    }

    /// Unloads an adapter no request holds.
    pub fn unload(&mut self, req: UnloadLoraRequest) -> Result<(), ApiError> {
        let name = req
            .lora_name
            .filter(|n| !n.is_empty())
            .ok_or_else(|| ApiError::invalid("lora_name", "lora_name is required."))?;
        let Some(adapter) = self.adapters.get(&name) else {
            return Err(
                ApiError::not_found(format!("The lora adapter '{name}' cannot be found."))
                    .with_param("lora_name"),
            );
        };
        let holders = Arc::strong_count(adapter) - 1;
        if holders > 0 {
            return Err(ApiError::invalid(
                "lora_name",
                format!(
                    "The lora adapter '{name}' is in use by {holders} request(s); retry when \
                     they finish."
                ),
            ));
        }
        self.adapters.remove(&name);
        Ok(())
    }

    /// How many requests hold the adapter `name` (`None`: not loaded).
    pub fn holders(&self, name: &str) -> Option<usize> {
        self.adapters
            .get(name)
            .map(|a| Arc::strong_count(a).saturating_sub(1))
    }

    /// The adapter a request's `model` names, for the request to hold while it runs.
    pub fn get(&self, name: &str) -> Option<Arc<LoraAdapter>> {
        self.adapters.get(name).cloned()
    }

    /// Loaded adapter names, sorted (for `/v1/models`, each with `parent` = the base).
    pub fn names(&self) -> Vec<String> {
        self.adapters.keys().cloned().collect()
    }

    /// Loaded adapters, sorted by name.
    pub fn adapters(&self) -> Vec<Arc<LoraAdapter>> {
        self.adapters.values().cloned().collect()
    }

    /// The base model's name (the `parent` of every adapter).
    pub fn base_name(&self) -> &str {
        &self.base_name
    }
}

/// Reads an adapter at `path` for `base`, as an [`ApiError`] the endpoint can return: a
/// path with nothing there is a 404 (as vLLM), any other problem a 400 naming it.
pub fn read_adapter(
    name: &str,
    path: &str,
    base: &ModelConfig,
    max_rank: usize,
) -> Result<LoraAdapter, ApiError> {
    LoraAdapter::load(name, Path::new(path), base, max_rank).map_err(|e| match e {
        LoraError::NotFound(_) => {
            ApiError::not_found(format!("Cannot load '{name}': {e}")).with_param("lora_path")
        }
        other => ApiError::invalid("lora_path", format!("Cannot load '{name}': {other}")),
    })
}

#[cfg(test)]
mod tests {
    use super::super::adapter::tests::{tiny_base, tmp, write_adapter};
    use super::*;

    fn load(r: &mut LoraRegistry, name: &str, path: &Path) -> Result<Arc<LoraAdapter>, ApiError> {
        r.load(LoadLoraRequest {
            lora_name: Some(name.into()),
            lora_path: Some(path.to_string_lossy().into_owned()),
        })
    }

    #[test]
    fn load_unload_follow_vllms_errors() {
        let dir = tmp("registry");
        write_adapter(&dir, 2, false);
        let mut r = LoraRegistry::new(tiny_base(), "base", 8, 2);
        let err = r.load(LoadLoraRequest::default()).unwrap_err();
        assert_eq!((err.status, err.param.as_deref()), (400, Some("lora_name")));
        let err = r
            .load(LoadLoraRequest {
                lora_name: Some("a".into()),
                lora_path: None,
            })
            .unwrap_err();
        assert_eq!((err.status, err.param.as_deref()), (400, Some("lora_path")));
        load(&mut r, "a", &dir).unwrap();
        let err = load(&mut r, "a", &dir).unwrap_err();
        assert_eq!(err.status, 400);
        assert!(
            err.message.contains("already been loaded"),
            "{}",
            err.message
        );
        assert_eq!(load(&mut r, "base", &dir).unwrap_err().status, 400);
        let err = load(&mut r, "b", &tmp("missing")).unwrap_err();
        assert_eq!(err.status, 404, "{}", err.message);
        // Corrupt or mismatched: 400 naming the problem, and the registry is unchanged.
        let mut wide = tiny_base();
        wide.hidden = 16;
        let mut r2 = LoraRegistry::new(wide, "base", 8, 4);
        let err = load(&mut r2, "a", &dir).unwrap_err();
        assert_eq!(err.status, 400);
        assert!(err.message.contains("shape"), "{}", err.message);
        assert!(r2.names().is_empty());

        load(&mut r, "b", &dir).unwrap();
        let err = load(&mut r, "c", &dir).unwrap_err();
        assert!(err.message.contains("max-cpu-loras"), "{}", err.message);
        assert_eq!(r.names(), vec!["a".to_string(), "b".to_string()]);

        // In use: refused; once the request lets go, unloaded.
        let held = r.get("a").unwrap();
        let err = r
            .unload(UnloadLoraRequest {
                lora_name: Some("a".into()),
            })
            .unwrap_err();
        assert!(err.message.contains("in use by 1"), "{}", err.message);
        drop(held);
        r.unload(UnloadLoraRequest {
            lora_name: Some("a".into()),
        })
        .unwrap();
        let err = r
            .unload(UnloadLoraRequest {
                lora_name: Some("a".into()),
            })
            .unwrap_err();
        assert_eq!(err.status, 404);
        assert!(r.get("a").is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
