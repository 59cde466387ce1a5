//! [`BlockSpec`]: what two ends must agree on for a block's bytes to mean the same thing,
//! and how it crosses the wire in the handshake.

use std::fmt;
use std::hash::{Hash, Hasher};

use super::wire::{put_str, Reader, FRAME_OVERHEAD};
use super::{TransferError, MAX_FRAME_BYTES, MAX_MODEL_ID_BYTES};
use crate::kv::cache::{KvCache, KvDtype};

/// What two ends must agree on for a block's bytes to mean the same thing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockSpec {
    /// Model identity: a string the engine derives from the loaded weights; two engines
    /// with different weights must never accept each other's blocks.
    pub model: String,
    pub block_size: u32,
    pub n_layer: u32,
    /// Numbers per slot: n_kv_head * head_dim.
    pub slot_width: u32,
    pub dtype: KvDtype,
    /// 8-bit dtypes: scale groups per slot (the KV heads; each carries an f32 scale). 0 for
    /// f16 and f32, which carry none.
    pub scales_per_slot: u32,
}

impl BlockSpec {
    /// The spec of `cache`'s blocks for `model`.
    pub fn of_cache(model: String, cache: &KvCache) -> Self {
        Self {
            model,
            block_size: cache.block_size as u32,
            n_layer: cache.keys.len() as u32,
            slot_width: cache.slot_width as u32,
            dtype: cache.dtype,
            scales_per_slot: if cache.dtype.is_scaled() {
                cache.groups_per_slot as u32
            } else {
                0
            },
        }
    }

    /// Bytes of one block on the wire: 2 (keys, values) * n_layer * block_size * the bytes
    /// of a slot (slot_width * dtype bytes, plus 4 per scale for 8-bit dtypes). Saturates
    /// instead of overflowing, so an absurd spec from a peer is simply too large (see
    /// [`BlockSpec::validate`]).
    pub fn block_bytes(&self) -> usize {
        let slot = (self.slot_width as usize)
            .saturating_mul(self.dtype.bytes())
            .saturating_add(4usize.saturating_mul(self.scales_per_slot as usize));
        [self.n_layer as usize, self.block_size as usize, slot]
            .iter()
            .fold(2usize, |acc, &x| acc.saturating_mul(x))
    }

    /// Why this spec cannot be served, if it cannot: empty dimensions, an overlong model
    /// identity, or a block that does not fit in one frame.
    pub fn validate(&self) -> Result<(), String> {
        if self.model.is_empty() || self.model.len() > MAX_MODEL_ID_BYTES {
            return Err(format!(
                "model identity must be 1..={MAX_MODEL_ID_BYTES} bytes, got {}",
                self.model.len()
            ));
        }
        if self.block_size == 0 || self.n_layer == 0 || self.slot_width == 0 {
            return Err(format!("empty block dimensions in {self}"));
        }
        let scales_fit = if self.dtype.is_scaled() {
            self.scales_per_slot > 0 && self.slot_width.is_multiple_of(self.scales_per_slot)
        } else {
            self.scales_per_slot == 0
        };
        if !scales_fit {
            return Err(format!("scale groups do not fit the slot in {self}"));
        }
        if self.block_bytes() > MAX_FRAME_BYTES - FRAME_OVERHEAD - 32 {
            return Err(format!(
                "a block of {self} does not fit in a {MAX_FRAME_BYTES}-byte frame"
            ));
        }
        Ok(())
    }

    /// How many blocks fit in one frame (at least one for a valid spec).
    pub fn blocks_per_frame(&self) -> usize {
        ((MAX_FRAME_BYTES - FRAME_OVERHEAD) / (32 + self.block_bytes().max(1))).max(1)
    }

    pub(super) fn encode(&self, out: &mut Vec<u8>) {
        put_str(out, &self.model);
        out.extend_from_slice(&self.block_size.to_le_bytes());
        out.extend_from_slice(&self.n_layer.to_le_bytes());
        out.extend_from_slice(&self.slot_width.to_le_bytes());
        out.push(match self.dtype {
            KvDtype::F16 => 0,
            KvDtype::F32 => 1,
            KvDtype::Int8 => 2,
            KvDtype::Fp8E4m3 => 3,
        });
        // Only 8-bit dtypes carry scales: the f16 and f32 encoding is unchanged.
        if self.dtype.is_scaled() {
            out.extend_from_slice(&self.scales_per_slot.to_le_bytes());
        }
    }

    pub(super) fn decode(r: &mut Reader<'_>) -> Result<Self, TransferError> {
        let model = r.str()?;
        let block_size = r.u32()?;
        let n_layer = r.u32()?;
        let slot_width = r.u32()?;
        let dtype = match r.u8()? {
            0 => KvDtype::F16,
            1 => KvDtype::F32,
            2 => KvDtype::Int8,
            3 => KvDtype::Fp8E4m3,
            d => {
                return Err(TransferError::Protocol(format!(
                    "unknown KV dtype code {d}"
                )))
            }
        };
        let scales_per_slot = if dtype.is_scaled() { r.u32()? } else { 0 };
        Ok(Self {
            model,
            block_size,
            n_layer,
            slot_width,
            dtype,
            scales_per_slot,
        })
    }
}

impl fmt::Display for BlockSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "model={} block_size={} n_layer={} slot_width={} dtype={}",
            self.model, self.block_size, self.n_layer, self.slot_width, self.dtype
        )?;
        if self.dtype.is_scaled() {
            write!(f, " scales_per_slot={}", self.scales_per_slot)?;
        }
        Ok(())
    }
}

// `KvDtype` has no `Hash`; hash its width (and an 8-bit dtype's name) so specs can key
// maps (the tier's namespaces).
impl Hash for BlockSpec {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.model.hash(state);
        self.block_size.hash(state);
        self.n_layer.hash(state);
        self.slot_width.hash(state);
        self.dtype.bytes().hash(state);
        // The f16 and f32 hashes predate 8-bit entries and stay as they were.
        if self.dtype.is_scaled() {
            self.dtype.to_string().hash(state);
            self.scales_per_slot.hash(state);
        }
    }
}
