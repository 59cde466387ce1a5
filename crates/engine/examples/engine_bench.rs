//! Prompt-processing and single-stream decode throughput of the model itself (no HTTP),
//! the same two figures `llama-bench` reports as `pp` and `tg`.
//!
//! cargo run --release -p strata-engine --example engine_bench -- \
//!     [--model PATH] [--weights gguf|f32|q8_0] [--prompt 512] [--gen 128] [--reps 3]
//!     [--batch B [--ctx 512] [--steps 32]] [--exact-decode] [--exact-prefill] [--kv-cache-dtype f16|f32]
//!
//! With `--batch`, it also serves `B` sequences of `--ctx` prompt tokens the way the
//! step planner would (prefill steps of up to 2048 tokens, then one decode step for all `B`
//! per token) and reports that prefill's tokens/s and the decode step's milliseconds.
//! `tg_best_token_ms` and `batch_decode_best_step_ms` are the fastest single token and
//! decode step: on a machine shared with other work, the figures least disturbed by it.

use std::time::Instant;

use strata_engine::kv::cache::{KvCache, KvDtype};
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};

mod common;
use common::arg;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let model_arg: String = arg(&args, "--model", DEFAULT_MODEL.to_string());
    let weights: WeightFormat = arg(&args, "--weights", WeightFormat::Gguf);
    let n_prompt: usize = arg(&args, "--prompt", 512);
    let n_gen: usize = arg(&args, "--gen", 128);
    let reps: usize = arg(&args, "--reps", 3);
    let path = ModelCache::from_env().resolve(&model_arg)?;
    let mut model = Llama::load(&path, weights)?;
    model.q8_decode &= !args.iter().any(|a| a == "--exact-decode");
    model.q8_prompt &= !args.iter().any(|a| a == "--exact-prefill");
    let kv_dtype: KvDtype = arg(&args, "--kv-cache-dtype", model.default_kv_dtype());
    let block_size = 16;
    let num_blocks = (n_prompt + n_gen).div_ceil(block_size) + 1;
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    // Token ids spread over the vocabulary (the same ids as always for one of 40,100 tokens
    // or more; a tiny model's smaller vocabulary wraps them).
    let vocab = model.config.vocab_size as u32;
    let prompt: Vec<u32> = (0..n_prompt as u32)
        .map(|i| (100 + (i * 7919) % 40000) % vocab)
        .collect();
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    // The fastest single token over every rep: on a shared machine, the figure least
    // disturbed by other load.
    let mut tg_best = f64::INFINITY;
    for _ in 0..reps {
        let mut cache = KvCache::with_heads(
            model.config.n_layer,
            num_blocks,
            block_size,
            model.config.n_kv_head,
            model.config.head_dim,
            kv_dtype,
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
        let mut cache = KvCache::with_heads(
            model.config.n_layer,
            num_blocks,
            block_size,
            model.config.n_kv_head,
            model.config.head_dim,
            kv_dtype,
        );
        let t = Instant::now();
        let mut tok = 1u32;
        for pos in 0..n_gen {
            let t_tok = Instant::now();
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
            tg_best = tg_best.min(t_tok.elapsed().as_secs_f64());
        }
        tg.push(n_gen as f64 / t.elapsed().as_secs_f64());
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    let batch: usize = arg(&args, "--batch", 0);
    let batched = if batch > 0 {
        let ctx: usize = arg(&args, "--ctx", 512);
        let steps: usize = arg(&args, "--steps", 32);
        let (pp, step, best) = batched_decode(&model, kv_dtype, batch, ctx, steps)?;
        format!(
            ", \"batch\": {batch}, \"batch_prefill_tok_s\": {pp:.1}, \"batch_decode_ms_per_step\": {:.1}, \"batch_decode_best_step_ms\": {:.1}",
            step * 1e3,
            best * 1e3
        )
    } else {
        String::new()
    };
    println!(
        "{{\"weights\": \"{weights}\", \"q8_decode\": {}, \"q8_prompt\": {}, \"kv_dtype\": \"{kv_dtype}\", \"threads\": {}, \"pp{n_prompt}_tok_s\": {:.1}, \"tg{n_gen}_tok_s\": {:.1}, \"tg_best_token_ms\": {:.2}{batched}}}",
        model.q8_decode,
        model.q8_prompt && model.q8_decode,
        rayon::current_num_threads(),
        median(&mut pp),
        median(&mut tg),
        tg_best * 1e3
    );
    Ok(())
}

/// `batch` sequences of `ctx` prompt tokens: prefill in steps of up to 2048 tokens, then
/// `steps` decode steps of one token per sequence. Returns (prefill tokens/s, seconds per
/// decode step, seconds of the fastest step).
fn batched_decode(
    model: &Llama,
    kv_dtype: KvDtype,
    batch: usize,
    ctx: usize,
    steps: usize,
) -> Result<(f64, f64, f64), Box<dyn std::error::Error>> {
    const BUDGET: usize = 2048;
    let block_size = 16;
    let per_seq = (ctx + steps).div_ceil(block_size);
    let mut cache = KvCache::with_heads(
        model.config.n_layer,
        batch * per_seq,
        block_size,
        model.config.n_kv_head,
        model.config.head_dim,
        kv_dtype,
    );
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|b| ((b * per_seq) as u32..((b + 1) * per_seq) as u32).collect())
        .collect();
    let mut tokens: Vec<Vec<u32>> = (0..batch)
        .map(|b| {
            (0..ctx as u32)
                .map(|i| {
                    (100 + (i * 7919 + b as u32 * 104_729) % 40000) % model.config.vocab_size as u32
                })
                .collect()
        })
        .collect();
    // Prefill: fill each step's budget with the next chunks, sequence after sequence.
    let mut done = vec![0usize; batch];
    let t = Instant::now();
    while done.iter().any(|&d| d < ctx) {
        let mut budget = BUDGET;
        let mut inputs = Vec::new();
        let mut took = Vec::new();
        for b in 0..batch {
            if budget == 0 || done[b] == ctx {
                continue;
            }
            let n = (ctx - done[b]).min(budget);
            budget -= n;
            inputs.push(SeqInput {
                tokens: &tokens[b][done[b]..done[b] + n],
                start_pos: done[b],
                block_table: &tables[b],
                want_logits: done[b] + n == ctx,
                prompt_len: ctx,
            });
            took.push((b, n));
        }
        model.forward(&mut cache, &inputs)?;
        for (b, n) in took {
            done[b] += n;
        }
    }
    let prefill = (batch * ctx) as f64 / t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut best = f64::INFINITY;
    for step in 0..steps {
        let t_step = Instant::now();
        for (b, seq) in tokens.iter_mut().enumerate() {
            seq.push(1 + b as u32);
        }
        let pos = ctx + step;
        let inputs: Vec<SeqInput<'_>> = (0..batch)
            .map(|b| SeqInput {
                tokens: &tokens[b][pos..pos + 1],
                start_pos: pos,
                block_table: &tables[b],
                want_logits: true,
                prompt_len: ctx,
            })
            .collect();
        model.forward(&mut cache, &inputs)?;
        best = best.min(t_step.elapsed().as_secs_f64());
    }
    Ok((prefill, t.elapsed().as_secs_f64() / steps as f64, best))
}
