//! Prompt-processing and single-stream decode throughput of the model itself (no HTTP),
//! the same two figures `llama-bench` reports as `pp` and `tg`.
//!
//! cargo run --release -p strata-engine --example engine_bench -- \
//!     [--model PATH] [--weights gguf|f32|q8_0] [--prompt 512] [--gen 128] [--reps 3]

use std::time::Instant;

use strata_engine::kv::cache::KvCache;
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};

fn arg<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model_arg: String = arg(&args, "--model", DEFAULT_MODEL.to_string());
    let weights: WeightFormat = arg(&args, "--weights", WeightFormat::Gguf);
    let n_prompt: usize = arg(&args, "--prompt", 512);
    let n_gen: usize = arg(&args, "--gen", 128);
    let reps: usize = arg(&args, "--reps", 3);
    let path = ModelCache::from_env().resolve(&model_arg)?;
    let model = Llama::load(&path, weights)?;
    let block_size = 16;
    let num_blocks = (n_prompt + n_gen).div_ceil(block_size) + 1;
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let prompt: Vec<u32> = (0..n_prompt as u32)
        .map(|i| 100 + (i * 7919) % 40000)
        .collect();
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for _ in 0..reps {
        let mut cache = KvCache::new(
            model.config.n_layer,
            num_blocks,
            block_size,
            model.kv_slot_width(),
        );
        let t = Instant::now();
        model.forward(
            &mut cache,
            &[SeqInput {
                tokens: &prompt,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                prompt_len: prompt.len(),
            }],
        )?;
        pp.push(n_prompt as f64 / t.elapsed().as_secs_f64());
        // Decode from an empty context, as llama-bench's tg does.
        let mut cache = KvCache::new(
            model.config.n_layer,
            num_blocks,
            block_size,
            model.kv_slot_width(),
        );
        let t = Instant::now();
        let mut tok = 1u32;
        for pos in 0..n_gen {
            let out = model.forward(
                &mut cache,
                &[SeqInput {
                    tokens: &[tok],
                    start_pos: pos,
                    block_table: &table,
                    want_logits: true,
                    prompt_len: 0,
                }],
            )?;
            let logits = out[0].as_ref().ok_or("no logits")?;
            tok = logits
                .iter()
                .enumerate()
                .fold((0, f32::MIN), |b, (i, &v)| if v > b.1 { (i, v) } else { b })
                .0 as u32;
        }
        tg.push(n_gen as f64 / t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    println!(
        "{{\"weights\": \"{weights}\", \"threads\": {}, \"pp{n_prompt}_tok_s\": {:.1}, \"tg{n_gen}_tok_s\": {:.1}}}",
        rayon::current_num_threads(),
        median(&mut pp),
        median(&mut tg)
    );
    Ok(())
}
