//! The step-time model: what one engine step costs on given hardware for a given model.
//!
//! A step is one batched forward over every scheduled sequence: prefill chunks and decode
//! tokens together. Its time is a roofline,
//! `max(flops / (peak · tp), bytes / (bandwidth · tp)) + overhead`, where the flops are the
//! dense layers over every token plus attention over each token's context, and the bytes
//! are the weights (read once per step) plus the KV cache each sequence reads and writes.
//! Tensor parallelism splits both across `tp` chips and adds two all-reduces per layer.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::SimError;

/// A chip (or, calibrated, this machine): compute, memory bandwidth and fixed costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct HardwareProfile {
    pub name: String,
    /// Dense peak in FLOP/s at the weights' compute precision.
    pub peak_flops: f64,
    /// Memory bandwidth in bytes/s.
    pub mem_bandwidth: f64,
    /// Memory per chip in bytes (weights + KV cache + reserve).
    pub memory_bytes: f64,
    /// Fraction of the peak a real kernel mix reaches.
    #[serde(default = "one")]
    pub flops_efficiency: f64,
    /// Fraction of the bandwidth a real kernel mix reaches.
    #[serde(default = "one")]
    pub bandwidth_efficiency: f64,
    /// Fixed cost of every step (scheduling, kernel launches, sampling), seconds.
    pub step_overhead_s: f64,
    /// Latency of one all-reduce across the tensor-parallel group, seconds.
    #[serde(default)]
    pub allreduce_s: f64,
    /// Fraction of memory the engine may use.
    #[serde(default = "default_mem_util")]
    pub memory_utilization: f64,
    /// KV-cache bytes, when the engine is told exactly (a CPU engine's `--kv-cache-memory`);
    /// overrides the memory budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_bytes: Option<f64>,
    /// How much faster a step's compute runs when it prefills several sequences at once:
    /// the compute term is divided by `min(rows, prefill_row_cap) ^ prefill_row_exponent`,
    /// `rows` being the sequences the step prefills. 0 (the default, and the named GPU
    /// profiles') is neutral; a calibration against a CPU engine fits it, since there a
    /// wide step of short prompts costs far less per token than one long prompt.
    #[serde(default)]
    pub prefill_row_exponent: f64,
    /// Rows beyond which the gain stops growing (the widest step calibrated).
    #[serde(default = "one")]
    pub prefill_row_cap: f64,
    /// What a calibrated profile was measured on; `None` for the named chips (and for
    /// profiles written before calibration recorded it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibrated_on: Option<CalibratedOn>,
}

/// The engine a calibration measured: the step times it fitted hold for that model and KV
/// layout, not for another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CalibratedOn {
    /// The model profile whose shape the fit used (`--model-profile` of the calibration).
    pub model_profile: String,
    /// The model name the engine served, when it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model: Option<String>,
    /// Tokens per KV block of the engine.
    pub kv_block_size: usize,
    /// The KV cache's element type (`f16`, `fp8`, `int8`).
    pub kv_cache_dtype: String,
}

/// The model profile a simulation uses with `hardware`: the one it was calibrated on unless
/// another is asked for, and another only with `scale_across_models` (the fit is then
/// scaled by the two models' shapes, which the caller should say). Named chips default to
/// `llama-3.1-8b`.
pub fn model_profile_for(
    hardware: &HardwareProfile,
    requested: Option<&str>,
    scale_across_models: bool,
) -> Result<String, SimError> {
    let Some(on) = &hardware.calibrated_on else {
        return Ok(requested.unwrap_or(DEFAULT_MODEL_PROFILE).to_string());
    };
    match requested {
        None => Ok(on.model_profile.clone()),
        Some(r) if r == on.model_profile || scale_across_models => Ok(r.to_string()),
        Some(r) => Err(SimError::config(
            "--model-profile",
            format!(
                "the hardware profile `{}` was calibrated on `{}`, and step times fitted on \
                 one model do not hold for `{r}`: calibrate against an engine serving `{r}`, \
                 or pass --scale-across-models to scale the fit by the models' shapes",
                hardware.name, on.model_profile
            ),
        )),
    }
}

/// The model profile of a simulation on a named chip when none is given.
pub const DEFAULT_MODEL_PROFILE: &str = "llama-3.1-8b";

fn one() -> f64 {
    1.0
}

fn default_mem_util() -> f64 {
    0.9
}

impl HardwareProfile {
    /// The named profiles: `h100`, `h200`, `a100`, `l4` (datasheet dense BF16 peak and
    /// bandwidth; efficiencies from what serving engines typically reach).
    pub fn named(name: &str) -> Result<HardwareProfile, SimError> {
        let gpu = |name: &str, tflops: f64, tbps: f64, gb: f64| HardwareProfile {
            name: name.to_string(),
            peak_flops: tflops * 1e12,
            mem_bandwidth: tbps * 1e12,
            memory_bytes: gb * 1e9,
            flops_efficiency: 0.6,
            bandwidth_efficiency: 0.8,
            step_overhead_s: 0.003,
            allreduce_s: 12e-6,
            memory_utilization: 0.9,
            kv_cache_bytes: None,
            prefill_row_exponent: 0.0,
            prefill_row_cap: 1.0,
            calibrated_on: None,
        };
        match name {
            "h100" => Ok(gpu("h100", 989.0, 3.35, 80.0)),
            "h200" => Ok(gpu("h200", 989.0, 4.8, 141.0)),
            "a100" => Ok(gpu("a100", 312.0, 2.039, 80.0)),
            "l4" => Ok(gpu("l4", 121.0, 0.3, 24.0)),
            other => Err(SimError::UnknownProfile {
                kind: "hardware",
                name: other.to_string(),
                known: "h100, h200, a100, l4 (or --hardware-profile FILE)",
            }),
        }
    }

    /// A profile written by `strata sim calibrate`.
    pub fn load(path: &Path) -> Result<HardwareProfile, SimError> {
        let text = std::fs::read_to_string(path).map_err(|source| SimError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let p: HardwareProfile = serde_json::from_str(&text).map_err(|e| SimError::Config {
            what: format!("hardware profile {}", path.display()),
            message: e.to_string(),
        })?;
        p.validate()?;
        Ok(p)
    }

    pub fn validate(&self) -> Result<(), SimError> {
        let pos = |x: f64| x.is_finite() && x > 0.0;
        let frac = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        let ok = pos(self.peak_flops)
            && pos(self.mem_bandwidth)
            && pos(self.memory_bytes)
            && frac(self.flops_efficiency)
            && frac(self.bandwidth_efficiency)
            && frac(self.memory_utilization)
            && self.step_overhead_s.is_finite()
            && self.step_overhead_s >= 0.0
            && self.allreduce_s.is_finite()
            && self.allreduce_s >= 0.0
            && self.kv_cache_bytes.is_none_or(pos)
            && self.prefill_row_exponent.is_finite()
            && (0.0..=4.0).contains(&self.prefill_row_exponent)
            && self.prefill_row_cap.is_finite()
            && self.prefill_row_cap >= 1.0
            && self
                .calibrated_on
                .as_ref()
                .is_none_or(|c| c.kv_block_size > 0);
        if ok {
            Ok(())
        } else {
            Err(SimError::Config {
                what: format!("hardware profile `{}`", self.name),
                message: "rates and memory must be positive, efficiencies in (0, 1], \
                          overheads non-negative, prefill_row_exponent in 0..=4, \
                          prefill_row_cap at least 1"
                    .into(),
            })
        }
    }
}

/// A model's shape: what its forward costs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelProfile {
    pub name: String,
    pub layers: u32,
    pub hidden: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub vocab: u32,
    /// Parameters, embeddings included.
    pub params: f64,
    /// Bytes per weight as served (2 for BF16, 0.625 for GGUF Q4_1).
    pub bytes_per_param: f64,
    /// Bytes per KV-cache entry (2 for FP16/BF16).
    pub kv_dtype_bytes: f64,
    /// Longest context.
    pub context_len: u32,
}

impl ModelProfile {
    /// `smollm2-135m`, `llama-3.1-8b`, `llama-3.1-70b`, `qwen3-32b`.
    pub fn named(name: &str) -> Result<ModelProfile, SimError> {
        #[allow(clippy::too_many_arguments)]
        let m = |name: &str,
                 layers,
                 hidden,
                 heads,
                 kv_heads,
                 head_dim,
                 vocab,
                 params: f64,
                 bpp: f64,
                 ctx| ModelProfile {
            name: name.to_string(),
            layers,
            hidden,
            heads,
            kv_heads,
            head_dim,
            vocab,
            params,
            bytes_per_param: bpp,
            kv_dtype_bytes: 2.0,
            context_len: ctx,
        };
        match name {
            // The engine's default model: GGUF Q4_1 weights, f16 KV.
            "smollm2-135m" => Ok(m(name, 30, 576, 9, 3, 64, 49_152, 134.5e6, 0.625, 8192)),
            "llama-3.1-8b" => Ok(m(name, 32, 4096, 32, 8, 128, 128_256, 8.03e9, 2.0, 131_072)),
            "llama-3.1-70b" => Ok(m(name, 80, 8192, 64, 8, 128, 128_256, 70.6e9, 2.0, 131_072)),
            "qwen3-32b" => Ok(m(name, 64, 5120, 64, 8, 128, 151_936, 32.8e9, 2.0, 40_960)),
            other => Err(SimError::UnknownProfile {
                kind: "model",
                name: other.to_string(),
                known: "smollm2-135m, llama-3.1-8b, llama-3.1-70b, qwen3-32b",
            }),
        }
    }

    /// KV-cache bytes one token takes, over all layers (K and V).
    pub fn kv_bytes_per_token(&self) -> f64 {
        2.0 * f64::from(self.layers)
            * f64::from(self.kv_heads)
            * f64::from(self.head_dim)
            * self.kv_dtype_bytes
    }

    pub fn weight_bytes(&self) -> f64 {
        self.params * self.bytes_per_param
    }

    /// Parameters multiplied per token (the embedding lookup is a gather, not a product;
    /// the LM head is counted separately, only for rows that need logits).
    fn dense_params(&self) -> f64 {
        (self.params - 2.0 * f64::from(self.vocab) * f64::from(self.hidden)).max(self.params * 0.5)
    }
}

/// One step's work, summed over its sequences.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepShape {
    /// Tokens run through the model (prefill chunks plus one per decode).
    pub tokens: u64,
    /// Sequences in the step whose last token yields logits.
    pub logits_rows: u64,
    /// Σ over tokens of the context each attends to.
    pub attended: u64,
    /// Σ over sequences of the context each reads from the KV cache.
    pub kv_read_tokens: u64,
    /// Sequences prefilling in the step (more than one token scheduled).
    pub prefill_rows: u64,
}

impl StepShape {
    /// Adds one sequence's part: `n` tokens from position `start`.
    pub fn add(&mut self, start: u64, n: u64, logits: bool) {
        self.tokens += n;
        self.logits_rows += u64::from(logits);
        // Token i (0-based in the chunk) attends to start + i + 1 positions.
        self.attended += n * start + n * (n + 1) / 2;
        self.kv_read_tokens += start + n;
        self.prefill_rows += u64::from(n > 1);
    }
}

/// The model of one replica's forward: hardware × model × tensor parallelism.
#[derive(Debug, Clone, PartialEq)]
pub struct StepModel {
    pub hardware: HardwareProfile,
    pub model: ModelProfile,
    pub tp: u32,
}

impl StepModel {
    pub fn new(hardware: HardwareProfile, model: ModelProfile, tp: u32) -> Result<Self, SimError> {
        hardware.validate()?;
        if tp == 0
            || !tp.is_power_of_two()
            || !model.kv_heads.is_multiple_of(tp.min(model.kv_heads))
        {
            return Err(SimError::Config {
                what: "--tp".into(),
                message: format!("must be a power of two dividing the KV heads, got {tp}"),
            });
        }
        Ok(StepModel {
            hardware,
            model,
            tp,
        })
    }

    /// FLOPs of a step, whole model (before splitting over `tp`).
    pub fn flops(&self, s: &StepShape) -> f64 {
        let m = &self.model;
        let dense = 2.0 * m.dense_params() * s.tokens as f64;
        let head = 2.0 * f64::from(m.hidden) * f64::from(m.vocab) * s.logits_rows as f64;
        // QKᵀ and PV: 2 products × 2 FLOPs per multiply-add, per query head dimension.
        let attn = 4.0
            * f64::from(m.layers)
            * f64::from(m.heads)
            * f64::from(m.head_dim)
            * s.attended as f64;
        dense + head + attn
    }

    /// Bytes a step moves, whole model: weights once, the KV each sequence reads, and the
    /// KV the new tokens write.
    pub fn bytes(&self, s: &StepShape) -> f64 {
        let kv = self.model.kv_bytes_per_token();
        self.model.weight_bytes() + kv * (s.kv_read_tokens as f64 + s.tokens as f64)
    }

    /// Seconds the step takes.
    pub fn step_time(&self, s: &StepShape) -> f64 {
        if s.tokens == 0 {
            return 0.0;
        }
        let hw = &self.hardware;
        let tp = f64::from(self.tp);
        let compute =
            self.flops(s) / (tp * hw.peak_flops * hw.flops_efficiency * self.prefill_row_gain(s));
        let memory = self.bytes(s) / (tp * hw.mem_bandwidth * hw.bandwidth_efficiency);
        let comm = if self.tp > 1 {
            2.0 * f64::from(self.model.layers) * hw.allreduce_s
        } else {
            0.0
        };
        compute.max(memory) + hw.step_overhead_s + comm
    }

    /// The compute speed-up of a step that prefills several sequences (1 when neutral).
    pub fn prefill_row_gain(&self, s: &StepShape) -> f64 {
        let hw = &self.hardware;
        if hw.prefill_row_exponent == 0.0 || s.prefill_rows < 2 {
            return 1.0;
        }
        (s.prefill_rows as f64)
            .min(hw.prefill_row_cap.max(1.0))
            .powf(hw.prefill_row_exponent)
    }

    /// KV blocks one replica holds: the memory left after the weights, or the profile's
    /// explicit KV budget.
    pub fn num_blocks(&self, block_size: usize) -> Result<usize, SimError> {
        let hw = &self.hardware;
        let bytes = match hw.kv_cache_bytes {
            Some(b) => b,
            None => {
                let total = hw.memory_bytes * f64::from(self.tp) * hw.memory_utilization;
                // A few percent for activations and the runtime's own buffers.
                total * 0.95 - self.model.weight_bytes()
            }
        };
        let per_block = self.model.kv_bytes_per_token() * block_size as f64;
        let n = (bytes / per_block).floor();
        if !n.is_finite() || n < 1.0 {
            return Err(SimError::Config {
                what: format!(
                    "{} on {} × {}",
                    self.model.name, self.tp, self.hardware.name
                ),
                message: "the weights leave no memory for the KV cache (raise --tp)".into(),
            });
        }
        Ok(n as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(hw: &str, m: &str, tp: u32) -> StepModel {
        StepModel::new(
            HardwareProfile::named(hw).unwrap(),
            ModelProfile::named(m).unwrap(),
            tp,
        )
        .unwrap()
    }

    #[test]
    fn decode_is_bandwidth_bound_and_prefill_compute_bound() {
        let sm = model("h100", "llama-3.1-8b", 1);
        let mut decode = StepShape::default();
        for _ in 0..8 {
            decode.add(1000, 1, true);
        }
        let hw = &sm.hardware;
        let mem = sm.bytes(&decode) / (hw.mem_bandwidth * hw.bandwidth_efficiency);
        let t = sm.step_time(&decode);
        assert!(
            (t - (mem + hw.step_overhead_s)).abs() < 1e-12,
            "{t} vs {mem}"
        );
        // 16 GB of weights at 2.68 TB/s effective: about 6 ms.
        assert!((0.005..0.008).contains(&mem), "{mem}");
        let mut prefill = StepShape::default();
        prefill.add(0, 8192, true);
        let flops = sm.flops(&prefill) / (hw.peak_flops * hw.flops_efficiency);
        assert!(flops > sm.bytes(&prefill) / (hw.mem_bandwidth * hw.bandwidth_efficiency));
        assert!((sm.step_time(&prefill) - (flops + hw.step_overhead_s)).abs() < 1e-12);
    }

    #[test]
    fn tensor_parallelism_splits_work_and_adds_allreduces() {
        let one = model("h100", "llama-3.1-70b", 4);
        let two = model("h100", "llama-3.1-70b", 8);
        let mut s = StepShape::default();
        s.add(0, 4096, true);
        assert!(two.step_time(&s) < one.step_time(&s));
        // 70B in BF16 does not fit on one H100.
        assert!(model("h100", "llama-3.1-70b", 1).num_blocks(16).is_err());
        assert!(one.num_blocks(16).unwrap() > 10_000);
    }

    #[test]
    fn prefill_row_gain_is_neutral_for_gpus_and_capped_when_fitted() {
        let mut sm = model("h100", "llama-3.1-8b", 1);
        let mut wide = StepShape::default();
        for _ in 0..8 {
            wide.add(0, 256, true);
        }
        assert_eq!(wide.prefill_rows, 8);
        assert_eq!(sm.prefill_row_gain(&wide), 1.0);
        let neutral = sm.step_time(&wide);
        sm.hardware.prefill_row_exponent = 0.5;
        sm.hardware.prefill_row_cap = 4.0;
        // Capped at 4 rows: 4^0.5 = 2.
        assert!((sm.prefill_row_gain(&wide) - 2.0).abs() < 1e-12);
        let o = sm.hardware.step_overhead_s;
        assert!(((sm.step_time(&wide) - o) * 2.0 - (neutral - o)).abs() < 1e-9);
        // One prompt, or decodes only, gain nothing.
        let mut one = StepShape::default();
        one.add(0, 2048, true);
        one.add(500, 1, true);
        assert_eq!(one.prefill_rows, 1);
        assert_eq!(sm.prefill_row_gain(&one), 1.0);
        sm.hardware.prefill_row_cap = 0.5;
        assert!(sm.hardware.validate().is_err());
    }

    #[test]
    fn attention_counts_the_triangle() {
        let mut s = StepShape::default();
        s.add(10, 3, true);
        assert_eq!(s.attended, 11 + 12 + 13);
        assert_eq!(s.kv_read_tokens, 13);
    }

    #[test]
    fn unknown_names_and_bad_profiles_are_errors() {
        assert!(HardwareProfile::named("tpu").is_err());
        assert!(ModelProfile::named("gpt-9").is_err());
        let mut hw = HardwareProfile::named("l4").unwrap();
        hw.peak_flops = f64::NAN;
        assert!(hw.validate().is_err());
        let hw = HardwareProfile::named("l4").unwrap();
        assert!(StepModel::new(hw, ModelProfile::named("qwen3-32b").unwrap(), 3).is_err());
    }
}
