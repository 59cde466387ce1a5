//! One pool per model in `strata up`: the `models:` list of `strata.yaml`, checked at
//! startup, and what the front needs at run time to tell pools apart.
//!
//! Each entry is a model (a cache name or a GGUF path) served under one name, with a fixed
//! replica count or `autoscale` bounds (`minReplicas: 0` scales it to zero when idle),
//! its own engine flags and LoRA adapters. Without `models:` the top-level `model`,
//! `replicas` and `autoscale` keys make the one pool, as before.
//!
//! All pools share one router: every replica is registered under its pool's served name
//! with the pool's adapters as its LoRA list, so the router's model filter keeps each
//! request on the pool that serves its `model`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicU32;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use strata_controller::autoscale::AutoscaleConfig;
use strata_router::Router;

/// Most entries `models:` may hold.
pub const MAX_POOLS: usize = 16;
/// Most replicas one pool may run.
pub const MAX_REPLICAS: u32 = 64;

/// A LoRA adapter served on top of a pool's model: `--lora-modules name=path`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterEntry {
    /// The name clients send as `model`.
    pub name: String,
    /// The adapter's folder or file, as the engine loads it.
    pub path: PathBuf,
}

/// One entry of `models:`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// A model name from the cache (pulled when missing), a GGUF path, or a model
    /// directory (`config.json`, `model.safetensors`, `tokenizer.json`): a sentence
    /// encoder, a cross-encoder (reranker) or a classifier, served like the embedding model.
    pub model: String,
    /// The name clients send; absent: the cache name, the file's stem or the directory's
    /// name.
    #[serde(default)]
    pub name: Option<String>,
    /// A fixed replica count (the default is 1 when `autoscale` is absent too).
    #[serde(default)]
    pub replicas: Option<u32>,
    /// Autoscaling bounds and targets (the controller's camelCase keys).
    #[serde(default)]
    pub autoscale: Option<AutoscaleConfig>,
    /// `strata engine` flags for this pool's replicas (after the top-level `engine_args`).
    #[serde(default)]
    pub engine_args: Vec<String>,
    /// KV-cache bytes per replica; absent: the top-level `kv_cache_memory`.
    #[serde(default)]
    pub kv_cache_memory: Option<u64>,
    /// LoRA adapters, passed as `--enable-lora --lora-modules name=path ...`.
    #[serde(default)]
    pub adapters: Vec<AdapterEntry>,
}

/// A pool as it runs: every default resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolSpec {
    /// The served name.
    pub name: String,
    /// What each replica loads (`{model}` in the engine command; the endpoint group).
    pub model: String,
    pub autoscale: AutoscaleConfig,
    /// Every engine flag for this pool (the stack-wide ones first).
    pub engine_args: Vec<String>,
    pub kv_cache_memory: u64,
    pub adapters: Vec<AdapterEntry>,
    /// Disaggregated serving: the replicas' role (`prefill` or `decode`), registered with
    /// the router as their `role` label; `None` for a colocated pool.
    pub role: Option<String>,
}

impl PoolSpec {
    /// Whether the replicas are mock engines (`--mock`): nothing to pull.
    pub fn mock(&self) -> bool {
        self.engine_args.iter().any(|a| a == "--mock")
    }

    pub fn adapter_names(&self) -> Vec<String> {
        self.adapters.iter().map(|a| a.name.clone()).collect()
    }

    /// A short label, safe as a folder name (for per-pool log folders).
    pub fn slug(&self) -> String {
        self.name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' {
                    c
                } else {
                    '_'
                }
            })
            .collect()
    }
}

/// The name clients send for `model`: the cache name, a GGUF file's stem, or a model
/// directory's name.
pub fn served_name_of(model: &str) -> String {
    let p = std::path::Path::new(model);
    if p.extension().is_some_and(|e| e == "gguf") {
        if let Some(stem) = p.file_stem() {
            return stem.to_string_lossy().into_owned();
        }
    }
    if is_model_dir(p) {
        if let Some(name) = p.file_name() {
            return name.to_string_lossy().into_owned();
        }
    }
    model.to_string()
}

/// A Hugging Face model directory (what an encoder, cross-encoder or classifier is): it
/// holds a `config.json`. Nothing to pull.
pub fn is_model_dir(p: &std::path::Path) -> bool {
    p.join("config.json").is_file()
}

/// A `models:` list that cannot run; the message names the entry and the key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("models[{index}].{key}: {message}")]
pub struct PoolConfigError {
    pub index: usize,
    pub key: String,
    pub message: String,
}

fn bad(index: usize, key: &str, message: impl Into<String>) -> PoolConfigError {
    PoolConfigError {
        index,
        key: key.to_string(),
        message: message.into(),
    }
}

/// Resolves and checks `models:` (stack-wide `engine_args` and `kv_cache_memory` as
/// defaults). Names (models and adapters together) must be unique: a request's `model`
/// has to pick exactly one pool.
pub fn resolve(
    entries: &[ModelEntry],
    stack_engine_args: &[String],
    stack_kv_cache_memory: u64,
) -> Result<Vec<PoolSpec>, PoolConfigError> {
    if entries.len() > MAX_POOLS {
        return Err(bad(
            MAX_POOLS,
            "model",
            format!("at most {MAX_POOLS} models, not {}", entries.len()),
        ));
    }
    let mut names = Names::default();
    let mut out = Vec::with_capacity(entries.len());
    for (i, e) in entries.iter().enumerate() {
        if e.model.trim().is_empty() {
            return Err(bad(
                i,
                "model",
                "must name a model (a cache name or a GGUF path)",
            ));
        }
        let name = served_name(i, e)?;
        names.claim(i, "name", &name)?;
        let autoscale = autoscale_of(i, e)?;
        let kv = e.kv_cache_memory.unwrap_or(stack_kv_cache_memory);
        if kv < 1 << 20 {
            return Err(bad(i, "kv_cache_memory", "must be at least 1 MiB"));
        }
        check_adapters(i, e, &mut names)?;
        let mut engine_args = stack_engine_args.to_vec();
        engine_args.extend(e.engine_args.iter().cloned());
        out.push(PoolSpec {
            name,
            model: e.model.clone(),
            autoscale,
            engine_args,
            kv_cache_memory: kv,
            adapters: e.adapters.clone(),
            role: None,
        });
    }
    Ok(out)
}

/// The names requests pick pools by, each with the key that first claimed it.
#[derive(Default)]
struct Names(HashMap<String, String>);

impl Names {
    /// Claims `name` for `models[index].key`; a name already claimed is an error naming
    /// who has it.
    fn claim(&mut self, index: usize, key: &str, name: &str) -> Result<(), PoolConfigError> {
        let here = format!("models[{index}].{key}");
        match self.0.get(name) {
            Some(first) => Err(bad(
                index,
                key,
                format!("the name `{name}` is already used by {first}"),
            )),
            None => {
                self.0.insert(name.to_string(), here);
                Ok(())
            }
        }
    }
}

/// The `index`th entry's served name: its `name`, or the cache name or file stem.
fn served_name(index: usize, e: &ModelEntry) -> Result<String, PoolConfigError> {
    let name = match &e.name {
        Some(n) => n.clone(),
        None => served_name_of(&e.model),
    };
    if name.trim().is_empty() || name.len() > 256 {
        return Err(bad(index, "name", "must be 1..=256 characters"));
    }
    Ok(name)
}

/// The `index`th entry's autoscaling: `replicas` pinned, or `autoscale` checked (one of
/// the two at most; neither is one replica).
fn autoscale_of(index: usize, e: &ModelEntry) -> Result<AutoscaleConfig, PoolConfigError> {
    match (&e.replicas, &e.autoscale) {
        (Some(_), Some(_)) => Err(bad(
            index,
            "replicas",
            "set `replicas` or `autoscale`, not both",
        )),
        (Some(n), None) => {
            if !(1..=MAX_REPLICAS).contains(n) {
                return Err(bad(
                    index,
                    "replicas",
                    format!("must be 1..={MAX_REPLICAS}, not {n} (use autoscale with minReplicas: 0 to scale to zero)"),
                ));
            }
            Ok(pinned(*n))
        }
        (None, Some(a)) => {
            a.validate()
                .map_err(|err| bad(index, "autoscale", err.to_string()))?;
            if a.max_replicas > MAX_REPLICAS {
                return Err(bad(
                    index,
                    "autoscale",
                    format!("maxReplicas must be at most {MAX_REPLICAS}"),
                ));
            }
            Ok(a.clone())
        }
        (None, None) => Ok(pinned(1)),
    }
}

/// The `index`th entry's adapters: each named (without `=`, which `--lora-modules`
/// splits on) and with a path, and each name claimed.
fn check_adapters(index: usize, e: &ModelEntry, names: &mut Names) -> Result<(), PoolConfigError> {
    for (j, a) in e.adapters.iter().enumerate() {
        let key = format!("adapters[{j}]");
        if a.name.trim().is_empty() || a.name.contains('=') {
            return Err(bad(index, &key, "name must be non-empty and without `=`"));
        }
        if a.path.as_os_str().is_empty() {
            return Err(bad(index, &key, "path must not be empty"));
        }
        names.claim(index, &key, &a.name)?;
    }
    Ok(())
}

/// `replicas: n`: a fixed count, no spares.
pub fn pinned(n: u32) -> AutoscaleConfig {
    AutoscaleConfig {
        min_replicas: n,
        max_replicas: n,
        warm_spares: 0,
        ..AutoscaleConfig::default()
    }
}

/// What the front knows of one pool.
#[derive(Debug, Clone)]
pub struct PoolRoute {
    pub name: String,
    pub model: String,
    pub adapters: Vec<AdapterEntry>,
    /// Requests waiting for this pool's first ready replica (its activation signal).
    pub held: Arc<AtomicU32>,
    /// `Retry-After` of the 503 a request gets when the pool is still cold after the hold.
    pub retry_after_secs: u64,
}

impl PoolRoute {
    /// Whether `model` (a request's) is this pool's model or one of its adapters.
    pub fn serves(&self, model: &str) -> bool {
        self.name == model || self.adapters.iter().any(|a| a.name == model)
    }

    /// Whether the router has a ready, non-draining replica of this pool.
    pub fn ready(&self, router: &Router) -> bool {
        router
            .status()
            .iter()
            .any(|s| s.ready && !s.draining && s.spec.model.as_deref() == Some(&self.name))
    }
}

/// Every pool, in `models:` order.
#[derive(Debug, Clone, Default)]
pub struct PoolSet(pub Vec<PoolRoute>);

impl PoolSet {
    /// The pool a request's `model` belongs to.
    pub fn find(&self, model: &str) -> Option<&PoolRoute> {
        self.0.iter().find(|p| p.serves(model))
    }

    /// Every name a client may send: models, then their adapters.
    pub fn names(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in &self.0 {
            out.push(p.name.clone());
            out.extend(p.adapters.iter().map(|a| a.name.clone()));
        }
        out
    }

    /// `/v1/models`: what the replicas answered (`listed`, merged by the router), then an
    /// entry for every configured model and adapter missing from it, such as a pool scaled
    /// to zero. Adapters carry their pool's name as `parent`, as vLLM lists them.
    pub fn models_list(&self, listed: Vec<serde_json::Value>, created: u64) -> serde_json::Value {
        let mut data = listed;
        let has = |data: &[serde_json::Value], id: &str| {
            data.iter()
                .any(|m| m.get("id").and_then(|v| v.as_str()) == Some(id))
        };
        for p in &self.0 {
            if !has(&data, &p.name) {
                data.push(serde_json::json!({
                    "id": p.name, "object": "model", "created": created,
                    "owned_by": "strata", "root": p.model, "parent": null,
                }));
            }
            for a in &p.adapters {
                if !has(&data, &a.name) {
                    data.push(serde_json::json!({
                        "id": a.name, "object": "model", "created": created,
                        "owned_by": "strata", "root": a.path.to_string_lossy(),
                        "parent": p.name,
                    }));
                }
            }
        }
        serde_json::json!({"object": "list", "data": data})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(yaml: &str) -> Vec<ModelEntry> {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn entries_resolve_with_stack_defaults() {
        let e = entries(
            "- model: smollm2-135m-instruct\n  replicas: 2\n  adapters: [{name: a, path: /x/a}]\n\
             - model: /m/all-minilm.gguf\n  autoscale: {minReplicas: 0, maxReplicas: 3}\n  \
               engine_args: [--max-num-seqs, '8']\n  kv_cache_memory: 2097152\n",
        );
        let p = resolve(&e, &["--mock".into()], 4 << 20).unwrap();
        assert_eq!(p[0].name, "smollm2-135m-instruct");
        assert_eq!(
            (p[0].autoscale.min_replicas, p[0].autoscale.max_replicas),
            (2, 2)
        );
        assert_eq!(p[0].kv_cache_memory, 4 << 20);
        assert_eq!(p[0].adapter_names(), ["a"]);
        assert_eq!(p[1].name, "all-minilm");
        assert_eq!(
            (p[1].autoscale.min_replicas, p[1].autoscale.max_replicas),
            (0, 3)
        );
        assert_eq!(p[1].engine_args, ["--mock", "--max-num-seqs", "8"]);
        assert_eq!(p[1].kv_cache_memory, 2 << 20);
        assert!(p[1].mock());
        // Neither replicas nor autoscale: one replica.
        let p = resolve(&entries("- model: m\n"), &[], 1 << 20).unwrap();
        assert_eq!(p[0].autoscale.max_replicas, 1);
        assert_eq!(p[0].slug(), "m");
    }

    #[test]
    fn a_model_directory_is_an_entry_named_after_it() {
        // A reranker (cross-encoder) and a classifier: model directories, not cache names.
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/tiny-bert");
        let (rerank, classify) = (root.join("cross-encoder"), root.join("classifier"));
        let yaml = format!(
            "- model: {}\n- model: {}\n  name: guard\n  replicas: 2\n",
            rerank.display(),
            classify.display()
        );
        let p = resolve(&entries(&yaml), &[], 1 << 20).unwrap();
        assert_eq!(p[0].name, "cross-encoder");
        assert_eq!(p[0].model, rerank.display().to_string());
        assert_eq!(
            (p[1].name.as_str(), p[1].autoscale.max_replicas),
            ("guard", 2)
        );
        assert!(is_model_dir(&rerank));
        assert_eq!(served_name_of("/no/such/dir"), "/no/such/dir");
    }

    #[test]
    fn bad_entries_name_their_key() {
        let err = |yaml: &str| {
            resolve(&entries(yaml), &[], 1 << 20)
                .unwrap_err()
                .to_string()
        };
        let e = err("- model: a\n- model: b\n  name: a\n");
        assert!(e.contains("models[1].name") && e.contains("`a`"), "{e}");
        let e = err("- model: a\n  adapters: [{name: x, path: p}]\n- model: x\n");
        assert!(
            e.contains("models[1].name") && e.contains("models[0].adapters[0]"),
            "{e}"
        );
        let e = err("- model: ''\n");
        assert!(e.contains("models[0].model"), "{e}");
        let e = err("- model: a\n  autoscale: {minReplicas: 3, maxReplicas: 1}\n");
        assert!(
            e.contains("models[0].autoscale") && e.contains("minReplicas"),
            "{e}"
        );
        let e = err("- model: a\n  replicas: 0\n");
        assert!(e.contains("models[0].replicas"), "{e}");
        let e = err("- model: a\n  replicas: 1\n  autoscale: {maxReplicas: 2}\n");
        assert!(e.contains("not both"), "{e}");
        let e = err("- model: a\n  adapters: [{name: '', path: p}]\n");
        assert!(e.contains("adapters[0]"), "{e}");
        let e = err("- model: a\n  kv_cache_memory: 10\n");
        assert!(e.contains("kv_cache_memory"), "{e}");
        // A missing `model` key and an unknown key are refused by the parser.
        let e = serde_yaml::from_str::<Vec<ModelEntry>>("- name: a\n").unwrap_err();
        assert!(e.to_string().contains("missing field `model`"), "{e}");
        let e = serde_yaml::from_str::<Vec<ModelEntry>>("- model: a\n  replica: 2\n").unwrap_err();
        assert!(e.to_string().contains("replica"), "{e}");
    }

    #[test]
    fn requests_find_their_pool_and_models_lists_every_name() {
        let pool = |name: &str, adapters: &[&str]| PoolRoute {
            name: name.into(),
            model: format!("file-{name}"),
            adapters: adapters
                .iter()
                .map(|a| AdapterEntry {
                    name: a.to_string(),
                    path: PathBuf::from(format!("/ad/{a}")),
                })
                .collect(),
            held: Arc::default(),
            retry_after_secs: 1,
        };
        let set = PoolSet(vec![pool("chat", &["sql", "poem"]), pool("embed", &[])]);
        assert_eq!(set.find("poem").unwrap().name, "chat");
        assert_eq!(set.find("embed").unwrap().name, "embed");
        assert!(set.find("other").is_none());
        assert_eq!(set.names(), ["chat", "sql", "poem", "embed"]);
        // The replicas listed `chat` (with its real metadata); the rest is filled in.
        let listed = vec![serde_json::json!({"id": "chat", "max_model_len": 2048})];
        let v = set.models_list(listed, 7);
        let data = v["data"].as_array().unwrap();
        let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["chat", "sql", "poem", "embed"]);
        assert_eq!(data[0]["max_model_len"], 2048);
        assert_eq!(data[1]["parent"], "chat");
        assert_eq!(data[1]["root"], "/ad/sql");
        assert!(data[3]["parent"].is_null());
        assert_eq!(v["object"], "list");
    }
}
