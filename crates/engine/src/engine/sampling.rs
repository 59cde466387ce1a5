//! Sampling a step's logits: each sequence's rows in order, with its own sampler, random
//! stream and grammar, stopping at the first row that does not confirm a proposal.

use rayon::prelude::*;

use crate::planner::Slot;
use crate::sampler::SampleOutput;
use crate::sequence::Sequence;
use crate::structured::GrammarStep;

/// One sequence's sampling result for a step.
pub(super) struct SeqSample {
    /// Tokens sampled from the rows in order, stopping after the first that differs from
    /// its proposal (or at the last row).
    pub(super) outs: Vec<SampleOutput>,
    /// The structured-output grammar is complete after the last of `outs`.
    pub(super) grammar_done: bool,
    /// The grammar failed; the sequence ends with this error.
    pub(super) error: Option<String>,
}

/// Samples one sequence's rows: row `i` is the distribution after the pending token and
/// the first `i` proposals. Penalties see exactly the tokens a one-at-a-time decode would
/// have seen, and each sample is one draw from the sequence's own random stream, so an
/// accepted proposal is the token the same seed would have produced without speculation.
fn sample_seq(seq: &mut Sequence, rows: Vec<Vec<f32>>, eos_ids: &[u32]) -> Option<SeqSample> {
    if rows.is_empty() {
        return None;
    }
    let mut result = SeqSample {
        outs: Vec::with_capacity(rows.len()),
        grammar_done: false,
        error: None,
    };
    let proposed = seq.num_draft;
    let base = seq.tokens.len() - proposed;
    for (i, mut logits) in rows.into_iter().enumerate() {
        let allowed = match seq.grammar.as_mut().map(|g| g.mask_logits(&mut logits)) {
            None => None,
            Some(Ok(a)) => Some(a),
            Some(Err(e)) => {
                result.error = Some(e.to_string());
                return Some(result);
            }
        };
        let (prompt, output) = seq.tokens[..base + i].split_at(seq.prompt_len);
        let mut out = seq.sampler.sample(&mut logits, prompt, output, eos_ids);
        if let (Some(g), Some(allowed)) = (seq.grammar.as_mut(), allowed) {
            if !allowed.contains(out.token) {
                // Sampling's own masks removed every token the grammar allows (only
                // `min_tokens` hiding EOS can): the grammar wins.
                out.token = allowed.best;
            }
            match g.accept(out.token) {
                Ok(GrammarStep::Done) => result.grammar_done = true,
                Ok(GrammarStep::Continue) => {}
                Err(e) => {
                    result.error = Some(e.to_string());
                    return Some(result);
                }
            }
        }
        let confirms = i < proposed && seq.tokens[base + i] == out.token;
        result.outs.push(out);
        if !confirms {
            break;
        }
    }
    Some(result)
}

/// Samples every running sequence given its logit rows, both by id (`logits[i]` belongs
/// to the sequence in `slots[i]`; a sequence without rows is not sampled). Each sequence
/// has its own sampler, random stream and grammar, so the sequences are sampled (and
/// their grammar masks computed) in parallel with the same results as one after another.
pub(super) fn sample_all(
    slots: &mut [Slot],
    logits: Vec<Vec<Vec<f32>>>,
    eos_ids: &[u32],
) -> Vec<Option<SeqSample>> {
    let sample =
        |(slot, rows): (&mut Slot, Vec<Vec<f32>>)| sample_seq(slot.seq_mut()?, rows, eos_ids);
    if logits.iter().filter(|r| !r.is_empty()).count() > 1 {
        slots.par_iter_mut().zip(logits).map(sample).collect()
    } else {
        slots.iter_mut().zip(logits).map(sample).collect()
    }
}
