//! Strata's transformer: weights from GGUF and one batched forward pass over a ragged
//! batch, for every model family the engine runs ([`arch`]).
//!
//! A step's batch is any number of sequences, each contributing a run of new tokens at
//! its own positions (a prefill chunk or a single decode token). The dense layers run as
//! one matrix product over every token of the step; attention reads each sequence's own
//! keys and values through its block table ([`KvCache`]), so sequences of any length batch
//! together without padding.
//!
//! One forward pass serves every family: the family's table ([`arch::Family`]) and its
//! hyper-parameters ([`config`]) switch its steps (biases, query/key norms, post-norms,
//! the activation, soft-caps, sliding windows, RoPE layout and scaling).

pub mod activation;
pub mod arch;
pub mod config;
pub mod format;
mod linear;
pub mod norm;
mod par;
pub mod rope;
mod weights;

use std::path::Path;

use candle_core::{Device, Tensor};

use crate::attention::{attend, AttnShape, TokenCtx};
use crate::gguf::{GgufFile, ModelError};
use crate::kv::cache::{KvCache, KvDtype};
use crate::lora::{apply_rows_strided, LoraAdapter, Module as LoraModule};
use activation::gated;
use config::ArchConfig;
pub use config::ModelConfig;
pub use format::WeightFormat;
use linear::{matmul, merge_into, Linear};
use norm::{rms_norm, rms_norm_in_place};
use rope::{Rope, RopeConfig, RopeRows};
use weights::{load_globals, load_layer, Layer};

/// Logit rows at and above which they are copied out of the product in parallel.
const PAR_LOGIT_ROWS: usize = 4;

/// The name the rest of the engine knew the model by when it ran llama alone.
pub type Llama = Model;

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
    /// [`Model::q8_decode`]), the others prompt rows ([`Model::q8_prompt`]). The role
    /// follows the position, so a sequence recomputed after preemption gets the same keys
    /// and values as the first time.
    pub prompt_len: usize,
}

/// A loaded model.
pub struct Model {
    pub config: ModelConfig,
    /// The family and what its metadata adds to the shape.
    pub arch: ArchConfig,
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
    /// RoPE of the global layers, and of the sliding ones when it differs.
    rope: Rope,
    window_rope: Option<Rope>,
}

/// A step's rows, in the order the matrix products take them.
struct StepRows {
    ids: Vec<u32>,
    positions: Vec<usize>,
    slots: Vec<usize>,
    seq_of: Vec<usize>,
    /// Rows of each sequence's last `tails[s]` tokens, in position order.
    tail_rows: Vec<Vec<usize>>,
    /// Rows before this one keep f32 activations; the rest are 8-bit rows.
    exact: usize,
}

impl Model {
    /// Loads a GGUF from `path`.
    pub fn load(path: &Path, format: WeightFormat) -> Result<Self, ModelError> {
        let mut file = GgufFile::open(path)?;
        Self::from_gguf(&mut file, format)
    }

    pub fn from_gguf(file: &mut GgufFile, format: WeightFormat) -> Result<Self, ModelError> {
        let (cfg, mut arch) = config::read(file)?;
        let globals = load_globals(file, &cfg, &arch, format)?;
        arch.rope.freq_factors = globals.rope_freqs;
        let layers = (0..cfg.n_layer)
            .map(|i| load_layer(file, i, &cfg, &arch, format))
            .collect::<Result<Vec<_>, _>>()?;
        let layout = arch.family.rope;
        let rope = Rope::new(&arch.rope, cfg.head_dim, layout);
        let window_rope = arch
            .window_rope
            .as_ref()
            .map(|r: &RopeConfig| Rope::new(r, cfg.head_dim, layout));
        Ok(Self {
            config: cfg,
            arch,
            q8_decode: format == WeightFormat::Gguf,
            q8_prompt: format == WeightFormat::Gguf,
            format,
            embed: globals.embed,
            layers,
            output_norm: globals.output_norm,
            lm_head: globals.lm_head,
            rope,
            window_rope,
        })
    }

    /// The `general.architecture` this model was loaded as.
    pub fn architecture(&self) -> &'static str {
        self.arch.family.name
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

    /// Checks the step and lays out its rows: per token its position and cache slot, rows
    /// with f32 activations first, then rows with 8-bit ones (the matrix products take the
    /// two groups apart; a row's group follows its role, prompt or decode).
    fn step_rows(
        &self,
        cache: &KvCache,
        seqs: &[SeqInput<'_>],
        tails: &[usize],
    ) -> Result<StepRows, ModelError> {
        let cfg = &self.config;
        for seq in seqs {
            if seq.start_pos + seq.tokens.len() > cfg.context_len {
                return Err(ModelError::Unsupported(format!(
                    "sequence of {} tokens exceeds the context length {}",
                    seq.start_pos + seq.tokens.len(),
                    cfg.context_len
                )));
            }
        }
        let mut r = StepRows {
            ids: Vec::new(),
            positions: Vec::new(),
            slots: Vec::new(),
            seq_of: Vec::new(),
            // A sequence's prompt rows never come after its decode rows: they share a
            // group or take the earlier one (see `quantizes`); positions ascend within each
            // group, so tails stay in position order.
            tail_rows: vec![Vec::new(); seqs.len()],
            exact: 0,
        };
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
                        r.tail_rows[s].push(r.ids.len());
                    }
                    r.ids.push(t);
                    r.positions.push(pos);
                    r.slots.push(slot);
                    r.seq_of.push(s);
                }
            }
            if !quantized {
                r.exact = r.ids.len();
            }
        }
        Ok(r)
    }

    /// The step's token embeddings, scaled where the family scales them.
    fn embed(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        let ids_t = Tensor::from_slice(ids, ids.len(), &Device::Cpu)?;
        let mut x: Vec<f32> = self
            .embed
            .index_select(&ids_t, 0)?
            .flatten_all()?
            .to_vec1()?;
        if let Some(s) = self.arch.embed_scale {
            x.iter_mut().for_each(|v| *v *= s);
        }
        Ok(x)
    }

    fn forward_in_pool(
        &self,
        cache: &mut KvCache,
        seqs: &[SeqInput<'_>],
        tails: &[usize],
        loras: &[Option<&LoraAdapter>],
    ) -> Result<Vec<Vec<Vec<f32>>>, ModelError> {
        let cfg = &self.config;
        if cache.slot_width != self.kv_slot_width() || cache.keys.len() != cfg.n_layer {
            return Err(ModelError::Unsupported(
                "KV cache shape does not match the model".into(),
            ));
        }
        // Attention applies an 8-bit scale per head: a scale group must be whole heads.
        let group = cache.slot_width / cache.groups_per_slot.max(1);
        if cache.dtype.is_scaled() && !group.is_multiple_of(cfg.head_dim) {
            return Err(ModelError::Unsupported(
                "8-bit KV scale groups must cover whole heads".into(),
            ));
        }
        let rows = self.step_rows(cache, seqs, tails)?;
        if rows.ids.is_empty() {
            return Ok(vec![Vec::new(); seqs.len()]);
        }
        // Each row's adapter; none at all skips every LoRA pass.
        let row_lora: Vec<Option<&LoraAdapter>> = rows
            .seq_of
            .iter()
            .map(|&s| loras.get(s).copied().flatten())
            .collect();
        let ctx: Vec<TokenCtx<'_>> = rows
            .positions
            .iter()
            .zip(&rows.seq_of)
            .map(|(&pos, &s)| TokenCtx {
                pos,
                block_table: seqs[s].block_table,
            })
            .collect();
        let step = Step {
            rows: &rows,
            ctx: &ctx,
            row_lora: &row_lora,
            any_lora: row_lora.iter().any(Option::is_some),
            rope: self.rope.rows(&rows.positions),
            window_rope: self.window_rope.as_ref().map(|r| r.rows(&rows.positions)),
        };
        let mut x = self.embed(&rows.ids)?;
        for (l, layer) in self.layers.iter().enumerate() {
            self.layer_forward(l, layer, &step, cache, &mut x)?;
        }
        self.logits(&x, &rows, seqs.len())
    }

    /// One block over the step's rows: attention, then the feed-forward, each added to the
    /// residual `x`.
    fn layer_forward(
        &self,
        l: usize,
        layer: &Layer,
        step: &Step<'_>,
        cache: &mut KvCache,
        x: &mut [f32],
    ) -> Result<(), ModelError> {
        let cfg = &self.config;
        let (h, hd, nh, nkv) = (cfg.hidden, cfg.head_dim, cfg.n_head, cfg.n_kv_head);
        let (q_dim, kv_dim) = (nh * hd, nkv * hd);
        let (n_tok, exact) = (step.rows.ids.len(), step.rows.exact);
        let lora = |m: LoraModule, x: &[f32], y: &mut [f32], stride, offset| {
            if step.any_lora {
                apply_rows_strided(step.row_lora, l, m, x, y, stride, offset);
            }
        };
        let normed = rms_norm(x, &layer.attn_norm, cfg.rms_eps);
        let mut qkv = layer.qkv.forward(&normed, n_tok, exact)?;
        let mut v = qkv.pop().unwrap_or_default();
        let mut k = qkv.pop().unwrap_or_default();
        let mut q = qkv.pop().unwrap_or_default();
        lora(LoraModule::Q, &normed, &mut q, q_dim, 0);
        lora(LoraModule::K, &normed, &mut k, kv_dim, 0);
        lora(LoraModule::V, &normed, &mut v, kv_dim, 0);
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            rms_norm_in_place(&mut q, qn, cfg.rms_eps);
            rms_norm_in_place(&mut k, kn, cfg.rms_eps);
        }
        let sliding = self.arch.is_window_layer(l);
        let (rope, angles) = match (&self.window_rope, &step.window_rope) {
            (Some(r), Some(a)) if sliding => (r, a),
            _ => (&self.rope, &step.rope),
        };
        rope.apply(angles, &mut q, nh);
        rope.apply(angles, &mut k, nkv);
        let (kc, vc) = (&mut cache.keys[l], &mut cache.values[l]);
        for (t, &slot) in step.rows.slots.iter().enumerate() {
            kc.write(slot * kv_dim, &k[t * kv_dim..(t + 1) * kv_dim]);
            vc.write(slot * kv_dim, &v[t * kv_dim..(t + 1) * kv_dim]);
        }
        let shape = AttnShape {
            n_head: nh,
            n_kv_head: nkv,
            head_dim: hd,
            block_size: cache.block_size,
            scale: self.arch.attn_scale,
            window: if sliding { self.arch.window } else { None },
            softcap: self.arch.attn_softcap,
        };
        let mut attn = vec![0f32; n_tok * q_dim];
        attend(
            shape,
            &q,
            &cache.keys[l],
            &cache.values[l],
            step.ctx,
            &mut attn,
        );
        let mut o = matmul(&layer.wo, &attn, n_tok, exact)?;
        lora(LoraModule::O, &attn, &mut o, h, 0);
        if let Some(w) = &layer.post_attn_norm {
            rms_norm_in_place(&mut o, w, cfg.rms_eps);
        }
        add_in_place(x, &o);

        let normed = rms_norm(x, &layer.ffn_norm, cfg.rms_eps);
        let ffn = cfg.ffn_hidden;
        let mut gu = layer.gate_up.gate_up(&normed, n_tok, exact, ffn)?;
        lora(LoraModule::Gate, &normed, &mut gu, 2 * ffn, 0);
        lora(LoraModule::Up, &normed, &mut gu, 2 * ffn, ffn);
        let act = gated(self.arch.family.activation, &gu, n_tok, ffn);
        let mut d = matmul(&layer.down, &act, n_tok, exact)?;
        lora(LoraModule::Down, &act, &mut d, h, 0);
        if let Some(w) = &layer.post_ffn_norm {
            rms_norm_in_place(&mut d, w, cfg.rms_eps);
        }
        add_in_place(x, &d);
        Ok(())
    }

    /// Logits only for the rows asked for: f32 rows first, then 8-bit rows, so that the
    /// `lm_head` product keeps each row's kernel. Each sequence's rows stay in position
    /// order (its prompt rows come before its decode rows).
    fn logits(
        &self,
        x: &[f32],
        rows: &StepRows,
        n_seqs: usize,
    ) -> Result<Vec<Vec<Vec<f32>>>, ModelError> {
        let (h, v) = (self.config.hidden, self.config.vocab_size);
        let mut picked = Vec::new();
        let mut which = Vec::new();
        let mut exact_logits = 0;
        for quantized in [false, true] {
            for (s, tail) in rows.tail_rows.iter().enumerate() {
                for &r in tail.iter().filter(|&&r| (r >= rows.exact) == quantized) {
                    picked.extend_from_slice(&x[r * h..(r + 1) * h]);
                    which.push(s);
                }
            }
            if !quantized {
                exact_logits = which.len();
            }
        }
        let mut out = vec![Vec::new(); n_seqs];
        if which.is_empty() {
            return Ok(out);
        }
        let normed = rms_norm(&picked, &self.output_norm, self.config.rms_eps);
        let mut logits = matmul(&self.lm_head, &normed, which.len(), exact_logits)?;
        if let Some(cap) = self.arch.final_softcap {
            logits.iter_mut().for_each(|z| *z = cap * (*z / cap).tanh());
        }
        // One row (a single stream) keeps the product's buffer; a batch's rows are copied
        // out by the pool (64 rows are 12 MiB at this vocabulary).
        let rows: Vec<Vec<f32>> = match which.len() {
            1 if logits.len() == v => vec![logits],
            n if n >= PAR_LOGIT_ROWS => {
                use rayon::prelude::*;
                logits.par_chunks_exact(v).map(<[f32]>::to_vec).collect()
            }
            _ => logits.chunks_exact(v).map(<[f32]>::to_vec).collect(),
        };
        for (row, s) in rows.into_iter().zip(which) {
            out[s].push(row);
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
        for (l, layer) in self.layers.iter_mut().enumerate() {
            layer.qkv.merge_lora(
                adapter,
                l,
                &[(LoraModule::Q, 0), (LoraModule::K, 1), (LoraModule::V, 2)],
            )?;
            layer
                .gate_up
                .merge_lora(adapter, l, &[(LoraModule::Gate, 0), (LoraModule::Up, 1)])?;
            merge_into(&mut layer.wo, adapter, l, &[(LoraModule::O, 0)])?;
            merge_into(&mut layer.down, adapter, l, &[(LoraModule::Down, 0)])?;
        }
        Ok(())
    }
}

/// What every layer of a step shares.
struct Step<'a> {
    rows: &'a StepRows,
    ctx: &'a [TokenCtx<'a>],
    row_lora: &'a [Option<&'a LoraAdapter>],
    any_lora: bool,
    /// RoPE angles of the step's positions: global layers', and sliding layers' when
    /// they differ.
    rope: RopeRows,
    window_rope: Option<RopeRows>,
}

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}
