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
    fn block_bytes_follow_the_dtype() {
        assert_eq!(KvCache::bytes_per_block(30, 16, 192, KvDtype::F32), 737_280);
        assert_eq!(KvCache::bytes_per_block(30, 16, 192, KvDtype::F16), 368_640);
        assert_eq!("fp16".parse::<KvDtype>(), Ok(KvDtype::F16));
        assert!("fp8".parse::<KvDtype>().is_err());
    }
}
