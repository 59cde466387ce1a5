//! KV storage: one key and one value buffer per layer, addressed by slot.
//!
//! The cache is `num_blocks * block_size` slots; a slot holds one token's keys (or values)
//! for every KV head: `n_kv_head * head_dim` floats. A sequence's token at position `p`
//! lives in slot `block_table[p / block_size] * block_size + p % block_size`, so a
//! sequence's blocks may be anywhere and sequences of any length share one cache.

/// Per-layer key/value buffers.
pub struct KvCache {
    pub block_size: usize,
    pub num_blocks: usize,
    /// floats per slot: `n_kv_head * head_dim`
    pub slot_width: usize,
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
}

impl KvCache {
    pub fn new(n_layer: usize, num_blocks: usize, block_size: usize, slot_width: usize) -> Self {
        let len = num_blocks * block_size * slot_width;
        Self {
            block_size,
            num_blocks,
            slot_width,
            keys: (0..n_layer).map(|_| vec![0.0; len]).collect(),
            values: (0..n_layer).map(|_| vec![0.0; len]).collect(),
        }
    }

    /// Bytes one block takes across all layers (keys and values).
    pub fn bytes_per_block(n_layer: usize, block_size: usize, slot_width: usize) -> usize {
        2 * n_layer * block_size * slot_width * std::mem::size_of::<f32>()
    }

    /// The slot of position `pos` through `block_table`, if the table covers it.
    #[inline]
    pub fn slot(&self, block_table: &[u32], pos: usize) -> Option<usize> {
        let block = *block_table.get(pos / self.block_size)? as usize;
        (block < self.num_blocks).then_some(block * self.block_size + pos % self.block_size)
    }
}
