//! The engine loop: one thread owns the model, the KV cache and the step planner, and
//! turns submitted requests into streamed tokens, one batched forward per step.
//!
//! Requests arrive over a channel ([`EngineHandle::submit`]); each step the loop drops
//! sequences whose submitter went away (freeing their blocks), asks the planner for a
//! plan, runs one forward over every planned sequence, samples where a sequence's
//! pending tokens are all computed, and reports tokens and finishes on each sequence's
//! own channel.
//!
//! What lives where, in the order a request meets it:
//! - [`handle`]: the server's side ([`EngineHandle`]): submission with its queue limit,
//!   and the commands the loop answers between two steps (export, pins, stats, tier news);
//! - [`block_identity`]: what makes a block the same block elsewhere: this engine's
//!   [`BlockSpec`](crate::kv::transfer::BlockSpec) (model identity and layout, computed
//!   once) and the prefix-cache hashes the planner names blocks with;
//! - [`cached_index`]: the hashes cached right now, shared with the server;
//! - `engine_loop`: the thread: waits for work, applies commands, runs steps, publishes
//!   gauges and KV events;
//! - `step`: one step as named stages: plan, forward, sample, settle each sequence's
//!   tokens, end (the planner's after-step rule, pins, finishes);
//! - `drafts`: speculative proposals before planning and their verification after;
//! - `sampling`: every sequence's rows sampled in parallel;
//! - `output`: a sampled token streamed with its stop check; a sequence's final report;
//! - `pins`: a finished prefill's prompt blocks kept for a decoder to pull;
//! - `kv_link`: the loop's link to the KV tier: copies of evicted blocks out to the
//!   offloader, imported blocks in before admission; `tier_state` is its bookkeeping of
//!   what the tier holds, for CPU-medium KV events.

mod block_identity;
mod cached_index;
mod drafts;
mod engine_loop;
mod handle;
mod kv_link;
mod output;
mod pins;
mod sampling;
mod step;
#[cfg(test)]
mod test_support;
#[cfg(test)]
mod tests;
mod tier_state;

use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::kv::block_pool::PoolEvent;
use crate::kv::transfer::BlockData;
use crate::metrics::EngineMetrics;
use crate::model::Llama;
use crate::options::EngineOptions;
use crate::tokenizer::Tokenizer;

pub use block_identity::{prompt_block_hashes, weights_digest};
pub use cached_index::CachedIndex;
pub use handle::{BlockStats, EngineHandle, SubmitError};

use block_identity::BlockSpecCell;
use engine_loop::EngineLoop;
use handle::Shared;

/// How long a finished request's pinned prompt blocks wait for a decoder to pull them by
/// default ([`EngineOptions::kv_pin_timeout`]).
pub const DEFAULT_PIN_TIMEOUT: Duration = Duration::from_secs(60);

/// Where cache changes go (the ZMQ publisher in production, a channel in tests).
pub type KvEventSink = Box<dyn FnMut(Vec<PoolEvent>, usize) + Send>;

/// Starts the engine thread over a KV cache of `num_blocks` blocks (`--num-blocks`, or
/// what `--kv-cache-memory` holds, resolved by the caller), with `opts`'s settings; the
/// blocks it computes are named after the weights at `opts.model_path`. Dropping every
/// [`EngineHandle`] ends it. `evicted`: where copies of the cached blocks the pool evicts
/// go (the tier offloader); `None` copies nothing.
pub fn start(
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    opts: &EngineOptions,
    num_blocks: usize,
    metrics: Arc<EngineMetrics>,
    kv_events: Option<KvEventSink>,
    evicted: Option<tokio::sync::mpsc::Sender<BlockData>>,
) -> (EngineHandle, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new(Shared::default());
    let cached = CachedIndex::default();
    let spec = Arc::new(BlockSpecCell::new(&model, opts));
    let handle = EngineHandle::new(
        tx,
        shared.clone(),
        metrics.clone(),
        opts,
        cached.clone(),
        spec,
    );
    let opts = opts.clone();
    let thread = std::thread::Builder::new()
        .name("strata-engine".into())
        .spawn(move || {
            let mut engine = EngineLoop::new(model, tokenizer, &opts, num_blocks, metrics, shared);
            engine.publish_to(kv_events, cached);
            if let Some(tx) = evicted {
                engine.offload_to(tx);
            }
            engine.run(rx);
        });
    let thread = match thread {
        Ok(t) => t,
        // Spawning a thread only fails when the OS is out of resources; nothing to serve with.
        Err(e) => panic!("cannot start the engine thread: {e}"),
    };
    (handle, thread)
}
