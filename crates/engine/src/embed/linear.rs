//! The encoder's dense layers, `y = x · Wᵀ + b`, with f32 or 8-bit weights.
//!
//! With [`EncoderWeights::Int8`] each weight row is cut into blocks of 32 and stored as
//! GGUF Q8_0 blocks (an f16 scale from the block's largest magnitude, 32 signed bytes), in
//! the interleaved layout of the decoder's batched integer kernel
//! ([`crate::kernels::PackedQ4`], through [`BlockMatrix::with_q8_decode_rows`]). Every
//! activation row is quantized to 8 bits per block of 32 as well, and the products are
//! integer dot products (`vpdpbusd` or `maddubs`, chosen at run time like the decoder's,
//! `STRATA_KERNEL` included) with the scales applied per block in f32. A row's result
//! depends on that row alone, so an input's vector does not depend on its batch.
//!
//! A layer that reads a LayerNorm's output (the query/key/value projection and the
//! feed-forward's first one) moves part of its inputs' range into its weights first, as
//! SmoothQuant does: input channel `j` is divided by `s_j` and weight column `j`
//! multiplied by it, `s_j = a_j^½ / w_j^½` (normalised to mean 1), with `a_j = |γ_j| + |β_j|`
//! the LayerNorm's reach on that channel and `w_j` the column's largest weight. The product
//! is unchanged in exact arithmetic, but the few channels with large activations no longer
//! set the 8-bit step of their whole block. The scales come from the weights alone, no
//! calibration data. Measured on the MiniLM reference: lowest cosine to the f32
//! reference 0.99898 without it, 0.99946 with it (Python emulation of these exact
//! roundings, `docs/BENCHMARKS.md`).
//!
//! [`EncoderWeights::F32`] keeps the weights in f32 and multiplies with candle's GEMM: the
//! reference the 8-bit path is measured against. A matrix whose width is not a multiple of
//! 32, or whose block scales the packed layout cannot hold exactly, stays in f32 either way.

use candle_core::{DType, Device, Tensor};
use half::f16;
use rayon::prelude::*;

use super::EmbedError;
use crate::kernels::{BlockMatrix, BlockType, BLOCK};

/// The environment variable that picks the encoder's weight format.
pub const WEIGHTS_ENV: &str = "STRATA_EMBED_WEIGHTS";

/// How the encoder stores its dense layers' weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EncoderWeights {
    /// f32 weights and activations (candle's GEMM).
    F32,
    /// 8-bit weights per block of 32 (Q8_0) and 8-bit activations, integer products.
    #[default]
    Int8,
}

impl EncoderWeights {
    /// The name [`WEIGHTS_ENV`] takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Int8 => "int8",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(Self::F32),
            "int8" | "q8_0" => Some(Self::Int8),
            _ => None,
        }
    }

    /// [`WEIGHTS_ENV`] when set, else the default ([`EncoderWeights::Int8`]); a value that
    /// names no format is an error naming the variable.
    pub fn from_env() -> Result<Self, EmbedError> {
        match std::env::var(WEIGHTS_ENV) {
            Err(_) => Ok(Self::default()),
            Ok(v) => Self::parse(&v).ok_or_else(|| {
                EmbedError::Setting(format!("{WEIGHTS_ENV}={v:?}: expected `f32` or `int8`"))
            }),
        }
    }
}

enum Matrix {
    /// `Wᵀ`, `[inp, out]`, contiguous so the product needs no transpose.
    F32(Tensor),
    /// `W`, `[out, inp]`, Q8_0 blocks with the packed copy for 8-bit activations.
    Int8(BlockMatrix),
}

/// `x · Wᵀ + b`.
pub struct Linear {
    w: Matrix,
    /// `1 / s_j` per input channel when the 8-bit weights were smoothed.
    inv_smooth: Option<Vec<f32>>,
    b: Vec<f32>,
    pub inp: usize,
    pub out: usize,
}

/// Rows per rayon task when adding the bias: enough work to outweigh the task.
const ROWS_PER_TASK: usize = 16;

impl Linear {
    /// A layer from `w: [out, inp]` (f32) and `b: [out]`, stored as `format` asks.
    pub fn new(w: &Tensor, b: Vec<f32>, format: EncoderWeights) -> Result<Self, EmbedError> {
        Self::build(w, b, format, None)
    }

    /// A layer whose input is a LayerNorm's output, `reach[j] = |γ_j| + |β_j|`: 8-bit
    /// weights are smoothed by input channel (see the module's notes); f32 ones are not.
    pub fn after_norm(
        w: &Tensor,
        b: Vec<f32>,
        format: EncoderWeights,
        reach: &[f32],
    ) -> Result<Self, EmbedError> {
        Self::build(w, b, format, Some(reach))
    }

    fn build(
        w: &Tensor,
        b: Vec<f32>,
        format: EncoderWeights,
        reach: Option<&[f32]>,
    ) -> Result<Self, EmbedError> {
        let (out, inp) = w.dims2()?;
        if b.len() != out {
            return Err(EmbedError::Forward(format!(
                "bias of {} for {out} outputs",
                b.len()
            )));
        }
        if reach.is_some_and(|r| r.len() != inp) {
            return Err(EmbedError::Forward(format!(
                "{} channel reaches for {inp} inputs",
                reach.map_or(0, <[f32]>::len)
            )));
        }
        let w = w.to_dtype(DType::F32)?;
        let int8 = match format {
            EncoderWeights::Int8 if inp.is_multiple_of(BLOCK) => {
                let mut data = w.flatten_all()?.to_vec1::<f32>()?;
                let smooth = reach.map(|r| smoothing(&data, inp, r));
                if let Some(s) = &smooth {
                    for row in data.chunks_exact_mut(inp) {
                        row.iter_mut().zip(s).for_each(|(v, s)| *v *= s);
                    }
                }
                quantize_q8_0(&data, out, inp).map(|m| (m, smooth))
            }
            _ => None,
        };
        Ok(match int8 {
            Some((m, smooth)) => Linear {
                w: Matrix::Int8(m),
                inv_smooth: smooth.map(|s| s.iter().map(|s| 1.0 / s).collect()),
                b,
                inp,
                out,
            },
            None => Linear {
                w: Matrix::F32(w.t()?.contiguous()?),
                inv_smooth: None,
                b,
                inp,
                out,
            },
        })
    }

    /// Whether the products run on 8-bit weights and activations.
    pub fn is_int8(&self) -> bool {
        matches!(self.w, Matrix::Int8(_))
    }

    /// `rows × inp` in, `rows × out` out (bias added).
    pub fn forward(&self, x: &[f32], rows: usize) -> Result<Vec<f32>, EmbedError> {
        if x.len() != rows * self.inp {
            return Err(EmbedError::Forward(format!(
                "{} activations for {rows} rows of {}",
                x.len(),
                self.inp
            )));
        }
        let mut y = match &self.w {
            Matrix::F32(w_t) => {
                let t = Tensor::from_slice(x, (rows, self.inp), &Device::Cpu)?;
                t.matmul(w_t)?.flatten_all()?.to_vec1::<f32>()?
            }
            // Every row quantized (none kept exact): the decoder's 8-bit decode-row path.
            Matrix::Int8(m) => match &self.inv_smooth {
                Some(inv) => {
                    let mut xs = x.to_vec();
                    xs.par_chunks_mut(self.inp * ROWS_PER_TASK)
                        .for_each(|chunk| {
                            for row in chunk.chunks_exact_mut(self.inp) {
                                row.iter_mut().zip(inv).for_each(|(v, s)| *v *= s);
                            }
                        });
                    m.matmul_split(&xs, rows, 0)
                }
                None => m.matmul_split(x, rows, 0),
            },
        };
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

/// The per-input-channel smoothing scales `s_j = √(reach_j / max_i |w_ij|)`, normalised to
/// mean 1; a channel with no reach or no weight (or a non-finite one) keeps 1.
fn smoothing(w: &[f32], cols: usize, reach: &[f32]) -> Vec<f32> {
    let mut wmax = vec![0f32; cols];
    for row in w.chunks_exact(cols) {
        for (m, v) in wmax.iter_mut().zip(row) {
            *m = m.max(v.abs());
        }
    }
    let mut s: Vec<f32> = reach
        .iter()
        .zip(&wmax)
        .map(|(&a, &m)| {
            let v = (a.abs() / m).sqrt();
            if v.is_finite() && v > 0.0 {
                v
            } else {
                1.0
            }
        })
        .collect();
    let mean = s.iter().map(|&v| f64::from(v)).sum::<f64>() / s.len().max(1) as f64;
    if mean.is_finite() && mean > 0.0 {
        s.iter_mut()
            .for_each(|v| *v = (f64::from(*v) / mean) as f32);
    }
    s
}

/// `w: [rows, cols]` (row-major f32, `cols` a multiple of 32) as Q8_0 blocks with the
/// packed layout for 8-bit activations: per block `d = f16(max|w| / 127)`,
/// `q = round(w / d)` clamped to ±127. `None` when some scale is not finite or cannot be
/// held exactly by the packed layout (the caller keeps f32).
pub fn quantize_q8_0(w: &[f32], rows: usize, cols: usize) -> Option<BlockMatrix> {
    if !cols.is_multiple_of(BLOCK) || w.len() != rows * cols {
        return None;
    }
    let bb = BlockType::Q8_0.block_bytes();
    let mut data = Vec::with_capacity(rows * cols / BLOCK * bb);
    for block in w.chunks_exact(BLOCK) {
        let amax = block.iter().fold(0f32, |a, v| a.max(v.abs()));
        if !amax.is_finite() {
            return None;
        }
        let d = f16::from_f32(amax / 127.0);
        let df = d.to_f32();
        let inv = if df > 0.0 { 1.0 / df } else { 0.0 };
        data.extend_from_slice(&d.to_bits().to_le_bytes());
        for v in block {
            let q = (v * inv).round().clamp(-127.0, 127.0) as i8;
            data.push(q as u8);
        }
    }
    let m = BlockMatrix::new(BlockType::Q8_0, rows, cols, data)
        .ok()?
        .with_q8_decode_rows();
    m.takes_q8_activations().then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deterministic spread of values in (-scale/2, scale/2).
    fn spread(n: usize, seed: f64, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((((i as f64 + seed) * 0.618_033_988_7).fract() - 0.5) as f32) * scale)
            .collect()
    }

    fn reference(x: &[f32], w: &[f32], b: &[f32], rows: usize, inp: usize) -> Vec<f32> {
        let out = b.len();
        let mut y = vec![0f32; rows * out];
        for r in 0..rows {
            for o in 0..out {
                let dot: f64 = (0..inp)
                    .map(|k| f64::from(x[r * inp + k]) * f64::from(w[o * inp + k]))
                    .sum();
                y[r * out + o] = dot as f32 + b[o];
            }
        }
        y
    }

    #[test]
    fn int8_products_stay_close_to_f32_and_rows_do_not_depend_on_the_batch() {
        let (rows, inp, out) = (13, 96, 40);
        let w = spread(out * inp, 3.0, 0.2);
        let b = spread(out, 7.0, 0.1);
        let x = spread(rows * inp, 11.0, 4.0);
        let wt = Tensor::from_vec(w.clone(), (out, inp), &Device::Cpu).unwrap();
        let int8 = Linear::new(&wt, b.clone(), EncoderWeights::Int8).unwrap();
        let f32l = Linear::new(&wt, b.clone(), EncoderWeights::F32).unwrap();
        assert!(int8.is_int8());
        assert!(!f32l.is_int8());
        let want = reference(&x, &w, &b, rows, inp);
        let y8 = int8.forward(&x, rows).unwrap();
        let y32 = f32l.forward(&x, rows).unwrap();
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        for ((a, c), e) in y8.iter().zip(&y32).zip(&want) {
            assert!((c - e).abs() <= 1e-4 * scale, "f32 {c} vs {e}");
            // Two 8-bit roundings per product: well under 2 % of the output range.
            assert!((a - e).abs() <= 0.02 * scale, "int8 {a} vs {e}");
        }
        // Row 5 alone gives the same bits as in the batch of 13.
        let alone = int8.forward(&x[5 * inp..6 * inp], 1).unwrap();
        assert_eq!(alone, y8[5 * out..6 * out]);
    }

    #[test]
    fn smoothing_keeps_the_product_and_tames_an_outlier_channel() {
        let (rows, inp, out) = (6, 64, 24);
        let w = spread(out * inp, 5.0, 0.2);
        let b = spread(out, 9.0, 0.1);
        // Channel 3 of every input is fifty times the others, as after some LayerNorms.
        let mut x = spread(rows * inp, 13.0, 2.0);
        for r in 0..rows {
            x[r * inp + 3] *= 50.0;
        }
        let mut reach = vec![1.0f32; inp];
        reach[3] = 50.0;
        let wt = Tensor::from_vec(w.clone(), (out, inp), &Device::Cpu).unwrap();
        let plain = Linear::new(&wt, b.clone(), EncoderWeights::Int8).unwrap();
        let smooth = Linear::after_norm(&wt, b.clone(), EncoderWeights::Int8, &reach).unwrap();
        assert!(smooth.inv_smooth.is_some());
        let want = reference(&x, &w, &b, rows, inp);
        let err = |y: &[f32]| {
            y.iter()
                .zip(&want)
                .map(|(a, e)| f64::from(a - e).powi(2))
                .sum::<f64>()
                .sqrt()
        };
        let (e_plain, e_smooth) = (
            err(&plain.forward(&x, rows).unwrap()),
            err(&smooth.forward(&x, rows).unwrap()),
        );
        assert!(e_smooth < e_plain, "smoothed {e_smooth} vs plain {e_plain}");
        // f32 weights are never smoothed; a reach of the wrong length is an error.
        let f = Linear::after_norm(&wt, b.clone(), EncoderWeights::F32, &reach).unwrap();
        assert!(f.inv_smooth.is_none() && !f.is_int8());
        assert!(Linear::after_norm(&wt, b, EncoderWeights::Int8, &reach[1..]).is_err());
        // Degenerate reaches keep a scale of 1, never NaN.
        let s = smoothing(&w, inp, &vec![0.0; inp]);
        assert!(s.iter().all(|v| *v == 1.0));
    }

    #[test]
    fn widths_off_the_block_and_bad_scales_stay_f32() {
        let w = Tensor::from_vec(spread(8 * 20, 1.0, 1.0), (8, 20), &Device::Cpu).unwrap();
        let l = Linear::new(&w, vec![0.0; 8], EncoderWeights::Int8).unwrap();
        assert!(!l.is_int8(), "20 columns are not whole blocks");
        let mut inf = spread(4 * 32, 2.0, 1.0);
        inf[5] = f32::INFINITY;
        assert!(quantize_q8_0(&inf, 4, 32).is_none());
        // A scale past f16's range for the packed offset: kept f32, not wrong.
        let big = vec![1.0e6f32; 32];
        assert!(quantize_q8_0(&big, 1, 32).is_none());
        // Mismatched shapes are errors, not panics.
        let ok = Tensor::from_vec(spread(4 * 32, 2.0, 1.0), (4, 32), &Device::Cpu).unwrap();
        assert!(Linear::new(&ok, vec![0.0; 3], EncoderWeights::Int8).is_err());
        let l = Linear::new(&ok, vec![0.0; 4], EncoderWeights::Int8).unwrap();
        assert!(l.forward(&[0.0; 31], 1).is_err());
    }

    #[test]
    fn the_format_parses_and_bad_names_are_refused() {
        assert_eq!(EncoderWeights::parse("f32"), Some(EncoderWeights::F32));
        assert_eq!(EncoderWeights::parse(" INT8 "), Some(EncoderWeights::Int8));
        assert_eq!(EncoderWeights::parse("fp4"), None);
        assert_eq!(EncoderWeights::default(), EncoderWeights::Int8);
        for f in [EncoderWeights::F32, EncoderWeights::Int8] {
            assert_eq!(EncoderWeights::parse(f.name()), Some(f));
        }
    }
}
