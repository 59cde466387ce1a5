//! Block hashes of token ids, the way a vLLM-compatible engine names its cached blocks
//! (PROTOCOLS §3, `sha256_cbor` mode), so the router can look a request's blocks up in the
//! precise index built from KV events. The hashing itself is
//! [`strata_api::block_hash`], the same code the engine names its blocks with; this adapter
//! gives the router the two forms it uses: full digests, and the wire `u64` that KV events
//! carry (the digest's last 8 bytes, big-endian).

use strata_api::block_hash::{self, BlockHash};

pub use strata_api::block_hash::DEFAULT_HASH_SEED;

/// Chained block hashing for one seed and block size.
#[derive(Debug, Clone)]
pub struct BlockHasher(block_hash::BlockHasher);

impl BlockHasher {
    pub fn new(seed: &str, block_size: usize) -> Self {
        BlockHasher(block_hash::BlockHasher::new(seed, block_size))
    }

    pub fn block_size(&self) -> usize {
        self.0.block_size()
    }

    /// The full 32-byte digests of every full block of `tokens`.
    pub fn digests(&self, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<[u8; 32]> {
        self.0
            .hash_sequence(tokens, lora, salt)
            .into_iter()
            .map(|h| h.0)
            .collect()
    }

    /// The wire (`u64`) hashes of every full block of `tokens`.
    pub fn hash_tokens(&self, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
        self.0
            .hash_sequence(tokens, lora, salt)
            .iter()
            .map(BlockHash::to_u64)
            .collect()
    }
}

/// The wire form of a digest: its last 8 bytes, big-endian.
pub fn to_u64(digest: &[u8; 32]) -> u64 {
    BlockHash(*digest).to_u64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    struct Fixture {
        cases: Vec<Case>,
    }
    #[derive(Deserialize)]
    struct Case {
        name: String,
        seed: String,
        block_size: usize,
        tokens: Vec<u32>,
        lora_name: Option<String>,
        cache_salt: Option<String>,
        none_hash: String,
        hashes: Vec<Expected>,
    }
    #[derive(Deserialize)]
    struct Expected {
        hex: String,
        u64: u64,
    }

    fn hex(d: &[u8]) -> String {
        d.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn matches_the_engine_fixture() {
        let text = include_str!("../../../engine/tests/fixtures/block_hashes.json");
        let fixture: Fixture = serde_json::from_str(text).unwrap();
        let mut checked = 0;
        for case in &fixture.cases {
            let h = BlockHasher::new(&case.seed, case.block_size);
            assert_eq!(hex(&h.0.none_hash().0), case.none_hash, "{}", case.name);
            let lora = case.lora_name.as_deref();
            let salt = case.cache_salt.as_deref();
            let digests = h.digests(&case.tokens, lora, salt);
            let wire = h.hash_tokens(&case.tokens, lora, salt);
            assert_eq!(digests.len(), case.hashes.len(), "{}", case.name);
            for ((d, w), want) in digests.iter().zip(&wire).zip(&case.hashes) {
                assert_eq!(hex(d), want.hex, "{}", case.name);
                assert_eq!(*w, want.u64, "{}", case.name);
                checked += 1;
            }
        }
        assert!(checked >= 30, "only {checked} hashes checked");
    }

    #[test]
    fn block_size_zero_hashes_nothing() {
        assert!(BlockHasher::new("s", 0)
            .hash_tokens(&[1, 2], None, None)
            .is_empty());
    }
}
