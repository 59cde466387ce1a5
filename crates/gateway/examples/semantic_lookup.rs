//! Semantic-cache lookup cost per request at 10k and 100k entries (results in
//! docs/BENCHMARKS.md).
//!
//! Random unit vectors of MiniLM's size (384) in a [`SemanticIndex`]; every lookup is a
//! miss (random vectors are far apart), so it scans the whole bucket: the worst case. Two
//! layouts of the same entries: all in one bucket (one tenant, one system prompt, one set
//! of parameters) and spread over 1,000 buckets. For comparison, the previous layout (a
//! separately allocated vector per entry and a single running sum) is timed on the same
//! vectors, interleaved with the index.
//!
//!   cargo run --release -p strata-gateway --example semantic_lookup [LOOKUPS=200]

use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use strata_gateway::semantic::{normalized, SemanticIndex};

const DIM: usize = 384;

fn unit(rng: &mut StdRng) -> Vec<f32> {
    let v: Vec<f32> = (0..DIM).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    normalized(v).unwrap_or_else(|| vec![1.0; DIM])
}

/// The layout before: one `Vec` per entry, one running sum.
fn naive_best(entries: &[Vec<f32>], q: &[f32], threshold: f32) -> Option<f32> {
    entries
        .iter()
        .map(|e| e.iter().zip(q).map(|(x, y)| x * y).sum::<f32>())
        .filter(|s| *s >= threshold)
        .max_by(|a, b| a.total_cmp(b))
}

fn main() {
    let lookups: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let mut rng = StdRng::seed_from_u64(17);
    let queries: Vec<Vec<f32>> = (0..lookups).map(|_| unit(&mut rng)).collect();
    println!("{{\"lookups\": {lookups}, \"dim\": {DIM}}}");
    for n in [10_000usize, 100_000] {
        let vectors: Vec<Vec<f32>> = (0..n).map(|_| unit(&mut rng)).collect();
        for buckets in [1usize, 1000] {
            let idx = SemanticIndex::new(n, Duration::from_secs(3600));
            let now = Instant::now();
            let key = |i: usize| {
                let mut k = [0u8; 32];
                k[..8].copy_from_slice(&((i % buckets) as u64).to_le_bytes());
                k
            };
            for (i, v) in vectors.iter().enumerate() {
                idx.put(key(i), v.clone(), Bytes::from_static(b"{}"), now);
            }
            // Interleaved: index, old layout, index, old layout, ...
            let (mut t_index, mut t_naive) = (Duration::ZERO, Duration::ZERO);
            let mut hits = 0;
            for (j, q) in queries.iter().enumerate() {
                let k = key(j);
                let t = Instant::now();
                hits += idx.get(&k, q, 0.9, now).is_some() as usize;
                t_index += t.elapsed();
                let t = Instant::now();
                let slice: &[Vec<f32>] = if buckets == 1 {
                    &vectors
                } else {
                    // The old index scanned only the bucket too: time a bucket's share.
                    &vectors[..n / buckets]
                };
                hits += naive_best(slice, q, 0.9).is_some() as usize;
                t_naive += t.elapsed();
            }
            let per = |t: Duration| t.as_secs_f64() * 1e6 / lookups as f64;
            println!(
                "{{\"entries\": {n}, \"buckets\": {buckets}, \"scanned_per_lookup\": {}, \"index_us\": {:.1}, \"previous_layout_us\": {:.1}, \"hits\": {hits}}}",
                n / buckets,
                per(t_index),
                per(t_naive)
            );
        }
    }
}
