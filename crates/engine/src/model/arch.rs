//! The model families the engine runs and what sets each apart: the table every other
//! part of the model reads instead of matching on a family name.
//!
//! One forward pass serves every family ([`super::Model`]); a family only switches steps
//! on or off (biases, per-head query/key norms, norms after attention and feed-forward,
//! the activation, soft-capping, sliding-window layers) and picks the RoPE layout.

use crate::gguf::ModelError;

/// A `general.architecture` the engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
    Phi3,
    Gemma2,
    Gemma3,
}

/// How RoPE pairs a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])`: llama's GGUF converter permutes Q/K rows so.
    Interleaved,
    /// Halves `(x[i], x[i + d/2])` (GPT-NeoX style): Qwen, Phi-3, Gemma.
    Halves,
}

/// The feed-forward activation applied to the gate before it multiplies the up branch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: `silu(gate) · up`.
    Silu,
    /// GeGLU with the tanh approximation of GELU: `gelu_tanh(gate) · up`.
    GeluTanh,
}

/// Which layers attend over a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowLayers {
    /// None: every layer is global.
    None,
    /// Every `n`-th layer (1-based) is global, the others slide: Gemma 2 (`n = 2`: even
    /// layers slide) and Gemma 3 (`n = 6`: five sliding layers, then a global one).
    AllButEvery(usize),
}

/// What one family does differently; see [`Family::of`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Family {
    pub arch: Arch,
    /// `general.architecture`, also the prefix of the family's metadata keys.
    pub name: &'static str,
    pub rope: RopeLayout,
    /// Per-head RMSNorm of queries and keys before RoPE (`attn_q_norm` / `attn_k_norm`).
    pub qk_norm: bool,
    /// RMSNorm of the attention output and of the feed-forward output before each joins
    /// the residual (`post_attention_norm` / `post_ffw_norm`).
    pub post_norms: bool,
    pub activation: Activation,
    /// Token embeddings are multiplied by `√hidden` before the first layer.
    pub embed_scale: bool,
    pub window_layers: WindowLayers,
    /// The sliding window when the file does not say (Gemma 2's 4096); `None` makes
    /// `{arch}.attention.sliding_window` required for a family with window layers.
    pub default_window: Option<usize>,
    /// RoPE base of the sliding layers when it differs from `rope.freq_base` (Gemma 3's
    /// local layers use 10 000 unscaled; its global layers the file's base and scaling).
    pub window_rope_base: Option<f32>,
    /// Attention-score soft-cap when the file does not say (Gemma 2's 50).
    pub default_attn_softcap: Option<f32>,
    /// Final-logit soft-cap when the file does not say (Gemma 2's 30).
    pub default_final_softcap: Option<f32>,
    /// `rope_freqs.weight` (llama 3 frequency factors) is read when present.
    pub rope_freq_factors: bool,
    /// The output matrix is always the token embeddings, whatever else the file holds.
    pub always_tied: bool,
    /// Layer counts of the sizes whose attention scale is `1/√(hidden/heads)` rather than
    /// `1/√head_dim` (the 27B Gemmas).
    pub scale_by_hidden_at: &'static [usize],
}

const BASE: Family = Family {
    arch: Arch::Llama,
    name: "llama",
    rope: RopeLayout::Interleaved,
    qk_norm: false,
    post_norms: false,
    activation: Activation::Silu,
    embed_scale: false,
    window_layers: WindowLayers::None,
    default_window: None,
    window_rope_base: None,
    default_attn_softcap: None,
    default_final_softcap: None,
    rope_freq_factors: false,
    always_tied: false,
    scale_by_hidden_at: &[],
};

/// Every family the engine runs, in the order the README lists them.
pub const FAMILIES: &[Family] = &[
    Family {
        rope_freq_factors: true,
        ..BASE
    },
    Family {
        arch: Arch::Mistral,
        name: "mistral",
        rope_freq_factors: true,
        ..BASE
    },
    Family {
        arch: Arch::Qwen2,
        name: "qwen2",
        rope: RopeLayout::Halves,
        ..BASE
    },
    Family {
        arch: Arch::Qwen3,
        name: "qwen3",
        rope: RopeLayout::Halves,
        qk_norm: true,
        ..BASE
    },
    Family {
        arch: Arch::Phi3,
        name: "phi3",
        rope: RopeLayout::Halves,
        ..BASE
    },
    Family {
        arch: Arch::Gemma2,
        name: "gemma2",
        rope: RopeLayout::Halves,
        post_norms: true,
        activation: Activation::GeluTanh,
        embed_scale: true,
        window_layers: WindowLayers::AllButEvery(2),
        default_window: Some(4096),
        default_attn_softcap: Some(50.0),
        default_final_softcap: Some(30.0),
        always_tied: true,
        scale_by_hidden_at: &[46],
        ..BASE
    },
    Family {
        arch: Arch::Gemma3,
        name: "gemma3",
        rope: RopeLayout::Halves,
        qk_norm: true,
        post_norms: true,
        activation: Activation::GeluTanh,
        embed_scale: true,
        window_layers: WindowLayers::AllButEvery(6),
        window_rope_base: Some(10_000.0),
        scale_by_hidden_at: &[62],
        ..BASE
    },
];

impl Family {
    /// The family of a `general.architecture` value, or an error naming it and the ones
    /// the engine runs.
    pub fn of(arch: &str) -> Result<&'static Family, ModelError> {
        FAMILIES.iter().find(|f| f.name == arch).ok_or_else(|| {
            let known: Vec<&str> = FAMILIES.iter().map(|f| f.name).collect();
            ModelError::Unsupported(format!(
                "architecture `{arch}` (this engine runs {})",
                known.join(", ")
            ))
        })
    }

    /// The metadata key `{arch}.{suffix}`.
    pub fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.name)
    }

    /// Whether layer `il` (0-based) of `n_layer` attends over the sliding window.
    pub fn is_window_layer(&self, il: usize) -> bool {
        match self.window_layers {
            WindowLayers::None => false,
            WindowLayers::AllButEvery(n) => n > 0 && il % n < n - 1,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_family_is_found_by_its_name() {
        for f in FAMILIES {
            assert_eq!(Family::of(f.name).map(|g| g.arch).ok(), Some(f.arch));
        }
    }

    #[test]
    fn an_unknown_architecture_is_named_in_the_error() {
        let err = Family::of("mamba").err().map(|e| e.to_string());
        let msg = err.unwrap_or_default();
        assert!(msg.contains("`mamba`") && msg.contains("qwen3"), "{msg}");
    }

    #[test]
    fn gemma_window_layers_interleave_with_global_ones() {
        let g2 = Family::of("gemma2").ok().copied();
        let g2 = g2.map(|f| (0..4).map(|l| f.is_window_layer(l)).collect::<Vec<_>>());
        assert_eq!(g2, Some(vec![true, false, true, false]));
        let g3 = Family::of("gemma3").ok().copied();
        let g3 = g3.map(|f| {
            (0..7)
                .filter(|&l| !f.is_window_layer(l))
                .collect::<Vec<_>>()
        });
        assert_eq!(g3, Some(vec![5]));
    }
}
