//! Weight matrices and how they are multiplied: candle's kernels or Strata's block
//! kernels ([`crate::kernels`]), and projections of one input fused into one matrix.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};

use super::format::WeightFormat;
use crate::gguf::ModelError;
use crate::kernels::{BlockMatrix, BlockType};
use crate::lora::{LoraAdapter, Module as LoraModule};

/// A weight matrix `[out, in]` and how it is multiplied.
pub enum Linear {
    /// candle: f32 GEMM, or its quantized kernels.
    Candle(QMatMul),
    /// Strata's block kernels.
    Blocks(BlockMatrix),
}

/// Several projections of the same input (Q, K, V; gate, up): fused into one matrix when
/// the format allows, with an optional bias over the concatenated outputs.
pub struct Proj {
    mats: ProjMats,
    /// Output width of each projection, in order.
    splits: Vec<usize>,
    /// Added to every row of the concatenated outputs (Qwen 2's Q/K/V biases).
    bias: Option<Vec<f32>>,
}

enum ProjMats {
    Fused(Linear),
    Separate(Vec<Linear>),
}

pub fn to_linear(w: QTensor, format: WeightFormat) -> Result<Linear, ModelError> {
    match format {
        WeightFormat::Gguf => match block_type(w.dtype()) {
            Some(kind) => Ok(Linear::Blocks(to_blocks(&w, kind)?)),
            None => Ok(Linear::Candle(QMatMul::from_qtensor(w)?)),
        },
        WeightFormat::F32 => Ok(Linear::Candle(QMatMul::Tensor(w.dequantize(&Device::Cpu)?))),
        WeightFormat::Q8_0 => dense_to_format(w.dequantize(&Device::Cpu)?, format),
    }
}

fn block_type(dtype: GgmlDType) -> Option<BlockType> {
    match dtype {
        GgmlDType::Q4_0 => Some(BlockType::Q4_0),
        GgmlDType::Q4_1 => Some(BlockType::Q4_1),
        GgmlDType::Q8_0 => Some(BlockType::Q8_0),
        _ => None,
    }
}

fn to_blocks(w: &QTensor, kind: BlockType) -> Result<BlockMatrix, ModelError> {
    let (rows, cols) = w.shape().dims2()?;
    BlockMatrix::new(kind, rows, cols, w.data()?.into_owned())
        .map_err(|e| ModelError::Unsupported(format!("weight layout: {e}")))
}

pub fn dense_to_format(w: Tensor, format: WeightFormat) -> Result<Linear, ModelError> {
    let k = w.dim(1)?;
    if format == WeightFormat::Q8_0 && k % GgmlDType::Q8_0.block_size() == 0 {
        Ok(Linear::Candle(QMatMul::from_qtensor(QTensor::quantize(
            &w,
            GgmlDType::Q8_0,
        )?)?))
    } else {
        Ok(Linear::Candle(QMatMul::Tensor(w)))
    }
}

/// `x: [rows, in]` times the matrix; rows from `exact` on are decode rows.
pub fn matmul(m: &Linear, x: &[f32], rows: usize, exact: usize) -> Result<Vec<f32>, ModelError> {
    match m {
        Linear::Blocks(b) => Ok(b.matmul_split(x, rows, exact)),
        Linear::Candle(q) => {
            let k = x.len() / rows.max(1);
            let t = Tensor::from_slice(x, (rows, k), &Device::Cpu)?;
            Ok(q.forward(&t)?.flatten_all()?.to_vec1()?)
        }
    }
}

impl Proj {
    /// Projections from separate matrices (`ws`, each `[out_i, in]`), fused into one when
    /// the format allows.
    pub fn new(
        ws: Vec<QTensor>,
        bias: Option<Vec<f32>>,
        format: WeightFormat,
    ) -> Result<Self, ModelError> {
        let splits = ws
            .iter()
            .map(|w| w.shape().dims2().map(|d| d.0))
            .collect::<Result<Vec<_>, _>>()?;
        let mats = fuse(ws, format)?;
        Ok(Self { mats, splits, bias })
    }

    /// Projections stored as one matrix in the file (Phi-3's `attn_qkv`, its `ffn_up`
    /// holding gate and up): `splits` are the output widths in row order.
    pub fn from_fused(
        w: QTensor,
        splits: Vec<usize>,
        format: WeightFormat,
    ) -> Result<Self, ModelError> {
        let mats = ProjMats::Fused(match format {
            WeightFormat::Gguf => to_linear(w, format)?,
            _ => dense_to_format(w.dequantize(&Device::Cpu)?, format)?,
        });
        Ok(Self {
            mats,
            splits,
            bias: None,
        })
    }

    /// `x` is `[rows, in]`; returns one `[rows, out_i]` buffer per projection. Rows from
    /// `exact` on are decode rows.
    pub fn forward(
        &self,
        x: &[f32],
        rows: usize,
        exact: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let total: usize = self.splits.iter().sum();
        match &self.mats {
            ProjMats::Separate(mats) => {
                let mut outs = mats
                    .iter()
                    .map(|m| matmul(m, x, rows, exact))
                    .collect::<Result<Vec<_>, _>>()?;
                if let Some(bias) = &self.bias {
                    let mut at = 0;
                    for (out, &n) in outs.iter_mut().zip(&self.splits) {
                        add_bias(out, &bias[at..at + n]);
                        at += n;
                    }
                }
                Ok(outs)
            }
            ProjMats::Fused(mat) => {
                let mut y = matmul(mat, x, rows, exact)?;
                if let Some(bias) = &self.bias {
                    add_bias(&mut y, bias);
                }
                let mut outs: Vec<Vec<f32>> = self
                    .splits
                    .iter()
                    .map(|&n| Vec::with_capacity(rows * n))
                    .collect();
                for row in y.chunks_exact(total) {
                    let mut at = 0;
                    for (out, &n) in outs.iter_mut().zip(&self.splits) {
                        out.extend_from_slice(&row[at..at + n]);
                        at += n;
                    }
                }
                Ok(outs)
            }
        }
    }

    /// The gate and up products side by side, `[rows, 2·ffn]` (each row: gate, then up).
    pub fn gate_up(
        &self,
        x: &[f32],
        rows: usize,
        exact: usize,
        ffn: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let gu = match &self.mats {
            ProjMats::Fused(mat) => matmul(mat, x, rows, exact)?,
            ProjMats::Separate(_) => {
                let parts = self.forward(x, rows, exact)?;
                let mut gu = Vec::with_capacity(rows * 2 * ffn);
                for r in 0..rows {
                    for part in &parts {
                        gu.extend_from_slice(&part[r * ffn..(r + 1) * ffn]);
                    }
                }
                gu
            }
        };
        if gu.len() != rows * 2 * ffn {
            return Err(ModelError::Unsupported(
                "gate and up projections do not match the feed-forward size".into(),
            ));
        }
        Ok(gu)
    }

    /// Adds each adapter module's `scale·B·A` into the fused f32 matrix, at the rows of
    /// projection `modules[i].1` (an index into the splits).
    pub fn merge_lora(
        &mut self,
        adapter: &LoraAdapter,
        layer: usize,
        modules: &[(LoraModule, usize)],
    ) -> Result<(), ModelError> {
        let ProjMats::Fused(mat) = &mut self.mats else {
            return Err(ModelError::Unsupported("unfused f32 projections".into()));
        };
        let firsts: Vec<(LoraModule, usize)> = modules
            .iter()
            .map(|&(m, part)| (m, self.splits[..part].iter().sum()))
            .collect();
        merge_into(mat, adapter, layer, &firsts)
    }
}

fn add_bias(y: &mut [f32], bias: &[f32]) {
    for row in y.chunks_exact_mut(bias.len()) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

fn fuse(ws: Vec<QTensor>, format: WeightFormat) -> Result<ProjMats, ModelError> {
    if format == WeightFormat::Gguf {
        let kinds: Vec<_> = ws.iter().map(|w| block_type(w.dtype())).collect();
        if let Some(Some(kind)) = kinds.first().copied() {
            if kinds.iter().all(|k| *k == Some(kind)) {
                let blocks = ws
                    .iter()
                    .map(|w| to_blocks(w, kind))
                    .collect::<Result<Vec<_>, _>>()?;
                if let Some(mat) = BlockMatrix::concat_rows(blocks) {
                    return Ok(ProjMats::Fused(Linear::Blocks(mat)));
                }
            }
        }
        let mats = ws
            .into_iter()
            .map(|w| to_linear(w, format))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(ProjMats::Separate(mats));
    }
    let dense = ws
        .iter()
        .map(|w| w.dequantize(&Device::Cpu))
        .collect::<Result<Vec<_>, _>>()?;
    let cat = Tensor::cat(&dense, 0)?;
    Ok(ProjMats::Fused(dense_to_format(cat, format)?))
}

/// Adds `scale·B·A` of each `(module, first row)` into an f32 matrix whose rows from
/// `first row` on are that module's.
pub fn merge_into(
    mat: &mut Linear,
    adapter: &LoraAdapter,
    layer: usize,
    modules: &[(LoraModule, usize)],
) -> Result<(), ModelError> {
    let Linear::Candle(QMatMul::Tensor(t)) = mat else {
        return Err(ModelError::Unsupported(
            "merging needs an f32 matrix".into(),
        ));
    };
    let (rows, cols) = t.dims2()?;
    let mut w: Vec<f32> = t.flatten_all()?.to_vec1()?;
    for &(m, first) in modules {
        let Some(p) = adapter.pair(layer, m) else {
            continue;
        };
        if p.inp != cols || first + p.out > rows {
            return Err(ModelError::Unsupported(format!(
                "adapter {} does not fit layer {layer}",
                adapter.name
            )));
        }
        let block = &mut w[first * cols..(first + p.out) * cols];
        let merged = adapter.merged(layer, m, block);
        block.copy_from_slice(&merged);
    }
    *mat = Linear::Candle(QMatMul::Tensor(Tensor::from_vec(
        w,
        (rows, cols),
        &Device::Cpu,
    )?));
    Ok(())
}
