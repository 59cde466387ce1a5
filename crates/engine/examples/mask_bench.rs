//! What a structured-output mask costs per token on the default model's vocabulary: the
//! JSON schema of `bench/engine_features.py` (an order with items) is compiled, then a
//! valid document is walked token by token; each step computes the grammar's mask and
//! applies it to a full row of logits (what the engine does before every sample of a
//! constrained sequence), then advances the grammar by the document's token.
//!
//! cargo run --release -p strata-engine --example mask_bench -- [--reps 20]

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use strata_api::validate::StructuredOutput;
use strata_engine::model_cache::{ModelCache, DEFAULT_MODEL};
use strata_engine::structured::GrammarCompiler;
use strata_engine::tokenizer::Tokenizer;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let reps: usize = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(20)
        .max(1);
    let path = ModelCache::from_env().resolve(DEFAULT_MODEL)?;
    let tokenizer = Arc::new(Tokenizer::from_gguf_path(&path)?);
    let t = Instant::now();
    let compiler = GrammarCompiler::new(tokenizer.clone())?;
    let trie = t.elapsed();
    let schema = json!({
        "type": "object",
        "properties": {
            "customer": {"type": "string", "maxLength": 30},
            "items": {"type": "array", "maxItems": 4, "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 20},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000}},
                "required": ["name", "quantity", "price"],
                "additionalProperties": false}},
            "express": {"type": "boolean"}},
        "required": ["customer", "items", "express"],
        "additionalProperties": false
    });
    let constraint = StructuredOutput::JsonSchema {
        name: Some("order".into()),
        schema,
        strict: true,
    };
    let doc = r#"{"customer": "Ada Lovelace", "items": [{"name": "notebook", "quantity": 3, "price": 4.5}, {"name": "pencil", "quantity": 12, "price": 0.8}], "express": true}"#;
    let tokens = tokenizer.encode(doc, false, false)?;
    let vocab = tokenizer.vocab_size();
    // Logits of a plausible shape: any values do, the mask does not look at them.
    let row: Vec<f32> = (0..vocab)
        .map(|i| ((i * 7919) % 1000) as f32 / 100.0)
        .collect();
    let mut compile = Duration::ZERO;
    let mut masked = Duration::ZERO;
    let mut steps = 0u32;
    let mut mask_only = Duration::ZERO;
    for _ in 0..reps {
        let t = Instant::now();
        let mut g = compiler.compile(&constraint)?;
        compile += t.elapsed();
        for &tok in &tokens {
            let mut logits = row.clone();
            let t = Instant::now();
            let allowed = g.mask_logits(&mut logits)?;
            masked += t.elapsed();
            if !allowed.contains(tok) {
                return Err(format!("the grammar refused token {tok} of a valid document").into());
            }
            g.accept(tok)?;
            steps += 1;
        }
        mask_only += g.mask_time;
    }
    println!(
        "vocabulary {vocab}: trie built in {:.1} ms; schema compiled in {:.2} ms; \
         {} tokens x {reps} reps: mask {:.1} us per token, mask + apply to the logits {:.1} us per token",
        trie.as_secs_f64() * 1e3,
        compile.as_secs_f64() * 1e3 / reps as f64,
        tokens.len(),
        mask_only.as_secs_f64() * 1e6 / f64::from(steps),
        masked.as_secs_f64() * 1e6 / f64::from(steps),
    );
    Ok(())
}
