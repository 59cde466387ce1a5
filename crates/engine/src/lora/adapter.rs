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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use serde::Deserialize;

use crate::gguf::LlamaConfig;

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
    pub fn dims(self, cfg: &LlamaConfig) -> (usize, usize) {
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

/// The `A` and `B` of one projection as they are found, either possibly missing.
type Halves = (Option<Vec<f32>>, Option<Vec<f32>>);

/// `A` (`[r, in]`) and `B` (`[out, r]`) of one projection, row-major f32.
#[derive(Debug, Clone)]
pub struct LoraPair {
    pub a: Vec<f32>,
    pub b: Vec<f32>,
    pub inp: usize,
    pub out: usize,
}

/// A loaded adapter.
#[derive(Debug, Clone)]
pub struct LoraAdapter {
    pub name: String,
    pub path: PathBuf,
    pub rank: usize,
    pub scale: f32,
    pairs: BTreeMap<(usize, Module), LoraPair>,
}

impl LoraAdapter {
    /// Reads a PEFT adapter directory and checks it against the base model.
    pub fn load_peft(
        name: &str,
        dir: &Path,
        base: &LlamaConfig,
        max_rank: usize,
    ) -> Result<Self, LoraError> {
        let config_path = dir.join("adapter_config.json");
        let weights_path = dir.join("adapter_model.safetensors");
        if !config_path.is_file() || !weights_path.is_file() {
            return Err(LoraError::NotFound(dir.to_path_buf()));
        }
        let text = std::fs::read_to_string(&config_path).map_err(|e| LoraError::Unreadable {
            path: config_path.clone(),
            reason: e.to_string(),
        })?;
        let bad = |reason: String| LoraError::Config {
            path: config_path.clone(),
            reason,
        };
        let cfg: PeftConfig =
            serde_json::from_str(&text).map_err(|e| bad(format!("not a PEFT LoRA config: {e}")))?;
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
        let scale = if cfg.use_rslora {
            cfg.lora_alpha / (cfg.r as f64).sqrt()
        } else {
            cfg.lora_alpha / cfg.r as f64
        } as f32;
        let tensors = candle_core::safetensors::load(&weights_path, &Device::Cpu).map_err(|e| {
            LoraError::Unreadable {
                path: weights_path.clone(),
                reason: format!("not a readable safetensors file: {e}"),
            }
        })?;
        let mut halves: BTreeMap<(usize, Module), Halves> = BTreeMap::new();
        for (tname, t) in &tensors {
            let (layer, module, is_a) =
                parse_name(tname, base.n_layer).ok_or_else(|| LoraError::UnknownTensor {
                    name: tname.clone(),
                })?;
            let (inp, out) = module.dims(base);
            let want = if is_a {
                vec![cfg.r, inp]
            } else {
                vec![out, cfg.r]
            };
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
                    path: weights_path.clone(),
                    reason: format!("tensor `{tname}`: {e}"),
                })?;
            if data.iter().any(|v| !v.is_finite()) {
                return Err(LoraError::Config {
                    path: weights_path.clone(),
                    reason: format!("tensor `{tname}` holds a NaN or infinity"),
                });
            }
            let slot = halves.entry((layer, module)).or_default();
            if is_a {
                slot.0 = Some(data);
            } else {
                slot.1 = Some(data);
            }
        }
        let mut pairs = BTreeMap::new();
        for ((layer, module), (a, b)) in halves {
            let stem = format!(
                "base_model.model.model.layers.{layer}.{}.{}",
                module.block(),
                module.hf_name()
            );
            let (a, b) = match (a, b) {
                (Some(a), Some(b)) => (a, b),
                (Some(_), None) => {
                    return Err(LoraError::Unpaired {
                        name: format!("{stem}.lora_A.weight"),
                        missing: "lora_B".into(),
                    })
                }
                (None, _) => {
                    return Err(LoraError::Unpaired {
                        name: format!("{stem}.lora_B.weight"),
                        missing: "lora_A".into(),
                    })
                }
            };
            let (inp, out) = module.dims(base);
            let b = match module {
                Module::Q => rope_rows(&b, base.n_head, base.head_dim, cfg.r),
                Module::K => rope_rows(&b, base.n_kv_head, base.head_dim, cfg.r),
                _ => b,
            };
            pairs.insert((layer, module), LoraPair { a, b, inp, out });
        }
        if pairs.is_empty() {
            return Err(LoraError::Empty);
        }
        Ok(LoraAdapter {
            name: name.to_string(),
            path: dir.to_path_buf(),
            rank: cfg.r,
            scale,
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
        // A x first: r floats, so the update costs r·(in + out), not in·out.
        let ax: Vec<f32> =
            p.a.chunks_exact(p.inp)
                .map(|row| row.iter().zip(x).map(|(a, v)| a * v).sum::<f32>() * self.scale)
                .collect();
        for (o, brow) in y.iter_mut().zip(p.b.chunks_exact(self.rank)) {
            *o += brow.iter().zip(&ax).map(|(b, v)| b * v).sum::<f32>();
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
    let (inp, out) = (x.len() / rows, y.len() / rows);
    for (i, adapter) in adapters.iter().enumerate() {
        if let Some(a) = adapter {
            a.apply_row(
                layer,
                module,
                &x[i * inp..(i + 1) * inp],
                &mut y[i * out..(i + 1) * out],
            );
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

    pub(crate) fn tiny_base() -> LlamaConfig {
        LlamaConfig {
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
    fn smollm2() -> LlamaConfig {
        LlamaConfig {
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
