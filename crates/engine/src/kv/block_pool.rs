//! The block pool: which KV blocks are free and who holds the others.
//!
//! Invariants: every block id in `0..num_blocks` is either in `free` (ref count 0) or
//! held by at least one sequence (ref count > 0), never both; `free` has no duplicates.

/// Owner of the KV blocks' bookkeeping.
#[derive(Debug)]
pub struct BlockPool {
    ref_counts: Vec<u32>,
    free: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self {
            ref_counts: vec![0; num_blocks],
            // pop() hands out low ids first
            free: (0..num_blocks as u32).rev().collect(),
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Fraction of blocks in use, 0..=1.
    pub fn usage(&self) -> f64 {
        if self.ref_counts.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.ref_counts.len() as f64
    }

    /// Takes `n` free blocks, or none at all when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let at = self.free.len() - n;
        let blocks: Vec<u32> = self.free.drain(at..).rev().collect();
        for &b in &blocks {
            self.ref_counts[b as usize] = 1;
        }
        Some(blocks)
    }

    /// Drops one reference to each block; blocks nobody holds become free.
    pub fn release(&mut self, blocks: &[u32]) {
        for &b in blocks.iter().rev() {
            let Some(rc) = self.ref_counts.get_mut(b as usize) else {
                continue;
            };
            debug_assert!(*rc > 0, "release of a free block {b}");
            if *rc == 0 {
                continue;
            }
            *rc -= 1;
            if *rc == 0 {
                self.free.push(b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_and_release_round_trip() {
        let mut pool = BlockPool::new(4);
        let a = pool.allocate(3).expect("3 of 4 free");
        assert_eq!(a.len(), 3);
        assert_eq!(pool.num_free(), 1);
        assert!(pool.allocate(2).is_none(), "all-or-nothing");
        assert_eq!(pool.num_free(), 1);
        pool.release(&a);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(pool.usage(), 0.0);
        let b = pool.allocate(4).expect("all free again");
        let mut sorted = b.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
    }
}
