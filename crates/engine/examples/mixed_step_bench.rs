//! What a prefill chunk costs the decodes that share its step: times steps of `--decodes`
//! running sequences (one token each, `--ctx` tokens of context) plus a chunk of N prompt
//! tokens of another sequence (at `--chunk-at` tokens of context), for each N given. The
//! step time is every one of those decodes' inter-token gap, so this is the curve the
//! step planner's step budget picks a point on.
//!
//! cargo run --release -p strata-engine --example mixed_step_bench -- \
//!     [--model PATH] [--decodes 3] [--ctx 1016] [--chunk-at 512] [--reps 5] [N ...]
//!
//! Prints one JSON line per chunk size: median and minimum step milliseconds.

use std::time::Instant;

use strata_engine::kv::cache::KvCache;
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};

mod common;
use common::arg;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model_arg: String = arg(&args, "--model", DEFAULT_MODEL.to_string());
    let decodes: usize = arg(&args, "--decodes", 3);
    let ctx: usize = arg(&args, "--ctx", 1016);
    let chunk_at: usize = arg(&args, "--chunk-at", 512);
    let reps: usize = arg(&args, "--reps", 5).max(1);
    // Bare numbers after the flags' values are chunk sizes.
    let mut chunks: Vec<usize> = Vec::new();
    let mut i = 1;
    while i < args.len() {
        if args[i].starts_with("--") {
            i += 2;
            continue;
        }
        if let Ok(n) = args[i].parse() {
            chunks.push(n);
        }
        i += 1;
    }
    if chunks.is_empty() {
        chunks = vec![0, 16, 32, 64, 128, 256];
    }
    let max_chunk = chunks.iter().copied().max().unwrap_or(0);
    let path = ModelCache::from_env().resolve(&model_arg)?;
    let model = Llama::load(&path, WeightFormat::Gguf)?;
    let block_size = 16;
    // Every decode sequence: its context plus the one token it runs; the prefilling one:
    // its chunk's context plus the largest chunk.
    let per_decode = (ctx + 1).div_ceil(block_size);
    let per_prefill = (chunk_at + max_chunk).div_ceil(block_size);
    let num_blocks = decodes * per_decode + per_prefill;
    let mut cache = KvCache::with_dtype(
        model.config.n_layer,
        num_blocks,
        block_size,
        model.kv_slot_width(),
        model.default_kv_dtype(),
    );
    let tables: Vec<Vec<u32>> = (0..decodes)
        .map(|d| ((d * per_decode) as u32..((d + 1) * per_decode) as u32).collect())
        .collect();
    let prefill_table: Vec<u32> = ((decodes * per_decode) as u32..num_blocks as u32).collect();
    let tokens = |seed: usize, n: usize| -> Vec<u32> {
        (0..n as u32)
            .map(|i| 100 + (i * 7919 + seed as u32 * 104_729) % 40000)
            .collect()
    };
    // Fill every context once (prefill steps, not timed).
    let prompts: Vec<Vec<u32>> = (0..decodes).map(|d| tokens(d, ctx + 1)).collect();
    for (d, p) in prompts.iter().enumerate() {
        model.forward(
            &mut cache,
            &[SeqInput {
                tokens: &p[..ctx],
                start_pos: 0,
                block_table: &tables[d],
                want_logits: false,
                prompt_len: ctx,
            }],
        )?;
    }
    let long = tokens(decodes, chunk_at + max_chunk);
    if chunk_at > 0 {
        model.forward(
            &mut cache,
            &[SeqInput {
                tokens: &long[..chunk_at],
                start_pos: 0,
                block_table: &prefill_table,
                want_logits: false,
                prompt_len: long.len(),
            }],
        )?;
    }
    for &n in &chunks {
        let mut times = Vec::with_capacity(reps);
        for _ in 0..reps + 1 {
            // Each decode runs its next token at position `ctx` (rewritten every rep, so
            // every step sees the same context), the prefill its chunk after `chunk_at`.
            let mut seqs: Vec<SeqInput<'_>> = (0..decodes)
                .map(|d| SeqInput {
                    tokens: &prompts[d][ctx..ctx + 1],
                    start_pos: ctx,
                    block_table: &tables[d],
                    want_logits: true,
                    prompt_len: ctx,
                })
                .collect();
            if n > 0 {
                seqs.push(SeqInput {
                    tokens: &long[chunk_at..chunk_at + n],
                    start_pos: chunk_at,
                    block_table: &prefill_table,
                    want_logits: false,
                    prompt_len: long.len(),
                });
            }
            let t = Instant::now();
            model.forward(&mut cache, &seqs)?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        // The first run warms the caches for this shape.
        times.remove(0);
        times.sort_by(f64::total_cmp);
        println!(
            "{{\"decodes\": {decodes}, \"ctx\": {ctx}, \"chunk\": {n}, \"step_ms_median\": {:.1}, \"step_ms_min\": {:.1}}}",
            times[times.len() / 2],
            times[0]
        );
    }
    Ok(())
}
