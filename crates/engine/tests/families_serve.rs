//! Every model family served like `strata engine --model PATH` would serve it (the tiny
//! GGUFs of tools/families/): greedy completions of llama.cpp's prompts, sent all at once
//! (one batch) and then one by one with their prompts' blocks in the prefix cache, equal
//! the model's own greedy continuation run step by step outside the server. Prompts are
//! longer than the sliding windows, so window layers read only recent keys throughout.

mod common;

use std::path::PathBuf;

use serde::Deserialize;
use serde_json::json;
use strata_engine::kv::cache::KvCache;
use strata_engine::model::{Model, SeqInput, WeightFormat};
use strata_engine::server::{self, EngineOptions};

const FAMILIES: &[&str] = &[
    "llama3",
    "llama_yarn",
    "qwen2",
    "qwen3",
    "phi3",
    "gemma2",
    "gemma3",
];
const NEW_TOKENS: usize = 12;

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    prompt_ids: Vec<u32>,
}

fn path(family: &str, ext: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join(format!("tests/fixtures/families/{family}.{ext}"))
}

/// Greedy decoding one token at a time through [`Model::forward`].
fn direct_greedy(model: &Model, prompt: &[u32]) -> Vec<u32> {
    let block = 16;
    let total = prompt.len() + NEW_TOKENS;
    let mut cache = KvCache::new(
        model.config.n_layer,
        total.div_ceil(block),
        block,
        model.kv_slot_width(),
    );
    let table: Vec<u32> = (0..total.div_ceil(block) as u32).collect();
    let mut tokens = prompt.to_vec();
    let mut start = 0;
    while tokens.len() < total {
        let out = model
            .forward(
                &mut cache,
                &[SeqInput {
                    tokens: &tokens[start..],
                    start_pos: start,
                    block_table: &table,
                    want_logits: true,
                    prompt_len: prompt.len(),
                }],
            )
            .expect("forward");
        let row = out[0].as_ref().expect("logits");
        let best = (0..row.len()).fold(0, |b, i| if row[i] > row[b] { i } else { b });
        start = tokens.len();
        tokens.push(best as u32);
    }
    tokens[prompt.len()..].to_vec()
}

fn complete(addr: std::net::SocketAddr, model: &str, prompt: &[u32]) -> String {
    let (status, body) = common::post(
        addr,
        "/v1/completions",
        &json!({
            "model": model,
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "ignore_eos": true,
        }),
    );
    assert_eq!(status, 200, "{body}");
    body["choices"][0]["text"]
        .as_str()
        .expect("completion text")
        .to_string()
}

#[test]
fn every_family_serves_its_greedy_continuations_batched_and_from_the_prefix_cache() {
    for family in FAMILIES {
        let gguf = path(family, "gguf");
        let fx: Fixture =
            serde_json::from_str(&std::fs::read_to_string(path(family, "json")).expect("json"))
                .expect("fixture");
        let model = Model::load(&gguf, WeightFormat::F32).expect("load");
        let opts = EngineOptions {
            model_path: gguf.clone(),
            model_name: family.to_string(),
            weights: WeightFormat::F32,
            num_blocks: Some(128),
            prefix_caching: true,
            generation_config: "vllm".into(),
            ..EngineOptions::default()
        };
        let loaded = server::load(&opts).expect("serve the model");
        let state = loaded.state.clone();
        let addr = common::serve_app(server::router(state.clone()), state.clone());
        let want: Vec<String> = fx
            .cases
            .iter()
            .map(|c| {
                let ids = direct_greedy(&model, &c.prompt_ids);
                state.tokenizer.decode(&ids, true).expect("decode")
            })
            .collect();
        // All at once: the scheduler batches them.
        let batched: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = fx
                .cases
                .iter()
                .map(|c| s.spawn(|| complete(addr, family, &c.prompt_ids)))
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("request thread"))
                .collect()
        });
        assert_eq!(batched, want, "{family}: batched completions");
        let hits_before = state.metrics.prefix_cache_hits.get();
        for (c, w) in fx.cases.iter().zip(&want) {
            assert_eq!(
                &complete(addr, family, &c.prompt_ids),
                w,
                "{family}: cached prompt"
            );
        }
        assert!(
            state.metrics.prefix_cache_hits.get() > hits_before,
            "{family}: the repeated prompts found no cached blocks"
        );
        drop(loaded);
    }
}
