//! Decode attention over a long cache, by KV entry type: one decode token for each of
//! `--streams` sequences of `--ctx` cached positions, every layer of the default model's
//! shape (30 layers, 9 query heads over 3 KV heads of 64), timed per step; the entry types
//! alternate round by round so a busy machine disturbs each alike.
//!
//! cargo run --release -p strata-engine --example attention_bench -- [--streams 16]
//!     [--ctx 2048] [--layers 30] [--rounds 5] [--dtypes f16,int8,fp8] [--contiguous]
//!
//! Prints one JSON line per entry type: the median step (ms) over rounds, and the bytes of
//! keys and values a step reads.

use std::time::Instant;

use strata_engine::attention::{attend, AttnShape, TokenCtx};
use strata_engine::kv::cache::{KvCache, KvDtype};

mod common;
use common::arg;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let streams: usize = arg(&args, "--streams", 16);
    let ctx: usize = arg(&args, "--ctx", 2048);
    let layers: usize = arg(&args, "--layers", 30);
    let rounds: usize = arg(&args, "--rounds", 5);
    let dtypes: String = arg(&args, "--dtypes", "f16,int8,fp8".to_string());
    let dtypes: Vec<KvDtype> = dtypes
        .split(',')
        .map(|d| d.parse::<KvDtype>())
        .collect::<Result<_, _>>()?;
    let (n_head, n_kv_head, hd, block_size) = (9, 3, 64, 16);
    let shape = AttnShape::causal(n_head, n_kv_head, hd, block_size);
    let per_seq = (ctx + 1).div_ceil(block_size);
    let kv_dim = n_kv_head * hd;
    // Sequence `s` owns blocks s, s + streams, s + 2·streams, ...: interleaved, as a busy
    // pool hands them out; with `--contiguous`, blocks s·per_seq.. in a row.
    let contiguous = args.iter().any(|a| a == "--contiguous");
    let tables: Vec<Vec<u32>> = (0..streams)
        .map(|s| {
            (0..per_seq)
                .map(|b| {
                    if contiguous {
                        (s * per_seq + b) as u32
                    } else {
                        (b * streams + s) as u32
                    }
                })
                .collect()
        })
        .collect();
    let tokens: Vec<TokenCtx<'_>> = tables
        .iter()
        .map(|t| TokenCtx {
            pos: ctx,
            block_table: t,
        })
        .collect();
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let q: Vec<f32> = (0..streams * n_head * hd).map(|_| next()).collect();
    let caches: Vec<KvCache> = dtypes
        .iter()
        .map(|&dtype| {
            let mut c =
                KvCache::with_heads(layers, streams * per_seq, block_size, n_kv_head, hd, dtype);
            let slot: Vec<f32> = (0..kv_dim).map(|_| next() * 3.0).collect();
            for l in 0..layers {
                for s in 0..c.num_blocks * block_size {
                    c.keys[l].write(s * kv_dim, &slot);
                    c.values[l].write(s * kv_dim, &slot);
                }
            }
            c
        })
        .collect();
    let mut out = vec![0f32; streams * n_head * hd];
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); dtypes.len()];
    for _ in 0..rounds {
        for (i, c) in caches.iter().enumerate() {
            let t = Instant::now();
            for l in 0..layers {
                attend(shape, &q, &c.keys[l], &c.values[l], &tokens, &mut out);
            }
            times[i].push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    for ((dtype, c), t) in dtypes.iter().zip(&caches).zip(&mut times) {
        t.sort_by(|a, b| a.total_cmp(b));
        let read = streams * (ctx + 1) * layers * 2 * dtype.slot_bytes(kv_dim, n_kv_head);
        println!(
            "{{\"kv_dtype\": \"{dtype}\", \"contiguous\": {contiguous}, \"streams\": {streams}, \"ctx\": {ctx}, \"layers\": {layers}, \"step_ms_median\": {:.2}, \"step_ms_min\": {:.2}, \"bytes_read_per_step\": {read}, \"cache_bytes\": {}}}",
            t[t.len() / 2],
            t[0],
            c.num_blocks * c.block_bytes()
        );
    }
    Ok(())
}
