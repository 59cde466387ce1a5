//! What a speculative verification step costs: one sequence's decode step with `1 + k`
//! rows (its pending token and `k` proposals, all decode rows, logits for every row)
//! against the plain one-row step, at a given context length.
//!
//! cargo run --release -p strata-engine --example verify_bench -- [--ctx 256] [--reps 20]

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

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let ctx = arg(&args, "--ctx", 256);
    let reps = arg(&args, "--reps", 20);
    let path = ModelCache::from_env().resolve(DEFAULT_MODEL)?;
    let model = Llama::load(&path, WeightFormat::Gguf)?;
    let block_size = 16;
    let num_blocks = (ctx + 32).div_ceil(block_size) + 1;
    let mut cache = KvCache::with_dtype(
        model.config.n_layer,
        num_blocks,
        block_size,
        model.kv_slot_width(),
        model.default_kv_dtype(),
    );
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let tokens: Vec<u32> = (0..ctx as u32 + 32).map(|i| 100 + i % 1000).collect();
    // Prefill the context once.
    model.forward(
        &mut cache,
        &[SeqInput {
            tokens: &tokens[..ctx],
            start_pos: 0,
            block_table: &table,
            want_logits: false,
            prompt_len: ctx,
        }],
    )?;
    let mut base = 0.0;
    for rows in 1..=5usize {
        let input = SeqInput {
            tokens: &tokens[ctx..ctx + rows],
            start_pos: ctx,
            block_table: &table,
            want_logits: true,
            prompt_len: ctx,
        };
        model.forward_rows(&mut cache, &[input], &[rows])?;
        let t = Instant::now();
        for _ in 0..reps {
            model.forward_rows(&mut cache, &[input], &[rows])?;
        }
        let ms = t.elapsed().as_secs_f64() * 1e3 / reps as f64;
        if rows == 1 {
            base = ms;
        }
        println!(
            "rows {rows}: {ms:.2} ms/step ({:.2}x one row); break-even mean acceptance length {:.2}",
            ms / base,
            ms / base
        );
    }
    Ok(())
}
