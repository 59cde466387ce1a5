//! A BERT encoder for sentence embeddings: 8-bit (or f32) matrix products, the rest by hand.
//!
//! The batch is ragged: every input's tokens are laid end to end, so the embeddings, the
//! dense projections, the layer norms and the feed-forward run as one matrix product over
//! all tokens of the batch and no work is spent on padding. Only attention looks at one
//! input at a time (an input attends to itself alone), so no mask is needed and an input's
//! vector does not depend on what else is in the batch.
//!
//! Activations live in plain row-major `Vec<f32>`s. The products go through
//! [`super::linear`] (the decoder's 8-bit integer kernels by default, candle's f32 GEMM
//! with `STRATA_EMBED_WEIGHTS=f32`, both multi-threaded); the row-wise work around them (bias, residual, layer norm,
//! GELU, softmax) is fused into one pass per row and split over the rayon pool, because
//! candle runs each of those as a separate single-threaded pass with a fresh buffer, which
//! cost as much as the products themselves.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use rayon::prelude::*;

use super::attention::{attention, Rows};
use super::input::Segmented;
use super::linear::{EncoderWeights, Linear};
use super::{Activation, EmbedError, EncoderConfig, Pooling};
use crate::attention::exp;

/// Rows per rayon task in the row-wise passes: enough work to outweigh the task.
const ROWS_PER_TASK: usize = 16;

struct LayerNorm {
    gamma: Vec<f32>,
    beta: Vec<f32>,
    eps: f32,
}

impl LayerNorm {
    /// `|γ_j| + |β_j|` per channel: how far the output can reach (the normalised input is
    /// about unit scale); what the next layer's 8-bit weights are smoothed by.
    fn reach(&self) -> Vec<f32> {
        self.gamma
            .iter()
            .zip(&self.beta)
            .map(|(g, b)| g.abs() + b.abs())
            .collect()
    }

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

/// The query, key and value projections.
enum Qkv {
    /// f32: fused into one `[hidden, 3·hidden]` product, `[q | k | v]` per token.
    Fused(Linear),
    /// 8-bit: three products, each smoothed by its own input-channel scales (one shared
    /// set, over the three matrices' largest weights, lost too much: the lowest
    /// reference cosine fell below 0.999).
    Split(Box<[Linear; 3]>),
}

struct Layer {
    qkv: Qkv,
    attn_out: Linear,
    attn_norm: LayerNorm,
    intermediate: Linear,
    output: Linear,
    out_norm: LayerNorm,
}

/// The last layer's token vectors of a batch, its inputs' rows end to end, and each
/// input's `(first row, length)` ([`BertModel::hidden_states`]).
pub type HiddenStates = (Vec<f32>, Vec<(usize, usize)>);

/// The encoder and its pooling.
pub struct BertModel {
    pub config: EncoderConfig,
    /// `[vocab, hidden]`, row-major.
    word: Vec<f32>,
    /// `[max_position_embeddings, hidden]`.
    position: Vec<f32>,
    /// The token-type table, `[type_vocab_size, hidden]`: row 0 for an input of one
    /// segment, row 1 for the second part of a pair (a cross-encoder's document).
    segment: Vec<f32>,
    emb_norm: LayerNorm,
    layers: Vec<Layer>,
}

/// The checkpoint's tensor `name` (`t`), checked to be there and of `shape`, in f32.
pub(super) fn checked_f32(
    name: String,
    t: Option<&Tensor>,
    shape: &[usize],
) -> Result<Tensor, EmbedError> {
    let Some(t) = t else {
        return Err(EmbedError::Weights {
            name,
            reason: "missing".into(),
        });
    };
    if t.dims() != shape {
        return Err(EmbedError::Weights {
            name,
            reason: format!("shape {:?}, expected {shape:?}", t.dims()),
        });
    }
    t.to_dtype(DType::F32).map_err(|e| EmbedError::Weights {
        name,
        reason: e.to_string(),
    })
}

/// The tensors of a safetensors file, found by name with or without a `bert.` prefix.
struct Weights {
    tensors: HashMap<String, Tensor>,
    prefix: &'static str,
    format: EncoderWeights,
}

impl Weights {
    fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, EmbedError> {
        let full = format!("{}{name}", self.prefix);
        let t = self.tensors.get(&full);
        checked_f32(full, t, shape)
    }

    fn vec(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, EmbedError> {
        Ok(self.get(name, shape)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// A dense layer's `[out, inp]` weight and its bias.
    fn dense(&self, name: &str, out: usize, inp: usize) -> Result<(Tensor, Vec<f32>), EmbedError> {
        let w = self.get(&format!("{name}.weight"), &[out, inp])?;
        let b = self.vec(&format!("{name}.bias"), &[out])?;
        Ok((w, b))
    }

    fn linear(&self, name: &str, out: usize, inp: usize) -> Result<Linear, EmbedError> {
        let (w, b) = self.dense(name, out, inp)?;
        Linear::new(&w, b, self.format)
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
    /// Loads `model.safetensors` from a model directory described by `config`, with the
    /// weight format `STRATA_EMBED_WEIGHTS` names (default 8-bit, see [`EncoderWeights`]).
    pub fn load(dir: &Path, config: EncoderConfig) -> Result<Self, EmbedError> {
        Self::load_as(dir, config, EncoderWeights::from_env()?)
    }

    /// [`BertModel::load`] with the weight format given.
    pub fn load_as(
        dir: &Path,
        config: EncoderConfig,
        format: EncoderWeights,
    ) -> Result<Self, EmbedError> {
        Self::from_checkpoint(read_safetensors(dir)?, config, format)
    }

    /// Builds the model from a checkpoint's tensors, named with or without a `bert.`
    /// prefix (a task model such as `BertForSequenceClassification` has it).
    pub(super) fn from_checkpoint(
        tensors: HashMap<String, Tensor>,
        config: EncoderConfig,
        format: EncoderWeights,
    ) -> Result<Self, EmbedError> {
        let prefix = if tensors.contains_key("embeddings.word_embeddings.weight") {
            ""
        } else {
            "bert."
        };
        Self::from_weights(
            &Weights {
                tensors,
                prefix,
                format,
            },
            config,
        )
    }

    /// Builds the model from tensors already in memory (tests build small random ones).
    pub fn from_tensors(
        tensors: HashMap<String, Tensor>,
        config: EncoderConfig,
        format: EncoderWeights,
    ) -> Result<Self, EmbedError> {
        Self::from_weights(
            &Weights {
                tensors,
                prefix: "",
                format,
            },
            config,
        )
    }

    /// The weight format the dense layers ended up in: 8-bit only if every one of them is
    /// (a width off the block size keeps f32).
    pub fn weights(&self) -> EncoderWeights {
        let all_int8 = self.layers.iter().all(|l| {
            let qkv_int8 = match &l.qkv {
                Qkv::Fused(m) => m.is_int8(),
                Qkv::Split(ms) => ms.iter().all(Linear::is_int8),
            };
            qkv_int8
                && [&l.attn_out, &l.intermediate, &l.output]
                    .iter()
                    .all(|m| m.is_int8())
        });
        if all_int8 && !self.layers.is_empty() {
            EncoderWeights::Int8
        } else {
            EncoderWeights::F32
        }
    }

    fn from_weights(w: &Weights, config: EncoderConfig) -> Result<Self, EmbedError> {
        let h = config.hidden_size;
        let eps = config.layer_norm_eps;
        let word = w.vec("embeddings.word_embeddings.weight", &[config.vocab_size, h])?;
        let position = w.vec(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?;
        let segment = w.vec(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?;
        let emb_norm = w.norm("embeddings.LayerNorm", h, eps)?;
        let mut layers = Vec::with_capacity(config.num_layers);
        for i in 0..config.num_layers {
            let p = format!("encoder.layer.{i}");
            let (qw, qb) = w.dense(&format!("{p}.attention.self.query"), h, h)?;
            let (kw, kb) = w.dense(&format!("{p}.attention.self.key"), h, h)?;
            let (vw, vb) = w.dense(&format!("{p}.attention.self.value"), h, h)?;
            // The query/key/value projection reads the previous LayerNorm's output (the
            // embeddings' for the first layer), the feed-forward the attention's.
            let reach = layers
                .last()
                .map_or(&emb_norm, |l: &Layer| &l.out_norm)
                .reach();
            let qkv = match w.format {
                EncoderWeights::F32 => Qkv::Fused(Linear::new(
                    &Tensor::cat(&[&qw, &kw, &vw], 0)?,
                    [qb, kb, vb].concat(),
                    w.format,
                )?),
                EncoderWeights::Int8 => Qkv::Split(Box::new([
                    Linear::after_norm(&qw, qb, w.format, &reach)?,
                    Linear::after_norm(&kw, kb, w.format, &reach)?,
                    Linear::after_norm(&vw, vb, w.format, &reach)?,
                ])),
            };
            let attn_norm = w.norm(&format!("{p}.attention.output.LayerNorm"), h, eps)?;
            let (iw, ib) = w.dense(
                &format!("{p}.intermediate.dense"),
                config.intermediate_size,
                h,
            )?;
            let intermediate = Linear::after_norm(&iw, ib, w.format, &attn_norm.reach())?;
            layers.push(Layer {
                qkv,
                attn_out: w.linear(&format!("{p}.attention.output.dense"), h, h)?,
                attn_norm,
                intermediate,
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
        self.embed_segmented(inputs)
    }

    /// [`BertModel::embed`] over inputs that may be pairs (a pair's second part reads
    /// the second token type).
    pub fn embed_segmented<T: Segmented>(&self, inputs: &[T]) -> Result<Vec<Vec<f32>>, EmbedError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let (x, spans) = self.hidden_states(inputs)?;
        Ok(self.pool(&x, &spans))
    }

    /// The last layer's token vectors, every input's rows end to end (`[tokens, hidden]`),
    /// and each input's `(first row, length)`: what pooling or a task head reads. Inputs
    /// are checked as [`BertModel::embed`] says; a pair's second part must start within it
    /// and the model must have a second token type.
    pub fn hidden_states<T: Segmented>(&self, inputs: &[T]) -> Result<HiddenStates, EmbedError> {
        let cfg = &self.config;
        let h = cfg.hidden_size;
        for (i, input) in inputs.iter().enumerate() {
            let (second, input) = (input.second_segment(), input.ids());
            if second < input.len() && (second == 0 || cfg.type_vocab_size < 2) {
                return Err(EmbedError::Forward(format!(
                    "input {i}: a second segment at {second} needs a first one and two token \
                     types (the model has {})",
                    cfg.type_vocab_size
                )));
            }
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
        let mut x = Vec::with_capacity(inputs.iter().map(|i| i.ids().len()).sum::<usize>() * h);
        for input in inputs {
            let second = input.second_segment();
            for (pos, &id) in input.ids().iter().enumerate() {
                let word = &self.word[id as usize * h..(id as usize + 1) * h];
                let position = &self.position[pos * h..(pos + 1) * h];
                let kind = usize::from(pos >= second);
                let segment = &self.segment[kind * h..(kind + 1) * h];
                x.extend(
                    word.iter()
                        .zip(position)
                        .zip(segment)
                        .map(|((w, p), s)| w + p + s),
                );
            }
        }
        self.emb_norm.add_forward(&mut x, &[]);
        let spans = spans(inputs);
        for layer in &self.layers {
            x = self.layer(layer, x, &spans)?;
        }
        Ok((x, spans))
    }

    fn layer(
        &self,
        l: &Layer,
        x: Vec<f32>,
        spans: &[(usize, usize)],
    ) -> Result<Vec<f32>, EmbedError> {
        let cfg = &self.config;
        let rows = x.len() / cfg.hidden_size;
        let h = cfg.hidden_size;
        let ctx = match &l.qkv {
            Qkv::Fused(m) => {
                let qkv = m.forward(&x, rows)?;
                let part = |offset| Rows {
                    data: &qkv,
                    stride: 3 * h,
                    offset,
                };
                attention([part(0), part(h), part(2 * h)], spans, h, cfg.num_heads)
            }
            Qkv::Split(qkv) => {
                let [q, k, v] = &**qkv;
                let (q, k, v) = (
                    q.forward(&x, rows)?,
                    k.forward(&x, rows)?,
                    v.forward(&x, rows)?,
                );
                let part = |data| Rows {
                    data,
                    stride: h,
                    offset: 0,
                };
                attention([part(&q), part(&k), part(&v)], spans, h, cfg.num_heads)
            }
        };
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
fn spans<T: Segmented>(inputs: &[T]) -> Vec<(usize, usize)> {
    let mut start = 0;
    inputs
        .iter()
        .map(|i| {
            let s = (start, i.ids().len());
            start += i.ids().len();
            s
        })
        .collect()
}

/// The tensors of a model directory's `model.safetensors`.
pub(super) fn read_safetensors(dir: &Path) -> Result<HashMap<String, Tensor>, EmbedError> {
    let path = dir.join("model.safetensors");
    if !path.is_file() {
        return Err(EmbedError::Io {
            path,
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "no such file"),
        });
    }
    candle_core::safetensors::load(&path, &Device::Cpu).map_err(|e| EmbedError::Config {
        path: path.clone(),
        reason: format!("not a readable safetensors file: {e}"),
    })
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
        let model =
            BertModel::from_tensors(random_tensors(&cfg), cfg, EncoderWeights::Int8).unwrap();
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
    fn int8_weights_agree_with_f32_and_leave_the_batch_out() {
        // Widths that are whole blocks of 32, so every dense layer takes 8 bits.
        let cfg = EncoderConfig {
            hidden_size: 64,
            intermediate_size: 128,
            ..tiny_config()
        };
        let int8 = BertModel::from_tensors(random_tensors(&cfg), cfg.clone(), EncoderWeights::Int8)
            .unwrap();
        let f32m = BertModel::from_tensors(random_tensors(&cfg), cfg, EncoderWeights::F32).unwrap();
        assert_eq!(int8.weights(), EncoderWeights::Int8);
        assert_eq!(f32m.weights(), EncoderWeights::F32);
        let inputs = vec![
            vec![1, 5, 7, 2],
            vec![1, 9, 2],
            vec![3; 16],
            vec![4, 8, 15, 16, 23],
        ];
        let a = int8.embed(&inputs).unwrap();
        let b = f32m.embed(&inputs).unwrap();
        for (input, (x, y)) in inputs.iter().zip(a.iter().zip(&b)) {
            let cos: f32 = x.iter().zip(y).map(|(p, q)| p * q).sum();
            assert!(cos >= 0.999, "int8 vs f32 cosine {cos}");
            // 8-bit rows depend on themselves alone: the same bits alone and batched.
            let alone = int8.embed(std::slice::from_ref(input)).unwrap();
            assert_eq!(&alone[0], x);
        }
    }

    #[test]
    fn bad_inputs_are_errors_not_panics() {
        let cfg = tiny_config();
        let model =
            BertModel::from_tensors(random_tensors(&cfg), cfg, EncoderWeights::Int8).unwrap();
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
        let err = BertModel::from_tensors(t, cfg.clone(), EncoderWeights::Int8)
            .err()
            .unwrap();
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
        let err = BertModel::from_tensors(t, cfg, EncoderWeights::Int8)
            .err()
            .unwrap();
        assert!(err.to_string().contains("shape"), "{err}");
    }
}
