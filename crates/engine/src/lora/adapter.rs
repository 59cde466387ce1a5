//! One PEFT LoRA adapter, checked against the base model and held in f32.
//!
//! PEFT names a tensor `base_model.model.model.layers.{i}.{self_attn|mlp}.{m}.lora_A.weight`
//! (`[r, in]`) and `...lora_B.weight` (`[out, r]`); the update of projection `m` is
//! `y += scale · B (A x)` with `scale = lora_alpha / r` (`lora_alpha / √r` with
//! `use_rslora`). Query and key `B` rows are moved into the GGUF row order the engine's
//! weights use (see [`rope_rows`]). Every problem with an adapter (a missing file, an unsupported PEFT
//! option, a rank above the limit, a tensor of the wrong shape or for a layer or module the
//! model does not have) is a [`LoraError`] naming it, so the server can answer a 400 and
//! keep serving.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use candle_core::{DType, Device};
use serde::Deserialize;

use crate::gguf::{metadata_str, GgufFile};
use crate::model::config::ModelConfig;

/// A projection an adapter may target.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Module {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Module {
    pub const ALL: [Module; 7] = [
        Module::Q,
        Module::K,
        Module::V,
        Module::O,
        Module::Gate,
        Module::Up,
        Module::Down,
    ];

    /// The Hugging Face name (`q_proj`, ...), as PEFT's `target_modules` spells it.
    pub fn hf_name(self) -> &'static str {
        match self {
            Module::Q => "q_proj",
            Module::K => "k_proj",
            Module::V => "v_proj",
            Module::O => "o_proj",
            Module::Gate => "gate_proj",
            Module::Up => "up_proj",
            Module::Down => "down_proj",
        }
    }

    fn block(self) -> &'static str {
        match self {
            Module::Q | Module::K | Module::V | Module::O => "self_attn",
            _ => "mlp",
        }
    }

    pub fn from_hf_name(name: &str) -> Option<Module> {
        Module::ALL.into_iter().find(|m| m.hf_name() == name)
    }

    /// `(in, out)` of this projection in `cfg`'s model.
    pub fn dims(self, cfg: &ModelConfig) -> (usize, usize) {
        let q = cfg.n_head * cfg.head_dim;
        let kv = cfg.n_kv_head * cfg.head_dim;
        match self {
            Module::Q => (cfg.hidden, q),
            Module::K | Module::V => (cfg.hidden, kv),
            Module::O => (q, cfg.hidden),
            Module::Gate | Module::Up => (cfg.hidden, cfg.ffn_hidden),
            Module::Down => (cfg.ffn_hidden, cfg.hidden),
        }
    }
}

/// Why an adapter cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("no adapter at {0}: expected a directory with adapter_config.json and adapter_model.safetensors")]
    NotFound(PathBuf),
    #[error("cannot read {path}: {reason}")]
    Unreadable { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    Config { path: PathBuf, reason: String },
    #[error("adapter rank {rank} is above --max-lora-rank {max}")]
    RankTooLarge { rank: usize, max: usize },
    #[error("tensor `{name}` has shape {got:?}, but the base model needs {want:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    #[error("tensor `{name}` does not name a layer and projection of the base model")]
    UnknownTensor { name: String },
    #[error("tensor `{name}` has no matching `{missing}`")]
    Unpaired { name: String, missing: String },
    #[error("the adapter holds no LoRA tensor")]
    Empty,
}

#[derive(Deserialize)]
struct PeftConfig {
    #[serde(default)]
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f64,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    #[serde(default)]
    bias: Option<String>,
}

impl PeftConfig {
    /// Reads `adapter_config.json` and refuses what the engine cannot apply: another PEFT
    /// type, DoRA, `fan_in_fan_out`, trained biases, a rank of 0 or above `max_rank`, a
    /// `lora_alpha` that is not a finite number.
    fn read(config_path: &Path, max_rank: usize) -> Result<Self, LoraError> {
        let text = std::fs::read_to_string(config_path).map_err(|e| LoraError::Unreadable {
            path: config_path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let bad = |reason: String| LoraError::Config {
            path: config_path.to_path_buf(),
            reason,
        };
        // Only where the JSON goes wrong, never the parser's message: it can quote the
        // file's text.
        let cfg: PeftConfig = serde_json::from_str(&text).map_err(|e| {
            bad(format!(
                "not a PEFT LoRA config (line {}, column {})",
                e.line(),
                e.column()
            ))
        })?;
        if let Some(t) = cfg.peft_type.as_deref() {
            if t != "LORA" {
                return Err(bad(format!("peft_type `{t}` is not LORA")));
            }
        }
        if cfg.use_dora {
            return Err(bad("DoRA adapters (use_dora) are not supported".into()));
        }
        if cfg.fan_in_fan_out {
            return Err(bad("fan_in_fan_out adapters are not supported".into()));
        }
        if cfg.bias.as_deref().is_some_and(|b| b != "none") {
            return Err(bad("adapters with trained biases are not supported".into()));
        }
        if cfg.r == 0 {
            return Err(bad("`r` must be positive".into()));
        }
        if cfg.r > max_rank {
            return Err(LoraError::RankTooLarge {
                rank: cfg.r,
                max: max_rank,
            });
        }
        if !cfg.lora_alpha.is_finite() {
            return Err(bad("`lora_alpha` must be a finite number".into()));
        }
        Ok(cfg)
    }

    /// `lora_alpha / r`, or `lora_alpha / √r` with `use_rslora`.
    fn scale(&self) -> f32 {
        (if self.use_rslora {
            self.lora_alpha / (self.r as f64).sqrt()
        } else {
            self.lora_alpha / self.r as f64
        }) as f32
    }
}

/// The `A` and `B` of one projection as they are found, either possibly missing.
type Halves = (Option<Vec<f32>>, Option<Vec<f32>>);

/// The halves an adapter file holds, by layer and projection.
type HalvesByTarget = BTreeMap<(usize, Module), Halves>;

/// `A` (`[r, in]`) and `B` (`[out, r]`) of one projection, row-major f32.
#[derive(Debug, Clone)]
pub struct LoraPair {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub inp: usize,
    pub out: usize,
    /// `B` transposed (`[r, out]`): the update is then `r` runs over contiguous rows of
    /// `out` floats, which vectorize, instead of `out` dot products of length `r`.
    bt: Vec<f32>,
}

impl LoraPair {
    fn new(a: Vec<f32>, b: Vec<f32>, inp: usize, out: usize) -> Self {
        let r = b.len().checked_div(out).unwrap_or(0);
        let mut bt = vec![0f32; b.len()];
        for o in 0..out {
            for k in 0..r {
                bt[k * out + o] = b[o * r + k];
            }
        }
        Self { a, b, inp, out, bt }
    }

    /// `B (A x)` for one row given `A x` (already scaled): `Σ_k ax[k] · B[:, k]`, always
    /// summed in the order of `k`.
    fn update(&self, ax: &[f32]) -> Vec<f32> {
        let mut d = vec![0f32; self.out];
        if self.out == 0 {
            return d;
        }
        for (col, &a) in self.bt.chunks_exact(self.out).zip(ax) {
            for (v, b) in d.iter_mut().zip(col) {
                *v += a * b;
            }
        }
        d
    }
}

/// A loaded adapter.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    pub name: String,
    /// vLLM's `lora_int_id`: a positive number the registry gives each load (KV events
    /// carry it as `lora_id`); 0 until registered.
    pub id: u32,
    pub path: PathBuf,
    pub rank: usize,
    pub scale: f32,
    pairs: BTreeMap<(usize, Module), LoraPair>,
}

impl LoraAdapter {
    /// Reads the adapter at `path` (a PEFT directory, or a llama.cpp GGUF adapter file)
    /// and checks it against the base model.
    pub fn load(
        name: &str,
        path: &Path,
        base: &ModelConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        if path.is_file() {
            return Self::load_gguf(name, path, base, max_rank);
        }
        Self::load_peft(name, path, base, max_rank)
    }

    /// Reads a llama.cpp LoRA adapter (`general.type = adapter`, `adapter.type = lora`,
    /// `adapter.lora.alpha`; tensors `blk.{i}.{attn_q|...}.weight.lora_a` `[r, in]` and
    /// `.lora_b` `[out, r]`). Its converter already moved query and key rows into the
    /// GGUF order, so nothing is reordered here. The scale is `alpha / r`, or 1 when alpha
    /// is 0 (llama.cpp's rule).
    pub fn load_gguf(
        name: &str,
        path: &Path,
        base: &ModelConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let mut file = open_gguf_adapter(path)?;
        let alpha = gguf_alpha(file.metadata(), path)?;
        let (halves, rank) = gguf_halves(&mut file, path, base, max_rank)?;
        let scale = if alpha == 0.0 {
            1.0
        } else {
            (alpha / rank as f64) as f32
        };
        let pairs = pair_up(
            halves,
            base,
            |layer, module| format!("blk.{layer}.{}.weight", gguf_stem(module)),
            |_, b| b,
        )?;
        Ok(LoraAdapter {
            name: name.to_string(),
            id: 0,
            path: path.to_path_buf(),
            rank,
            scale,
            pairs,
        })
    }

    /// Reads a PEFT adapter directory and checks it against the base model.
    pub fn load_peft(
        name: &str,
        dir: &Path,
        base: &ModelConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let config_path = dir.join("adapter_config.json");
        let weights_path = dir.join("adapter_model.safetensors");
        if !config_path.is_file() || !weights_path.is_file() {
            return Err(LoraError::NotFound(dir.to_path_buf()));
        }
        let cfg = PeftConfig::read(&config_path, max_rank)?;
        let halves = peft_halves(&weights_path, base, cfg.r)?;
        let r = cfg.r;
        let pairs = pair_up(
            halves,
            base,
            |layer, module| {
                format!(
                    "base_model.model.model.layers.{layer}.{}.{}",
                    module.block(),
                    module.hf_name()
                )
            },
            |module, b| match module {
                Module::Q => rope_rows(&b, base.n_head, base.head_dim, r),
                Module::K => rope_rows(&b, base.n_kv_head, base.head_dim, r),
                _ => b,
            },
        )?;
        Ok(LoraAdapter {
            name: name.to_string(),
            id: 0,
            path: dir.to_path_buf(),
            rank: cfg.r,
            scale: cfg.scale(),
            pairs,
        })
    }

    /// The projections this adapter changes.
    pub fn targets(&self) -> impl Iterator<Item = (usize, Module)> + '_ {
        self.pairs.keys().copied()
    }

    pub fn pair(&self, layer: usize, module: Module) -> Option<&LoraPair> {
        self.pairs.get(&(layer, module))
    }

    /// `y += scale · B (A x)` for one row (`x`: `in` floats, `y`: `out` floats); a no-op
    /// for a projection the adapter does not target.
    pub fn apply_row(&self, layer: usize, module: Module, x: &[f32], y: &mut [f32]) {
        let Some(p) = self.pairs.get(&(layer, module)) else {
            return;
        };
        // A x first: r floats, so the update costs r·(in + out), not in·out. At most the
        // rank limit's worth on the stack would do, but ranks are small and a Vec of r
        // floats per row is noise next to the dot products.
        let ax: Vec<f32> =
            p.a.chunks_exact(p.inp)
                .map(|row| dot(row, x) * self.scale)
                .collect();
        for (o, d) in y.iter_mut().zip(p.update(&ax)) {
            *o += d;
        }
    }

    /// `W + scale·B·A` for a `[out, in]` weight `w`: the merged reference the tests compare
    /// the per-row update with.
    pub fn merged(&self, layer: usize, module: Module, w: &[f32]) -> Vec<f32> {
        let mut out = w.to_vec();
        let Some(p) = self.pairs.get(&(layer, module)) else {
            return out;
        };
        for (o_row, b_row) in out.chunks_exact_mut(p.inp).zip(p.b.chunks_exact(self.rank)) {
            for (k, b) in b_row.iter().enumerate() {
                let a_row = &p.a[k * p.inp..(k + 1) * p.inp];
                for (o, a) in o_row.iter_mut().zip(a_row) {
                    *o += self.scale * b * a;
                }
            }
        }
        out
    }
}

/// Opens a llama.cpp adapter file and checks that it is a LoRA adapter for a llama model.
fn open_gguf_adapter(path: &Path) -> Result<GgufFile, LoraError> {
    // The reason stays out of the answer: a GGUF reader's message can quote the
    // file's first bytes (its "magic").
    let file = GgufFile::open(path).map_err(|e| LoraError::Unreadable {
        path: path.to_path_buf(),
        reason: match e {
            crate::gguf::ModelError::NotGguf { .. } => "not a GGUF file".into(),
            _ => "the file cannot be opened".into(),
        },
    })?;
    let md = file.metadata();
    let bad = |reason: String| LoraError::Config {
        path: path.to_path_buf(),
        reason,
    };
    if metadata_str(md, "general.type") != Some("adapter")
        || metadata_str(md, "adapter.type") != Some("lora")
    {
        return Err(bad(
            "not a LoRA adapter (general.type must be `adapter`, adapter.type `lora`)".into(),
        ));
    }
    if let Some(arch) = metadata_str(md, "general.architecture") {
        if arch != "llama" {
            return Err(bad(format!(
                "an adapter for `{arch}`, not for a llama model"
            )));
        }
    }
    Ok(file)
}

/// `adapter.lora.alpha` (0 when absent), which must be a finite number.
fn gguf_alpha(md: &HashMap<String, Value>, path: &Path) -> Result<f64, LoraError> {
    let bad = |reason: String| LoraError::Config {
        path: path.to_path_buf(),
        reason,
    };
    let alpha = match md.get("adapter.lora.alpha") {
        None => 0.0,
        Some(Value::F32(a)) => f64::from(*a),
        Some(Value::F64(a)) => *a,
        Some(other) => return Err(bad(format!("adapter.lora.alpha is {other:?}"))),
    };
    if !alpha.is_finite() {
        return Err(bad("adapter.lora.alpha must be a finite number".into()));
    }
    Ok(alpha)
}

/// Every `A` and `B` of a llama.cpp adapter in f32, and the rank: the first tensor's, which
/// every other must have too (its shape is checked at that rank).
fn gguf_halves(
    file: &mut GgufFile,
    path: &Path,
    base: &ModelConfig,
    max_rank: usize,
) -> Result<(HalvesByTarget, usize), LoraError> {
    let unreadable = |reason: String| LoraError::Unreadable {
        path: path.to_path_buf(),
        reason,
    };
    let names: Vec<String> = file.content.tensor_infos.keys().cloned().collect();
    let mut halves = BTreeMap::new();
    let mut rank = None;
    for tname in names {
        let (layer, module, is_a) =
            parse_gguf_name(&tname, base.n_layer).ok_or_else(|| LoraError::UnknownTensor {
                name: tname.clone(),
            })?;
        let dims = file.content.tensor_infos[&tname].shape.dims().to_vec();
        let r = match (is_a, dims.as_slice()) {
            (true, [r, _]) | (false, [_, r]) => *r,
            _ => 0,
        };
        if r == 0 {
            return Err(LoraError::Shape {
                name: tname,
                got: dims,
                want: vec![],
            });
        }
        let r = *rank.get_or_insert(r);
        if r > max_rank {
            return Err(LoraError::RankTooLarge {
                rank: r,
                max: max_rank,
            });
        }
        let want = half_shape(module, base, r, is_a);
        let t = file.tensor(&tname, &want).map_err(|e| {
            if dims != want {
                LoraError::Shape {
                    name: tname.clone(),
                    got: dims.clone(),
                    want: want.clone(),
                }
            } else {
                unreadable(e.to_string())
            }
        })?;
        let data = t
            .dequantize(&Device::Cpu)
            .and_then(|t| t.to_dtype(DType::F32))
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| unreadable(format!("tensor `{tname}`: {e}")))?;
        add_half(&mut halves, path, &tname, (layer, module, is_a), data)?;
    }
    let rank = rank.ok_or(LoraError::Empty)?;
    Ok((halves, rank))
}

/// Every `A` and `B` of a PEFT adapter's safetensors file in f32, each checked against
/// the base model at rank `r`.
fn peft_halves(
    weights_path: &Path,
    base: &ModelConfig,
    r: usize,
) -> Result<HalvesByTarget, LoraError> {
    let tensors = candle_core::safetensors::load(weights_path, &Device::Cpu).map_err(|_| {
        LoraError::Unreadable {
            path: weights_path.to_path_buf(),
            reason: "not a readable safetensors file".into(),
        }
    })?;
    let mut halves = BTreeMap::new();
    for (tname, t) in &tensors {
        let (layer, module, is_a) =
            parse_name(tname, base.n_layer).ok_or_else(|| LoraError::UnknownTensor {
                name: tname.clone(),
            })?;
        let want = half_shape(module, base, r, is_a);
        if t.dims() != want.as_slice() {
            return Err(LoraError::Shape {
                name: tname.clone(),
                got: t.dims().to_vec(),
                want,
            });
        }
        let data = t
            .to_dtype(DType::F32)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f32>())
            .map_err(|e| LoraError::Unreadable {
                path: weights_path.to_path_buf(),
                reason: format!("tensor `{tname}`: {}", crate::gguf::error_message(&e)),
            })?;
        add_half(
            &mut halves,
            weights_path,
            tname,
            (layer, module, is_a),
            data,
        )?;
    }
    Ok(halves)
}

/// The shape one half of `module` must have at rank `r`: `A` is `[r, in]`, `B` `[out, r]`.
fn half_shape(module: Module, base: &ModelConfig, r: usize, is_a: bool) -> Vec<usize> {
    let (inp, out) = module.dims(base);
    if is_a {
        vec![r, inp]
    } else {
        vec![out, r]
    }
}

/// Files `data` as the `A` (`is_a`) or `B` of its projection, refusing a NaN or infinity
/// (`file` is the file it was read from, named in that error).
fn add_half(
    halves: &mut HalvesByTarget,
    file: &Path,
    tname: &str,
    (layer, module, is_a): (usize, Module, bool),
    data: Vec<f32>,
) -> Result<(), LoraError> {
    if data.iter().any(|v| !v.is_finite()) {
        return Err(LoraError::Config {
            path: file.to_path_buf(),
            reason: format!("tensor `{tname}` holds a NaN or infinity"),
        });
    }
    let slot = halves.entry((layer, module)).or_default();
    if is_a {
        slot.0 = Some(data);
    } else {
        slot.1 = Some(data);
    }
    Ok(())
}

/// Matches each projection's `A` with its `B` (`stem` names the tensors in errors;
/// `fix_b` moves `B`'s rows into the engine's order); an empty adapter is an error.
fn pair_up(
    halves: HalvesByTarget,
    base: &ModelConfig,
    stem: impl Fn(usize, Module) -> String,
    fix_b: impl Fn(Module, Vec<f32>) -> Vec<f32>,
) -> Result<BTreeMap<(usize, Module), LoraPair>, LoraError> {
    let mut pairs = BTreeMap::new();
    for ((layer, module), (a, b)) in halves {
        let (a, b) = match (a, b) {
            (Some(a), Some(b)) => (a, b),
            (Some(_), None) => {
                return Err(LoraError::Unpaired {
                    name: format!("{} A", stem(layer, module)),
                    missing: "B".into(),
                })
            }
            (None, _) => {
                return Err(LoraError::Unpaired {
                    name: format!("{} B", stem(layer, module)),
                    missing: "A".into(),
                })
            }
        };
        let (inp, out) = module.dims(base);
        let b = fix_b(module, b);
        pairs.insert((layer, module), LoraPair::new(a, b, inp, out));
    }
    if pairs.is_empty() {
        return Err(LoraError::Empty);
    }
    Ok(pairs)
}

/// The GGUF name of a projection's weight (`attn_q`, ...).
fn gguf_stem(m: Module) -> &'static str {
    match m {
        Module::Q => "attn_q",
        Module::K => "attn_k",
        Module::V => "attn_v",
        Module::O => "attn_output",
        Module::Gate => "ffn_gate",
        Module::Up => "ffn_up",
        Module::Down => "ffn_down",
    }
}

/// `blk.{i}.{attn_q|...}.weight.lora_{a|b}` into its parts.
fn parse_gguf_name(name: &str, n_layer: usize) -> Option<(usize, Module, bool)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if layer >= n_layer {
        return None;
    }
    let (stem, half) = rest.split_once(".weight.")?;
    let module = Module::ALL.into_iter().find(|&m| gguf_stem(m) == stem)?;
    match half {
        "lora_a" => Some((layer, module, true)),
        "lora_b" => Some((layer, module, false)),
        _ => None,
    }
}

/// Reorders the rows of a query or key `B` (`[heads·head_dim, r]`) from Hugging Face's
/// layout to the GGUF one the engine's weights are in: llama.cpp's converter interleaves
/// each head's two halves (row `j·head_dim/2 + i` becomes row `2i + j`) so that RoPE
/// rotates adjacent pairs. An adapter trained on the Hugging Face model must have its
/// output rows moved the same way, or it would add each update to the wrong row.
fn rope_rows(b: &[f32], heads: usize, head_dim: usize, r: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; b.len()];
    for h in 0..heads {
        for i in 0..half {
            for j in 0..2 {
                let from = (h * head_dim + j * half + i) * r;
                let to = (h * head_dim + 2 * i + j) * r;
                out[to..to + r].copy_from_slice(&b[from..from + r]);
            }
        }
    }
    out
}

/// A dot product with eight independent partial sums, so the compiler can keep them in
/// one vector register. The order of additions is fixed by the lengths alone, so a row's
/// result never depends on which other rows share its step.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for k in 0..8 {
            acc[k] += x[k] * y[k];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// Rows of one adapter handled by one task: each task reads its adapter's `A` and `B`
/// once for all its rows, instead of once per row.
const GROUP_ROWS: usize = 16;

/// Adds each row's own adapter update to a projection's output: row `i` of `x`
/// (`rows × in`) and `y` (`rows × out`) gets `adapters[i]`'s, or nothing for `None` (the
/// base model). This is how one step serves rows of different adapters and the base.
pub fn apply_rows(
    adapters: &[Option<&LoraAdapter>],
    layer: usize,
    module: Module,
    x: &[f32],
    y: &mut [f32],
) {
    let rows = adapters.len();
    if rows == 0 {
        return;
    }
    let out = y.len() / rows;
    apply_rows_strided(adapters, layer, module, x, y, out, 0);
}

/// [`apply_rows`] where each row's output is `y[i·stride + offset ..][..out]` inside a
/// wider row (the fused gate/up product holds both halves side by side).
///
/// Rows are grouped by adapter (at most [`GROUP_ROWS`] to a task, the tasks in parallel)
/// so that an adapter's matrices are streamed once per group rather than once per row:
/// with every row on its own, a step of 16 rows over 4 adapters reads more adapter
/// weights than base-model weights. Each row's numbers are still computed exactly as
/// [`LoraAdapter::apply_row`] computes them (the same dot products in the same order),
/// so grouping never changes a result. Rows whose adapter is `None` or does not target
/// this projection are left exactly as they are.
pub fn apply_rows_strided(
    adapters: &[Option<&LoraAdapter>],
    layer: usize,
    module: Module,
    x: &[f32],
    y: &mut [f32],
    stride: usize,
    offset: usize,
) {
    use rayon::prelude::*;
    let rows = adapters.len();
    if rows == 0 || stride == 0 || y.len() < rows * stride {
        return;
    }
    let inp = x.len() / rows;
    // Tasks: (adapter, its pair, rows), rows in order, at most GROUP_ROWS each.
    let mut tasks: Vec<(&LoraAdapter, &LoraPair, Vec<usize>)> = Vec::new();
    for (i, a) in adapters.iter().enumerate() {
        let Some(a) = *a else { continue };
        let Some(p) = a.pair(layer, module) else {
            continue;
        };
        if p.inp != inp || offset + p.out > stride {
            continue;
        }
        match tasks
            .iter_mut()
            .rev()
            .find(|(t, _, r)| std::ptr::eq(*t, a) && r.len() < GROUP_ROWS)
        {
            Some((_, _, r)) => r.push(i),
            None => tasks.push((a, p, vec![i])),
        }
    }
    if tasks.is_empty() {
        return;
    }
    // Each task's updates, row by row (`rows_in_task × out`), then added in.
    let run = |(a, p, idx): &(&LoraAdapter, &LoraPair, Vec<usize>)| -> Vec<f32> {
        let r = a.rank;
        let mut ax = vec![0f32; idx.len() * r];
        for (k, arow) in p.a.chunks_exact(p.inp).enumerate() {
            for (g, &i) in idx.iter().enumerate() {
                ax[g * r + k] = dot(arow, &x[i * inp..(i + 1) * inp]) * a.scale;
            }
        }
        let mut delta = Vec::with_capacity(idx.len() * p.out);
        for g in 0..idx.len() {
            delta.extend(p.update(&ax[g * r..(g + 1) * r]));
        }
        delta
    };
    let deltas: Vec<Vec<f32>> = if tasks.len() > 1 {
        tasks.par_iter().map(run).collect()
    } else {
        tasks.iter().map(run).collect()
    };
    for ((_, p, idx), delta) in tasks.iter().zip(deltas) {
        for (g, &i) in idx.iter().enumerate() {
            let row = &mut y[i * stride + offset..i * stride + offset + p.out];
            for (o, d) in row.iter_mut().zip(&delta[g * p.out..(g + 1) * p.out]) {
                *o += d;
            }
        }
    }
}

/// `base_model.model.model.layers.{i}.{block}.{module}.lora_{A|B}.weight` into its parts.
fn parse_name(name: &str, n_layer: usize) -> Option<(usize, Module, bool)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    if layer >= n_layer {
        return None;
    }
    let (block, rest) = rest.split_once('.')?;
    let (module, rest) = rest.split_once('.')?;
    let module = Module::from_hf_name(module)?;
    if block != module.block() {
        return None;
    }
    match rest {
        "lora_A.weight" => Some((layer, module, true)),
        "lora_B.weight" => Some((layer, module, false)),
        _ => None,
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::Tensor;
    use std::collections::HashMap;

    pub(crate) fn tiny_base() -> ModelConfig {
        ModelConfig {
            n_layer: 2,
            hidden: 8,
            ffn_hidden: 12,
            n_head: 2,
            n_kv_head: 1,
            head_dim: 4,
            vocab_size: 10,
            context_len: 64,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            tied_embeddings: true,
        }
    }

    fn values(n: usize, seed: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as f32 + seed) * 0.618_034).fract() - 0.5) * 0.2)
            .collect()
    }

    /// Writes a PEFT adapter for `tiny_base` targeting q and v of every layer.
    pub(crate) fn write_adapter(dir: &Path, rank: usize, zero_b: bool) {
        let base = tiny_base();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(
            dir.join("adapter_config.json"),
            format!(
                r#"{{"peft_type": "LORA", "r": {rank}, "lora_alpha": {}, "target_modules": ["q_proj", "v_proj"], "bias": "none"}}"#,
                2 * rank
            ),
        )
        .unwrap();
        let mut t = HashMap::new();
        for layer in 0..base.n_layer {
            for m in [Module::Q, Module::V] {
                let (inp, out) = m.dims(&base);
                let stem = format!(
                    "base_model.model.model.layers.{layer}.self_attn.{}",
                    m.hf_name()
                );
                let a = values(rank * inp, layer as f32 + 1.0);
                let b = if zero_b {
                    vec![0.0; out * rank]
                } else {
                    values(out * rank, layer as f32 + 7.0)
                };
                t.insert(
                    format!("{stem}.lora_A.weight"),
                    Tensor::from_vec(a, (rank, inp), &Device::Cpu).unwrap(),
                );
                t.insert(
                    format!("{stem}.lora_B.weight"),
                    Tensor::from_vec(b, (out, rank), &Device::Cpu).unwrap(),
                );
            }
        }
        candle_core::safetensors::save(&t, dir.join("adapter_model.safetensors")).unwrap();
    }

    pub(crate) fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("strata-lora-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn matvec(w: &[f32], x: &[f32]) -> Vec<f32> {
        w.chunks_exact(x.len())
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    #[test]
    fn per_row_update_equals_the_merged_weights() {
        let dir = tmp("merged");
        write_adapter(&dir, 4, false);
        let base = tiny_base();
        let a = LoraAdapter::load_peft("a", &dir, &base, 16).unwrap();
        assert_eq!(a.rank, 4);
        assert_eq!(a.scale, 2.0);
        assert_eq!(a.targets().count(), 4);
        let (inp, out) = Module::Q.dims(&base);
        let w = values(out * inp, 3.0);
        let x = values(inp, 5.0);
        let mut y = matvec(&w, &x);
        a.apply_row(1, Module::Q, &x, &mut y);
        let want = matvec(&a.merged(1, Module::Q, &w), &x);
        for (g, e) in y.iter().zip(&want) {
            assert!((g - e).abs() < 1e-5, "{g} vs {e}");
        }
        // A projection it does not target is untouched.
        let mut y2 = matvec(&w, &x);
        a.apply_row(1, Module::O, &x, &mut y2);
        assert_eq!(y2, matvec(&w, &x));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn zero_b_changes_nothing_and_a_mixed_batch_gives_each_row_its_own() {
        let (d1, d2) = (tmp("mix1"), tmp("mix0"));
        write_adapter(&d1, 2, false);
        write_adapter(&d2, 2, true);
        let base = tiny_base();
        let real = LoraAdapter::load_peft("real", &d1, &base, 8).unwrap();
        let zero = LoraAdapter::load_peft("zero", &d2, &base, 8).unwrap();
        let (inp, out) = Module::V.dims(&base);
        let w = values(out * inp, 9.0);
        let xs: Vec<Vec<f32>> = (0..3).map(|i| values(inp, i as f32 * 3.0)).collect();
        let x: Vec<f32> = xs.concat();
        let mut y: Vec<f32> = xs.iter().flat_map(|r| matvec(&w, r)).collect();
        apply_rows(&[Some(&real), None, Some(&zero)], 0, Module::V, &x, &mut y);
        // Row 0 alone with its adapter, row 1 the base, row 2 (zero B) the base.
        let mut alone = matvec(&w, &xs[0]);
        real.apply_row(0, Module::V, &xs[0], &mut alone);
        assert_eq!(&y[..out], alone.as_slice());
        assert_eq!(&y[out..2 * out], matvec(&w, &xs[1]).as_slice());
        assert_eq!(&y[2 * out..], matvec(&w, &xs[2]).as_slice());
        assert_ne!(alone, matvec(&w, &xs[0]));
        for d in [d1, d2] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }

    #[test]
    fn grouped_rows_get_exactly_what_each_row_gets_alone() {
        // More rows than one group holds, adapters interleaved with the base: grouping by
        // adapter must not change a single bit of any row, in any projection.
        let (d1, d2) = (tmp("grp1"), tmp("grp2"));
        write_adapter(&d1, 4, false);
        write_adapter(&d2, 2, false);
        let base = tiny_base();
        let a = LoraAdapter::load_peft("a", &d1, &base, 8).unwrap();
        let b = LoraAdapter::load_peft("b", &d2, &base, 8).unwrap();
        let rows: Vec<Option<&LoraAdapter>> = (0..40)
            .map(|i| match i % 3 {
                0 => Some(&a),
                1 => None,
                _ => Some(&b),
            })
            .collect();
        for m in [Module::Q, Module::V] {
            let (inp, out) = m.dims(&base);
            let x: Vec<f32> = (0..rows.len())
                .flat_map(|i| values(inp, i as f32))
                .collect();
            // A wider row with the projection at an offset, as the fused gate/up product.
            let (stride, offset) = (out + 3, 2);
            let y0: Vec<f32> = values(rows.len() * stride, 11.0);
            let mut y = y0.clone();
            apply_rows_strided(&rows, 1, m, &x, &mut y, stride, offset);
            for (i, r) in rows.iter().enumerate() {
                let mut want = y0[i * stride..(i + 1) * stride].to_vec();
                if let Some(ad) = r {
                    ad.apply_row(
                        1,
                        m,
                        &x[i * inp..(i + 1) * inp],
                        &mut want[offset..offset + out],
                    );
                }
                assert_eq!(&y[i * stride..(i + 1) * stride], want.as_slice(), "row {i}");
            }
        }
        for d in [d1, d2] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }

    #[test]
    fn bad_adapters_are_named_errors() {
        let base = tiny_base();
        // Missing directory.
        let err = LoraAdapter::load_peft("x", &tmp("none"), &base, 8).unwrap_err();
        assert!(matches!(err, LoraError::NotFound(_)), "{err}");
        // Rank above the limit.
        let d = tmp("rank");
        write_adapter(&d, 4, false);
        let err = LoraAdapter::load_peft("x", &d, &base, 2).unwrap_err();
        assert!(
            matches!(err, LoraError::RankTooLarge { rank: 4, max: 2 }),
            "{err}"
        );
        // Shapes of another model.
        let mut other = base.clone();
        other.hidden = 16;
        let err = LoraAdapter::load_peft("x", &d, &other, 8).unwrap_err();
        assert!(matches!(err, LoraError::Shape { .. }), "{err}");
        assert!(err.to_string().contains("lora_A"), "{err}");
        // More layers than the model has.
        let mut shallow = base.clone();
        shallow.n_layer = 1;
        let err = LoraAdapter::load_peft("x", &d, &shallow, 8).unwrap_err();
        assert!(matches!(err, LoraError::UnknownTensor { .. }), "{err}");
        // Corrupt weights.
        std::fs::write(d.join("adapter_model.safetensors"), b"garbage").unwrap();
        let err = LoraAdapter::load_peft("x", &d, &base, 8).unwrap_err();
        assert!(matches!(err, LoraError::Unreadable { .. }), "{err}");
        // Not LoRA.
        write_adapter(&d, 4, false);
        std::fs::write(
            d.join("adapter_config.json"),
            r#"{"peft_type": "IA3", "r": 4, "lora_alpha": 8}"#,
        )
        .unwrap();
        let err = LoraAdapter::load_peft("x", &d, &base, 8).unwrap_err();
        assert!(err.to_string().contains("IA3"), "{err}");
        std::fs::write(d.join("adapter_config.json"), "{").unwrap();
        assert!(matches!(
            LoraAdapter::load_peft("x", &d, &base, 8).unwrap_err(),
            LoraError::Config { .. }
        ));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn query_and_key_rows_follow_the_gguf_order() {
        // One head of 4 rows, rank 1: HF rows [a0 a1 | b0 b1] become [a0 b0 a1 b1].
        assert_eq!(
            rope_rows(&[0.0, 1.0, 2.0, 3.0], 1, 4, 1),
            vec![0.0, 2.0, 1.0, 3.0]
        );
        // Two heads, rank 2: each head moves on its own, the rank columns stay together.
        let b: Vec<f32> = (0..16).map(|v| v as f32).collect();
        let got = rope_rows(&b, 2, 4, 2);
        assert_eq!(
            got,
            vec![0., 1., 4., 5., 2., 3., 6., 7., 8., 9., 12., 13., 10., 11., 14., 15.]
        );
    }

    #[test]
    fn tensor_names_parse_only_for_real_projections() {
        assert_eq!(
            parse_name(
                "base_model.model.model.layers.3.mlp.down_proj.lora_B.weight",
                30
            ),
            Some((3, Module::Down, false))
        );
        assert_eq!(
            parse_name(
                "base_model.model.model.layers.3.mlp.q_proj.lora_A.weight",
                30
            ),
            None
        );
        assert_eq!(
            parse_name(
                "base_model.model.model.layers.30.self_attn.q_proj.lora_A.weight",
                30
            ),
            None
        );
        assert_eq!(parse_name("lm_head.weight", 30), None);
    }

    /// The default model's shapes, as `tools/make_lora_adapter.py` writes for them.
    fn smollm2() -> ModelConfig {
        ModelConfig {
            n_layer: 30,
            hidden: 576,
            ffn_hidden: 1536,
            n_head: 9,
            n_kv_head: 3,
            head_dim: 64,
            vocab_size: 49152,
            context_len: 8192,
            rope_theta: 100000.0,
            rms_eps: 1e-5,
            tied_embeddings: true,
        }
    }

    #[test]
    fn the_tools_script_writes_adapters_that_load_for_the_default_model() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/make_lora_adapter.py");
        let dir = tmp("script");
        let out = std::process::Command::new("python3")
            .arg(&script)
            .arg(&dir)
            .args([
                "--rank",
                "4",
                "--alpha",
                "8",
                "--layers",
                "2",
                "--targets",
                "q_proj,down_proj",
            ])
            .output()
            .expect("run python3");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let a = LoraAdapter::load_peft("s", &dir, &smollm2(), 16).unwrap();
        assert_eq!((a.rank, a.scale), (4, 2.0));
        let targets: Vec<_> = a.targets().collect();
        assert_eq!(
            targets,
            vec![
                (0, Module::Q),
                (0, Module::Down),
                (1, Module::Q),
                (1, Module::Down)
            ]
        );
        let down = a.pair(1, Module::Down).unwrap();
        assert_eq!((down.inp, down.out), (1536, 576));
        assert!(down.b.iter().any(|&v| v != 0.0));
        // Same seed, same bytes.
        let again = tmp("script2");
        let status = std::process::Command::new("python3")
            .arg(&script)
            .arg(&again)
            .args([
                "--rank",
                "4",
                "--alpha",
                "8",
                "--layers",
                "2",
                "--targets",
                "q_proj,down_proj",
            ])
            .output()
            .expect("run python3");
        assert!(status.status.success());
        assert_eq!(
            std::fs::read(dir.join("adapter_model.safetensors")).unwrap(),
            std::fs::read(again.join("adapter_model.safetensors")).unwrap()
        );
        // --zero-b: every B is zero.
        let zero = tmp("script0");
        let status = std::process::Command::new("python3")
            .arg(&script)
            .arg(&zero)
            .args(["--rank", "2", "--layers", "1", "--zero-b"])
            .output()
            .expect("run python3");
        assert!(status.status.success());
        let z = LoraAdapter::load_peft("z", &zero, &smollm2(), 16).unwrap();
        assert!(z.pair(0, Module::V).unwrap().b.iter().all(|&v| v == 0.0));
        for d in [dir, again, zero] {
            let _ = std::fs::remove_dir_all(&d);
        }
    }
}
