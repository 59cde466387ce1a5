//! A BERT encoder for sentence embeddings: candle's matrix products, the rest by hand.
//!
//! The batch is ragged: every input's tokens are laid end to end, so the embeddings, the
//! dense projections, the layer norms and the feed-forward run as one matrix product over
//! all tokens of the batch and no work is spent on padding. Only attention looks at one
//! input at a time (an input attends to itself alone), so no mask is needed and an input's
//! vector does not depend on what else is in the batch.
//!
//! Activations live in plain row-major `Vec<f32>`s. The products go through candle (its
//! GEMM is multi-threaded); the row-wise work around them (bias, residual, layer norm,
//! GELU, softmax) is fused into one pass per row and split over the rayon pool, because
//! candle runs each of those as a separate single-threaded pass with a fresh buffer, which
//! cost as much as the products themselves.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::{Activation, EmbedError, EncoderConfig, Pooling};
use crate::attention::{dot, exp};

/// `x · W^T + b`, with `W^T` stored contiguous so the product needs no transpose.
struct Linear {
    w_t: Tensor,
    b: Vec<f32>,
    inp: usize,
    out: usize,
}

/// Rows per rayon task in the row-wise passes: enough work to outweigh the task.
const ROWS_PER_TASK: usize = 16;

impl Linear {
    /// `rows × inp` in, `rows × out` out (bias added).
    fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, EmbedError> {
        let t = Tensor::from_slice(x, (rows, self.inp), &Device::Cpu)?;
        let mut y = t.matmul(&self.w_t)?.flatten_all()?.to_vec1::<f32>()?;
        let b = &self.b;
        y.par_chunks_mut(self.out * ROWS_PER_TASK)
            .for_each(|chunk| {
                for row in chunk.chunks_exact_mut(b.len()) {
                    for (v, bias) in row.iter_mut().zip(b) {
                        *v += bias;
                    }
                }
            });
        Ok(y)
    }
}

struct LayerNorm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    /// `x = LayerNorm(x + residual)` row by row (`residual` may be empty: no residual).
    fn add_forward(&self, x: &mut [f32], residual: &[f32]) {
        let h = self.gamma.len();
        let (gamma, beta, eps) = (&self.gamma, &self.beta, self.eps);
        let task = h * ROWS_PER_TASK;
        let norm_rows = |chunk: &mut [f32], res: Option<&[f32]>| {
            for (r, row) in chunk.chunks_exact_mut(h).enumerate() {
                if let Some(res) = res {
                    for (v, add) in row.iter_mut().zip(&res[r * h..(r + 1) * h]) {
                        *v += add;
                    }
                }
                let mean = row.iter().sum::<f32>() / h as f32;
                let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / h as f32;
                let inv = 1.0 / (var + eps).sqrt();
                for ((v, g), b) in row.iter_mut().zip(gamma).zip(beta) {
                    *v = (*v - mean) * inv * g + b;
                }
            }
        };
        if residual.is_empty() {
            x.par_chunks_mut(task).for_each(|c| norm_rows(c, None));
        } else {
            x.par_chunks_mut(task)
                .zip(residual.par_chunks(task))
                .for_each(|(c, r)| norm_rows(c, Some(r)));
        }
    }
}

struct Layer {
    /// Query, key and value fused into one `[hidden, 3·hidden]` product.
    qkv: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

/// The encoder and its pooling.
pub struct BertModel {
    pub config: EncoderConfig,
    /// `[vocab, hidden]`, row-major.
    word: Vec<f32>,
    /// `[max_position_embeddings, hidden]`.
    position: Vec<f32>,
    /// Row 0 of the token-type table: every input is a single segment.
    segment: Vec<f32>,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
}

/// The tensors of a safetensors file, found by name with or without a `bert.` prefix.
struct Weights {
    tensors: HashMap<String, Tensor>,
    prefix: &'static str,
}

impl Weights {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EmbedError> {
        let full = format!("{}{name}", self.prefix);
        let t = self.tensors.get(&full).ok_or_else(|| EmbedError::Weights {
            name: full.clone(),
            reason: "missing".into(),
        })?;
        if t.dims() != shape {
            return Err(EmbedError::Weights {
                name: full,
                reason: format!("shape {:?}, expected {shape:?}", t.dims()),
            });
        }
        t.to_dtype(DType::F32).map_err(|e| EmbedError::Weights {
            name: full,
            reason: e.to_string(),
        })
    }

    fn vec(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EmbedError> {
        Ok(self.get(name, shape)?.flatten_all()?.to_vec1::<f32>()?)
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, EmbedError> {
        let w = self.get(&format!("{name}.weight"), &[out, inp])?;
        let b = self.vec(&format!("{name}.bias"), &[out])?;
        Ok(Linear {
            w_t: w.t()?.contiguous()?,
            b,
            inp,
            out,
        })
    }

    fn norm(&self, name: &str, n: usize, eps: f64) -> Result<LayerNorm, EmbedError> {
        Ok(LayerNorm {
            gamma: self.vec(&format!("{name}.weight"), &[n])?,
            beta: self.vec(&format!("{name}.bias"), &[n])?,
            eps: eps as f32,
        })
    }
}

impl BertModel {
    /// Loads `model.safetensors` from a model directory described by `config`.
    pub fn load(dir: &Path, config: EncoderConfig) -> Result<Self, EmbedError> {
        let path = dir.join("model.safetensors");
        if !path.is_file() {
            return Err(EmbedError::Io {
                path,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
            });
        }
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| {
            EmbedError::Config {
                path: path.clone(),
                reason: format!("not a readable safetensors file: {e}"),
            }
        })?;
        let prefix = if tensors.contains_key("embeddings.word_embeddings.weight") {
            ""
        } else {
            "bert."
        };
        Self::from_weights(&Weights { tensors, prefix }, config)
    }

    /// Builds the model from tensors already in memory (tests build small random ones).
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        config: EncoderConfig,
    ) -> Result<Self, EmbedError> {
        Self::from_weights(
            &Weights {
                tensors,
                prefix: "",
            },
            config,
        )
    }

    fn from_weights(w: &Weights, config: EncoderConfig) -> Result<Self, EmbedError> {
        let h = config.hidden_size;
        let eps = config.layer_norm_eps;
        let word = w.vec("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.vec(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?;
        let mut segment = w.vec(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?;
        segment.truncate(h);
        let emb_norm = w.norm("embeddings.LayerNorm", h, eps)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("encoder.layer.{i}");
            let q = w.linear(&format!("{p}.attention.self.query"), h, h)?;
            let k = w.linear(&format!("{p}.attention.self.key"), h, h)?;
            let v = w.linear(&format!("{p}.attention.self.value"), h, h)?;
            let qkv = Linear {
                w_t: Tensor::cat(&[&q.w_t, &k.w_t, &v.w_t], 1)?.contiguous()?,
                b: [q.b, k.b, v.b].concat(),
                inp: h,
                out: 3 * h,
            };
            layers.push(Layer {
                qkv,
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"), h, eps)?,
                intermediate: w.linear(
                    &format!("{p}.intermediate.dense"),
                    config.intermediate_size,
                    h,
                )?,
                output: w.linear(&format!("{p}.output.dense"), h, config.intermediate_size)?,
                out_norm: w.norm(&format!("{p}.output.LayerNorm"), h, eps)?,
            });
        }
        Ok(BertModel {
            config,
            word,
            position,
            segment,
            emb_norm,
            layers,
        })
    }

    /// Embeds each input (token ids, special tokens included) into one L2-normalised vector.
    ///
    /// Every input must be non-empty, at most `max_position_embeddings` long and hold ids
    /// below `vocab_size`; the server checks this before submitting, and a violation here is
    /// an error rather than a panic.
    pub fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let cfg = &self.config;
        let h = cfg.hidden_size;
        for (i, input) in inputs.iter().enumerate() {
            if input.is_empty() || input.len() > cfg.max_position_embeddings {
                return Err(EmbedError::Forward(format!(
                    "input {i} has {} tokens (1..={} allowed)",
                    input.len(),
                    cfg.max_position_embeddings
                )));
            }
            if let Some(bad) = input.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EmbedError::Forward(format!(
                    "input {i}: token id {bad} is outside the vocabulary"
                )));
            }
        }
        // Embedding rows: word + position + segment, one row per token.
        let mut x = Vec::with_capacity(inputs.iter().map(Vec::len).sum::<usize>() * h);
        for input in inputs {
            for (pos, &id) in input.iter().enumerate() {
                let word = &self.word[id as usize * h..(id as usize + 1) * h];
                let position = &self.position[pos * h..(pos + 1) * h];
                x.extend(
                    word.iter()
                        .zip(position)
                        .zip(&self.segment)
                        .map(|((w, p), s)| w + p + s),
                );
            }
        }
        self.emb_norm.add_forward(&mut x, &[]);
        let spans = spans(inputs);
        for layer in &self.layers {
            x = self.layer(layer, x, &spans)?;
        }
        Ok(self.pool(&x, &spans))
    }

    fn layer(
        &self,
        l: &Layer,
        x: Vec<f32>,
        spans: &[(usize, usize)],
    ) -> Result<Vec<f32>, EmbedError> {
        let cfg = &self.config;
        let rows = x.len() / cfg.hidden_size;
        let qkv = l.qkv.forward(&x, rows)?;
        let ctx = attention(&qkv, spans, cfg.hidden_size, cfg.num_heads);
        let mut y = l.attn_out.forward(&ctx, rows)?;
        l.attn_norm.add_forward(&mut y, &x);
        let mut inner = l.intermediate.forward(&y, rows)?;
        let act = cfg.activation;
        inner
            .par_chunks_mut(cfg.intermediate_size * ROWS_PER_TASK)
            .for_each(|c| activate_all(act, c));
        let mut out = l.output.forward(&inner, rows)?;
        l.out_norm.add_forward(&mut out, &y);
        Ok(out)
    }

    fn pool(&self, x: &[f32], spans: &[(usize, usize)]) -> Vec<Vec<f32>> {
        let h = self.config.hidden_size;
        let pooling = self.config.pooling;
        spans
            .par_iter()
            .map(|&(start, n)| {
                let rows = &x[start * h..(start + n) * h];
                let mut v = match pooling {
                    Pooling::Mean => {
                        let mut sum = vec![0f32; h];
                        for row in rows.chunks_exact(h) {
                            for (s, r) in sum.iter_mut().zip(row) {
                                *s += r;
                            }
                        }
                        sum.iter_mut().for_each(|s| *s /= n as f32);
                        sum
                    }
                    Pooling::Cls => rows[..h].to_vec(),
                };
                // L2 normalisation, guarded so an all-zero vector stays zero, not NaN.
                let norm = v.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
                v.iter_mut().for_each(|a| *a /= norm);
                v
            })
            .collect()
    }
}

/// `(first row, length)` of each input in the ragged batch.
fn spans(inputs: &[Vec<u32>]) -> Vec<(usize, usize)> {
    let mut start = 0;
    inputs
        .iter()
        .map(|i| {
            let s = (start, i.len());
            start += i.len();
            s
        })
        .collect()
}

/// The activation over a slice, chosen once outside the loop so each loop is branch-free
/// and vectorizes (libm's scalar `erff` was about a sixth of the encoder's time).
fn activate_all(act: Activation, xs: &mut [f32]) {
    match act {
        Activation::Gelu => xs
            .iter_mut()
            .for_each(|v| *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2))),
        Activation::GeluTanh => {
            let c = (2.0 / std::f32::consts::PI).sqrt();
            xs.iter_mut()
                .for_each(|v| *v = 0.5 * *v * (1.0 + (c * (*v + 0.044_715 * *v * *v * *v)).tanh()));
        }
        Activation::Relu => xs.iter_mut().for_each(|v| *v = v.max(0.0)),
    }
}

/// `erf(x)` by Abramowitz and Stegun's 7.1.26 (absolute error 1.5·10⁻⁷, about 5·10⁻⁷ once
/// evaluated in f32), branch-free, with the engine's vectorizing `exp`.
#[inline]
fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / (1.0 + 0.327_591_1 * a);
    let poly = t
        * (0.254_829_6
            + t * (-0.284_496_74 + t * (1.421_413_8 + t * (-1.453_152_1 + t * 1.061_405_4))));
    (1.0 - poly * exp(-a * a)).copysign(x)
}

/// Self-attention of each input over its own tokens, one task per (input, head).
///
/// `qkv` holds `[q | k | v]` per token (`3·hidden` wide); the result is the context,
/// `hidden` wide, heads side by side, in token order.
fn attention(qkv: &[f32], spans: &[(usize, usize)], hidden: usize, heads: usize) -> Vec<f32> {
    let d = hidden / heads;
    let scale = 1.0 / (d as f32).sqrt();
    let width = 3 * hidden;
    let tasks: Vec<(usize, usize, usize)> = spans
        .iter()
        .flat_map(|&(start, n)| (0..heads).map(move |head| (start, n, head)))
        .collect();
    // Each task returns its head's context rows; they are written back below.
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(start, n, head)| {
            let q_at = |i: usize| &qkv[(start + i) * width + head * d..][..d];
            // This head's keys and values, gathered contiguous: every query walks all of
            // them, and in `qkv` consecutive tokens are 3·hidden floats apart.
            let mut keys = Vec::with_capacity(n * d);
            let mut values = Vec::with_capacity(n * d);
            for j in 0..n {
                let row = &qkv[(start + j) * width..][..width];
                keys.extend_from_slice(&row[hidden + head * d..][..d]);
                values.extend_from_slice(&row[2 * hidden + head * d..][..d]);
            }
            let k_at = |j: usize| &keys[j * d..(j + 1) * d];
            let v_at = |j: usize| &values[j * d..(j + 1) * d];
            let mut ctx = vec![0f32; n * d];
            let mut scores = vec![0f32; n];
            for i in 0..n {
                let q = q_at(i);
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate() {
                    *s = dot(q, k_at(j)) * scale;
                    max = max.max(*s);
                }
                // The engine's vectorizing exp (≤ 2 ulp on softmax arguments): libm's
                // scalar expf was most of the attention time on long inputs.
                for s in scores.iter_mut() {
                    *s = exp(*s - max);
                }
                let sum: f32 = scores.iter().sum();
                let out = &mut ctx[i * d..(i + 1) * d];
                for (j, s) in scores.iter().enumerate() {
                    let p = s / sum;
                    for (o, v) in out.iter_mut().zip(v_at(j)) {
                        *o += p * v;
                    }
                }
            }
            ctx
        })
        .collect();
    let total: usize = spans.iter().map(|s| s.1).sum();
    let mut out = vec![0f32; total * hidden];
    for (&(start, n, head), part) in tasks.iter().zip(&parts) {
        for i in 0..n {
            out[(start + i) * hidden + head * d..][..d].copy_from_slice(&part[i * d..(i + 1) * d]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn erf_stays_within_a_millionth_of_libm() {
        let mut worst = 0f32;
        let mut x = -6.0f32;
        while x <= 6.0 {
            worst = worst.max((super::erf(x) - libm::erff(x)).abs());
            x += 1e-3;
        }
        // 1.5e-7 for the formula, the rest f32 rounding.
        assert!(worst < 1e-6, "erf differs from libm by {worst}");
        assert!(super::erf(0.0).abs() < 1e-7);
        assert_eq!(super::erf(f32::INFINITY), 1.0);
        assert_eq!(super::erf(-40.0), -1.0);
    }

    use super::*;

    fn tiny_config() -> EncoderConfig {
        EncoderConfig {
            vocab_size: 50,
            hidden_size: 8,
            num_layers: 2,
            num_heads: 2,
            intermediate_size: 16,
            max_position_embeddings: 16,
            type_vocab_size: 2,
            layer_norm_eps: 1e-12,
            activation: Activation::Gelu,
            pooling: Pooling::Mean,
            max_len: 16,
        }
    }

    fn random_tensors(cfg: &EncoderConfig) -> HashMap<String, Tensor> {
        let dev = Device::Cpu;
        let mut m = HashMap::new();
        let mut seed = 1.0f64;
        let mut add = |m: &mut HashMap<String, Tensor>, name: String, shape: &[usize]| {
            seed += 1.0;
            let n: usize = shape.iter().product();
            // A deterministic spread of values in (-0.5, 0.5).
            let data: Vec<f32> = (0..n)
                .map(|i| (((i as f64 + seed) * 0.618_033_988_7).fract() - 0.5) as f32)
                .collect();
            m.insert(name, Tensor::from_vec(data, shape, &dev).unwrap());
        };
        let h = cfg.hidden_size;
        add(
            &mut m,
            "embeddings.word_embeddings.weight".into(),
            &[cfg.vocab_size, h],
        );
        add(
            &mut m,
            "embeddings.position_embeddings.weight".into(),
            &[cfg.max_position_embeddings, h],
        );
        add(
            &mut m,
            "embeddings.token_type_embeddings.weight".into(),
            &[2, h],
        );
        add(&mut m, "embeddings.LayerNorm.weight".into(), &[h]);
        add(&mut m, "embeddings.LayerNorm.bias".into(), &[h]);
        for i in 0..cfg.num_layers {
            let p = format!("encoder.layer.{i}");
            for (name, out, inp) in [
                ("attention.self.query", h, h),
                ("attention.self.key", h, h),
                ("attention.self.value", h, h),
                ("attention.output.dense", h, h),
                ("intermediate.dense", cfg.intermediate_size, h),
                ("output.dense", h, cfg.intermediate_size),
            ] {
                add(&mut m, format!("{p}.{name}.weight"), &[out, inp]);
                add(&mut m, format!("{p}.{name}.bias"), &[out]);
            }
            for name in ["attention.output.LayerNorm", "output.LayerNorm"] {
                add(&mut m, format!("{p}.{name}.weight"), &[h]);
                add(&mut m, format!("{p}.{name}.bias"), &[h]);
            }
        }
        m
    }

    #[test]
    fn vectors_are_unit_length_and_independent_of_the_batch() {
        let cfg = tiny_config();
        let model = BertModel::from_tensors(random_tensors(&cfg), cfg).unwrap();
        let inputs = vec![vec![1, 5, 7, 2], vec![1, 9, 2], vec![3; 16]];
        let batch = model.embed(&inputs).unwrap();
        assert_eq!(batch.len(), 3);
        for (input, v) in inputs.iter().zip(&batch) {
            let norm: f32 = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
            let alone = model.embed(std::slice::from_ref(input)).unwrap();
            let diff = alone[0]
                .iter()
                .zip(v)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "batched differs from alone by {diff}");
        }
        assert_ne!(batch[0], batch[1]);
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let cfg = tiny_config();
        let model = BertModel::from_tensors(random_tensors(&cfg), cfg).unwrap();
        assert!(model.embed(&[vec![]]).is_err());
        assert!(model.embed(&[vec![1; 17]]).is_err());
        assert!(model.embed(&[vec![50]]).is_err());
        assert!(model.embed(&[]).unwrap().is_empty());
    }

    #[test]
    fn wrong_shapes_and_missing_tensors_are_named() {
        let cfg = tiny_config();
        let mut t = random_tensors(&cfg);
        t.remove("encoder.layer.1.output.dense.bias");
        let err = BertModel::from_tensors(t, cfg.clone()).err().unwrap();
        assert!(
            err.to_string()
                .contains("encoder.layer.1.output.dense.bias"),
            "{err}"
        );
        let mut t = random_tensors(&cfg);
        t.insert(
            "encoder.layer.0.attention.self.key.weight".into(),
            Tensor::zeros((8, 7), DType::F32, &Device::Cpu).unwrap(),
        );
        let err = BertModel::from_tensors(t, cfg).err().unwrap();
        assert!(err.to_string().contains("shape"), "{err}");
    }
}
