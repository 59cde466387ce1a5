//! [`BlockSource`]: what a transfer endpoint serves from.

use super::{BlockData, BlockSpec};
use crate::kv::block_pool::HashKey;

/// Tier evictions since a sequence number.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Evictions {
    /// Pass this back next time.
    pub next: u64,
    pub hashes: Vec<HashKey>,
    /// False when the log no longer reaches back to the asked seq (entries were dropped):
    /// the caller must treat every block it announced as possibly gone.
    pub complete: bool,
}

pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

/// What a transfer endpoint serves from: an engine's block pool or the tier.
pub trait BlockSource: Send + Sync + 'static {
    /// Whether a client's spec is acceptable (an engine: equal to its own; the tier: any,
    /// blocks are kept apart per spec).
    fn accepts(&self, spec: &BlockSpec) -> bool;
    fn get(
        &self,
        spec: &BlockSpec,
        hashes: Vec<HashKey>,
        release: Option<String>,
    ) -> BoxFuture<Vec<BlockData>>;
    fn put(&self, spec: &BlockSpec, blocks: Vec<BlockData>) -> BoxFuture<Result<(), String>>;
    fn evictions_since(&self, spec: &BlockSpec, seq: u64) -> Evictions;
    fn release(&self, pin: String) -> BoxFuture<()>;
    /// The one spec this source serves, if it serves only one (an engine): named in the
    /// refusal a client with another spec gets, so both ends can log what differs.
    fn own_spec(&self) -> Option<BlockSpec> {
        None
    }
}
