//! Prefix-cache block hashes, compatible with vLLM V1's `sha256_cbor` mode (PROTOCOLS §3).
//!
//! A full block of `block_size` tokens is identified by
//! `SHA-256(canonical_cbor((parent, tokens, extra_keys)))`, where `parent` is the previous
//! block's 32-byte hash (or `NONE_HASH` for the first block), `tokens` the block's token
//! ids and `extra_keys` either `None` or a tuple of keys that must keep otherwise equal
//! blocks apart. Hashes chain, so a block's hash stands for the whole prefix up to its end.
//!
//! What this mirrors in vLLM (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):
//!
//! - `sha256_cbor(x) = hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()`.
//!   The input is always the 3-tuple above; cbor2 encodes a tuple as a definite-length
//!   array (major type 4), `bytes` as a byte string (major 2), a non-negative int as
//!   major 0, a `str` as a text string (major 3, UTF-8) and `None` as `0xF6`, every
//!   length and integer in its shortest form. `canonical=True` only adds map-key sorting
//!   and float shrinking, neither of which occurs here, so [`BlockHasher`] writes these
//!   few shapes itself.
//! - `hash_block_tokens`: a missing (falsy) parent becomes `NONE_HASH`; the token list is
//!   hashed as a tuple.
//! - `init_none_hash`: `NONE_HASH = sha256_cbor(seed)` where `seed` is the *string*
//!   (`os.getenv` returns `str`, so the CBOR input is a text string, never bytes or an
//!   int). The seed is `PYTHONHASHSEED` when set; when unset, current vLLM (since
//!   vllm-project/vllm#51875) uses the fixed `DEFAULT_NONE_HASH_SEED = "vllm-none-hash"` for
//!   the cryptographic algorithms (`sha256`, `sha256_cbor`) and 32 random bytes (hex) for
//!   xxhash. Older vLLM used `os.urandom(32)` whenever `PYTHONHASHSEED` was unset, so with
//!   those versions hashes only match when both sides set the same seed.
//! - `generate_block_hash_extra_keys`: extra keys are, in order, the LoRA adapter's name
//!   (every block of a LoRA request), multimodal keys, the request's `cache_salt` (first
//!   block only, and only when non-empty: vLLM tests its truthiness) and prompt-embedding
//!   digests; an empty list becomes `None`. Strata serves text only, so only the LoRA name
//!   and the salt exist here ([`ExtraKey`]).
//! - `get_request_block_hasher`: only full blocks are hashed.
//! - `maybe_convert_block_hash` (KV events, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the
//!   default): the wire form is `int.from_bytes(digest, "big") & (2**64 - 1)`, i.e. the last
//!   8 bytes read big-endian ([`BlockHash::to_u64`]).
//!
//! To share hashes with a vLLM engine, start it with `--prefix-caching-hash-algo
//! sha256_cbor` (vLLM's default `sha256` pickles the tuple and cannot be reproduced outside
//! CPython), the same block size and the same seed: [`DEFAULT_HASH_SEED`] equals vLLM's
//! default, so an unconfigured Strata matches an unconfigured current vLLM. Note that
//! CPython itself only accepts `PYTHONHASHSEED` values that are `random` or an integer in
//! `0..=4294967295`, so a custom seed meant for both engines must be such an integer
//! (see [`is_pythonhashseed_compatible`]).

use sha2::{Digest, Sha256};
use std::fmt;

/// The default hash seed: vLLM's `DEFAULT_NONE_HASH_SEED`, the seed current vLLM uses for
/// `sha256_cbor` when `PYTHONHASHSEED` is unset. Fixed, so hashes survive restarts and
/// agree with any engine started with the same seed.
pub const DEFAULT_HASH_SEED: &str = "vllm-none-hash";

/// The default block size in tokens (vLLM's `CacheConfig.DEFAULT_BLOCK_SIZE`).
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// A block's 32-byte SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub [u8; 32]);

impl BlockHash {
    /// The wire form used by KV events: the digest's last 8 bytes, big-endian (vLLM's
    /// `int.from_bytes(digest, "big") & (2**64 - 1)`).
    pub fn to_u64(&self) -> u64 {
        let mut tail = [0u8; 8];
        tail.copy_from_slice(&self.0[24..]);
        u64::from_be_bytes(tail)
    }

    /// The digest as lowercase hex.
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }
}

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({})", self.to_hex())
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// One element of a block's extra keys. Both kinds are CBOR text strings on the wire; the
/// variants only say where the string came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ExtraKey {
    /// The LoRA adapter's name (`lora_request.lora_name`), on every block of the request.
    LoraName(String),
    /// The request's `cache_salt`, on the first block only.
    CacheSalt(String),
}

impl ExtraKey {
    fn as_str(&self) -> &str {
        match self {
            ExtraKey::LoraName(s) | ExtraKey::CacheSalt(s) => s,
        }
    }
}

/// The extra keys of block `block_index` of a request, in vLLM's order (LoRA name, then
/// the salt on block 0 when non-empty); `None` when there are none.
pub fn block_extra_keys(
    block_index: usize,
    lora: Option<&str>,
    cache_salt: Option<&str>,
) -> Option<Vec<ExtraKey>> {
    let mut keys = Vec::new();
    if let Some(name) = lora {
        keys.push(ExtraKey::LoraName(name.to_string()));
    }
    if block_index == 0 {
        if let Some(salt) = cache_salt.filter(|s| !s.is_empty()) {
            keys.push(ExtraKey::CacheSalt(salt.to_string()));
        }
    }
    (!keys.is_empty()).then_some(keys)
}

/// Whether a vLLM engine can be started with `seed` as `PYTHONHASHSEED`: `random` or a
/// plain decimal integer in `0..=4294967295` (CPython refuses anything else at startup; it
/// also tolerates a sign or leading whitespace, which this rejects to keep seeds canonical,
/// since vLLM hashes the variable's exact text).
pub fn is_pythonhashseed_compatible(seed: &str) -> bool {
    seed == "random"
        || (!seed.is_empty()
            && seed.bytes().all(|b| b.is_ascii_digit())
            && seed.parse::<u64>().is_ok_and(|v| v <= u64::from(u32::MAX)))
}

/// Computes chained block hashes for one seed and block size.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    none_hash: BlockHash,
    block_size: usize,
}

impl BlockHasher {
    /// A hasher whose `NONE_HASH` is `sha256_cbor(seed)` (the seed as a CBOR text string).
    /// A `block_size` of 0 hashes no blocks.
    pub fn new(seed: &str, block_size: usize) -> Self {
        let mut buf = Vec::with_capacity(seed.len() + 9);
        cbor_text(&mut buf, seed);
        BlockHasher {
            none_hash: BlockHash(Sha256::digest(&buf).into()),
            block_size,
        }
    }

    /// The parent hash of every first block: `sha256_cbor(seed)`.
    pub fn none_hash(&self) -> &BlockHash {
        &self.none_hash
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The hash of one block: SHA-256 of the canonical CBOR of
    /// `(parent or NONE_HASH, tuple(tokens), extra or None)`. The caller passes a full
    /// block; `Some(&[])` is treated as `None` (vLLM never hashes an empty tuple).
    pub fn hash_block(
        &self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: Option<&[ExtraKey]>,
    ) -> BlockHash {
        let mut buf = Vec::with_capacity(64 + tokens.len() * 5);
        self.encode_block(&mut buf, parent, tokens, extra);
        BlockHash(Sha256::digest(&buf).into())
    }

    /// The canonical CBOR that [`hash_block`](Self::hash_block) hashes (for tests and
    /// debugging).
    pub fn block_cbor(
        &self,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: Option<&[ExtraKey]>,
    ) -> Vec<u8> {
        let mut buf = Vec::new();
        self.encode_block(&mut buf, parent, tokens, extra);
        buf
    }

    /// The chained hashes of every full block of `tokens` (a trailing partial block is not
    /// hashed), with the LoRA name on every block and the salt on the first.
    pub fn hash_sequence(
        &self,
        tokens: &[u32],
        lora: Option<&str>,
        cache_salt: Option<&str>,
    ) -> Vec<BlockHash> {
        if self.block_size == 0 {
            return Vec::new();
        }
        let mut hashes: Vec<BlockHash> = Vec::with_capacity(tokens.len() / self.block_size);
        for (index, block) in tokens.chunks_exact(self.block_size).enumerate() {
            let extra = block_extra_keys(index, lora, cache_salt);
            let hash = self.hash_block(hashes.last(), block, extra.as_deref());
            hashes.push(hash);
        }
        hashes
    }

    fn encode_block(
        &self,
        buf: &mut Vec<u8>,
        parent: Option<&BlockHash>,
        tokens: &[u32],
        extra: Option<&[ExtraKey]>,
    ) {
        cbor_head(buf, MAJOR_ARRAY, 3);
        let parent = parent.unwrap_or(&self.none_hash);
        cbor_head(buf, MAJOR_BYTES, parent.0.len() as u64);
        buf.extend_from_slice(&parent.0);
        cbor_head(buf, MAJOR_ARRAY, tokens.len() as u64);
        for &t in tokens {
            cbor_head(buf, MAJOR_UINT, u64::from(t));
        }
        match extra {
            Some(keys) if !keys.is_empty() => {
                cbor_head(buf, MAJOR_ARRAY, keys.len() as u64);
                for key in keys {
                    cbor_text(buf, key.as_str());
                }
            }
            _ => buf.push(CBOR_NULL),
        }
    }
}

const MAJOR_UINT: u8 = 0;
const MAJOR_BYTES: u8 = 2;
const MAJOR_TEXT: u8 = 3;
const MAJOR_ARRAY: u8 = 4;
const CBOR_NULL: u8 = 0xF6;

/// A CBOR item head in its shortest form (RFC 8949 §3.1, §4.2.1).
fn cbor_head(buf: &mut Vec<u8>, major: u8, value: u64) {
    let m = major << 5;
    if value < 24 {
        buf.push(m | value as u8);
    } else if let Ok(v) = u8::try_from(value) {
        buf.extend_from_slice(&[m | 24, v]);
    } else if let Ok(v) = u16::try_from(value) {
        buf.push(m | 25);
        buf.extend_from_slice(&v.to_be_bytes());
    } else if let Ok(v) = u32::try_from(value) {
        buf.push(m | 26);
        buf.extend_from_slice(&v.to_be_bytes());
    } else {
        buf.push(m | 27);
        buf.extend_from_slice(&value.to_be_bytes());
    }
}

fn cbor_text(buf: &mut Vec<u8>, s: &str) {
    cbor_head(buf, MAJOR_TEXT, s.len() as u64);
    buf.extend_from_slice(s.as_bytes());
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
        first_block_cbor: Option<String>,
        hashes: Vec<ExpectedHash>,
    }

    #[derive(Deserialize)]
    struct ExpectedHash {
        hex: String,
        u64: u64,
    }

    fn fixture() -> Fixture {
        let text = include_str!("../../engine/tests/fixtures/block_hashes.json");
        match serde_json::from_str(text) {
            Ok(f) => f,
            Err(e) => panic!("crates/engine/tests/fixtures/block_hashes.json does not parse: {e}"),
        }
    }

    #[test]
    fn cbor_heads_use_the_shortest_form() {
        let cases: [(u8, u64, &[u8]); 10] = [
            (0, 0, &[0x00]),
            (0, 23, &[0x17]),
            (0, 24, &[0x18, 24]),
            (0, 255, &[0x18, 0xFF]),
            (0, 256, &[0x19, 0x01, 0x00]),
            (0, 65535, &[0x19, 0xFF, 0xFF]),
            (0, 65536, &[0x1A, 0x00, 0x01, 0x00, 0x00]),
            (0, u64::from(u32::MAX), &[0x1A, 0xFF, 0xFF, 0xFF, 0xFF]),
            (4, 1 << 32, &[0x9B, 0, 0, 0, 1, 0, 0, 0, 0]),
            (3, 24, &[0x78, 24]),
        ];
        for (major, value, want) in cases {
            let mut buf = Vec::new();
            cbor_head(&mut buf, major, value);
            assert_eq!(buf, want, "major {major} value {value}");
        }
    }

    #[test]
    fn block_cbor_layout() {
        let hasher = BlockHasher::new("0", 4);
        let parent = BlockHash([7; 32]);
        let extra = [
            ExtraKey::LoraName("a".into()),
            ExtraKey::CacheSalt("b".into()),
        ];
        let cbor = hasher.block_cbor(Some(&parent), &[1, 24, 300, 70000], Some(&extra));
        let mut want = vec![0x83, 0x58, 0x20];
        want.extend_from_slice(&[7; 32]);
        want.extend_from_slice(&[0x84, 0x01, 0x18, 24, 0x19, 0x01, 0x2C]);
        want.extend_from_slice(&[0x1A, 0x00, 0x01, 0x11, 0x70]);
        want.extend_from_slice(&[0x82, 0x61, b'a', 0x61, b'b']);
        assert_eq!(cbor, want);
        // No extra keys, and an empty list, are both CBOR null.
        let none = hasher.block_cbor(None, &[1], None);
        assert_eq!(none.last(), Some(&0xF6));
        assert_eq!(hasher.block_cbor(None, &[1], Some(&[])), none);
        assert_eq!(&none[3..35], &hasher.none_hash().0);
    }

    #[test]
    fn to_u64_is_last_eight_bytes_big_endian() {
        let mut digest = [0u8; 32];
        for (i, b) in digest.iter_mut().enumerate() {
            *b = i as u8;
        }
        assert_eq!(BlockHash(digest).to_u64(), 0x18191A1B1C1D1E1F);
    }

    #[test]
    fn extra_keys_follow_vllm_order() {
        assert_eq!(block_extra_keys(0, None, None), None);
        assert_eq!(block_extra_keys(0, None, Some("")), None);
        assert_eq!(block_extra_keys(1, None, Some("s")), None);
        assert_eq!(
            block_extra_keys(0, Some("l"), Some("s")),
            Some(vec![
                ExtraKey::LoraName("l".into()),
                ExtraKey::CacheSalt("s".into())
            ])
        );
        assert_eq!(
            block_extra_keys(3, Some("l"), Some("s")),
            Some(vec![ExtraKey::LoraName("l".into())])
        );
    }

    #[test]
    fn pythonhashseed_compatibility() {
        for ok in ["0", "42", "4294967295", "random"] {
            assert!(is_pythonhashseed_compatible(ok), "{ok}");
        }
        for bad in [
            "",
            "strata",
            "-1",
            "4294967296",
            "+1",
            " 1",
            DEFAULT_HASH_SEED,
        ] {
            assert!(!is_pythonhashseed_compatible(bad), "{bad}");
        }
    }

    #[test]
    fn only_full_blocks_are_hashed() {
        let hasher = BlockHasher::new(DEFAULT_HASH_SEED, 4);
        assert!(hasher.hash_sequence(&[1, 2, 3], None, None).is_empty());
        assert_eq!(hasher.hash_sequence(&[1, 2, 3, 4, 5], None, None).len(), 1);
        assert!(BlockHasher::new("0", 0)
            .hash_sequence(&[1, 2], None, None)
            .is_empty());
        // Chained: the same block after a different prefix hashes differently.
        let a = hasher.hash_sequence(&[1, 2, 3, 4, 9, 9, 9, 9], None, None);
        let b = hasher.hash_sequence(&[5, 2, 3, 4, 9, 9, 9, 9], None, None);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn matches_vllm_reference_fixture() {
        let fixture = fixture();
        assert!(fixture.cases.len() >= 10);
        let mut checked = 0;
        for case in &fixture.cases {
            let hasher = BlockHasher::new(&case.seed, case.block_size);
            assert_eq!(
                hasher.none_hash().to_hex(),
                case.none_hash,
                "{}: NONE_HASH",
                case.name
            );
            if let Some(want) = &case.first_block_cbor {
                let extra =
                    block_extra_keys(0, case.lora_name.as_deref(), case.cache_salt.as_deref());
                let cbor =
                    hasher.block_cbor(None, &case.tokens[..case.block_size], extra.as_deref());
                assert_eq!(&hex::encode(cbor), want, "{}: first block CBOR", case.name);
            }
            let got = hasher.hash_sequence(
                &case.tokens,
                case.lora_name.as_deref(),
                case.cache_salt.as_deref(),
            );
            assert_eq!(got.len(), case.hashes.len(), "{}: block count", case.name);
            for (i, (g, want)) in got.iter().zip(&case.hashes).enumerate() {
                assert_eq!(g.to_hex(), want.hex, "{}: block {i}", case.name);
                assert_eq!(g.to_u64(), want.u64, "{}: block {i} as u64", case.name);
                checked += 1;
            }
        }
        assert!(checked >= 30, "only {checked} hashes checked");
    }

    #[test]
    fn default_seed_none_hash_is_pinned() {
        // sha256(cbor("vllm-none-hash")): if this moves, every published hash moves.
        let hasher = BlockHasher::new(DEFAULT_HASH_SEED, DEFAULT_BLOCK_SIZE);
        assert_eq!(
            hasher.none_hash().to_hex(),
            "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
        );
    }
}
