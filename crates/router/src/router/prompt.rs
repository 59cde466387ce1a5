//! A request's prompt as the prefix indexes key it: the LoRA adapter it names, its
//! approximate-index chunk hashes, its precise-index block hashes (one chain per block
//! size in the pool) and, for those, its token ids from an engine's `/tokenize`.

use std::sync::Arc;
use std::time::Duration;

use super::pool::{names_adapter, refresh_ready};
use super::Router;
use crate::prefix::hashing::BlockHasher;
use crate::scheduling::PreciseBlocks;

impl Router {
    /// The LoRA adapter a request for `model` asks for: `model` itself when some
    /// endpoint advertises an adapter of that name (spec `lora` label, or its metrics'
    /// running/waiting adapters) and does not serve it as its base model. Such a
    /// request's blocks are hashed with the adapter name as the extra key (PROTOCOLS §3),
    /// as the engine hashes them.
    pub fn lora_adapter(&self, model: &str) -> Option<String> {
        names_adapter(&self.inner.lock_pool().cands, model).then(|| model.to_string())
    }

    /// Bytes of prompt text the approximate index hashes at most: a request's text past
    /// this never changes its keys.
    pub fn prefix_window(&self) -> usize {
        let c = &self.inner.approx_config;
        c.block_size_tokens.max(1) * 4 * c.max_blocks
    }

    /// The approximate-index chunk hashes of a prompt.
    pub fn approx_blocks(&self, model: &str, text: &str) -> Vec<u64> {
        let c = &self.inner.approx_config;
        crate::prefix::approx::hash_text(model, text, c.block_size_tokens.max(1) * 4, c.max_blocks)
    }

    /// The precise-index block hashes of token ids: one chain per block size the registered
    /// endpoints hash with (each endpoint's own, from its KV events or metrics; the
    /// configured `precise.block_size` for those that have said nothing yet).
    pub fn precise_blocks(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        salt: Option<&str>,
    ) -> PreciseBlocks {
        let default = self.inner.default_block_size();
        let mut sizes: Vec<u32> = vec![default];
        for c in &self.inner.lock_pool().cands {
            let b = c.block_size(default);
            if !sizes.contains(&b) {
                sizes.push(b);
            }
        }
        let chains = sizes
            .into_iter()
            .map(|b| {
                let hashes = if b == default {
                    self.inner.hasher.hash_tokens(tokens, lora, salt)
                } else {
                    BlockHasher::new(&self.inner.config.precise.hash_seed, b as usize)
                        .hash_tokens(tokens, lora, salt)
                };
                (b, hashes)
            })
            .collect();
        PreciseBlocks {
            default_block_size: default,
            chains,
        }
    }

    /// Token ids of a prompt from the engine's `/tokenize` (cached by `key`), or `None`
    /// when no endpoint answers in time.
    pub async fn tokenize(&self, key: u64, body: bytes::Bytes) -> Option<Arc<Vec<u32>>> {
        if let Some(t) = self.inner.lock_tokens().get(&key) {
            return Some(t.clone());
        }
        let url = {
            let now = self.now();
            let mut pool = self.inner.lock_pool();
            refresh_ready(&mut pool, now);
            pool.cands
                .iter()
                .find(|c| c.ready)
                .map(|c| c.spec.url.clone())?
        };
        let timeout = Duration::from_millis(self.inner.config.precise.tokenize_timeout_ms);
        let (status, bytes) = crate::client::fetch(
            &self.inner.client,
            hyper::Method::POST,
            &format!("{url}/tokenize"),
            Some(body),
            timeout,
            64 << 20,
        )
        .await
        .ok()?;
        if !status.is_success() {
            return None;
        }
        let resp: strata_api::TokenizeResponse = serde_json::from_slice(&bytes).ok()?;
        let tokens = Arc::new(resp.tokens);
        let mut cache = self.inner.lock_tokens();
        if cache.len() >= self.inner.config.precise.tokenize_cache {
            cache.clear();
        }
        cache.insert(key, tokens.clone());
        Some(tokens)
    }
}
