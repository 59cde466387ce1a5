//! Prefill/decode disaggregation (PROTOCOLS §11): the decider and the profile pair, in the
//! shape of llm-d's `pd-profile-handler` and `prefix-based-pd-decider`.
//!
//! One decision runs the **decode** profile first (endpoints of role `decode`, `both` or
//! none). The decider then looks at that pick alone: how many of the prompt's tokens it
//! does not hold yet (prompt tokens minus its cached prefix, from the same prefix index the
//! profiles score with). When those reach `nonCachedTokens`, the **prefill** profile
//! (endpoints of role `prefill` only) picks the engine that computes the prompt; the decode
//! pick then pulls its KV and generates. A short or mostly cached prompt is cheaper to
//! compute where it will be decoded, so it skips the prefill hop. With no prefill endpoint
//! (or only the decode pick itself) the request is served by the decode pick alone.
//!
//! As in llm-d, `nonCachedTokens: 0` (the default) disaggregates every request.
//!
//! Pure: the decision reads the candidates, the indexes in the [`Context`] and the request.

use super::{Candidate, Context, SchedRequest};

/// The profile handler's plugin type.
pub const PD_PROFILE_HANDLER: &str = "pd-profile-handler";
/// The decider's plugin type.
pub const PREFIX_PD_DECIDER: &str = "prefix-based-pd-decider";
/// llm-d's default: disaggregate every request.
pub const DEFAULT_NON_CACHED_TOKENS: u32 = 0;
/// The estimate of prompt tokens from text when the router has no token ids (llm-d's
/// average of four characters per token).
pub const CHARS_PER_TOKEN: usize = 4;
/// The threshold `strata up` and `strata router --pd` use when none is given: below a few
/// hundred tokens a prompt computes in about one decode step's time on a CPU engine, less
/// than a round trip to a prefill engine and a block transfer.
pub const SUGGESTED_NON_CACHED_TOKENS: u32 = 256;

/// Disaggregate iff the decode pick's uncached prompt tokens reach `non_cached_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PdDecider {
    pub non_cached_tokens: u32,
}

impl Default for PdDecider {
    fn default() -> Self {
        PdDecider {
            non_cached_tokens: DEFAULT_NON_CACHED_TOKENS,
        }
    }
}

impl PdDecider {
    /// Whether a prompt of `prompt_tokens`, of which the decode pick holds the first
    /// `cached_tokens`, goes through a prefill engine.
    pub fn decide(&self, prompt_tokens: usize, cached_tokens: usize) -> bool {
        if self.non_cached_tokens == 0 {
            return true;
        }
        prompt_tokens.saturating_sub(cached_tokens) >= self.non_cached_tokens as usize
    }
}

/// The profile pair and its decider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PdHandler {
    pub decode_profile: String,
    pub prefill_profile: String,
    pub decider: PdDecider,
}

impl Default for PdHandler {
    fn default() -> Self {
        PdHandler {
            decode_profile: "decode".into(),
            prefill_profile: "prefill".into(),
            decider: PdDecider::default(),
        }
    }
}

/// What the profile pair decided for one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PdChoice {
    /// No profile pair is configured, or the request named its profile, or it is not a
    /// generation request: one profile ran.
    Single,
    /// The decider kept the request on the decode pick (short or cached prompt).
    DecodeOnly,
    /// The decider asked for a prefill pick but no prefill endpoint other than the decode
    /// pick could take it.
    NoPrefill,
    /// Prefill on the prefill pick, then decode on the decode pick.
    Disaggregate,
}

impl PdChoice {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            PdChoice::Single => "single",
            PdChoice::DecodeOnly => "decode_only",
            PdChoice::NoPrefill => "no_prefill",
            PdChoice::Disaggregate => "prefill_decode",
        }
    }
}

/// Estimated prompt tokens: the token ids when known, else the text's length over
/// [`CHARS_PER_TOKEN`].
pub fn estimate_prompt_tokens(text_len: usize, tokens: Option<usize>) -> usize {
    tokens.unwrap_or(text_len / CHARS_PER_TOKEN)
}

/// Tokens of the request's prompt that `cand` already holds, from the index the prefix
/// scorers read: the precise one (KV events, the endpoint's own block size) when the
/// request has token-level hashes, else the approximate one (chunks of
/// `block_size_tokens`). Lower-tier (offloaded) blocks count: the engine fetches them
/// instead of computing them.
pub fn cached_tokens(ctx: &Context, req: &SchedRequest, cand: &Candidate) -> usize {
    match (ctx.precise, &req.precise_blocks) {
        (Some(idx), Some(blocks)) => {
            let chain = blocks.for_candidate(cand);
            let bs = cand.block_size(blocks.default_block_size) as usize;
            let m = idx.match_prefix(chain, &[cand.id]);
            m.first().map_or(0, |m| m.blocks as usize) * bs
        }
        _ => match ctx.approx {
            Some(idx) => {
                let bs = idx.config().block_size_tokens.max(1);
                let m = idx.match_prefix(&req.approx_blocks, &[cand.id]);
                m.first().map_or(0, |m| m.blocks as usize) * bs
            }
            None => 0,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::endpoint::EndpointId;
    use crate::prefix::approx::{ApproxConfig, ApproxIndex};
    use crate::prefix::precise::PreciseIndex;
    use crate::scheduling::PreciseBlocks;

    #[test]
    fn decider_threshold_on_uncached_tokens() {
        let d = PdDecider {
            non_cached_tokens: 100,
        };
        assert!(!d.decide(99, 0), "short prompt stays on decode");
        assert!(d.decide(100, 0), "at the threshold it disaggregates");
        assert!(d.decide(1000, 900), "100 uncached");
        assert!(!d.decide(1000, 901), "99 uncached");
        assert!(
            !d.decide(50, 4000),
            "cached beyond the prompt counts as all cached"
        );
        let always = PdDecider::default();
        assert_eq!(always.non_cached_tokens, 0, "llm-d's default");
        assert!(always.decide(0, 0) && always.decide(10, 10));
    }

    #[test]
    fn estimate_uses_tokens_when_known() {
        assert_eq!(estimate_prompt_tokens(400, None), 100);
        assert_eq!(estimate_prompt_tokens(400, Some(7)), 7);
    }

    #[test]
    fn cached_tokens_from_either_index() {
        let c = cand(3, 0.0, 0.0);
        // Approximate: chunks of 16 tokens.
        let mut approx = ApproxIndex::new(ApproxConfig {
            block_size_tokens: 16,
            ..Default::default()
        });
        approx.record(EndpointId(3), &[1, 2, 3]);
        let req = SchedRequest {
            approx_blocks: vec![1, 2, 9, 3],
            ..Default::default()
        };
        let ctx = Context {
            approx: Some(&approx),
            ..Context::at(now())
        };
        assert_eq!(cached_tokens(&ctx, &req, &c), 32, "two leading chunks");
        assert_eq!(cached_tokens(&Context::at(now()), &req, &c), 0, "no index");
        // Precise: the candidate's block size (32 from its KV events) times matched blocks.
        let mut precise = PreciseIndex::new();
        precise.apply(
            EndpointId(3),
            &strata_api::kv_events::KvEvent::BlockStored {
                block_hashes: vec![10, 11],
                parent_block_hash: None,
                token_ids: vec![],
                block_size: 32,
                lora_id: None,
                medium: None,
                lora_name: None,
            },
        );
        let mut c32 = c.clone();
        c32.kv_block_size = Some(32);
        let req = SchedRequest {
            approx_blocks: vec![1, 2, 3],
            precise_blocks: Some(PreciseBlocks {
                default_block_size: 16,
                chains: vec![(16, vec![50, 51]), (32, vec![10, 11, 12])],
            }),
            ..Default::default()
        };
        let ctx = Context {
            approx: Some(&approx),
            precise: Some(&precise),
            ..Context::at(now())
        };
        assert_eq!(cached_tokens(&ctx, &req, &c32), 64);
        assert_eq!(cached_tokens(&ctx, &req, &c), 0, "16-token chain not held");
    }
}
