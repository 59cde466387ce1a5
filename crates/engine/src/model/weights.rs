//! A model's tensors by their GGUF names, loaded into the layout the forward pass reads.
//!
//! Tensor names are llama.cpp's for every family: `token_embd`, `output_norm`, `output`,
//! `rope_freqs`, and per block `blk.{i}.`: `attn_norm`, `attn_q`/`attn_k`/`attn_v` (or the
//! fused `attn_qkv`), their optional `.bias`, `attn_q_norm`/`attn_k_norm`, `attn_output`,
//! `post_attention_norm`, `ffn_norm`, `ffn_gate` + `ffn_up` (or `ffn_up` holding both),
//! `ffn_down`, `post_ffw_norm`.

use candle_core::quantized::QTensor;
use candle_core::{DType, Device};

use super::config::{ArchConfig, ModelConfig};
use super::format::WeightFormat;
use super::linear::{dense_to_format, to_linear, Linear, Proj};
use crate::gguf::{GgufFile, ModelError};

/// One transformer block.
pub struct Layer {
    pub attn_norm: Vec<f32>,
    pub qkv: Proj,
    /// Per-head RMSNorm weights of queries and keys (`head_dim` each).
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub wo: Linear,
    pub post_attn_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub gate_up: Proj,
    pub down: Linear,
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// Everything outside the blocks.
pub struct Globals {
    pub embed: candle_core::Tensor,
    pub output_norm: Vec<f32>,
    pub lm_head: Linear,
    /// `rope_freqs.weight`: llama 3's per-pair frequency divisors.
    pub rope_freqs: Option<Vec<f32>>,
}

/// A vector tensor (norm weights, biases) as f32.
fn vector(file: &mut GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    Ok(file
        .tensor(name, &[len])?
        .dequantize(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?)
}

fn optional_vector(
    file: &mut GgufFile,
    name: &str,
    len: usize,
) -> Result<Option<Vec<f32>>, ModelError> {
    if file.has_tensor(name) {
        vector(file, name, len).map(Some)
    } else {
        Ok(None)
    }
}

fn required_vector(
    file: &mut GgufFile,
    name: &str,
    len: usize,
    needed: bool,
) -> Result<Option<Vec<f32>>, ModelError> {
    if needed {
        vector(file, name, len).map(Some)
    } else {
        Ok(None)
    }
}

pub fn load_globals(
    file: &mut GgufFile,
    cfg: &ModelConfig,
    arch: &ArchConfig,
    format: WeightFormat,
) -> Result<Globals, ModelError> {
    let h = cfg.hidden;
    let embed_q = file.tensor("token_embd.weight", &[cfg.vocab_size, h])?;
    let embed = embed_q.dequantize(&Device::Cpu)?;
    let lm_head = if cfg.tied_embeddings {
        match format {
            WeightFormat::Gguf => to_linear(embed_q, format)?,
            _ => dense_to_format(embed.clone(), format)?,
        }
    } else {
        to_linear(file.tensor("output.weight", &[cfg.vocab_size, h])?, format)?
    };
    // A Q8_0 `lm_head` (the default model's tied embeddings) is the largest matrix of a
    // decode step; with 8-bit decode activations it runs the batched integer kernel instead
    // of expanding every weight to f32 (3–5× faster). Rows whose role keeps f32
    // activations (`q8_prompt` / `q8_decode` off) still multiply them.
    let lm_head = match lm_head {
        Linear::Blocks(b) => Linear::Blocks(b.with_q8_decode_rows()),
        other => other,
    };
    let output_norm = vector(file, "output_norm.weight", h)?;
    let rope_freqs = if arch.family.rope_freq_factors {
        optional_vector(file, "rope_freqs.weight", cfg.head_dim / 2)?
    } else {
        None
    };
    if file.has_tensor("rope_factors_long.weight") || file.has_tensor("rope_factors_short.weight") {
        return Err(ModelError::Unsupported(
            "LongRoPE frequency factors (rope_factors_long/short.weight)".into(),
        ));
    }
    Ok(Globals {
        embed,
        output_norm,
        lm_head,
        rope_freqs,
    })
}

pub fn load_layer(
    file: &mut GgufFile,
    i: usize,
    cfg: &ModelConfig,
    arch: &ArchConfig,
    format: WeightFormat,
) -> Result<Layer, ModelError> {
    let (h, hd, ffn) = (cfg.hidden, cfg.head_dim, cfg.ffn_hidden);
    let (q_dim, kv_dim) = (cfg.n_head * hd, cfg.n_kv_head * hd);
    let p = |s: &str| format!("blk.{i}.{s}.weight");
    let fam = arch.family;
    let qkv = load_qkv(file, i, h, q_dim, kv_dim, format)?;
    let gate_up = if file.has_tensor(&p("ffn_gate")) {
        let gate = file.tensor(&p("ffn_gate"), &[ffn, h])?;
        let up = file.tensor(&p("ffn_up"), &[ffn, h])?;
        Proj::new(vec![gate, up], None, format)?
    } else {
        // Phi-3: one `ffn_up` whose first half of rows is the gate.
        let fused = file.tensor(&p("ffn_up"), &[2 * ffn, h])?;
        Proj::from_fused(fused, vec![ffn, ffn], format)?
    };
    Ok(Layer {
        attn_norm: vector(file, &p("attn_norm"), h)?,
        qkv,
        q_norm: required_vector(file, &p("attn_q_norm"), hd, fam.qk_norm)?,
        k_norm: required_vector(file, &p("attn_k_norm"), hd, fam.qk_norm)?,
        wo: to_linear(file.tensor(&p("attn_output"), &[h, q_dim])?, format)?,
        post_attn_norm: required_vector(file, &p("post_attention_norm"), h, fam.post_norms)?,
        ffn_norm: vector(file, &p("ffn_norm"), h)?,
        gate_up,
        down: to_linear(file.tensor(&p("ffn_down"), &[h, ffn])?, format)?,
        post_ffn_norm: required_vector(file, &p("post_ffw_norm"), h, fam.post_norms)?,
    })
}

/// Q, K and V: three matrices with optional biases, or Phi-3's one `attn_qkv`.
fn load_qkv(
    file: &mut GgufFile,
    i: usize,
    h: usize,
    q_dim: usize,
    kv_dim: usize,
    format: WeightFormat,
) -> Result<Proj, ModelError> {
    let p = |s: &str| format!("blk.{i}.{s}.weight");
    let b = |s: &str| format!("blk.{i}.{s}.bias");
    if file.has_tensor(&p("attn_qkv")) {
        let w = file.tensor(&p("attn_qkv"), &[q_dim + 2 * kv_dim, h])?;
        return Proj::from_fused(w, vec![q_dim, kv_dim, kv_dim], format);
    }
    let ws: Vec<QTensor> = vec![
        file.tensor(&p("attn_q"), &[q_dim, h])?,
        file.tensor(&p("attn_k"), &[kv_dim, h])?,
        file.tensor(&p("attn_v"), &[kv_dim, h])?,
    ];
    let names = [("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)];
    let present = names.iter().filter(|(n, _)| file.has_tensor(&b(n))).count();
    let bias = match present {
        0 => None,
        3 => {
            let mut all = Vec::with_capacity(q_dim + 2 * kv_dim);
            for (n, len) in names {
                all.extend(vector(file, &b(n), len)?);
            }
            Some(all)
        }
        _ => {
            return Err(ModelError::Tensor {
                name: format!("blk.{i}.attn_*.bias"),
                reason: "some but not all of the Q, K and V biases are present".into(),
            })
        }
    };
    Proj::new(ws, bias, format)
}
