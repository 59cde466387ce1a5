//! The loop's link to the KV tier, both ways. Out: the cached blocks the pool evicts are
//! copied to the offloader before their slots are written again, and remembered until the
//! tier answers ([`TierState`]). In: blocks a request imported (from a prefill engine or
//! the tier) are installed right before its admission, so it takes them as prefix hits.

use std::sync::Arc;

use tokio::sync::mpsc::Sender;

use crate::kv::block_pool::{BlockLora, BlockPool, EvictedBlock, PoolEvent};
use crate::kv::cache::KvCache;
use crate::kv::offload::TierChange;
use crate::kv::transfer::BlockData;
use crate::metrics::EngineMetrics;
use crate::sequence::Sequence;

use super::tier_state::{TierMeta, TierState};

/// The offloader's queue and what the tier holds of this engine's blocks.
pub(super) struct KvLink {
    /// Where copies of evicted cached blocks go (the tier offloader); `None`: nowhere (and
    /// the planner tracks no evictions).
    offload: Option<Sender<BlockData>>,
    pub(super) tier: TierState,
    metrics: Arc<EngineMetrics>,
}

impl KvLink {
    /// A link for a pool of `num_blocks` blocks, offloading nothing yet.
    pub(super) fn new(num_blocks: usize, metrics: Arc<EngineMetrics>) -> Self {
        Self {
            offload: None,
            tier: TierState::new(num_blocks),
            metrics,
        }
    }

    /// Sends copies of the evicted blocks [`Self::copy_evicted`] is given from now on to
    /// `tx` (the caller has the pool track its evictions).
    pub(super) fn offload_to(&mut self, tx: Sender<BlockData>) {
        self.offload = Some(tx);
    }

    /// What the offloader learned from the tier, kept for the next KV events.
    pub(super) fn tier_changed(&mut self, change: TierChange) {
        self.tier.apply(change);
    }

    /// Moves the tier events not yet published to the end of `events`.
    pub(super) fn take_events(&mut self, events: &mut Vec<PoolEvent>) {
        events.append(&mut self.tier.events);
    }

    /// Blocks announced as stored on the tier.
    pub(super) fn num_announced(&self) -> usize {
        self.tier.announced.len()
    }

    /// Evicted blocks copied out, awaiting the tier's answer.
    pub(super) fn num_remembered(&self) -> usize {
        self.tier.remembered.len()
    }

    /// Copies the blocks the pool just evicted (`evicted`, drained from it) to the
    /// offloader, before their slots are written again; a full queue drops the copy
    /// (counted). Nothing is copied without an offloader (the pool then tracks no
    /// evictions).
    pub(super) fn copy_evicted(
        &mut self,
        evicted: impl Iterator<Item = EvictedBlock>,
        cache: &KvCache,
    ) {
        let Some(tx) = &self.offload else { return };
        for e in evicted {
            if tx.capacity() == 0 || tx.is_closed() {
                self.metrics.kv_offload_dropped.inc();
                continue;
            }
            let Ok(bytes) = cache.read_block(e.block) else {
                continue;
            };
            match tx.try_send(BlockData {
                hash: e.hash,
                bytes,
            }) {
                Ok(()) => {
                    self.tier.remembered.insert(
                        e.hash,
                        TierMeta {
                            parent: e.parent,
                            tokens: e.tokens,
                            lora: e.lora,
                        },
                    );
                }
                Err(_) => {
                    self.metrics.kv_offload_dropped.inc();
                }
            }
        }
    }

    /// Installs `seq.imported` right before its admission: the run that matches the
    /// prompt's own block hashes ([`matching_run`]), skipping blocks cached meanwhile.
    /// Each is allocated, written into every layer and committed with its hash, parent,
    /// tokens and adapter exactly as a computed block (so a `Stored` event goes out), then
    /// released to the free queue, where admission takes it as a prefix hit.
    pub(super) fn install_imported(
        &mut self,
        pool: &mut BlockPool,
        cache: &mut KvCache,
        seq: &mut Sequence,
    ) {
        let bs = cache.block_size;
        let run = matching_run(pool, seq, bs, cache.block_bytes());
        if run.is_empty() {
            return;
        }
        let prompt_blocks = (seq.prompt_len / bs).min(seq.block_hashes.len());
        // Hold the prompt's blocks that are cached already, so the allocation below cannot
        // evict them (they and the installed ones form the prefix admission takes).
        let mut held = Vec::new();
        for h in &seq.block_hashes[..prompt_blocks] {
            if pool.cached_block(h).is_some() {
                held.extend(pool.acquire_cached(std::slice::from_ref(h)));
            }
        }
        let n = run.len().min(pool.num_free());
        let blocks = pool.allocate(n).unwrap_or_default();
        self.copy_evicted(pool.drain_evicted(), cache);
        let lora = seq.lora.as_ref().map(|a| BlockLora {
            id: i64::from(a.id),
            name: a.name.clone(),
        });
        let mut installed = 0u64;
        for (&block, (i, data)) in blocks.iter().zip(run) {
            if cache.write_block(block, &data.bytes).is_err() {
                continue;
            }
            let parent = i.checked_sub(1).map(|p| seq.block_hashes[p]);
            pool.commit_lora(
                block,
                data.hash,
                parent,
                &seq.tokens[i * bs..(i + 1) * bs],
                lora.as_ref(),
            );
            seq.installed.push(i);
            installed += 1;
        }
        pool.release(&blocks);
        pool.release(&held);
        self.metrics.record_transfer_blocks("received", installed);
    }
}

/// Takes `seq.imported` and keeps the run of it that continues the prompt's own full-block
/// hashes from the first imported block's place in the prompt (at the first block of
/// another hash or of another size than `block_bytes`, it and the rest are dropped), less
/// the blocks `pool` has cached meanwhile. Each comes with its index in the prompt.
fn matching_run(
    pool: &BlockPool,
    seq: &mut Sequence,
    block_size: usize,
    block_bytes: usize,
) -> Vec<(usize, BlockData)> {
    let imported = std::mem::take(&mut seq.imported);
    let prompt_blocks = (seq.prompt_len / block_size).min(seq.block_hashes.len());
    let hashes = &seq.block_hashes[..prompt_blocks];
    let Some(start) = imported
        .first()
        .and_then(|b| hashes.iter().position(|h| *h == b.hash))
    else {
        return Vec::new();
    };
    let mut run = Vec::new();
    for (k, b) in imported.into_iter().enumerate() {
        let i = start + k;
        if i >= prompt_blocks || b.hash != hashes[i] || b.bytes.len() != block_bytes {
            break;
        }
        if pool.cached_block(&b.hash).is_none() {
            run.push((i, b));
        }
    }
    run
}

#[cfg(test)]
mod tests {
    use super::super::block_identity::{block_hash_fn, prompt_block_hashes};
    use super::super::test_support::{pattern, seq, SEED};
    use super::*;
    use crate::kv::cache::KvDtype;
    use crate::kv::hashing::BlockHasher;
    use crate::options::EngineOptions;
    use crate::planner::{Policy, SeqId, StepPlanner};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn install_takes_the_matching_run_skips_cached_blocks_and_drops_the_rest() {
        let bs = 4;
        let hasher = BlockHasher::new(SEED, bs);
        let prompt: Vec<u32> = (1..=14).collect(); // 3 full blocks and 2 tokens
        let hashes = prompt_block_hashes(&hasher, &prompt, None, None);
        assert_eq!(hashes.len(), 3);
        let metrics = Arc::new(EngineMetrics::new("m", bs, 8));
        let mut link = KvLink::new(8, metrics.clone());

        let mut pool = BlockPool::new(8, true);
        let mut cache = KvCache::with_dtype(2, 8, bs, 3, KvDtype::F16);
        let n = cache.block_bytes();
        // Block 1 of the prompt is cached here already.
        let b = pool.allocate(1).unwrap();
        pool.commit(b[0], hashes[1], Some(hashes[0]), &prompt[4..8]);
        pool.release(&b);
        pool.take_events();

        // Blocks 0..3 arrive; block 2 has the wrong size: it is dropped.
        let mut s = seq(prompt.clone());
        s.block_hashes = hashes.clone();
        s.imported = vec![
            BlockData {
                hash: hashes[0],
                bytes: pattern(10, n),
            },
            BlockData {
                hash: hashes[1],
                bytes: pattern(20, n),
            },
            BlockData {
                hash: hashes[2],
                bytes: pattern(30, n - 1),
            },
        ];
        link.install_imported(&mut pool, &mut cache, &mut s);
        assert!(s.imported.is_empty(), "taken");
        assert_eq!(s.installed, vec![0]);
        let b0 = pool.cached_block(&hashes[0]).expect("installed");
        assert_eq!(cache.read_block(b0).unwrap(), pattern(10, n));
        assert_eq!(
            pool.cached_block(&hashes[1]),
            Some(b[0]),
            "kept, not replaced"
        );
        assert_eq!(pool.cached_block(&hashes[2]), None);
        assert_eq!(pool.num_free(), 8, "every block back in the free queue");
        assert_eq!(
            pool.take_events(),
            vec![PoolEvent::Stored {
                hash: hashes[0],
                parent: None,
                tokens: prompt[..4].to_vec(),
                lora: None,
            }]
        );

        // A run that starts later in the prompt: its first block's parent is named.
        let mut s = seq(prompt.clone());
        s.block_hashes = hashes.clone();
        s.imported = vec![BlockData {
            hash: hashes[2],
            bytes: pattern(30, n),
        }];
        link.install_imported(&mut pool, &mut cache, &mut s);
        assert_eq!(s.installed, vec![2]);
        assert!(matches!(
            &pool.take_events()[..],
            [PoolEvent::Stored { hash, parent: Some(p), .. }] if *hash == hashes[2] && *p == hashes[1]
        ));

        // Blocks of another prompt, or past the prompt's full blocks, install nothing.
        let other = prompt_block_hashes(&hasher, &[9; 8], None, None);
        let mut s = seq(prompt.clone());
        s.block_hashes = hashes.clone();
        s.imported = vec![BlockData {
            hash: other[0],
            bytes: pattern(1, n),
        }];
        link.install_imported(&mut pool, &mut cache, &mut s);
        assert!(s.installed.is_empty());
        assert!(pool.take_events().is_empty());
        assert_eq!(pool.num_free(), 8);
    }

    #[test]
    fn evicted_blocks_are_copied_before_an_install_overwrites_them() {
        let bs = 4;
        let hasher = BlockHasher::new(SEED, bs);
        let metrics = Arc::new(EngineMetrics::new("m", bs, 2));
        let mut link = KvLink::new(2, metrics.clone());
        let mut pool = BlockPool::new(2, true);
        pool.set_track_evictions(true);
        let mut cache = KvCache::with_dtype(1, 2, bs, 2, KvDtype::F32);
        let n = cache.block_bytes();
        // Both blocks hold an old prompt's cached blocks.
        let old: Vec<u32> = (100..108).collect();
        let old_hashes = prompt_block_hashes(&hasher, &old, None, None);
        let held = pool.allocate(2).unwrap();
        for (i, &b) in held.iter().enumerate() {
            cache.write_block(b, &pattern(50 + i as u8, n)).unwrap();
            let parent = i.checked_sub(1).map(|p| old_hashes[p]);
            pool.commit(b, old_hashes[i], parent, &old[i * bs..(i + 1) * bs]);
        }
        pool.release(&held);

        let prompt: Vec<u32> = (1..=9).collect();
        let hashes = prompt_block_hashes(&hasher, &prompt, None, None);
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let mut s = seq(prompt);
        s.block_hashes = hashes.clone();
        s.imported = hashes
            .iter()
            .map(|h| BlockData {
                hash: *h,
                bytes: pattern(7, n),
            })
            .collect();
        link.offload = Some(tx);
        link.install_imported(&mut pool, &mut cache, &mut s);
        assert_eq!(s.installed, vec![0, 1]);
        // The queue holds one: the first eviction's copy went out with the old bytes (the
        // tail block, evicted first), the second was dropped and counted.
        let copy = rx.try_recv().expect("one copy");
        assert_eq!(copy.hash, old_hashes[1]);
        assert_eq!(copy.bytes, pattern(51, n));
        assert!(rx.try_recv().is_err());
        assert_eq!(metrics.kv_offload_dropped.get(), 1);
        assert_eq!(link.tier.remembered.len(), 1);
        // The tier acknowledges it: a CPU-medium store with the block's own parent and
        // tokens goes out.
        link.tier
            .apply(TierChange::Stored(vec![old_hashes[1], old_hashes[0]]));
        assert_eq!(
            link.tier.events,
            vec![PoolEvent::TierStored {
                hash: old_hashes[1],
                parent: Some(old_hashes[0]),
                tokens: old[4..8].to_vec(),
                lora: None,
            }]
        );
        assert_eq!(link.tier.remembered.len(), 0);
        assert_eq!(link.tier.announced.len(), 1);
        let _ = EvictedBlock {
            block: 0,
            hash: [0; 32],
            parent: None,
            tokens: Vec::new(),
            lora: None,
        };
    }

    /// Random admissions with good, bad and partial imports, growth, preemption and
    /// finishes over a small pool: every block's references are exactly the running
    /// sequences' tables holding it, at every step and at the end.
    #[test]
    fn installs_finishes_and_preemptions_leak_no_block() {
        let bs = 4;
        let num_blocks = 14;
        let hasher = BlockHasher::new(SEED, bs);
        let metrics = Arc::new(EngineMetrics::new("m", bs, num_blocks));
        let mut link = KvLink::new(num_blocks, metrics.clone());
        let mut cache = KvCache::with_dtype(1, num_blocks, bs, 2, KvDtype::F16);
        let n = cache.block_bytes();
        let (tx, mut rx) = tokio::sync::mpsc::channel(8);
        link.offload = Some(tx.clone());
        let mut planner = StepPlanner::new(
            &EngineOptions {
                block_size: bs,
                max_num_seqs: 6,
                max_num_batched_tokens: 32,
                policy: Policy::Fcfs,
                step_time_budget: None,
                ..EngineOptions::default()
            },
            num_blocks,
            Some(block_hash_fn(SEED, bs)),
        );
        planner.set_track_evictions(true);
        let mut rng = StdRng::seed_from_u64(21);
        let mut installed_total = 0;
        let mut preempted = 0;
        for round in 0..400 {
            if rng.random_bool(0.4) {
                // Prompts share one of three prefixes, so imports meet cached blocks.
                let prefix = rng.random_range(0..3u32);
                let len = rng.random_range(5..30usize);
                let prompt: Vec<u32> = (0..len as u32)
                    .map(|i| {
                        if i < 12 {
                            prefix * 100 + i
                        } else {
                            round * 7 + i
                        }
                    })
                    .collect();
                let hashes = prompt_block_hashes(&hasher, &prompt, None, None);
                let mut s = seq(prompt);
                s.max_tokens = rng.random_range(1..24);
                let from = rng.random_range(0..=hashes.len());
                let mut imported: Vec<BlockData> = hashes[from..]
                    .iter()
                    .map(|h| BlockData {
                        hash: *h,
                        bytes: vec![1; n],
                    })
                    .collect();
                match rng.random_range(0..4) {
                    0 => imported.clear(),
                    1 if !imported.is_empty() => {
                        let at = rng.random_range(0..imported.len());
                        imported[at].bytes.pop();
                    }
                    2 if !imported.is_empty() => {
                        let at = rng.random_range(0..imported.len());
                        imported[at].hash[0] ^= 1;
                    }
                    _ => {}
                }
                s.imported = imported;
                planner.add(s);
            }
            let plan = planner.plan_with(&mut |pool, s| link.install_imported(pool, &mut cache, s));
            link.copy_evicted(planner.drain_evicted(), &cache);
            while rx.try_recv().is_ok() {}
            preempted += plan.num_preempted;
            for w in &plan.work {
                let q = planner.seq_mut(w.id);
                q.num_computed += w.num_tokens;
                if q.num_computed == q.tokens.len() {
                    q.tokens.push(rng.random_range(1..50));
                }
            }
            planner.commit_full_blocks();
            let running: Vec<SeqId> = planner.running_ids().collect();
            for id in running {
                let q = planner.seq(id);
                if q.num_output() >= q.max_tokens || rng.random_bool(0.02) {
                    let done = planner.finish(id);
                    installed_total += done.installed.len();
                }
            }
            planner.check_invariants();
        }
        let running: Vec<SeqId> = planner.running_ids().collect();
        for id in running {
            planner.finish(id);
        }
        planner.clear_waiting();
        planner.check_invariants();
        assert_eq!(planner.num_free_blocks(), num_blocks);
        assert!(installed_total > 0, "some imports were installed");
        assert!(preempted > 0, "the pool was tight enough to preempt");
    }
}
