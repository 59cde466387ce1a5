//! Strata's llama: weights from GGUF and one batched forward pass over a ragged batch.
//!
//! A step's batch is any number of sequences, each contributing a run of new tokens at
//! its own positions (a prefill chunk or a single decode token). The dense layers run as
//! one matrix product over every token of the step; attention reads each sequence's own
//! keys and values through its block table ([`KvCache`]), so sequences of any length batch
//! together without padding.

use std::path::Path;
use std::str::FromStr;

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};

use crate::attention::{attend, AttnShape, TokenCtx};
use crate::gguf::{GgufFile, LlamaConfig, ModelError};
use crate::kernels::{BlockMatrix, BlockType};
use crate::kv::cache::{KvCache, KvDtype};
use crate::lora::{apply_rows_strided, LoraAdapter, Module as LoraModule};
use crate::sampler::fast_exp;
use rayon::prelude::*;

/// How weight matrices are held in memory and multiplied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightFormat {
    /// Dequantized to f32 at load; matrix products through a GEMM. Exact reference mode.
    F32,
    /// Requantized at load to Q8_0 and multiplied by candle's kernels, which also quantize
    /// the activations to 8 bits.
    Q8_0,
    /// Kept in the file's own blocks. Q4_0, Q4_1 and Q8_0 are multiplied by Strata's
    /// kernels ([`crate::kernels`]): rows of 4-bit weights, and of a Q8_0 `lm_head`, with
    /// 8-bit activations unless [`Llama::q8_prompt`] (prompt rows) or
    /// [`Llama::q8_decode`] (decode rows) is off, with f32 activations otherwise. Other
    /// types by candle's.
    Gguf,
}

impl FromStr for WeightFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "q8_0" => Ok(Self::Q8_0),
            "gguf" => Ok(Self::Gguf),
            other => Err(format!(
                "unknown weight format `{other}` (expected f32, q8_0 or gguf)"
            )),
        }
    }
}

impl std::fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Q8_0 => "q8_0",
            Self::Gguf => "gguf",
        })
    }
}

/// A weight matrix `[out, in]` and how it is multiplied.
enum Linear {
    /// candle: f32 GEMM, or its quantized kernels.
    Candle(QMatMul),
    /// Strata's block kernels with f32 activations.
    Blocks(BlockMatrix),
}

/// Several projections of the same input: fused into one matrix when the format allows.
enum Proj {
    Fused { mat: Linear, splits: Vec<usize> },
    Separate(Vec<Linear>),
}

struct Layer {
    attn_norm: Vec<f32>,
    qkv: Proj,
    wo: Linear,
    ffn_norm: Vec<f32>,
    gate_up: Proj,
    down: Linear,
}

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy)]
pub struct SeqInput<'a> {
    /// New tokens to run, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: &'a [u32],
    pub start_pos: usize,
    /// Blocks covering at least `start_pos + tokens.len()` positions.
    pub block_table: &'a [u32],
    /// Whether to compute logits for the last token.
    pub want_logits: bool,
    /// Positions from here on hold generated tokens: their rows are decode rows (see
    /// [`Llama::q8_decode`]), the others prompt rows ([`Llama::q8_prompt`]). The role
    /// follows the position, so a sequence recomputed after preemption gets the same keys
    /// and values as the first time.
    pub prompt_len: usize,
}

/// A loaded llama model.
pub struct Llama {
    pub config: LlamaConfig,
    pub format: WeightFormat,
    /// Decode rows of 4-bit block weights (and of a Q8_0 `lm_head`) quantize their
    /// activations to 8 bits per block of 32 for integer dot products (as llama.cpp does
    /// for every row): 2.3–3× the rate of expanding the weights to f32 with AVX-512 VNNI.
    /// A row's kernel depends on its role, not on the batch, so outputs stay identical
    /// alone and batched. On by default; off is exact to the stored weights.
    pub q8_decode: bool,
    /// The same for prompt rows (only while `q8_decode` is on too). On by default; off
    /// keeps prompts exact to the stored weights (f32 activations through the f32 panel
    /// kernel). With both on, a token's keys and values are the same whether it was
    /// computed as a prompt or a decode row.
    pub q8_prompt: bool,
    embed: Tensor,
    layers: Vec<Layer>,
    output_norm: Vec<f32>,
    lm_head: Linear,
    /// cos/sin per (position, pair): `context_len * head_dim / 2` each.
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
}

fn to_linear(w: QTensor, format: WeightFormat) -> Result<Linear, ModelError> {
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

fn dense_to_format(w: Tensor, format: WeightFormat) -> Result<Linear, ModelError> {
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

impl Llama {
    /// Loads a llama GGUF from `path`.
    pub fn load(path: &Path, format: WeightFormat) -> Result<Self, ModelError> {
        let mut file = GgufFile::open(path)?;
        Self::from_gguf(&mut file, format)
    }

    pub fn from_gguf(file: &mut GgufFile, format: WeightFormat) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(file)?;
        let (h, hd) = (cfg.hidden, cfg.head_dim);
        let kv_dim = cfg.n_kv_head * hd;
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
        // A Q8_0 `lm_head` (the default model's tied embeddings) is the largest matrix of
        // a decode step; with 8-bit decode activations it runs the batched integer kernel
        // instead of expanding every weight to f32 (3–5× faster). Rows whose role keeps
        // f32 activations (`q8_prompt` / `q8_decode` off) still multiply them.
        let lm_head = match lm_head {
            Linear::Blocks(b) => Linear::Blocks(b.with_q8_decode_rows()),
            other => other,
        };
        let norm = |file: &mut GgufFile, name: &str| -> Result<Vec<f32>, ModelError> {
            Ok(file
                .tensor(name, &[h])?
                .dequantize(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?)
        };
        let output_norm = norm(file, "output_norm.weight")?;
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let q = file.tensor(&p("attn_q"), &[h, h])?;
            let k = file.tensor(&p("attn_k"), &[kv_dim, h])?;
            let v = file.tensor(&p("attn_v"), &[kv_dim, h])?;
            let qkv = proj(vec![q, k, v], format)?;
            let gate = file.tensor(&p("ffn_gate"), &[cfg.ffn_hidden, h])?;
            let up = file.tensor(&p("ffn_up"), &[cfg.ffn_hidden, h])?;
            let gate_up = proj(vec![gate, up], format)?;
            layers.push(Layer {
                attn_norm: norm(file, &p("attn_norm"))?,
                qkv,
                wo: to_linear(file.tensor(&p("attn_output"), &[h, h])?, format)?,
                ffn_norm: norm(file, &p("ffn_norm"))?,
                gate_up,
                down: to_linear(file.tensor(&p("ffn_down"), &[h, cfg.ffn_hidden])?, format)?,
            });
        }
        let (rope_cos, rope_sin) = rope_tables(cfg.context_len, hd, cfg.rope_theta);
        Ok(Self {
            config: cfg,
            q8_decode: format == WeightFormat::Gguf,
            q8_prompt: format == WeightFormat::Gguf,
            format,
            embed,
            layers,
            output_norm,
            lm_head,
            rope_cos,
            rope_sin,
        })
    }

    /// The KV-cache entry type when none is asked for: f32 with f32 weights (the exact
    /// reference mode), f16 otherwise.
    pub fn default_kv_dtype(&self) -> KvDtype {
        match self.format {
            WeightFormat::F32 => KvDtype::F32,
            _ => KvDtype::F16,
        }
    }

    /// Numbers one KV-cache slot holds per layer (keys or values).
    pub fn kv_slot_width(&self) -> usize {
        self.config.n_kv_head * self.config.head_dim
    }

    /// Whether a row of this role (decode or prompt) quantizes its activations. Prompt rows
    /// do only when decode rows do too: the f32 group runs first in a step, so a sequence's
    /// prompt rows must never land after its decode rows.
    fn quantizes(&self, decode: bool) -> bool {
        self.q8_decode && (decode || self.q8_prompt)
    }

    /// Runs one step. Returns, for each input sequence, the logits of its last token when
    /// `want_logits` was set.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
    ) -> Result<Vec<Option<Vec<f32>>>, ModelError> {
        let tails: Vec<usize> = seqs.iter().map(|s| usize::from(s.want_logits)).collect();
        let rows = self.forward_rows(cache, seqs, &tails)?;
        Ok(rows.into_iter().map(|mut r| r.pop()).collect())
    }

    /// Runs one step and returns, for each input sequence, the logits of its last
    /// `tails[i]` tokens in position order (speculative verification needs every row
    /// after the pending token). `want_logits` is ignored here; `tails[i] = 0` asks for
    /// none.
    pub fn forward_rows(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        tails: &[usize],
    ) -> Result<Vec<Vec<Vec<f32>>>, ModelError> {
        self.forward_rows_lora(cache, seqs, tails, &[])
    }

    /// [`Self::forward_rows`] where sequence `i` runs with LoRA adapter `loras[i]` (`None`,
    /// or an index past the end, is the base model): after each projection an adapter
    /// targets, each of its rows adds its own `scale · B (A x)`. Rows are updated one by
    /// one, so a row's result does not depend on the other rows of the step.
    pub fn forward_rows_lora(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        tails: &[usize],
        loras: &[Option<&LoraAdapter>],
    ) -> Result<Vec<Vec<Vec<f32>>>, ModelError> {
        // The step runs on a pool thread, so its ~6 parallel sections per layer fork from
        // inside the pool: without this, each one would hand work from the caller's
        // thread to the pool and put the caller to sleep until it is done (a thread wake-up
        // per section, hundreds per step).
        rayon::scope(|_| self.forward_in_pool(cache, seqs, tails, loras))
    }

    fn forward_in_pool(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        tails: &[usize],
        loras: &[Option<&LoraAdapter>],
    ) -> Result<Vec<Vec<Vec<f32>>>, ModelError> {
        let cfg = &self.config;
        let (h, hd, nh, nkv) = (cfg.hidden, cfg.head_dim, cfg.n_head, cfg.n_kv_head);
        let kv_dim = nkv * hd;
        if cache.slot_width != kv_dim || cache.keys.len() != cfg.n_layer {
            return Err(ModelError::Unsupported(
                "KV cache shape does not match the model".into(),
            ));
        }
        // Per token: its position and cache slot, rows with f32 activations first, then
        // rows with 8-bit ones (the matrix products take the two groups apart; a row's
        // group follows its role, prompt or decode); per sequence: its last token's row.
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut slots = Vec::new();
        let mut seq_of = Vec::new();
        // Rows of each sequence's last `tails[s]` tokens (a sequence's prompt rows never
        // come after its decode rows: they share a group or take the earlier one, see
        // `quantizes`; positions ascend within each group, so these stay in position order).
        let mut tail_rows: Vec<Vec<usize>> = vec![Vec::new(); seqs.len()];
        for seq in seqs {
            if seq.start_pos + seq.tokens.len() > cfg.context_len {
                return Err(ModelError::Unsupported(format!(
                    "sequence of {} tokens exceeds the context length {}",
                    seq.start_pos + seq.tokens.len(),
                    cfg.context_len
                )));
            }
        }
        let mut exact = 0;
        for quantized in [false, true] {
            for (s, seq) in seqs.iter().enumerate() {
                for (i, &t) in seq.tokens.iter().enumerate() {
                    let pos = seq.start_pos + i;
                    if self.quantizes(pos >= seq.prompt_len) != quantized {
                        continue;
                    }
                    if t as usize >= cfg.vocab_size {
                        return Err(ModelError::Unsupported(format!(
                            "token id {t} is outside the vocabulary ({})",
                            cfg.vocab_size
                        )));
                    }
                    let slot = cache.slot(seq.block_table, pos).ok_or_else(|| {
                        ModelError::Unsupported(format!(
                            "block table does not cover position {pos}"
                        ))
                    })?;
                    if i + tails.get(s).copied().unwrap_or(0) >= seq.tokens.len() {
                        tail_rows[s].push(ids.len());
                    }
                    ids.push(t);
                    positions.push(pos);
                    slots.push(slot);
                    seq_of.push(s);
                }
            }
            if !quantized {
                exact = ids.len();
            }
        }
        let n_tok = ids.len();
        if n_tok == 0 {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        // Each row's adapter; none at all skips every LoRA pass.
        let row_lora: Vec<Option<&LoraAdapter>> = seq_of
            .iter()
            .map(|&s| loras.get(s).copied().flatten())
            .collect();
        let any_lora = row_lora.iter().any(Option::is_some);
        let lora = |layer: usize, m: LoraModule, x: &[f32], y: &mut [f32], stride, offset| {
            if any_lora {
                apply_rows_strided(&row_lora, layer, m, x, y, stride, offset);
            }
        };
        let ids_t = Tensor::from_slice(&ids, n_tok, &Device::Cpu)?;
        let mut x: Vec<f32> = self
            .embed
            .index_select(&ids_t, 0)?
            .flatten_all()?
            .to_vec1()?;

        let mut attn = vec![0f32; n_tok * h];
        let shape = AttnShape {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
            block_size: cache.block_size,
        };
        let ctx: Vec<TokenCtx<'_>> = positions
            .iter()
            .zip(&seq_of)
            .map(|(&pos, &s)| TokenCtx {
                pos,
                block_table: seqs[s].block_table,
            })
            .collect();
        for (l, layer) in self.layers.iter().enumerate() {
            let normed = rms_norm(&x, &layer.attn_norm, cfg.rms_eps);
            let mut qkv = layer.qkv.forward(&normed, n_tok, exact)?;
            let v = qkv.pop().unwrap_or_default();
            let mut k = qkv.pop().unwrap_or_default();
            let mut q = qkv.pop().unwrap_or_default();
            let mut v = v;
            lora(l, LoraModule::Q, &normed, &mut q, nh * hd, 0);
            lora(l, LoraModule::K, &normed, &mut k, kv_dim, 0);
            lora(l, LoraModule::V, &normed, &mut v, kv_dim, 0);
            self.apply_rope(&mut q, &positions, nh);
            self.apply_rope(&mut k, &positions, nkv);
            let (kc, vc) = (&mut cache.keys[l], &mut cache.values[l]);
            for (t, &slot) in slots.iter().enumerate() {
                kc.write(slot * kv_dim, &k[t * kv_dim..(t + 1) * kv_dim]);
                vc.write(slot * kv_dim, &v[t * kv_dim..(t + 1) * kv_dim]);
            }
            attend(shape, &q, &cache.keys[l], &cache.values[l], &ctx, &mut attn);
            let mut o = matmul(&layer.wo, &attn, n_tok, exact)?;
            lora(l, LoraModule::O, &attn, &mut o, h, 0);
            add_in_place(&mut x, &o);

            let normed = rms_norm(&x, &layer.ffn_norm, cfg.rms_eps);
            let ffn = cfg.ffn_hidden;
            let mut gu = layer.gate_up.gate_up(&normed, n_tok, exact, ffn)?;
            lora(l, LoraModule::Gate, &normed, &mut gu, 2 * ffn, 0);
            lora(l, LoraModule::Up, &normed, &mut gu, 2 * ffn, ffn);
            let act = silu_mul(&gu, n_tok, ffn);
            let mut d = matmul(&layer.down, &act, n_tok, exact)?;
            lora(l, LoraModule::Down, &act, &mut d, h, 0);
            add_in_place(&mut x, &d);
        }

        // Logits only for the rows asked for: f32 rows first, then 8-bit rows, so that the
        // `lm_head` product keeps each row's kernel. Each sequence's rows stay in position
        // order (its prompt rows come before its decode rows).
        let mut rows = Vec::new();
        let mut which = Vec::new();
        let mut exact_logits = 0;
        for quantized in [false, true] {
            for (s, tail) in tail_rows.iter().enumerate() {
                for &r in tail.iter().filter(|&&r| (r >= exact) == quantized) {
                    rows.extend_from_slice(&x[r * h..(r + 1) * h]);
                    which.push(s);
                }
            }
            if !quantized {
                exact_logits = which.len();
            }
        }
        let mut out = vec![Vec::new(); seqs.len()];
        if which.is_empty() {
            return Ok(out);
        }
        let normed = rms_norm(&rows, &self.output_norm, cfg.rms_eps);
        let logits = matmul(&self.lm_head, &normed, which.len(), exact_logits)?;
        let v = cfg.vocab_size;
        for (r, s) in which.into_iter().enumerate() {
            out[s].push(logits[r * v..(r + 1) * v].to_vec());
        }
        Ok(out)
    }

    /// Folds an adapter into the weights, `W + scale·B·A` in f32: the reference the
    /// per-row update is checked against. Only for f32 weights (other formats would
    /// requantize the sum).
    pub fn merge_lora(&mut self, adapter: &LoraAdapter) -> Result<(), ModelError> {
        if self.format != WeightFormat::F32 {
            return Err(ModelError::Unsupported(
                "merging a LoRA adapter needs f32 weights".into(),
            ));
        }
        let cfg = self.config.clone();
        let q = cfg.n_head * cfg.head_dim;
        let kv = cfg.n_kv_head * cfg.head_dim;
        for (l, layer) in self.layers.iter_mut().enumerate() {
            let parts = [
                (
                    &mut layer.qkv,
                    vec![
                        (LoraModule::Q, 0),
                        (LoraModule::K, q),
                        (LoraModule::V, q + kv),
                    ],
                ),
                (
                    &mut layer.gate_up,
                    vec![(LoraModule::Gate, 0), (LoraModule::Up, cfg.ffn_hidden)],
                ),
            ];
            for (proj, modules) in parts {
                let Proj::Fused { mat, .. } = proj else {
                    return Err(ModelError::Unsupported("unfused f32 projections".into()));
                };
                merge_into(mat, adapter, l, &modules)?;
            }
            merge_into(&mut layer.wo, adapter, l, &[(LoraModule::O, 0)])?;
            merge_into(&mut layer.down, adapter, l, &[(LoraModule::Down, 0)])?;
        }
        Ok(())
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head: GGUF stores llama's Q/K
    /// rows permuted for this "normal" RoPE layout.
    fn apply_rope(&self, x: &mut [f32], positions: &[usize], n_heads: usize) {
        let hd = self.config.head_dim;
        let half = hd / 2;
        for_rows(x, n_heads * hd, |t, row| {
            let pos = positions[t];
            let cos = &self.rope_cos[pos * half..(pos + 1) * half];
            let sin = &self.rope_sin[pos * half..(pos + 1) * half];
            for head in row.chunks_exact_mut(hd) {
                for i in 0..half {
                    let (a, b) = (head[2 * i], head[2 * i + 1]);
                    head[2 * i] = a * cos[i] - b * sin[i];
                    head[2 * i + 1] = a * sin[i] + b * cos[i];
                }
            }
        });
    }
}

/// Adds `scale·B·A` of each `(module, first row)` into an f32 matrix whose rows from
/// `first row` on are that module's.
fn merge_into(
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

fn proj(ws: Vec<QTensor>, format: WeightFormat) -> Result<Proj, ModelError> {
    if format == WeightFormat::Gguf {
        let splits = ws
            .iter()
            .map(|w| w.shape().dims2().map(|d| d.0))
            .collect::<Result<Vec<_>, _>>()?;
        let kinds: Vec<_> = ws.iter().map(|w| block_type(w.dtype())).collect();
        if let Some(Some(kind)) = kinds.first().copied() {
            if kinds.iter().all(|k| *k == Some(kind)) {
                let blocks = ws
                    .iter()
                    .map(|w| to_blocks(w, kind))
                    .collect::<Result<Vec<_>, _>>()?;
                if let Some(mat) = BlockMatrix::concat_rows(blocks) {
                    return Ok(Proj::Fused {
                        mat: Linear::Blocks(mat),
                        splits,
                    });
                }
            }
        }
        let mats = ws
            .into_iter()
            .map(|w| to_linear(w, format))
            .collect::<Result<Vec<_>, _>>()?;
        return Ok(Proj::Separate(mats));
    }
    let mut splits = Vec::with_capacity(ws.len());
    let mut dense = Vec::with_capacity(ws.len());
    for w in &ws {
        let t = w.dequantize(&Device::Cpu)?;
        splits.push(t.dim(0)?);
        dense.push(t);
    }
    let cat = Tensor::cat(&dense, 0)?;
    Ok(Proj::Fused {
        mat: dense_to_format(cat, format)?,
        splits,
    })
}

impl Proj {
    /// `x` is `[rows, in]`; returns one `[rows, out_i]` buffer per projection. Rows from
    /// `exact` on are decode rows.
    fn forward(&self, x: &[f32], rows: usize, exact: usize) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Proj::Separate(mats) => mats.iter().map(|m| matmul(m, x, rows, exact)).collect(),
            Proj::Fused { mat, splits } => {
                let y = matmul(mat, x, rows, exact)?;
                let total: usize = splits.iter().sum();
                let mut outs: Vec<Vec<f32>> = splits
                    .iter()
                    .map(|&n| Vec::with_capacity(rows * n))
                    .collect();
                for row in y.chunks_exact(total) {
                    let mut at = 0;
                    for (out, &n) in outs.iter_mut().zip(splits) {
                        out.extend_from_slice(&row[at..at + n]);
                        at += n;
                    }
                }
                Ok(outs)
            }
        }
    }
}

/// `x: [rows, in]` times the matrix; rows from `exact` on are decode rows.
impl Proj {
    /// The gate and up products side by side, `[rows, 2·ffn]` (each row: gate, then up).
    fn gate_up(
        &self,
        x: &[f32],
        rows: usize,
        exact: usize,
        ffn: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let gu = match self {
            Proj::Fused { mat, .. } => matmul(mat, x, rows, exact)?,
            Proj::Separate(_) => {
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
}

/// `silu(gate) · up` row by row over `gu: [rows, 2·ffn]`.
fn silu_mul(gu: &[f32], rows: usize, ffn: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * ffn];
    for_rows(&mut out, ffn, |t, o| {
        let (gate, up) = gu[t * 2 * ffn..(t + 1) * 2 * ffn].split_at(ffn);
        for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
            *o = g / (1.0 + fast_exp(-g)) * u;
        }
    });
    out
}

/// Rows at and above which row-wise work is split over the pool.
const PAR_MIN_ROWS: usize = 8;

/// Calls `f(t, row)` for each row of `out` (`width` floats each); rows are independent, so
/// they run in parallel when there are enough of them.
fn for_rows(out: &mut [f32], width: usize, f: impl Fn(usize, &mut [f32]) + Sync + Send) {
    if out.len() >= PAR_MIN_ROWS * width {
        out.par_chunks_mut(width)
            .enumerate()
            .for_each(|(t, row)| f(t, row));
    } else {
        for (t, row) in out.chunks_mut(width).enumerate() {
            f(t, row);
        }
    }
}

fn matmul(m: &Linear, x: &[f32], rows: usize, exact: usize) -> Result<Vec<f32>, ModelError> {
    match m {
        Linear::Blocks(b) => Ok(b.matmul_split(x, rows, exact)),
        Linear::Candle(q) => {
            let k = x.len() / rows.max(1);
            let t = Tensor::from_slice(x, (rows, k), &Device::Cpu)?;
            Ok(q.forward(&t)?.flatten_all()?.to_vec1()?)
        }
    }
}

fn rope_tables(context_len: usize, head_dim: usize, theta: f32) -> (Vec<f32>, Vec<f32>) {
    let half = head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
        .collect();
    let mut cos = Vec::with_capacity(context_len * half);
    let mut sin = Vec::with_capacity(context_len * half);
    for pos in 0..context_len {
        for &f in &inv_freq {
            let a = pos as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// RMSNorm over rows of `weight.len()`.
fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let n = weight.len();
    let mut out = vec![0f32; x.len()];
    for_rows(&mut out, n, |t, o| {
        let row = &x[t * n..(t + 1) * n];
        let ms = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for ((o, v), w) in o.iter_mut().zip(row).zip(weight) {
            *o = v * inv * w;
        }
    });
    out
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let out = rms_norm(&[3.0, 4.0, 0.0, 0.0], &[1.0, 2.0], 1e-6);
        let inv = 1.0 / (12.5f32 + 1e-6).sqrt();
        assert!((out[0] - 3.0 * inv).abs() < 1e-6);
        assert!((out[1] - 8.0 * inv).abs() < 1e-6);
        assert_eq!(&out[2..], &[0.0, 0.0]);
    }

    #[test]
    fn weight_format_parses() {
        assert_eq!("q8_0".parse::<WeightFormat>(), Ok(WeightFormat::Q8_0));
        assert!("q4".parse::<WeightFormat>().is_err());
    }
}
