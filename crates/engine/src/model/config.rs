//! A model's hyper-parameters, read from the GGUF metadata under its architecture's
//! prefix (`{arch}.block_count`, `{arch}.attention.head_count_kv`, `{arch}.rope.freq_base`,
//! `{arch}.attention.sliding_window`, ...). Every value is checked; a missing or
//! out-of-range one is an error naming its key.

use std::collections::HashMap;

use candle_core::quantized::gguf_file::Value;

use super::arch::Family;
use super::rope::{RopeConfig, RopeScaling};
use crate::gguf::{metadata_f32, metadata_str, metadata_usize, GgufFile, ModelError};

/// The shape every family shares.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub n_layer: usize,
    pub hidden: usize,
    pub ffn_hidden: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub context_len: usize,
    pub rope_theta: f32,
    pub rms_eps: f32,
    pub tied_embeddings: bool,
}

/// What the family and its metadata add to the shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ArchConfig {
    pub family: &'static Family,
    /// RoPE of the global layers (of every layer without sliding windows).
    pub rope: RopeConfig,
    /// RoPE of the sliding layers when it differs (Gemma 3).
    pub window_rope: Option<RopeConfig>,
    /// Keys a sliding layer's query sees: positions `p - window + 1 ..= p`.
    pub window: Option<usize>,
    /// `cap · tanh(score / cap)` on attention scores (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// `cap · tanh(logit / cap)` on the output logits (Gemma 2).
    pub final_softcap: Option<f32>,
    /// The factor on `q·k` before softmax.
    pub attn_scale: f32,
    /// The factor on token embeddings (`√hidden` for Gemma).
    pub embed_scale: Option<f32>,
}

impl ArchConfig {
    /// Whether layer `il` attends over the sliding window.
    pub fn is_window_layer(&self, il: usize) -> bool {
        self.window.is_some() && self.family.is_window_layer(il)
    }
}

fn bad(key: String, reason: &str) -> ModelError {
    ModelError::Metadata {
        key,
        reason: reason.into(),
    }
}

/// `key` if present, else `default`.
fn usize_or(md: &HashMap<String, Value>, key: &str, default: usize) -> Result<usize, ModelError> {
    match md.get(key) {
        Some(_) => metadata_usize(md, key),
        None => Ok(default),
    }
}

fn f32_opt(md: &HashMap<String, Value>, key: &str) -> Result<Option<f32>, ModelError> {
    match md.get(key) {
        Some(_) => metadata_f32(md, key).map(Some),
        None => Ok(None),
    }
}

/// Reads the family, the shape and the family's parameters of `file`.
pub fn read(file: &GgufFile) -> Result<(ModelConfig, ArchConfig), ModelError> {
    let md = file.metadata();
    let arch = metadata_str(md, "general.architecture")
        .ok_or_else(|| bad("general.architecture".into(), "missing"))?;
    let family = Family::of(arch)?;
    let cfg = read_shape(file, family)?;
    let arch_cfg = read_arch(md, family, &cfg)?;
    Ok((cfg, arch_cfg))
}

fn read_shape(file: &GgufFile, family: &Family) -> Result<ModelConfig, ModelError> {
    let md = file.metadata();
    let k = |s: &str| family.key(s);
    let n_layer = metadata_usize(md, &k("block_count"))?;
    let hidden = metadata_usize(md, &k("embedding_length"))?;
    let ffn_hidden = metadata_usize(md, &k("feed_forward_length"))?;
    let n_head = metadata_usize(md, &k("attention.head_count"))?;
    let n_kv_head = usize_or(md, &k("attention.head_count_kv"), n_head)?;
    let context_len = metadata_usize(md, &k("context_length"))?;
    let rope_theta = f32_opt(md, &k("rope.freq_base"))?.unwrap_or(10_000.0);
    let rms_eps = metadata_f32(md, &k("attention.layer_norm_rms_epsilon"))?;
    if n_layer == 0 || hidden == 0 || ffn_hidden == 0 || context_len == 0 {
        return Err(bad(k("*"), "a size is zero"));
    }
    if n_head == 0 {
        return Err(bad(k("attention.head_count"), "must be non-zero"));
    }
    if n_kv_head == 0 || n_head % n_kv_head != 0 {
        return Err(bad(
            k("attention.head_count_kv"),
            "must be non-zero and divide head_count",
        ));
    }
    let default_hd = hidden / n_head;
    let head_dim = usize_or(md, &k("attention.key_length"), default_hd)?;
    let value_dim = usize_or(md, &k("attention.value_length"), default_hd)?;
    if value_dim != head_dim {
        return Err(ModelError::Unsupported(format!(
            "value heads of {value_dim} with key heads of {head_dim} ({})",
            k("attention.value_length")
        )));
    }
    if head_dim == 0 || head_dim % 2 != 0 {
        return Err(bad(
            k("attention.key_length"),
            "head dimension must be even",
        ));
    }
    let rope_dim = usize_or(md, &k("rope.dimension_count"), head_dim)?;
    if rope_dim != head_dim {
        return Err(ModelError::Unsupported(format!(
            "partial rotary embeddings (rope dimension {rope_dim}, head dimension {head_dim})"
        )));
    }
    if !(rms_eps > 0.0 && rms_eps < 1.0) {
        return Err(bad(k("attention.layer_norm_rms_epsilon"), "out of range"));
    }
    if !(rope_theta > 0.0 && rope_theta.is_finite()) {
        return Err(bad(k("rope.freq_base"), "out of range"));
    }
    let vocab_size = match file.tensor_dims("token_embd.weight").as_deref() {
        Some([v, h]) if *h == hidden && *v > 0 => *v,
        Some(dims) => {
            return Err(ModelError::Tensor {
                name: "token_embd.weight".into(),
                reason: format!("shape {dims:?}, expected [vocab, {hidden}]"),
            })
        }
        None => {
            return Err(ModelError::Tensor {
                name: "token_embd.weight".into(),
                reason: "missing from the file".into(),
            })
        }
    };
    Ok(ModelConfig {
        n_layer,
        hidden,
        ffn_hidden,
        n_head,
        n_kv_head,
        head_dim,
        vocab_size,
        context_len,
        rope_theta,
        rms_eps,
        tied_embeddings: family.always_tied || !file.has_tensor("output.weight"),
    })
}

fn read_arch(
    md: &HashMap<String, Value>,
    family: &'static Family,
    cfg: &ModelConfig,
) -> Result<ArchConfig, ModelError> {
    let k = |s: &str| family.key(s);
    let scaling = read_rope_scaling(md, family, cfg)?;
    let rope = RopeConfig {
        base: cfg.rope_theta,
        scaling,
        freq_factors: None,
    };
    let window = match family.window_layers {
        super::arch::WindowLayers::None => None,
        super::arch::WindowLayers::AllButEvery(_) => {
            let key = k("attention.sliding_window");
            let w = match (md.contains_key(&key), family.default_window) {
                (true, _) | (false, None) => metadata_usize(md, &key)?,
                (false, Some(d)) => d,
            };
            if w == 0 {
                return Err(bad(key, "must be non-zero"));
            }
            Some(w)
        }
    };
    let window_rope = family.window_rope_base.map(|base| RopeConfig {
        base,
        scaling: RopeScaling::None,
        freq_factors: None,
    });
    let cap = |key: &str, default: Option<f32>| -> Result<Option<f32>, ModelError> {
        let v = f32_opt(md, &k(key))?.or(default);
        match v {
            Some(c) if !(c > 0.0 && c.is_finite()) => Err(bad(k(key), "must be positive")),
            _ => Ok(v),
        }
    };
    let attn_softcap = cap("attn_logit_softcapping", family.default_attn_softcap)?;
    let final_softcap = cap("final_logit_softcapping", family.default_final_softcap)?;
    // Gemma's largest sizes scale by the width per head rather than the head dimension.
    let scale_dim = if family.scale_by_hidden_at.contains(&cfg.n_layer) {
        cfg.hidden / cfg.n_head
    } else {
        cfg.head_dim
    };
    Ok(ArchConfig {
        family,
        rope,
        window_rope,
        window,
        attn_softcap,
        final_softcap,
        attn_scale: 1.0 / (scale_dim as f32).sqrt(),
        embed_scale: family.embed_scale.then(|| (cfg.hidden as f32).sqrt()),
    })
}

fn read_rope_scaling(
    md: &HashMap<String, Value>,
    family: &Family,
    cfg: &ModelConfig,
) -> Result<RopeScaling, ModelError> {
    let k = |s: &str| family.key(s);
    let kind = metadata_str(md, &k("rope.scaling.type")).unwrap_or("linear");
    let factor = match f32_opt(md, &k("rope.scaling.factor"))? {
        Some(f) => Some(f),
        None => f32_opt(md, &k("rope.scale_linear"))?,
    };
    let factor = match factor {
        None => return Ok(RopeScaling::None),
        // A factor of 1 (or the unset 0) changes nothing in any scaling.
        Some(f) if f == 0.0 || f == 1.0 => return Ok(RopeScaling::None),
        Some(f) if !(f > 0.0 && f.is_finite()) => {
            return Err(bad(k("rope.scaling.factor"), "out of range"))
        }
        Some(f) => f,
    };
    match kind {
        "none" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor }),
        "yarn" => Ok(RopeScaling::Yarn {
            factor,
            orig_ctx: usize_or(
                md,
                &k("rope.scaling.original_context_length"),
                cfg.context_len,
            )?,
            attn_factor: f32_opt(md, &k("rope.scaling.attn_factor"))?.unwrap_or(1.0),
            beta_fast: 32.0,
            beta_slow: 1.0,
        }),
        other => Err(ModelError::Unsupported(format!(
            "RoPE scaling `{other}` ({})",
            k("rope.scaling.type")
        ))),
    }
}
