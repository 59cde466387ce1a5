//! A request in flight: its tokens, how many of them are in the KV cache, its blocks, and
//! the per-request state of sampling, detokenization and stop matching.

use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::sampler::Sampler;
use crate::spec_decode::DraftState;
use crate::stop::StopMatcher;
use crate::structured::GrammarState;
use crate::tokenizer::IncrementalDecoder;

/// Why a sequence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The client went away or the engine shut down.
    Abort,
    /// The engine failed on this request.
    Error(String),
}

impl FinishReason {
    /// The label vLLM uses (`finished_reason` metric label, `finish_reason` field).
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
            Self::Error(_) => "error",
        }
    }
}

/// Log-probabilities of one sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub logprob: f32,
    /// The most likely tokens at this step, best first.
    pub top: Vec<(u32, f32)>,
}

/// What a sequence reports to whoever submitted it.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqEvent {
    /// A sampled token and the text it completes (possibly empty: an incomplete UTF-8
    /// character, or text held back while it may still start a stop string).
    Token {
        token: u32,
        text: String,
        logprob: Option<TokenLogprob>,
    },
    /// The end, with any text released at the end and the token counts.
    Finished {
        reason: FinishReason,
        /// The stop string or stop token that ended the sequence, if any.
        stop: Option<String>,
        text: String,
        prompt_tokens: usize,
        completion_tokens: usize,
        cached_tokens: usize,
        /// When it queued, was first scheduled and produced tokens (for trace spans).
        times: SeqTimes,
        /// The blocks kept under the request's pin (`GenerationRequest::pin`), in prompt
        /// order; empty without a pin (or when nothing could be kept). The server reports
        /// them as `remote_block_ids`.
        pinned_blocks: Vec<u32>,
    },
}

/// Everything the engine needs to run one completion.
pub struct GenerationRequest {
    pub request_id: String,
    pub prompt: Vec<u32>,
    pub sampling: crate::sampler::SamplingConfig,
    /// Tokens to generate at most (already checked against the context length).
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub include_stop_str_in_output: bool,
    pub skip_special_tokens: bool,
    pub priority: i32,
    pub cache_salt: Option<String>,
    pub arrival: Instant,
    pub events: UnboundedSender<SeqEvent>,
    /// The compiled structured-output constraint, if the request has one.
    pub grammar: Option<Box<GrammarState>>,
    /// Whether the engine may speculate for this request (when it is configured to).
    pub speculative: bool,
    /// The LoRA adapter the request's `model` named; `None` is the base model. Holding it
    /// keeps the adapter from being unloaded while the request runs.
    pub lora: Option<std::sync::Arc<crate::lora::LoraAdapter>>,
    /// Prompt blocks pulled from elsewhere (a prefill engine or the KV tier), in prompt
    /// order, starting at the first block that was not cached here when the server looked.
    /// Right before the request is admitted the loop installs the run of them that matches
    /// the prompt's own block hashes (at the first mismatch, that block and the rest are
    /// dropped), skipping blocks that became cached meanwhile; admission then takes them as
    /// prefix hits. Empty for a request computed as usual.
    pub imported: Vec<crate::kv::transfer::BlockData>,
    /// Prefill role: when the request finishes (stop or length), its full committed prompt
    /// blocks stay referenced under this pin id until a decoder exports them with
    /// `release`, [`EngineHandle::release_pin`](crate::engine::EngineHandle::release_pin)
    /// drops it, or the engine's pin timeout passes.
    pub pin: Option<String>,
}

/// Timestamps for the latency histograms and trace spans.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SeqTimes {
    pub arrival: Instant,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
    pub last_token: Option<Instant>,
}

/// A request in the step planner. The fields a step reads for every running sequence come
/// first, in two cache lines of their own (`repr(C)`, 64-byte aligned): a planner step
/// over sequences the cache has lost since their last step (a simulated fleet's, or a
/// busy engine's) then misses on those two lines instead of on five or six scattered ones.
#[repr(C, align(64))]
pub struct Sequence {
    /// Prompt followed by the generated tokens.
    pub tokens: Vec<u32>,
    pub block_table: Vec<u32>,
    /// Prefix-cache hashes of the full blocks of `tokens`, computed as blocks fill.
    pub block_hashes: Vec<crate::kv::block_pool::HashKey>,
    /// Tokens whose keys and values are in the cache.
    pub num_computed: usize,
    pub prompt_len: usize,
    /// Leading blocks of `block_table` already named in the prefix cache.
    pub num_committed: usize,
    /// Proposed tokens at the end of `tokens`, not yet verified (0 outside a step).
    pub num_draft: usize,
    pub max_tokens: usize,
    /// Admission order, for FCFS and for choosing whom to preempt.
    pub arrival_seq: u64,
    /// The LoRA adapter this sequence runs with (`None`: the base model).
    pub lora: Option<std::sync::Arc<crate::lora::LoraAdapter>>,
    pub request_id: String,
    pub priority: i32,
    /// Boxed: half a kilobyte (its RNG and scratch) that only sampling reads, kept out of
    /// the line-by-line walks and moves of the planner's queues.
    pub sampler: Box<Sampler>,
    pub decoder: IncrementalDecoder,
    pub stop: StopMatcher,
    pub events: UnboundedSender<SeqEvent>,
    pub times: SeqTimes,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_tokens: usize,
    /// Mixed into the first block's hash: only requests with the same salt share a prefix.
    pub cache_salt: Option<String>,
    /// Whether the sequence was admitted before (a preempted one comes back).
    pub admitted_once: bool,
    /// The structured-output grammar the output must follow.
    pub grammar: Option<Box<GrammarState>>,
    /// Whether speculation is allowed for this sequence.
    pub speculative: bool,
    /// How this sequence's proposals have fared (the adaptive policy's input).
    pub draft_state: DraftState,
    /// Imported blocks not yet installed (taken at the first admission).
    pub imported: Vec<crate::kv::transfer::BlockData>,
    /// Indices (into `block_hashes`) of the blocks installed from `imported`.
    pub installed: Vec<usize>,
    /// Prompt tokens whose KV came from imported blocks (a part of `cached_tokens`).
    pub imported_tokens: usize,
    /// See [`GenerationRequest::pin`].
    pub pin: Option<String>,
}

impl Sequence {
    /// A new, not yet admitted sequence for `req`; `arrival_seq` orders admissions.
    pub fn new(req: GenerationRequest, sampler: Sampler, arrival_seq: u64) -> Self {
        Self {
            request_id: req.request_id,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            num_computed: 0,
            block_table: Vec::new(),
            max_tokens: req.max_tokens,
            priority: req.priority,
            arrival_seq,
            sampler: Box::new(sampler),
            decoder: IncrementalDecoder::new(req.skip_special_tokens),
            stop: StopMatcher::new(req.stop, req.include_stop_str_in_output),
            events: req.events,
            times: SeqTimes {
                arrival: req.arrival,
                first_scheduled: None,
                first_token: None,
                last_token: None,
            },
            cached_tokens: 0,
            block_hashes: Vec::new(),
            num_committed: 0,
            cache_salt: req.cache_salt,
            admitted_once: false,
            grammar: req.grammar,
            speculative: req.speculative,
            num_draft: 0,
            draft_state: DraftState::default(),
            lora: req.lora,
            imported: req.imported,
            installed: Vec::new(),
            imported_tokens: 0,
            pin: req.pin,
        }
    }

    /// Generated tokens (unverified proposals excluded).
    pub fn num_output(&self) -> usize {
        self.tokens.len() - self.num_draft - self.prompt_len
    }

    /// Drops unverified proposals from the end of `tokens`.
    pub fn drop_drafts(&mut self) {
        let keep = self.tokens.len() - self.num_draft;
        self.tokens.truncate(keep);
        self.num_draft = 0;
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..self.tokens.len() - self.num_draft]
    }

    /// Tokens still to run through the model before the next sample.
    pub fn num_pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Whether the submitter has gone away (stream closed, request dropped).
    pub fn is_abandoned(&self) -> bool {
        self.events.is_closed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, offset_of, size_of};

    #[test]
    fn the_fields_a_step_reads_share_two_cache_lines() {
        assert_eq!(align_of::<Sequence>(), 64);
        let ends = [
            offset_of!(Sequence, tokens) + size_of::<Vec<u32>>(),
            offset_of!(Sequence, block_table) + size_of::<Vec<u32>>(),
            offset_of!(Sequence, block_hashes) + size_of::<Vec<crate::kv::block_pool::HashKey>>(),
            offset_of!(Sequence, num_computed) + size_of::<usize>(),
            offset_of!(Sequence, prompt_len) + size_of::<usize>(),
            offset_of!(Sequence, num_committed) + size_of::<usize>(),
            offset_of!(Sequence, num_draft) + size_of::<usize>(),
            offset_of!(Sequence, max_tokens) + size_of::<usize>(),
            offset_of!(Sequence, arrival_seq) + size_of::<u64>(),
            offset_of!(Sequence, lora)
                + size_of::<Option<std::sync::Arc<crate::lora::LoraAdapter>>>(),
        ];
        assert!(ends.iter().all(|&e| e <= 128), "{ends:?}");
    }

    #[test]
    fn a_sequence_fits_eight_cache_lines_with_its_sampler_out_of_line() {
        // The planner moves sequences between its queues (admission, preemption) and
        // walks the running ones every step: the sampler's half kilobyte stays behind a
        // box.
        assert!(size_of::<Sampler>() > 256);
        assert!(
            size_of::<Sequence>() <= 512,
            "{} bytes",
            size_of::<Sequence>()
        );
    }
}
