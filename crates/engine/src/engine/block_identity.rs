//! What makes a KV block the same block elsewhere. Two things name it: this engine's
//! [`BlockSpec`] (the model identity, with the weights' digest, and the block layout),
//! which decides which engines and tiers may exchange blocks at all; and the prefix-cache
//! hash (PROTOCOLS §3: parent, tokens, adapter, salt), which decides which block it is.

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::kv::block_pool::HashKey;
use crate::kv::hashing::{block_extra_keys, BlockHash, BlockHasher};
use crate::kv::transfer::BlockSpec;
use crate::model::Llama;
use crate::options::EngineOptions;
use crate::planner::{BlockHashFn, LoraBlockHashFn};

/// The block spec of an engine, its model identity computed on first use (digesting the
/// weights takes a while, and only engines that exchange blocks need it).
pub(super) struct BlockSpecCell {
    dims: BlockSpec,
    arch: String,
    weights_path: Option<PathBuf>,
    spec: OnceLock<BlockSpec>,
}

impl BlockSpecCell {
    /// The spec of `model`'s blocks under `opts`; its identity digests the weights at
    /// `opts.model_path` (none given: the identity is unique to this process, and no other
    /// engine accepts its blocks).
    pub(super) fn new(model: &Llama, opts: &EngineOptions) -> Self {
        let dtype = opts.kv_dtype(model);
        Self {
            dims: BlockSpec {
                model: String::new(),
                block_size: u32::try_from(opts.block_size).unwrap_or(u32::MAX),
                n_layer: u32::try_from(model.config.n_layer).unwrap_or(u32::MAX),
                slot_width: u32::try_from(model.kv_slot_width()).unwrap_or(u32::MAX),
                dtype,
                scales_per_slot: if dtype.is_scaled() {
                    u32::try_from(model.config.n_kv_head).unwrap_or(u32::MAX)
                } else {
                    0
                },
            },
            arch: arch_identity(model),
            weights_path: (!opts.model_path.as_os_str().is_empty())
                .then(|| opts.model_path.clone()),
            spec: OnceLock::new(),
        }
    }

    pub(super) fn get(&self) -> BlockSpec {
        self.spec
            .get_or_init(|| {
                let weights = match &self.weights_path {
                    Some(p) => match weights_digest(p) {
                        Ok(d) => format!("sha256:{d}"),
                        Err(e) => {
                            tracing::warn!(path = %p.display(), error = %e,
                                "cannot digest the weights; this engine's KV blocks are its own");
                            unique_identity()
                        }
                    },
                    None => unique_identity(),
                };
                BlockSpec {
                    model: format!("{};{weights}", self.arch),
                    ..self.dims.clone()
                }
            })
            .clone()
    }
}

/// A model identity no other engine has (its blocks are never accepted elsewhere).
fn unique_identity() -> String {
    use rand::RngCore;
    format!(
        "unique:{}:{:016x}",
        std::process::id(),
        rand::rng().next_u64()
    )
}

/// The SHA-256 of a weights file, hex.
pub fn weights_digest(path: &std::path::Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex::encode(h.finalize()))
}

/// The architecture part of a model identity: every dimension that shapes the KV, and
/// the weight format the numbers are computed in.
fn arch_identity(model: &Llama) -> String {
    let c = &model.config;
    format!(
        "{}:l{}:d{}:f{}:h{}:kv{}x{}:v{}:rope{}:{}",
        model.architecture(),
        c.n_layer,
        c.hidden,
        c.ffn_hidden,
        c.n_head,
        c.n_kv_head,
        c.head_dim,
        c.vocab_size,
        c.rope_theta,
        model.format
    )
}

/// The prefix-cache hashes of the full blocks of `tokens`, exactly as the planner names
/// them: chained, with the adapter's name on every block and the salt on the first.
pub fn prompt_block_hashes(
    hasher: &BlockHasher,
    tokens: &[u32],
    salt: Option<&str>,
    lora: Option<&str>,
) -> Vec<HashKey> {
    hasher
        .hash_sequence(tokens, lora, salt)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

/// The block hash of a sequence with a LoRA adapter: the adapter's name is an extra key of
/// every block, ahead of the salt (PROTOCOLS §3).
pub(super) fn lora_block_hash_fn(seed: &str, block_size: usize) -> LoraBlockHashFn {
    let hasher = BlockHasher::new(seed, block_size);
    Box::new(move |parent, tokens, lora, salt| {
        let parent = parent.map(|p| BlockHash(*p));
        let extra = block_extra_keys(0, Some(lora), salt);
        hasher
            .hash_block(parent.as_ref(), tokens, extra.as_deref())
            .0
    })
}

/// The prefix-cache block hash (PROTOCOLS §3) as the planner calls it.
pub(super) fn block_hash_fn(seed: &str, block_size: usize) -> BlockHashFn {
    let hasher = BlockHasher::new(seed, block_size);
    Box::new(move |parent, tokens, salt| {
        let parent = parent.map(|p| BlockHash(*p));
        // The planner passes the salt for the first block only.
        let extra = block_extra_keys(0, None, salt);
        let extra = extra.as_deref();
        hasher.hash_block(parent.as_ref(), tokens, extra).0
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_support::{seq, SEED};
    use super::*;
    use crate::kv::block_pool::PoolEvent;
    use crate::kv::cache::KvDtype;
    use crate::planner::{Policy, StepPlanner};
    use std::collections::HashSet;
    use std::sync::Arc;

    #[test]
    fn the_handles_block_hashes_are_the_planners_names_with_salt_and_adapter() {
        use crate::lora::adapter::tests::{tiny_base, tmp, write_adapter};
        let bs = 4;
        let dir = tmp("engine-hashes");
        write_adapter(&dir, 2, false);
        let mut adapter =
            crate::lora::LoraAdapter::load_peft("sql", &dir, &tiny_base(), 8).unwrap();
        adapter.id = 3;
        let adapter = Arc::new(adapter);
        let hasher = BlockHasher::new(SEED, bs);
        let prompt: Vec<u32> = (20..33).collect(); // 3 full blocks
        let cases: [(Option<&str>, bool); 4] = [
            (None, false),
            (Some("salt"), false),
            (None, true),
            (Some("salt"), true),
        ];
        let mut seen = HashSet::new();
        for (salt, with_lora) in cases {
            let mut planner = StepPlanner::new(
                &EngineOptions {
                    block_size: bs,
                    max_num_seqs: 4,
                    max_num_batched_tokens: 64,
                    policy: Policy::Fcfs,
                    step_time_budget: None,
                    ..EngineOptions::default()
                },
                16,
                Some(block_hash_fn(SEED, bs)),
            );
            planner.set_lora_hash(lora_block_hash_fn(SEED, bs));
            let mut s = seq(prompt.clone());
            s.cache_salt = salt.map(str::to_string);
            s.lora = with_lora.then(|| adapter.clone());
            planner.add(s);
            let plan = planner.plan();
            let q = planner.seq_mut(plan.work[0].id);
            q.num_computed = q.tokens.len();
            planner.commit_full_blocks();
            let committed: Vec<HashKey> = planner
                .drain_kv_events()
                .filter_map(|e| match e {
                    PoolEvent::Stored { hash, .. } => Some(hash),
                    _ => None,
                })
                .collect();
            let ours = prompt_block_hashes(&hasher, &prompt, salt, with_lora.then_some("sql"));
            assert_eq!(committed, ours, "salt {salt:?}, lora {with_lora}");
            assert_eq!(ours.len(), 3);
            assert!(seen.insert(ours[0]), "each naming differs");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_model_identity_follows_the_weights_bytes() {
        let dir = std::env::temp_dir().join(format!("strata-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b, c) = (dir.join("a"), dir.join("b"), dir.join("c"));
        std::fs::write(&a, b"weights one").unwrap();
        std::fs::write(&b, b"weights two").unwrap();
        std::fs::write(&c, b"weights one").unwrap();
        let cell = |path: Option<PathBuf>| BlockSpecCell {
            dims: BlockSpec {
                model: String::new(),
                block_size: 16,
                n_layer: 2,
                slot_width: 8,
                dtype: KvDtype::F16,
                scales_per_slot: 0,
            },
            arch: "llama:test".into(),
            weights_path: path,
            spec: OnceLock::new(),
        };
        let spec_a = cell(Some(a.clone())).get();
        assert_eq!(spec_a.block_size, 16);
        assert!(
            spec_a.model.starts_with("llama:test;sha256:"),
            "{}",
            spec_a.model
        );
        // Same bytes at another path: the same model; other bytes: another model.
        assert_eq!(cell(Some(c)).get(), spec_a);
        assert_ne!(cell(Some(b)).get().model, spec_a.model);
        // Computed once: a cell keeps its identity even if the file changes later.
        let once = cell(Some(a.clone()));
        let first = once.get();
        std::fs::write(&a, b"changed").unwrap();
        assert_eq!(once.get(), first);
        // Without readable weights, every engine is a model of its own.
        let missing = cell(Some(dir.join("missing"))).get();
        assert_ne!(missing.model, cell(Some(dir.join("missing"))).get().model);
        assert_ne!(cell(None).get().model, cell(None).get().model);
        assert!(missing.validate().is_ok());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
