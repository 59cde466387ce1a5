//! Perplexity of the model on a text file, teacher-forced in windows, under each way of
//! holding weights and activations (what `llama-perplexity` measures):
//!
//! cargo run --release -p strata-engine --example perplexity -- FILE [--model PATH]
//!     [--window 512] [--max-tokens 4096] [--kv-cache-dtype f32]
//!
//! Prints one JSON line per mode: `f32` (weights dequantized to f32), `gguf exact` (the
//! stored blocks with f32 activations: `--exact-decode`), `gguf q8` (the default: 8-bit
//! activations for every row; decode rows use the same kernel, so this is also what
//! decoding sees). `--kv-cache-dtype` (f32, f16, int8, fp8) is the cache every mode
//! runs over. Every window is run as one prompt; the loss of token `i + 1` is read
//! from row `i`'s logits.

use strata_engine::kv::cache::{KvCache, KvDtype};
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};
use strata_engine::tokenizer::Tokenizer;

mod common;
use common::arg;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let file = args.get(1).ok_or("usage: perplexity FILE [--model PATH]")?;
    let model_arg: String = arg(&args, "--model", DEFAULT_MODEL.to_string());
    let window: usize = arg(&args, "--window", 512);
    let max_tokens: usize = arg(&args, "--max-tokens", 4096);
    let kv_dtype: KvDtype = arg(&args, "--kv-cache-dtype", KvDtype::F32);
    let path = ModelCache::from_env().resolve(&model_arg)?;
    let text = std::fs::read_to_string(file)?;
    let tokenizer = Tokenizer::from_gguf_path(&path)?;
    let mut ids = tokenizer.encode(&text, false, false)?;
    ids.truncate(max_tokens);
    let modes = [
        ("f32", WeightFormat::F32, false),
        ("gguf exact", WeightFormat::Gguf, false),
        ("gguf q8", WeightFormat::Gguf, true),
    ];
    for (name, format, q8) in modes {
        let mut model = Llama::load(&path, format)?;
        model.q8_decode = q8;
        model.q8_prompt = q8;
        let block_size = 16;
        let num_blocks = window.div_ceil(block_size);
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        let (mut nll, mut count) = (0f64, 0usize);
        for chunk in ids.chunks(window).filter(|c| c.len() > 1) {
            let mut cache = KvCache::with_heads(
                model.config.n_layer,
                num_blocks,
                block_size,
                model.config.n_kv_head,
                model.config.head_dim,
                kv_dtype,
            );
            let rows = model.forward_rows(
                &mut cache,
                &[SeqInput {
                    tokens: chunk,
                    start_pos: 0,
                    block_table: &table,
                    want_logits: true,
                    prompt_len: chunk.len(),
                }],
                &[chunk.len()],
            )?;
            for (logits, &next) in rows[0].iter().zip(&chunk[1..]) {
                let max = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
                let lse = logits
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln()
                    + f64::from(max);
                nll += lse - f64::from(logits[next as usize]);
                count += 1;
            }
        }
        let mean = nll / count.max(1) as f64;
        println!(
            "{{\"mode\": \"{name}\", \"kv_cache_dtype\": \"{kv_dtype}\", \"tokens\": {count}, \"mean_nll\": {mean:.5}, \"perplexity\": {:.4}}}",
            mean.exp()
        );
    }
    Ok(())
}
