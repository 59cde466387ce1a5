//! KV storage: one key and one value buffer per layer, addressed by slot.
//!
//! The cache is `num_blocks * block_size` slots; a slot holds one token's keys (or values)
//! for every KV head: `n_kv_head * head_dim` numbers. A sequence's token at position `p`
//! lives in slot `block_table[p / block_size] * block_size + p % block_size`, so a
//! sequence's blocks may be anywhere and sequences of any length share one cache.
//!
//! Entries are f16 (half the memory and half the bytes attention reads per step; what
//! llama.cpp and vLLM keep by default) or f32 (exact, for the f32 reference mode).

use std::str::FromStr;

use half::f16;

/// How cache entries are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub const fn bytes(self) -> usize {
        match self {
            Self::F16 => 2,
            Self::F32 => 4,
        }
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f16" | "fp16" | "float16" | "half" => Ok(Self::F16),
            "f32" | "fp32" | "float32" | "float" => Ok(Self::F32),
            other => Err(format!(
                "unknown KV-cache dtype `{other}` (expected auto, f16 or f32)"
            )),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F16 => "f16",
            Self::F32 => "f32",
        })
    }
}

/// One layer's keys or values.
pub enum KvBuf {
    F16(Vec<f16>),
    F32(Vec<f32>),
}

impl KvBuf {
    fn new(dtype: KvDtype, len: usize) -> Self {
        match dtype {
            KvDtype::F16 => Self::F16(vec![f16::ZERO; len]),
            KvDtype::F32 => Self::F32(vec![0.0; len]),
        }
    }

    /// Stores `src` from element `at` on (rounded to nearest when f16).
    #[inline]
    pub fn write(&mut self, at: usize, src: &[f32]) {
        match self {
            Self::F16(b) => {
                for (o, v) in b[at..at + src.len()].iter_mut().zip(src) {
                    *o = f16::from_f32(*v);
                }
            }
            Self::F32(b) => b[at..at + src.len()].copy_from_slice(src),
        }
    }

    /// Element `i` as f32.
    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Self::F16(b) => b[i].to_f32(),
            Self::F32(b) => b[i],
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Self::F16(b) => b.len(),
            Self::F32(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends elements `at..at + n` to `out` as little-endian bytes of the buffer's dtype.
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
        }
    }

    /// Stores little-endian elements of the buffer's dtype from element `at` on; `src`
    /// holds a whole number of elements.
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
    pub dtype: KvDtype,
    pub keys: Vec<KvBuf>,
    pub values: Vec<KvBuf>,
}

impl KvCache {
    /// An f32 cache (exact).
    pub fn new(n_layer: usize, num_blocks: usize, block_size: usize, slot_width: usize) -> Self {
        Self::with_dtype(n_layer, num_blocks, block_size, slot_width, KvDtype::F32)
    }

    pub fn with_dtype(
        n_layer: usize,
        num_blocks: usize,
        block_size: usize,
        slot_width: usize,
        dtype: KvDtype,
    ) -> Self {
        let len = num_blocks * block_size * slot_width;
        Self {
            block_size,
            num_blocks,
            slot_width,
            dtype,
            keys: (0..n_layer).map(|_| KvBuf::new(dtype, len)).collect(),
            values: (0..n_layer).map(|_| KvBuf::new(dtype, len)).collect(),
        }
    }

    /// Bytes one block takes across all layers (keys and values).
    pub fn bytes_per_block(
        n_layer: usize,
        block_size: usize,
        slot_width: usize,
        dtype: KvDtype,
    ) -> usize {
        2 * n_layer * block_size * slot_width * dtype.bytes()
    }

    /// Bytes of one of this cache's blocks (what [`Self::read_block`] produces).
    pub fn block_bytes(&self) -> usize {
        Self::bytes_per_block(
            self.keys.len(),
            self.block_size,
            self.slot_width,
            self.dtype,
        )
    }

    /// Copies block `block`'s keys and values out, in the transfer layout: for each layer,
    /// the block's keys (`block_size * slot_width` elements) then its values, as
    /// little-endian elements of the cache's dtype (exact: no conversion).
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
        let part = n * self.dtype.bytes();
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
                KvDtype::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
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

    #[test]
    fn block_bytes_follow_the_dtype() {
        assert_eq!(KvCache::bytes_per_block(30, 16, 192, KvDtype::F32), 737_280);
        assert_eq!(KvCache::bytes_per_block(30, 16, 192, KvDtype::F16), 368_640);
        assert_eq!("fp16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert!("fp8".parse::<KvDtype>().is_err());
    }
}
