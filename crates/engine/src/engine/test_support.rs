//! What the engine's unit tests share: requests, sequences and block bytes.

use std::time::Instant;

use crate::sampler::{Sampler, SamplingConfig};
use crate::sequence::{GenerationRequest, SeqEvent, Sequence};

pub(super) const SEED: &str = "0";

pub(super) fn request(
    id: &str,
    prompt: Vec<u32>,
    max_tokens: usize,
) -> (
    GenerationRequest,
    tokio::sync::mpsc::UnboundedReceiver<SeqEvent>,
) {
    let (events, rx) = tokio::sync::mpsc::unbounded_channel();
    let req = GenerationRequest {
        request_id: id.to_string(),
        prompt,
        sampling: SamplingConfig {
            temperature: 0.0,
            ignore_eos: true,
            ..SamplingConfig::default()
        },
        max_tokens,
        stop: Vec::new(),
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        priority: 0,
        cache_salt: None,
        arrival: Instant::now(),
        events,
        grammar: None,
        speculative: false,
        lora: None,
        imported: Vec::new(),
        pin: None,
    };
    (req, rx)
}

pub(super) fn seq(prompt: Vec<u32>) -> Sequence {
    let (req, _rx) = request("s", prompt, 4);
    Sequence::new(req, Sampler::new(SamplingConfig::default(), 0), 0)
}

/// A block's bytes for a cache of `bytes` per block: a pattern that names the block.
pub(super) fn pattern(tag: u8, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|i| tag.wrapping_add(i as u8)).collect()
}
