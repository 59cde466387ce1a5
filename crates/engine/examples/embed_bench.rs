//! Times the sentence encoder: sentences per second at batch 1 and batch 32 over the
//! reference sentences (the nine short ones, 7 to 11 tokens), and one 256-token input.
//!
//! `cargo run --release -p strata-engine --example embed_bench [-- MODEL_DIR [ROUNDS [ONLY]]]`;
//! the model directory defaults to the cache entry of `strata model pull all-minilm-l6-v2`
//! (`-` for the default when more arguments follow). Both weight formats (f32 and 8-bit) are
//! timed, round by round alternately; `ONLY` keeps the cases whose label contains it (`int8`,
//! `batch 32`, `batch 32 int8`), for a profile of one case.

use std::path::PathBuf;
use std::time::Instant;

use strata_engine::embed::bert::BertModel;
use strata_engine::embed::linear::EncoderWeights;
use strata_engine::embed::tokenizer::EmbedTokenizer;
use strata_engine::embed::EncoderConfig;
use strata_engine::model_cache::{ModelCache, EMBEDDING_MODEL};

const SENTENCES: &[&str] = &[
    "What is the capital city of France?",
    "Tell me the capital of France.",
    "How long should I knead bread dough?",
    "What is the capital of Germany?",
    "and the second one?",
    "A cat sits on the mat.",
    "A kitten is sitting on a rug.",
    "Quarterly revenue rose by 8 percent.",
];

/// User + system CPU time of the whole process (all threads), from `/proc/self/stat`; 0
/// where that file does not exist. On a shared machine wall time depends on the
/// neighbours, CPU time much less.
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the parenthesised command name; utime and stime are the 12th and 13th.
    let Some((_, rest)) = stat.rsplit_once(") ") else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields
        .get(11..13)
        .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
        .unwrap_or(0.0);
    // The kernel's USER_HZ is 100 on every Linux target.
    ticks / 100.0
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .filter(|d| d != "-")
        .map(PathBuf::from)
        .unwrap_or_else(|| ModelCache::from_env().path_of(EMBEDDING_MODEL));
    let rounds: usize = args.next().map(|r| r.parse()).transpose()?.unwrap_or(20);
    let only = args.next().unwrap_or_default();
    let config = EncoderConfig::from_dir(&dir)?;
    let tokenizer = EmbedTokenizer::from_file(&dir.join("tokenizer.json"))?;
    let models = [EncoderWeights::F32, EncoderWeights::Int8]
        .into_iter()
        .map(|f| Ok((f, BertModel::load_as(&dir, config.clone(), f)?)))
        .collect::<Result<Vec<_>, Box<dyn std::error::Error>>>()?;
    let inputs: Vec<Vec<u32>> = SENTENCES
        .iter()
        .map(|s| tokenizer.encode(s, true, None))
        .collect::<Result<_, _>>()?;
    let batch32: Vec<Vec<u32>> = (0..32).map(|i| inputs[i % inputs.len()].clone()).collect();
    let long = vec![tokenizer.encode(&"word ".repeat(300), true, Some(256))?];
    // Warm-up: page in the weights, start the pool.
    for (_, model) in &models {
        model.embed(&batch32)?;
    }

    let run = |model: &BertModel,
               batch: &[Vec<u32>],
               label: &str|
     -> Result<(), Box<dyn std::error::Error>> {
        let start = Instant::now();
        let cpu_start = cpu_seconds();
        for _ in 0..rounds {
            rayon::scope(|_| model.embed(batch))?;
        }
        let secs = start.elapsed().as_secs_f64();
        let cpu = cpu_seconds() - cpu_start;
        let per_forward = secs / rounds as f64;
        println!(
            "{label:<20} {:>8.1} sentences/s  {:>7.2} ms/forward  {:>7.2} CPU-ms/forward",
            (batch.len() * rounds) as f64 / secs,
            per_forward * 1e3,
            cpu / rounds as f64 * 1e3
        );
        Ok(())
    };
    println!("threads: {}", rayon::current_num_threads());
    let singles: Vec<Vec<u32>> = inputs[..1].to_vec();
    for (batch, label) in [
        (&singles, "batch 1"),
        (&batch32, "batch 32"),
        (&long, "1 × 256 tok"),
    ] {
        for (format, model) in &models {
            let label = format!("{label} {}", format.name());
            if label.contains(only.as_str()) {
                run(model, batch, &label)?;
            }
        }
    }
    Ok(())
}
