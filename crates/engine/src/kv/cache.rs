//! KV storage: one key and one value buffer per layer, addressed by slot.
//!
//! The cache is `num_blocks * block_size` slots; a slot holds one token's keys (or values)
//! for every KV head: `n_kv_head * head_dim` numbers. A sequence's token at position `p`
//! lives in slot `block_table[p / block_size] * block_size + p % block_size`, so a
//! sequence's blocks may be anywhere and sequences of any length share one cache.
//!
//! Entries are f16 (half the memory and half the bytes attention reads per step; what
//! llama.cpp and vLLM keep by default), f32 (exact, for the f32 reference mode), or 8-bit
//! codes (int8 or fp8 E4M3, [`super::quant8`]) with one scale per KV head of each token:
//! half an f16 cache's bytes again, plus 4 bytes a head.

use std::str::FromStr;

use half::f16;

use super::quant8::{E4m3, Scaled};

/// How cache entries are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
    /// int8 codes, one scale per head and token (`--kv-cache-dtype int8`).
    Int8,
    /// fp8 E4M3 codes, one scale per head and token (`--kv-cache-dtype fp8`, vLLM's
    /// spelling; also `fp8_e4m3`).
    Fp8E4m3,
}

impl KvDtype {
    /// Bytes of one entry's code (scales not counted).
    pub const fn bytes(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
            Self::Int8 | Self::Fp8E4m3 => 1,
        }
    }

    /// The name vLLM's `cache_config_info{cache_dtype}` uses for this type.
    pub const fn vllm_name(self) -> &'static str {
        match self {
            Self::F16 => "float16",
            Self::F32 => "float32",
            Self::Int8 => "int8",
            Self::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Whether entries carry a scale per group (per head of each token).
    pub const fn is_scaled(self) -> bool {
        matches!(self, Self::Int8 | Self::Fp8E4m3)
    }

    /// Bytes of one slot of `slot_width` numbers in `groups` scale groups (the groups
    /// count only for scaled dtypes).
    pub const fn slot_bytes(self, slot_width: usize, groups: usize) -> usize {
        slot_width * self.bytes() + if self.is_scaled() { 4 * groups } else { 0 }
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" | "fp16" | "float16" | "half" => Ok(Self::F16),
            "f32" | "fp32" | "float32" | "float" => Ok(Self::F32),
            "int8" | "i8" => Ok(Self::Int8),
            "fp8" | "fp8_e4m3" => Ok(Self::Fp8E4m3),
            other => Err(format!(
                "unknown KV-cache dtype `{other}` (expected auto, f16, f32, fp8, fp8_e4m3 or int8)"
            )),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F16 => "f16",
            Self::F32 => "f32",
            Self::Int8 => "int8",
            Self::Fp8E4m3 => "fp8_e4m3",
        })
    }
}

/// One layer's keys or values.
pub enum KvBuf {
    F16(Vec<f16>),
    F32(Vec<f32>),
    Int8(Scaled<i8>),
    Fp8(Scaled<E4m3>),
}

impl KvBuf {
    /// `len` zero entries; 8-bit entries share a scale per `group` numbers.
    fn new(dtype: KvDtype, len: usize, group: usize) -> Self {
        match dtype {
            KvDtype::F16 => Self::F16(vec![f16::ZERO; len]),
            KvDtype::F32 => Self::F32(vec![0.0; len]),
            KvDtype::Int8 => Self::Int8(Scaled::new(len, group)),
            KvDtype::Fp8E4m3 => Self::Fp8(Scaled::new(len, group)),
        }
    }

    /// Stores `src` from element `at` on (rounded to nearest when f16; quantized per
    /// group when 8-bit, where `at` and `src.len()` are whole groups: one token's slot).
    #[inline]
    pub fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Self::F16(b) => {
                for (o, v) in b[at..at + src.len()].iter_mut().zip(src) {
                    *o = f16::from_f32(*v);
                }
            }
            Self::F32(b) => b[at..at + src.len()].copy_from_slice(src),
            Self::Int8(b) => b.write(at, src),
            Self::Fp8(b) => b.write(at, src),
        }
    }

    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Self::F16(b) => b[i].to_f32(),
            Self::F32(b) => b[i],
            Self::Int8(b) => b.get(i),
            Self::Fp8(b) => b.get(i),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::F16(b) => b.len(),
            Self::F32(b) => b.len(),
            Self::Int8(b) => b.data.len(),
            Self::Fp8(b) => b.data.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends elements `at..at + n` to `out` as little-endian bytes of the buffer's dtype
    /// (8-bit: the codes, then their groups' scales).
    fn read_le(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        // Grown once and filled through fixed-size chunks, which compiles to a plain copy
        // loop (a push per element would check the capacity every time).
        let start = out.len();
        match self {
            Self::F16(b) => {
                out.resize(start + 2 * n, 0);
                for (o, v) in out[start..].chunks_exact_mut(2).zip(&b[at..at + n]) {
                    o.copy_from_slice(&v.to_bits().to_le_bytes());
                }
            }
            Self::F32(b) => {
                out.resize(start + 4 * n, 0);
                for (o, v) in out[start..].chunks_exact_mut(4).zip(&b[at..at + n]) {
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            Self::Int8(b) => b.read_le(at, n, out),
            Self::Fp8(b) => b.read_le(at, n, out),
        }
    }

    /// Stores little-endian elements of the buffer's dtype from element `at` on; `src`
    /// holds a whole number of elements (8-bit: whole groups, codes then scales).
    fn write_le(&mut self, at: usize, src: &[u8]) {
        match self {
            Self::F16(b) => {
                for (o, c) in b[at..].iter_mut().zip(src.chunks_exact(2)) {
                    *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            Self::F32(b) => {
                for (o, c) in b[at..].iter_mut().zip(src.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            Self::Int8(b) => b.write_le(at, src),
            Self::Fp8(b) => b.write_le(at, src),
        }
    }
}

/// Why a block's bytes could not be written into the cache.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockIoError {
    #[error("block {0} is outside the cache")]
    OutOfRange(u32),
    #[error("a block is {expected} bytes here, got {got}")]
    Size { expected: usize, got: usize },
}

/// Per-layer key/value buffers.
pub struct KvCache {
    pub block_size: usize,
    pub num_blocks: usize,
    /// Numbers per slot: `n_kv_head * head_dim`.
    pub slot_width: usize,
    /// Scale groups per slot for 8-bit entries: the KV heads (each head of each token has
    /// its own scale). 1 for the other dtypes, which carry no scales.
    pub groups_per_slot: usize,
    pub dtype: KvDtype,
    pub keys: Vec<KvBuf>,
    pub values: Vec<KvBuf>,
}

impl KvCache {
    /// An f32 cache (exact).
    pub fn new(n_layer: usize, num_blocks: usize, block_size: usize, slot_width: usize) -> Self {
        Self::with_dtype(n_layer, num_blocks, block_size, slot_width, KvDtype::F32)
    }

    /// A cache of `dtype` entries whose 8-bit scales (if any) cover a whole slot each.
    /// A model's cache has one scale per head: [`Self::with_heads`].
    pub fn with_dtype(
        n_layer: usize,
        num_blocks: usize,
        block_size: usize,
        slot_width: usize,
        dtype: KvDtype,
    ) -> Self {
        Self::with_heads(n_layer, num_blocks, block_size, 1, slot_width, dtype)
    }

    /// A cache for `n_kv_head` heads of `head_dim` numbers per slot.
    pub fn with_heads(
        n_layer: usize,
        num_blocks: usize,
        block_size: usize,
        n_kv_head: usize,
        head_dim: usize,
        dtype: KvDtype,
    ) -> Self {
        let slot_width = n_kv_head * head_dim;
        let len = num_blocks * block_size * slot_width;
        Self {
            block_size,
            num_blocks,
            slot_width,
            groups_per_slot: n_kv_head.max(1),
            dtype,
            keys: (0..n_layer)
                .map(|_| KvBuf::new(dtype, len, head_dim))
                .collect(),
            values: (0..n_layer)
                .map(|_| KvBuf::new(dtype, len, head_dim))
                .collect(),
        }
    }

    /// Bytes one block takes across all layers (keys and values), `groups` scale groups
    /// per slot (the KV heads; they count only for 8-bit entries).
    pub fn bytes_per_block(
        n_layer: usize,
        block_size: usize,
        slot_width: usize,
        groups: usize,
        dtype: KvDtype,
    ) -> usize {
        2 * n_layer * block_size * dtype.slot_bytes(slot_width, groups)
    }

    /// Bytes of one of this cache's blocks (what [`Self::read_block`] produces).
    pub fn block_bytes(&self) -> usize {
        Self::bytes_per_block(
            self.keys.len(),
            self.block_size,
            self.slot_width,
            self.groups_per_slot,
            self.dtype,
        )
    }

    /// Copies block `block`'s keys and values out, in the transfer layout: for each layer,
    /// the block's keys (`block_size * slot_width` elements) then its values, as
    /// little-endian elements of the cache's dtype (exact: no conversion; 8-bit entries are
    /// each part's codes followed by its scales as f32).
    pub fn read_block(&self, block: u32) -> Result<Vec<u8>, BlockIoError> {
        if block as usize >= self.num_blocks {
            return Err(BlockIoError::OutOfRange(block));
        }
        let n = self.block_size * self.slot_width;
        let at = block as usize * n;
        let mut out = Vec::with_capacity(self.block_bytes());
        for (k, v) in self.keys.iter().zip(&self.values) {
            k.read_le(at, n, &mut out);
            v.read_le(at, n, &mut out);
        }
        Ok(out)
    }

    /// Writes `bytes` (the layout of [`Self::read_block`], same dtype and shape) into block
    /// `block` of every layer. A wrong size changes nothing.
    pub fn write_block(&mut self, block: u32, bytes: &[u8]) -> Result<(), BlockIoError> {
        if block as usize >= self.num_blocks {
            return Err(BlockIoError::OutOfRange(block));
        }
        let expected = self.block_bytes();
        if bytes.len() != expected {
            return Err(BlockIoError::Size {
                expected,
                got: bytes.len(),
            });
        }
        let n = self.block_size * self.slot_width;
        let at = block as usize * n;
        let part = self.block_size * self.dtype.slot_bytes(self.slot_width, self.groups_per_slot);
        let mut chunks = bytes.chunks_exact(part);
        for (k, v) in self.keys.iter_mut().zip(self.values.iter_mut()) {
            if let (Some(kb), Some(vb)) = (chunks.next(), chunks.next()) {
                k.write_le(at, kb);
                v.write_le(at, vb);
            }
        }
        Ok(())
    }

    /// The slot of position `pos` through `block_table`, if the table covers it.
    #[inline]
    pub fn slot(&self, block_table: &[u32], pos: usize) -> Option<usize> {
        let block = *block_table.get(pos / self.block_size)? as usize;
        (block < self.num_blocks).then_some(block * self.block_size + pos % self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_entries_round_to_nearest_and_f32_entries_are_exact() {
        let mut c = KvCache::with_dtype(1, 2, 4, 3, KvDtype::F16);
        c.keys[0].write(3, &[1.0, 0.1, -65504.0]);
        assert_eq!(c.keys[0].get(3), 1.0);
        assert_eq!(c.keys[0].get(4), f16::from_f32(0.1).to_f32());
        assert!((c.keys[0].get(4) - 0.1).abs() < 1e-4);
        assert_eq!(c.keys[0].get(5), -65504.0);
        let mut c = KvCache::new(1, 2, 4, 3);
        c.values[0].write(0, &[0.1]);
        assert_eq!(c.values[0].get(0), 0.1);
        assert_eq!(c.values[0].len(), 24);
    }

    #[test]
    fn a_block_round_trips_through_its_bytes_in_either_dtype() {
        for dtype in [KvDtype::F16, KvDtype::F32] {
            let mut a = KvCache::with_dtype(2, 3, 2, 3, dtype);
            // Block 1 of each layer: 2 slots of 3 numbers, distinct per layer and kind.
            for l in 0..2 {
                let base = l as f32 * 10.0;
                a.keys[l].write(6, &[base + 1.0, base + 2.0, 0.5, -0.25, 3.0, 4.0]);
                a.values[l].write(6, &[-base, 7.0, 8.0, 9.0, 0.125, 6.0]);
            }
            let bytes = a.read_block(1).unwrap();
            assert_eq!(bytes.len(), a.block_bytes());
            assert_eq!(a.block_bytes(), 2 * 2 * 2 * 3 * dtype.bytes());
            // Layer 0's keys lead the layout.
            let first = match dtype {
                KvDtype::F16 => f16::from_bits(u16::from_le_bytes([bytes[0], bytes[1]])).to_f32(),
                _ => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
            };
            assert_eq!(first, 1.0);
            let mut b = KvCache::with_dtype(2, 3, 2, 3, dtype);
            b.write_block(2, &bytes).unwrap();
            for l in 0..2 {
                for i in 0..6 {
                    assert_eq!(b.keys[l].get(12 + i), a.keys[l].get(6 + i));
                    assert_eq!(b.values[l].get(12 + i), a.values[l].get(6 + i));
                }
                // Neighbouring blocks are untouched.
                assert_eq!(b.keys[l].get(6), 0.0);
            }
            assert_eq!(b.read_block(2).unwrap(), bytes);
            assert_eq!(
                b.write_block(0, &bytes[1..]),
                Err(BlockIoError::Size {
                    expected: bytes.len(),
                    got: bytes.len() - 1
                })
            );
            assert_eq!(b.read_block(0).unwrap(), vec![0; bytes.len()]);
            assert_eq!(b.write_block(3, &bytes), Err(BlockIoError::OutOfRange(3)));
            assert!(b.read_block(3).is_err());
        }
    }

    fn basic_8bit() -> usize {
        2 * 30 * 16 * (192 + 3 * 4)
    }

    #[test]
    fn eight_bit_entries_keep_one_scale_per_head_and_round_trip_their_blocks() {
        for dtype in [KvDtype::Int8, KvDtype::Fp8E4m3] {
            // 2 heads of 4 numbers: head 1 is a thousand times smaller than head 0 and
            // keeps its own precision.
            let mut a = KvCache::with_heads(2, 3, 2, 2, 4, dtype);
            assert_eq!(a.groups_per_slot, 2);
            let slot = [100.0, -50.0, 25.0, 3.0, 0.1, -0.05, 0.025, 0.003];
            a.keys[1].write(8 * 3, &slot);
            a.values[0].write(8 * 2, &slot);
            let tol = if dtype == KvDtype::Int8 {
                0.5 / 127.0
            } else {
                1.0 / 16.0
            };
            for (i, &x) in slot.iter().enumerate() {
                let amax = if i < 4 { 100.0 } else { 0.1 };
                assert!(
                    (a.keys[1].get(24 + i) - x).abs() <= amax * tol + 1e-7,
                    "{dtype} {i}"
                );
            }
            let bytes = a.read_block(1).unwrap();
            assert_eq!(bytes.len(), a.block_bytes());
            assert_eq!(a.block_bytes(), 2 * 2 * 2 * (8 + 2 * 4));
            let mut b = KvCache::with_heads(2, 3, 2, 2, 4, dtype);
            b.write_block(0, &bytes).unwrap();
            for i in 0..8 {
                assert_eq!(b.keys[1].get(8 + i), a.keys[1].get(24 + i));
                assert_eq!(b.values[0].get(i), a.values[0].get(16 + i));
            }
            assert_eq!(b.read_block(0).unwrap(), bytes);
            assert!(b.write_block(0, &bytes[..bytes.len() - 4]).is_err());
        }
    }

    #[test]
    fn block_bytes_follow_the_dtype() {
        assert_eq!(
            KvCache::bytes_per_block(30, 16, 192, 3, KvDtype::F32),
            737_280
        );
        assert_eq!(
            KvCache::bytes_per_block(30, 16, 192, 3, KvDtype::F16),
            368_640
        );
        // 192 codes and 3 scales of 4 bytes per slot.
        assert_eq!(
            KvCache::bytes_per_block(30, 16, 192, 3, KvDtype::Int8),
            basic_8bit()
        );
        assert_eq!(
            KvCache::bytes_per_block(30, 16, 192, 3, KvDtype::Fp8E4m3),
            basic_8bit()
        );
        assert_eq!("fp16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert_eq!("fp8".parse::<KvDtype>(), Ok(KvDtype::Fp8E4m3));
        assert_eq!("fp8_e4m3".parse::<KvDtype>(), Ok(KvDtype::Fp8E4m3));
        assert_eq!("int8".parse::<KvDtype>(), Ok(KvDtype::Int8));
        assert!("fp8_e5m2".parse::<KvDtype>().is_err());
        assert!("int4".parse::<KvDtype>().is_err());
    }
}
