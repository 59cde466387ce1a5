//! What a speculative verification step costs: a decode step of `--batch` sequences, each
//! with `1 + k` rows (its pending token and `k` proposals, all decode rows, logits for
//! every row), against the plain step of one row per sequence, at a given context length.
//! The relative cost of one more row is what `--speculative-config`'s `row_cost` prices
//! and what the engine's own step-time fit estimates while it runs.
//!
//! Sizes are timed interleaved (1, 2, ..., 5 rows, then again) so that a machine shared
//! with other work slows every size alike.
//!
//! cargo run --release -p strata-engine --example verify_bench -- [--ctx 256] [--reps 20] [--batch 1]

use std::time::Instant;

use strata_engine::kv::cache::KvCache;
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};

fn arg(args: &[String], name: &str, default: usize) -> usize {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

const MAX_ROWS: usize = 5;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let ctx = arg(&args, "--ctx", 256);
    let reps = arg(&args, "--reps", 20).max(1);
    let batch = arg(&args, "--batch", 1).max(1);
    let path = ModelCache::from_env().resolve(DEFAULT_MODEL)?;
    let model = Llama::load(&path, WeightFormat::Gguf)?;
    let block_size = 16;
    let per_seq = (ctx + MAX_ROWS).div_ceil(block_size);
    let num_blocks = per_seq * batch;
    let mut cache = KvCache::with_dtype(
        model.config.n_layer,
        num_blocks,
        block_size,
        model.kv_slot_width(),
        model.default_kv_dtype(),
    );
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let tokens: Vec<Vec<u32>> = (0..batch)
        .map(|s| {
            (0..(ctx + MAX_ROWS) as u32)
                .map(|i| 100 + (i * 7 + s as u32 * 13) % 1000)
                .collect()
        })
        .collect();
    // Prefill every sequence's context once.
    for s in 0..batch {
        model.forward(
            &mut cache,
            &[SeqInput {
                tokens: &tokens[s][..ctx],
                start_pos: 0,
                block_table: &tables[s],
                want_logits: false,
                prompt_len: ctx,
            }],
        )?;
    }
    let step = |cache: &mut KvCache, rows: usize| -> Result<f64, Box<dyn std::error::Error>> {
        let inputs: Vec<SeqInput<'_>> = (0..batch)
            .map(|s| SeqInput {
                tokens: &tokens[s][ctx..ctx + rows],
                start_pos: ctx,
                block_table: &tables[s],
                want_logits: true,
                prompt_len: ctx,
            })
            .collect();
        let tails = vec![rows; batch];
        let t = Instant::now();
        model.forward_rows(cache, &inputs, &tails)?;
        Ok(t.elapsed().as_secs_f64())
    };
    // Warm up every size, then time them round-robin.
    for rows in 1..=MAX_ROWS {
        step(&mut cache, rows)?;
    }
    let mut total = [0f64; MAX_ROWS];
    for _ in 0..reps {
        for rows in 1..=MAX_ROWS {
            total[rows - 1] += step(&mut cache, rows)?;
        }
    }
    let ms: Vec<f64> = total.iter().map(|t| t * 1e3 / reps as f64).collect();
    println!("batch {batch}, context {ctx}, {reps} reps per size");
    for (i, &m) in ms.iter().enumerate() {
        let rows = i + 1;
        let per_row = if rows > 1 {
            format!(
                "; each extra row {:.2} of a one-row step",
                (m / ms[0] - 1.0) / (rows - 1) as f64
            )
        } else {
            String::new()
        };
        println!(
            "rows {rows} per sequence: {m:.2} ms/step ({:.2}x one row){per_row}",
            m / ms[0]
        );
    }
    Ok(())
}
