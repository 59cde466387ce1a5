//! Sampling parameters: the checks and defaults shared by chat and completions.
//!
//! Ranges follow OpenAI where OpenAI defines the field and vLLM otherwise, with one
//! deliberate tightening: `repetition_penalty` must lie in `(0, 2]`. vLLM accepts any
//! positive value, but beyond 2 the penalty wipes out every token already seen (including
//! the chat template's own tokens), and outputs degenerate; refusing early is kinder than
//! returning gibberish.

use serde_json::Number;
use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use super::structured::StructuredOutput;
use crate::error::ApiError;
use crate::types::sampling::SamplingFields;
use crate::types::Stop;

/// Largest `n` (choices per request) accepted.
pub const MAX_N: u32 = 16;
/// Largest number of stop strings accepted.
pub const MAX_STOP: usize = 16;
/// Largest `top_logprobs` (chat) or `logprobs` (completions) accepted.
pub const MAX_TOP_LOGPROBS: u32 = 20;
/// Magnitude limit of a `logit_bias` value, as in OpenAI's API.
pub const MAX_LOGIT_BIAS: f64 = 100.0;

/// Checked sampling and output controls, ready for the engine.
///
/// Built by [`crate::validate::validate_chat`] and
/// [`crate::validate::validate_completion`]; `Default` gives the values used when a
/// client sends none of the fields.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0..=2; 0 means greedy. Default 1.
    pub temperature: f32,
    /// (0, 1]; 1 disables. Default 1.
    pub top_p: f32,
    /// `None` disables (the client sent -1, 0 or nothing).
    pub top_k: Option<u32>,
    /// 0..=1; 0 disables. Default 0.
    pub min_p: f32,
    /// (0, 2]; 1 disables. Default 1.
    pub repetition_penalty: f32,
    /// -2..=2. Default 0.
    pub presence_penalty: f32,
    /// -2..=2. Default 0.
    pub frequency_penalty: f32,
    /// RNG seed. Negative JSON integers are reinterpreted as their two's-complement `u64`,
    /// so every `i64` and `u64` seed is accepted and distinct seeds stay distinct.
    pub seed: Option<u64>,
    /// Output limit: `max_completion_tokens` if sent, else `max_tokens`; `None` means "up
    /// to the context length" (see [`crate::validate::check_context`]).
    pub max_tokens: Option<u32>,
    /// EOS and stop tokens are ignored before this many tokens. Default 0.
    pub min_tokens: u32,
    /// Choices to generate, 1..=[`MAX_N`]. Default 1.
    pub n: u32,
    /// Stop strings, at most [`MAX_STOP`], none empty.
    pub stop: Vec<String>,
    /// Token ids that end a choice. Only checked to be valid `u32`s here; the engine checks
    /// them against its vocabulary.
    pub stop_token_ids: Vec<u32>,
    /// Keep a matched stop string in the output. Default false.
    pub include_stop_str_in_output: bool,
    /// Keep going past EOS. Default false.
    pub ignore_eos: bool,
    /// `Some(k)`: return logprobs of sampled tokens and the top `k` alternatives (k may be
    /// 0). `None`: no logprobs.
    pub logprobs: Option<u32>,
    /// Drop special tokens from output text. Default true.
    pub skip_special_tokens: bool,
    /// Put spaces between special tokens in output text. Default true.
    pub spaces_between_special_tokens: bool,
    /// Scheduling priority; lower runs earlier. Default 0.
    pub priority: i32,
    /// Prefix-cache salt, non-empty when present.
    pub cache_salt: Option<String>,
    /// Additive logit biases `(token id, bias)` with bias in -100..=100, sorted by token
    /// id.
    pub logit_bias: Vec<(u32, f32)>,
    /// A grammar the output must follow (`response_format`, `guided_*`), if any.
    pub structured: Option<StructuredOutput>,
    /// Whether the engine may speculate for this request. Default true.
    pub speculative: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: None,
            min_tokens: 0,
            n: 1,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            include_stop_str_in_output: false,
            ignore_eos: false,
            logprobs: None,
            skip_special_tokens: true,
            spaces_between_special_tokens: true,
            priority: 0,
            cache_salt: None,
            logit_bias: Vec::new(),
            structured: None,
            speculative: true,
        }
    }
}

impl SamplingParams {
    /// True when sampling reduces to argmax (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Checks every sampling field of `fields` and applies defaults. `logprobs` comes resolved
/// (the endpoints spell it differently), `structured` already checked.
pub(crate) fn sampling_params(
    fields: SamplingFields,
    logprobs: Option<u32>,
    structured: Option<StructuredOutput>,
) -> Result<SamplingParams, ApiError> {
    let max_tokens = resolve_max_tokens(fields.max_tokens, fields.max_completion_tokens)?;
    let min_tokens = match fields.min_tokens {
        None => 0,
        Some(m) => {
            let m = u32::try_from(m).map_err(|_| {
                ApiError::invalid(
                    "min_tokens",
                    format!("min_tokens must be between 0 and {}, got {m}.", u32::MAX),
                )
            })?;
            if let Some(max) = max_tokens {
                if m > max {
                    return Err(ApiError::invalid(
                        "min_tokens",
                        format!("min_tokens ({m}) must not exceed max_tokens ({max})."),
                    ));
                }
            }
            m
        }
    };

    Ok(SamplingParams {
        temperature: float_in("temperature", fields.temperature, 1.0, 0.0..=2.0)?,
        top_p: positive_up_to("top_p", fields.top_p, 1.0, 1.0)?,
        top_k: top_k(fields.top_k)?,
        min_p: float_in("min_p", fields.min_p, 0.0, 0.0..=1.0)?,
        repetition_penalty: positive_up_to(
            "repetition_penalty",
            fields.repetition_penalty,
            1.0,
            2.0,
        )?,
        presence_penalty: float_in("presence_penalty", fields.presence_penalty, 0.0, -2.0..=2.0)?,
        frequency_penalty: float_in(
            "frequency_penalty",
            fields.frequency_penalty,
            0.0,
            -2.0..=2.0,
        )?,
        seed: fields.seed.as_ref().map(seed).transpose()?,
        max_tokens,
        min_tokens,
        n: n(fields.n)?,
        stop: stop(fields.stop)?,
        stop_token_ids: stop_token_ids(fields.stop_token_ids)?,
        include_stop_str_in_output: fields.include_stop_str_in_output.unwrap_or(false),
        ignore_eos: fields.ignore_eos.unwrap_or(false),
        logprobs,
        skip_special_tokens: fields.skip_special_tokens.unwrap_or(true),
        spaces_between_special_tokens: fields.spaces_between_special_tokens.unwrap_or(true),
        priority: priority(fields.priority)?,
        cache_salt: cache_salt(fields.cache_salt)?,
        logit_bias: logit_bias(fields.logit_bias)?,
        structured,
        speculative: fields.speculative.unwrap_or(true),
    })
}

/// `value` (or `default`) checked against an inclusive range.
fn float_in(
    param: &str,
    value: Option<f64>,
    default: f32,
    range: RangeInclusive<f64>,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if range.contains(&v) => Ok(v as f32),
        Some(v) => Err(ApiError::invalid(
            param,
            format!(
                "{param} must be between {} and {}, got {v}.",
                range.start(),
                range.end()
            ),
        )),
    }
}

/// `value` (or `default`) checked to lie in `(0, max]`.
fn positive_up_to(
    param: &str,
    value: Option<f64>,
    default: f32,
    max: f64,
) -> Result<f32, ApiError> {
    match value {
        None => Ok(default),
        Some(v) if v > 0.0 && v <= max => Ok(v as f32),
        Some(v) => Err(ApiError::invalid(
            param,
            format!("{param} must be greater than 0 and at most {max}, got {v}."),
        )),
    }
}

fn top_k(value: Option<i64>) -> Result<Option<u32>, ApiError> {
    match value {
        None | Some(-1) | Some(0) => Ok(None),
        Some(k) => match u32::try_from(k) {
            Ok(k) => Ok(Some(k)),
            Err(_) => Err(ApiError::invalid(
                "top_k",
                format!("top_k must be -1 or 0 (disabled) or a positive integer, got {k}."),
            )),
        },
    }
}

fn n(value: Option<i64>) -> Result<u32, ApiError> {
    match value {
        None => Ok(1),
        Some(n) if (1..=i64::from(MAX_N)).contains(&n) => Ok(n as u32),
        Some(n) => Err(ApiError::invalid(
            "n",
            format!("n must be between 1 and {MAX_N}, got {n}."),
        )),
    }
}

/// Accepts any JSON integer that fits `i64` or `u64`.
fn seed(value: &Number) -> Result<u64, ApiError> {
    if let Some(s) = value.as_u64() {
        Ok(s)
    } else if let Some(s) = value.as_i64() {
        // Two's-complement reinterpretation: total and injective on i64.
        Ok(s as u64)
    } else {
        Err(ApiError::invalid(
            "seed",
            format!("seed must be an integer, got {value}."),
        ))
    }
}

/// One output-length field checked to be a positive `u32`.
fn positive_u32(param: &str, value: i64) -> Result<u32, ApiError> {
    if value < 1 {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be at least 1, got {value}."),
        ));
    }
    u32::try_from(value).map_err(|_| {
        ApiError::invalid(
            param,
            format!("{param} must be at most {}, got {value}.", u32::MAX),
        )
    })
}

/// Both length fields are checked when sent; `max_completion_tokens` wins.
fn resolve_max_tokens(
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
) -> Result<Option<u32>, ApiError> {
    let legacy = max_tokens
        .map(|v| positive_u32("max_tokens", v))
        .transpose()?;
    let current = max_completion_tokens
        .map(|v| positive_u32("max_completion_tokens", v))
        .transpose()?;
    Ok(current.or(legacy))
}

fn stop(value: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let stops = value.map(Stop::into_vec).unwrap_or_default();
    if stops.len() > MAX_STOP {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "At most {MAX_STOP} stop sequences are allowed, got {}.",
                stops.len()
            ),
        ));
    }
    if stops.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            "stop",
            "Stop sequences must not be empty.",
        ));
    }
    Ok(stops)
}

fn stop_token_ids(value: Option<Vec<i64>>) -> Result<Vec<u32>, ApiError> {
    value
        .unwrap_or_default()
        .into_iter()
        .map(|id| {
            u32::try_from(id).map_err(|_| {
                ApiError::invalid(
                    "stop_token_ids",
                    format!("stop_token_ids contains {id}, which is not a valid token id."),
                )
            })
        })
        .collect()
}

fn priority(value: Option<i64>) -> Result<i32, ApiError> {
    match value {
        None => Ok(0),
        Some(p) => i32::try_from(p).map_err(|_| {
            ApiError::invalid(
                "priority",
                format!(
                    "priority must be between {} and {}, got {p}.",
                    i32::MIN,
                    i32::MAX
                ),
            )
        }),
    }
}

fn cache_salt(value: Option<String>) -> Result<Option<String>, ApiError> {
    match value {
        Some(salt) if salt.is_empty() => Err(ApiError::invalid(
            "cache_salt",
            "cache_salt must be a non-empty string when present.",
        )),
        other => Ok(other),
    }
}

fn logit_bias(value: Option<BTreeMap<String, f64>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let mut biases = Vec::new();
    for (token, bias) in value.unwrap_or_default() {
        let id: u32 = token.trim().parse().map_err(|_| {
            ApiError::invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {token:?}."),
            )
        })?;
        if !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(&bias) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!(
                    "logit_bias values must be between -100 and 100, got {bias} for token {id}."
                ),
            ));
        }
        biases.push((id, bias as f32));
    }
    // Keys like "5" and " 5" parse to the same id; keep the last, as a map would.
    biases.sort_by_key(|&(id, _)| id);
    biases.dedup_by(|later, earlier| {
        if later.0 == earlier.0 {
            earlier.1 = later.1;
            true
        } else {
            false
        }
    });
    Ok(biases)
}

/// Chat spelling: `logprobs: true` plus optional `top_logprobs`.
pub(crate) fn chat_logprobs(
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
) -> Result<Option<u32>, ApiError> {
    if logprobs != Some(true) {
        return match top_logprobs {
            None => Ok(None),
            Some(_) => Err(ApiError::invalid(
                "top_logprobs",
                "top_logprobs requires logprobs to be set to true.",
            )),
        };
    }
    match top_logprobs {
        None => Ok(Some(0)),
        Some(k) => top_count("top_logprobs", k).map(Some),
    }
}

/// Completions spelling: `logprobs: <count>`.
pub(crate) fn completion_logprobs(logprobs: Option<i64>) -> Result<Option<u32>, ApiError> {
    logprobs.map(|k| top_count("logprobs", k)).transpose()
}

fn top_count(param: &str, k: i64) -> Result<u32, ApiError> {
    if (0..=i64::from(MAX_TOP_LOGPROBS)).contains(&k) {
        Ok(k as u32)
    } else {
        Err(ApiError::invalid(
            param,
            format!("{param} must be between 0 and {MAX_TOP_LOGPROBS}, got {k}."),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_when_nothing_sent() {
        let p = sampling_params(SamplingFields::default(), None, None).unwrap();
        assert_eq!(p, SamplingParams::default());
        assert!(!p.is_greedy());
        assert!(p.skip_special_tokens);
        assert_eq!(p.n, 1);
    }

    #[test]
    fn nan_is_rejected_by_ranges() {
        // JSON cannot carry NaN, but the helpers must not let one through either.
        assert!(float_in("temperature", Some(f64::NAN), 1.0, 0.0..=2.0).is_err());
        assert!(positive_up_to("top_p", Some(f64::NAN), 1.0, 1.0).is_err());
    }

    #[test]
    fn seed_reinterprets_negative() {
        assert_eq!(seed(&Number::from(-1i64)).unwrap(), u64::MAX);
        assert_eq!(seed(&Number::from(u64::MAX)).unwrap(), u64::MAX);
        assert_eq!(seed(&Number::from(42u64)).unwrap(), 42);
        let float = Number::from_f64(1.5).unwrap();
        assert_eq!(seed(&float).unwrap_err().param.as_deref(), Some("seed"));
    }

    #[test]
    fn logit_bias_sorted_and_deduplicated() {
        let map = BTreeMap::from([
            ("7".to_string(), 1.0),
            (" 5".to_string(), -3.0),
            ("5".to_string(), 2.0),
        ]);
        // BTreeMap order: " 5", "5", "7" — the later "5" wins.
        assert_eq!(logit_bias(Some(map)).unwrap(), vec![(5, 2.0), (7, 1.0)]);
    }
}
