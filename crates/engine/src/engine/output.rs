//! What a sequence's client hears: each sampled token appended, detokenized, passed
//! through the stop matcher and streamed, with the check whether the sequence ends there;
//! and at the end the text still held back, the token counts and the request's metrics.

use std::sync::Arc;
use std::time::Instant;

use crate::metrics::{EngineMetrics, FinishedRequest};
use crate::sampler::SampleOutput;
use crate::sequence::{FinishReason, SeqEvent, Sequence, TokenLogprob};
use crate::tokenizer::Tokenizer;

/// Why a sequence ends, and the stop string or token that ended it, if any.
pub(super) type Ending = (FinishReason, Option<String>);

/// Turns sampled tokens into each sequence's events.
pub(super) struct SeqOutput {
    tokenizer: Arc<Tokenizer>,
    eos_ids: Vec<u32>,
    context_len: usize,
    metrics: Arc<EngineMetrics>,
}

impl SeqOutput {
    pub(super) fn new(
        tokenizer: Arc<Tokenizer>,
        context_len: usize,
        metrics: Arc<EngineMetrics>,
    ) -> Self {
        let eos_ids = tokenizer.stop_ids().to_vec();
        Self {
            tokenizer,
            eos_ids,
            context_len,
            metrics,
        }
    }

    /// The tokens that end a sequence unless it ignores EOS (the sampler needs them too).
    pub(super) fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Appends one sampled token to `seq`, streams it and returns why the sequence ends
    /// there, if it does. `grammar_done`: the structured-output grammar is complete with
    /// this token.
    pub(super) fn emit(
        &self,
        seq: &mut Sequence,
        out: SampleOutput,
        grammar_done: bool,
    ) -> Option<Ending> {
        seq.tokens.push(out.token);
        self.metrics.generation_tokens.inc();
        self.record_token_time(seq);

        let config = seq.sampler.config();
        let is_eos = self.eos_ids.contains(&out.token);
        let is_stop_token = (!config.ignore_eos && is_eos)
            || config.stop_token_ids.contains(&out.token)
            || (grammar_done && is_eos);
        let wants_logprobs = config.logprobs.is_some();
        let text = if is_stop_token {
            String::new()
        } else {
            seq.decoder
                .push(&self.tokenizer, out.token)
                .unwrap_or_default()
        };
        let step = seq.stop.push(&text);
        let logprob = wants_logprobs.then_some(TokenLogprob {
            logprob: out.logprob,
            top: out.top_logprobs,
        });
        let _ = seq.events.send(SeqEvent::Token {
            token: out.token,
            text: step.emit,
            logprob,
        });
        if is_stop_token {
            let stop = self
                .tokenizer
                .token_str(out.token)
                .ok()
                .map(|s| s.to_string());
            Some((FinishReason::Stop, stop))
        } else if let Some(s) = step.stopped {
            Some((FinishReason::Stop, Some(s)))
        } else if grammar_done {
            // The grammar is complete and nothing can follow: the structured output ends.
            Some((FinishReason::Stop, None))
        } else if seq.num_output() >= seq.max_tokens || seq.tokens.len() >= self.context_len {
            Some((FinishReason::Length, None))
        } else {
            None
        }
    }

    /// Times a token just produced: the first one's time to first token (with where the
    /// prompt came from), every later one's gap since the previous.
    fn record_token_time(&self, seq: &mut Sequence) {
        let t = Instant::now();
        match seq.times.last_token {
            None => {
                seq.times.first_token = Some(t);
                // Like vLLM: the whole prompt, cached or not, once per request.
                self.metrics.record_prompt_sources(
                    seq.prompt_len,
                    seq.cached_tokens,
                    seq.imported_tokens,
                );
                self.metrics
                    .time_to_first_token
                    .observe((t - seq.times.arrival).as_secs_f64());
            }
            Some(prev) => self
                .metrics
                .inter_token_latency
                .observe((t - prev).as_secs_f64()),
        }
        seq.times.last_token = Some(t);
    }

    /// Reports the end of a sequence (its blocks are already released) and records metrics.
    pub(super) fn finish(
        &self,
        mut seq: Sequence,
        (reason, stop): Ending,
        pinned_blocks: Vec<u32>,
    ) {
        // Release text still held by the decoder or the stop matcher, unless the client is
        // gone. After a stop-string match the matcher releases nothing.
        let mut text = String::new();
        if reason != FinishReason::Abort {
            let rest = seq.decoder.finish();
            let step = seq.stop.push(&rest);
            text = step.emit;
            text.push_str(&seq.stop.flush());
        }
        self.record_finish(&seq, &reason);
        let _ = seq.events.send(SeqEvent::Finished {
            reason,
            stop,
            text,
            prompt_tokens: seq.prompt_len,
            completion_tokens: seq.num_output(),
            cached_tokens: seq.cached_tokens,
            times: seq.times,
            pinned_blocks,
        });
    }

    /// The finished request's counters and latency histograms.
    fn record_finish(&self, seq: &Sequence, reason: &FinishReason) {
        let now = Instant::now();
        let t = seq.times;
        self.metrics.record_finish(reason.as_str());
        self.metrics.record_request(FinishedRequest {
            prompt_tokens: seq.prompt_len,
            generation_tokens: seq.num_output(),
            cached_tokens: seq.cached_tokens,
            inference_time: t.first_scheduled.map(|s| now.duration_since(s)),
        });
        self.metrics
            .e2e_request_latency
            .observe((now - t.arrival).as_secs_f64());
        let Some(s) = t.first_scheduled else {
            return;
        };
        self.metrics
            .request_queue_time
            .observe((s - t.arrival).as_secs_f64());
        let Some(f) = t.first_token else {
            return;
        };
        self.metrics
            .request_prefill_time
            .observe((f - s).as_secs_f64());
        let last = t.last_token.unwrap_or(f);
        self.metrics
            .request_decode_time
            .observe((last - f).as_secs_f64());
        let n = seq.num_output();
        if n > 1 {
            self.metrics
                .time_per_output_token
                .observe((last - f).as_secs_f64() / (n - 1) as f64);
        }
    }
}
