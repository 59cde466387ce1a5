//! The reference oracle's fixture (`tools/reference/oracle.py`): transformers running the
//! default model's GGUF dequantized to f32, greedy from each prompt, with the top logits of
//! every step.

use serde::Deserialize;

#[derive(Deserialize)]
pub struct Fixture {
    pub model_sha256: String,
    pub cases: Vec<Case>,
}

#[derive(Deserialize)]
pub struct Case {
    pub name: String,
    pub prompt_ids: Vec<u32>,
    pub greedy_ids: Vec<u32>,
    pub steps: Vec<Step>,
}

#[derive(Deserialize)]
pub struct Step {
    pub top5: Vec<(u32, f32)>,
}

pub fn fixture() -> Fixture {
    let text = include_str!("../fixtures/reference_smollm2.json");
    serde_json::from_str(text).expect("fixture parses")
}
