//! Block hashes of token ids, the way a vLLM-compatible engine names its cached blocks
//! (PROTOCOLS §3, `sha256_cbor` mode), so the router can look a request's blocks up in the
//! precise index built from KV events.
//!
//! `hash(block) = SHA-256(cbor([parent digest or NONE_HASH, [token ids], extra keys or
//! null]))`, `NONE_HASH = SHA-256(cbor(seed as text))`; extra keys are the LoRA name on
//! every block and the `cache_salt` on the first block (when non-empty). Only full blocks
//! are hashed. Events carry a hash as the digest's last 8 bytes read big-endian, so that is
//! what [`BlockHasher::hash_tokens`] returns. Checked against the engine's fixture
//! (`crates/engine/tests/fixtures/block_hashes.json`, generated with vLLM's own code).

use sha2::{Digest, Sha256};

/// vLLM's default seed when `PYTHONHASHSEED` is unset (the engine's default too).
pub const DEFAULT_HASH_SEED: &str = "vllm-none-hash";

/// Chained block hashing for one seed and block size.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    none_hash: [u8; 32],
    block_size: usize,
}

impl BlockHasher {
    pub fn new(seed: &str, block_size: usize) -> Self {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        head(&mut buf, 3, seed.len() as u64);
        buf.extend_from_slice(seed.as_bytes());
        BlockHasher {
            none_hash: Sha256::digest(&buf).into(),
            block_size,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The full 32-byte digests of every full block of `tokens`.
    pub fn digests(&self, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<[u8; 32]> {
        if self.block_size == 0 {
            return Vec::new();
        }
        let salt = salt.filter(|s| !s.is_empty());
        let mut out: Vec<[u8; 32]> = Vec::with_capacity(tokens.len() / self.block_size);
        let mut buf = Vec::with_capacity(48 + self.block_size * 5);
        for (i, block) in tokens.chunks_exact(self.block_size).enumerate() {
            buf.clear();
            head(&mut buf, 4, 3);
            let parent = out.last().unwrap_or(&self.none_hash);
            head(&mut buf, 2, 32);
            buf.extend_from_slice(parent);
            head(&mut buf, 4, block.len() as u64);
            for &t in block {
                head(&mut buf, 0, u64::from(t));
            }
            let keys: Vec<&str> = lora.into_iter().chain(salt.filter(|_| i == 0)).collect();
            if keys.is_empty() {
                buf.push(0xF6);
            } else {
                head(&mut buf, 4, keys.len() as u64);
                for k in keys {
                    head(&mut buf, 3, k.len() as u64);
                    buf.extend_from_slice(k.as_bytes());
                }
            }
            out.push(Sha256::digest(&buf).into());
        }
        out
    }

    /// The wire (`u64`) hashes of every full block of `tokens`.
    pub fn hash_tokens(&self, tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<u64> {
        self.digests(tokens, lora, salt)
            .iter()
            .map(to_u64)
            .collect()
    }
}

/// The wire form of a digest: its last 8 bytes, big-endian.
pub fn to_u64(digest: &[u8; 32]) -> u64 {
    let mut tail = [0u8; 8];
    tail.copy_from_slice(&digest[24..]);
    u64::from_be_bytes(tail)
}

/// A CBOR item head, shortest form.
fn head(buf: &mut Vec<u8>, major: u8, v: u64) {
    let m = major << 5;
    match v {
        0..=23 => buf.push(m | v as u8),
        24..=0xFF => buf.extend_from_slice(&[m | 24, v as u8]),
        0x100..=0xFFFF => {
            buf.push(m | 25);
            buf.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xFFFF_FFFF => {
            buf.push(m | 26);
            buf.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            buf.push(m | 27);
            buf.extend_from_slice(&v.to_be_bytes());
        }
    }
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
            assert_eq!(hex(&h.none_hash), case.none_hash, "{}", case.name);
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
    fn cbor_heads_are_shortest() {
        for (v, want) in [
            (23u64, vec![0x17]),
            (24, vec![0x18, 24]),
            (256, vec![0x19, 1, 0]),
            (65_536, vec![0x1A, 0, 1, 0, 0]),
            (1 << 32, vec![0x1B, 0, 0, 0, 1, 0, 0, 0, 0]),
        ] {
            let mut b = Vec::new();
            head(&mut b, 0, v);
            assert_eq!(b, want, "{v}");
        }
        assert!(BlockHasher::new("s", 0)
            .hash_tokens(&[1, 2], None, None)
            .is_empty());
    }
}
