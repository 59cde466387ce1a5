//! 8-bit KV caches (`--kv-cache-dtype int8` and `fp8`) on the default model against the
//! f16 cache with the same weights: perplexity on a text close to f16's, the top logits of
//! the reference fixtures' teacher-forced steps within a stated distance, and the greedy
//! token the same wherever f16's own choice is not a near-tie.

mod common;

use common::reference_fixture::{fixture, Case};
use strata_engine::kv::cache::{KvCache, KvDtype};
use strata_engine::model::{Llama, SeqInput, WeightFormat};
use strata_engine::tokenizer::Tokenizer;

const EIGHT_BIT: [KvDtype; 2] = [KvDtype::Int8, KvDtype::Fp8E4m3];

fn cache(model: &Llama, num_blocks: usize, dtype: KvDtype) -> KvCache {
    KvCache::with_heads(
        model.config.n_layer,
        num_blocks,
        16,
        model.config.n_kv_head,
        model.config.head_dim,
        dtype,
    )
}

/// The prompt in one step, then the reference's greedy tokens one decode step each (the
/// decode rows read every earlier key and value from the cache): the logits of each step.
fn teacher_forced(model: &Llama, case: &Case, dtype: KvDtype) -> Vec<Vec<f32>> {
    let total = case.prompt_ids.len() + case.greedy_ids.len();
    let num_blocks = total.div_ceil(16);
    let mut cache = cache(model, num_blocks, dtype);
    // Scattered blocks: the scales must follow the table like the codes.
    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
    let mut rows = Vec::new();
    let mut tokens: &[u32] = &case.prompt_ids;
    let mut pos = 0;
    for step in 0..case.greedy_ids.len() {
        let out = model
            .forward(
                &mut cache,
                &[SeqInput {
                    tokens,
                    start_pos: pos,
                    block_table: &table,
                    want_logits: true,
                    prompt_len: case.prompt_ids.len(),
                }],
            )
            .expect("forward");
        rows.push(out[0].clone().expect("logits"));
        pos += tokens.len();
        tokens = std::slice::from_ref(&case.greedy_ids[step]);
    }
    rows
}

fn top2(row: &[f32]) -> (usize, f32) {
    let (mut best, mut second) = (0, f32::NEG_INFINITY);
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            second = row[best];
            best = i;
        } else if i != best && v > second {
            second = v;
        }
    }
    (best, row[best] - second)
}

/// How far an 8-bit cache may move any of the f16 cache's five top logits (logit units;
/// the default model's top logits are 10–30). Measured worst on the fixtures with 8-bit
/// activations (the default): int8 1.59, fp8 1.91, and an exact f32 cache 1.28 from the
/// same f16 one: the activations' rounding amplifies any change in the attention output.
const TOP5_BOUND: f32 = 2.5;

/// Below this margin between f16's best and second logit a step is a near-tie, where a
/// different greedy token is no disagreement. Measured: every change of greedy token, for
/// int8, fp8 and an exact f32 cache alike, came at a margin under 0.5.
const NEAR_TIE: f32 = 1.0;

/// The f16 cache's five best token ids of a row.
fn top5(row: &[f32]) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.select_nth_unstable_by(4, |a, b| row[*b].total_cmp(&row[*a]));
    idx.truncate(5);
    idx
}

#[test]
fn eight_bit_caches_keep_logits_and_greedy_tokens_of_the_f16_cache() {
    let fx = fixture();
    let model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("load");
    let want: Vec<Vec<Vec<f32>>> = fx
        .cases
        .iter()
        .map(|case| teacher_forced(&model, case, KvDtype::F16))
        .collect();
    let mut failures = Vec::new();
    for dtype in EIGHT_BIT {
        let (mut worst, mut steps, mut compared) = (0f32, 0, 0);
        for (case, want) in fx.cases.iter().zip(&want) {
            let got = teacher_forced(&model, case, dtype);
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                steps += 1;
                for j in top5(w) {
                    worst = worst.max((w[j] - g[j]).abs());
                }
                let ((wt, margin), (gt, _)) = (top2(w), top2(g));
                if margin >= NEAR_TIE {
                    compared += 1;
                    if wt != gt {
                        failures.push(format!(
                            "{dtype} {} step {i}: greedy {gt}, f16 {wt} (margin {margin:.2})",
                            case.name
                        ));
                    }
                }
            }
        }
        eprintln!(
            "{dtype}: worst top-5 |Δlogit| {worst:.3} over {steps} steps; greedy compared on {compared}"
        );
        if worst > TOP5_BOUND {
            failures.push(format!(
                "{dtype}: a top logit moved {worst:.3} (bound {TOP5_BOUND})"
            ));
        }
        assert!(
            compared * 2 > steps,
            "{dtype}: only {compared} of {steps} steps are clear of a near-tie"
        );
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Mean negative log-likelihood of `ids` teacher-forced in windows of 256 tokens.
fn mean_nll(model: &Llama, ids: &[u32], dtype: KvDtype) -> f64 {
    const WINDOW: usize = 256;
    let table: Vec<u32> = (0..(WINDOW / 16) as u32).collect();
    let (mut nll, mut count) = (0f64, 0usize);
    for chunk in ids.chunks(WINDOW).filter(|c| c.len() > 1) {
        let mut cache = cache(model, WINDOW / 16, dtype);
        let rows = model
            .forward_rows(
                &mut cache,
                &[SeqInput {
                    tokens: chunk,
                    start_pos: 0,
                    block_table: &table,
                    want_logits: true,
                    prompt_len: chunk.len(),
                }],
                &[chunk.len()],
            )
            .expect("forward");
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
    nll / count as f64
}

/// How far each 8-bit cache's perplexity may be from the f16 cache's. int8 keeps within
/// 1 % (measured +0.14 % on this text with keys scored against a 16-bit query, −0.10 %
/// before that; −0.11 % on the GPL-3 text of docs/BENCHMARKS.md);
/// E4M3's three mantissa bits cost more whatever the scale (+0.97 % here, +1.17 % there).
const PERPLEXITY_BOUND: [(KvDtype, f64); 2] = [(KvDtype::Int8, 0.01), (KvDtype::Fp8E4m3, 0.015)];

#[test]
fn eight_bit_caches_keep_perplexity_close_to_f16() {
    let path = common::model_path();
    let model = Llama::load(&path, WeightFormat::Gguf).expect("load");
    let tokenizer = Tokenizer::from_gguf_path(&path).expect("tokenizer");
    // English prose that ships with the repository.
    let text = include_str!("../../../docs/ENGINE.md");
    let mut ids = tokenizer.encode(text, false, false).expect("encode");
    ids.truncate(1024);
    assert_eq!(ids.len(), 1024, "the text is long enough");
    let f16 = mean_nll(&model, &ids, KvDtype::F16).exp();
    for (dtype, bound) in PERPLEXITY_BOUND {
        let ppl = mean_nll(&model, &ids, dtype).exp();
        let rel = ppl / f16 - 1.0;
        eprintln!(
            "perplexity: f16 {f16:.4}, {dtype} {ppl:.4} ({:+.3} %)",
            rel * 100.0
        );
        assert!(
            rel.abs() <= bound,
            "{dtype}: perplexity {ppl:.4} vs f16 {f16:.4} ({:+.2} %, bound {} %)",
            rel * 100.0,
            bound * 100.0
        );
    }
}

#[test]
fn an_engine_serves_from_an_8bit_cache_and_says_so() {
    use strata_engine::server::EngineOptions;
    for (dtype, name) in [(KvDtype::Int8, "int8"), (KvDtype::Fp8E4m3, "fp8_e4m3")] {
        let addr = common::serve(&EngineOptions {
            num_blocks: Some(64),
            max_model_len: Some(512),
            kv_cache_dtype: Some(dtype),
            ..EngineOptions::default()
        });
        let body = serde_json::json!({
            "model": "smollm2-135m-instruct",
            "prompt": "A paged cache keeps each sequence's keys and values in blocks of sixteen \
                tokens, so that a prompt seen before is found again block by block. The capital \
                of France is",
            "max_tokens": 8,
            "temperature": 0,
        });
        let (status, v) = common::post(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
        // The same prompt again is a prefix-cache hit over 8-bit blocks, and greedy
        // decoding from them gives the same text.
        let (status, again) = common::post(addr, "/v1/completions", &body);
        assert_eq!(status, 200, "{again}");
        assert_eq!(again["choices"][0]["text"], v["choices"][0]["text"]);
        let cached = &again["usage"]["prompt_tokens_details"]["cached_tokens"];
        assert!(cached.as_u64().is_some_and(|n| n >= 32), "{again}");
        let (_, metrics) = common::request(addr, "GET", "/metrics", b"");
        assert!(
            metrics.contains(&format!("cache_dtype=\"{name}\"")),
            "{dtype}: {metrics}"
        );
    }
}
