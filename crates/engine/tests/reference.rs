//! The engine against the reference oracle (`tools/reference/oracle.py`): transformers
//! running the same GGUF dequantized to f32. With f32 weights every greedy token and every
//! top-5 logit must match; with the weights kept in their GGUF blocks and exact decode the
//! free-running greedy continuations must match too. With 8-bit activations (the default,
//! for prompt and decode rows) the logits must stay within a stated distance of the
//! reference, and the greedy token must agree wherever the reference's own margin is wider
//! than twice that.

mod common;

use common::reference_fixture::{fixture, Case};
use strata_engine::kv::cache::KvCache;
use strata_engine::model::{Llama, SeqInput, WeightFormat};

/// Runs the prompt then teacher-forces the reference's greedy tokens, returning the
/// logits after the prompt and after each forced token (one row per reference step).
fn run_case(model: &Llama, case: &Case) -> Vec<Vec<f32>> {
    let block_size = 16;
    let total = case.prompt_ids.len() + case.greedy_ids.len();
    let num_blocks = total.div_ceil(block_size);
    let mut cache = KvCache::new(
        model.config.n_layer,
        num_blocks,
        block_size,
        model.kv_slot_width(),
    );
    // A scrambled block table: attention must follow the table, not assume contiguity.
    let table: Vec<u32> = (0..num_blocks as u32).rev().collect();
    let mut rows = Vec::new();
    let first = model
        .forward(
            &mut cache,
            &[SeqInput {
                tokens: &case.prompt_ids,
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                prompt_len: case.prompt_ids.len(),
            }],
        )
        .expect("prefill");
    rows.push(first[0].clone().expect("logits"));
    let forced = &case.greedy_ids[..case.greedy_ids.len() - 1];
    for (i, &tok) in forced.iter().enumerate() {
        let pos = case.prompt_ids.len() + i;
        let out = model
            .forward(
                &mut cache,
                &[SeqInput {
                    tokens: &[tok],
                    start_pos: pos,
                    block_table: &table,
                    want_logits: true,
                    prompt_len: case.prompt_ids.len(),
                }],
            )
            .expect("decode");
        rows.push(out[0].clone().expect("logits"));
    }
    rows
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn f32_weights_match_reference_tokens_and_logits() {
    let fx = fixture();
    let path = common::model_path();
    assert_eq!(
        strata_engine::model_cache::file_sha256(&path).expect("hash"),
        fx.model_sha256,
        "the fixture was made from a different model file"
    );
    let model = Llama::load(&path, WeightFormat::F32).expect("load f32");
    let mut failures = Vec::new();
    let mut worst = 0f32;
    for case in &fx.cases {
        let rows = run_case(&model, case);
        for (i, (row, step)) in rows.iter().zip(&case.steps).enumerate() {
            let got = argmax(row);
            if got != case.greedy_ids[i] {
                failures.push(format!(
                    "{} step {i}: greedy {got}, reference {}",
                    case.name, case.greedy_ids[i]
                ));
            }
            for &(id, logit) in &step.top5 {
                let ours = row[id as usize];
                let rel = (ours - logit).abs() / logit.abs().max(1.0);
                worst = worst.max(rel);
                if rel > 1e-3 {
                    failures.push(format!(
                        "{} step {i}: logit of {id} is {ours}, reference {logit} (rel {rel:.2e})",
                        case.name
                    ));
                }
            }
        }
    }
    eprintln!("worst relative logit error: {worst:.2e}");
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
}

#[test]
fn gguf_block_weights_match_greedy_continuations() {
    let fx = fixture();
    let mut model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("load gguf");
    model.q8_decode = false;
    let mut matched = 0;
    let mut report = Vec::new();
    for case in &fx.cases {
        // Free-running greedy decode: the continuation must equal the reference's.
        let block_size = 16;
        let total = case.prompt_ids.len() + case.greedy_ids.len();
        let num_blocks = total.div_ceil(block_size);
        let mut cache = KvCache::new(
            model.config.n_layer,
            num_blocks,
            block_size,
            model.kv_slot_width(),
        );
        let table: Vec<u32> = (0..num_blocks as u32).collect();
        let mut tokens = case.prompt_ids.clone();
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
                        prompt_len: case.prompt_ids.len(),
                    }],
                )
                .expect("forward");
            start = tokens.len();
            tokens.push(argmax(out[0].as_ref().expect("logits")));
        }
        let ours = &tokens[case.prompt_ids.len()..];
        let agree = ours
            .iter()
            .zip(&case.greedy_ids)
            .take_while(|(a, b)| a == b)
            .count();
        if agree == case.greedy_ids.len() {
            matched += 1;
        }
        report.push(format!(
            "{}: {agree}/{} tokens",
            case.name,
            case.greedy_ids.len()
        ));
    }
    eprintln!("gguf-weights greedy agreement:\n{}", report.join("\n"));
    let needed = (fx.cases.len() * 5).div_ceil(6);
    assert!(
        matched >= needed,
        "only {matched}/{} continuations matched (need {needed}):\n{}",
        fx.cases.len(),
        report.join("\n")
    );
}

/// How far 8-bit activations may move a logit relative to the reference's top logit
/// (logit units; softmax and greedy only see these differences, and the default model's
/// top logits are 10–30). Measured worst on the fixture: 0.53 with the GGUF-layout integer
/// kernel, 1.06 (one logit 9.4 below the top, one step) with the packed kernel, whose
/// integer sums are the same but whose float order differs: that moves later layers'
/// 8-bit rounding, so this is a draw of quantization noise, not a fixed figure.
const Q8_DECODE_LOGIT_TOLERANCE: f32 = 1.2;
/// Greedy must agree with the reference wherever the reference's own top two are further
/// apart than this (the 8-bit noise seen at the top of the distribution stays well below).
const GREEDY_MARGIN: f32 = 0.6;

#[test]
fn q8_activations_stay_near_the_reference_and_agree_outside_near_ties() {
    let model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("load gguf");
    assert!(
        model.q8_decode && model.q8_prompt,
        "8-bit activations are the default for 4-bit weights"
    );
    q8_near_the_reference(&model, "8-bit prompt and decode rows");
}

#[test]
fn q8_decode_after_an_exact_prefill_stays_near_the_reference() {
    let mut model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("load gguf");
    model.q8_prompt = false;
    q8_near_the_reference(&model, "f32 prompt rows, 8-bit decode rows");
}

fn q8_near_the_reference(model: &Llama, label: &str) {
    let fx = fixture();
    let mut worst = 0f32;
    let mut failures = Vec::new();
    let mut checked = 0;
    for case in &fx.cases {
        // Teacher-forced, so every step sees the reference's context; rows after the
        // first are decode rows.
        let rows = run_case(model, case);
        for (i, (row, step)) in rows.iter().zip(&case.steps).enumerate() {
            let (top, top_logit) = step.top5[0];
            for &(id, logit) in &step.top5[1..] {
                let ours = row[id as usize] - row[top as usize];
                let err = (ours - (logit - top_logit)).abs();
                worst = worst.max(err);
                if err > Q8_DECODE_LOGIT_TOLERANCE {
                    failures.push(format!(
                        "{} step {i}: logit of {id} is {ours} from the top, reference {}",
                        case.name,
                        logit - top_logit
                    ));
                }
            }
            // Greedy may only flip where the reference's own top two are close.
            let margin = top_logit - step.top5[1].1;
            if margin > GREEDY_MARGIN {
                checked += 1;
                let got = argmax(row);
                if got != case.greedy_ids[i] {
                    failures.push(format!(
                        "{} step {i}: greedy {got}, reference {} (margin {margin})",
                        case.name, case.greedy_ids[i]
                    ));
                }
            }
        }
    }
    eprintln!("{label}: worst error {worst:.3} (relative to the top logit); {checked} steps outside near-ties");
    assert!(checked > 100, "too few steps to judge: {checked}");
    assert!(failures.is_empty(), "mismatches:\n{}", failures.join("\n"));
}

/// The logits of the last of `tokens`, computed as a prompt row (`decode_last` false) or,
/// after a prefill of the others, as a decode row.
fn last_logits(model: &Llama, tokens: &[u32], decode_last: bool) -> Vec<f32> {
    let block_size = 16;
    let num_blocks = tokens.len().div_ceil(block_size);
    let mut cache = KvCache::new(
        model.config.n_layer,
        num_blocks,
        block_size,
        model.kv_slot_width(),
    );
    let table: Vec<u32> = (0..num_blocks as u32).collect();
    let (prompt_len, first) = if decode_last {
        (tokens.len() - 1, tokens.len() - 1)
    } else {
        (tokens.len(), tokens.len())
    };
    let mut out = model
        .forward(
            &mut cache,
            &[SeqInput {
                tokens: &tokens[..first],
                start_pos: 0,
                block_table: &table,
                want_logits: true,
                prompt_len,
            }],
        )
        .expect("prefill");
    if decode_last {
        out = model
            .forward(
                &mut cache,
                &[SeqInput {
                    tokens: &tokens[first..],
                    start_pos: first,
                    block_table: &table,
                    want_logits: true,
                    prompt_len,
                }],
            )
            .expect("decode");
    }
    out.pop().flatten().expect("logits")
}

#[test]
fn with_8_bit_prompt_rows_a_token_gives_the_same_bits_as_a_prompt_or_a_decode_row() {
    let fx = fixture();
    let mut model = Llama::load(&common::model_path(), WeightFormat::Gguf).expect("load gguf");
    for case in &fx.cases {
        let tokens = &case.prompt_ids;
        let as_prompt = last_logits(&model, tokens, false);
        let as_decode = last_logits(&model, tokens, true);
        assert!(
            as_prompt
                .iter()
                .zip(&as_decode)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: the last token's logits depend on its role",
            case.name
        );
    }
    // With exact prefill the two roles run different kernels, and the check above sees it.
    model.q8_prompt = false;
    let tokens = &fx.cases[0].prompt_ids;
    assert_ne!(
        last_logits(&model, tokens, false),
        last_logits(&model, tokens, true),
        "f32 and 8-bit rows gave the same logits"
    );
}
