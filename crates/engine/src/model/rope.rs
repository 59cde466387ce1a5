//! Rotary position embeddings: the per-pair frequencies a family's scaling gives (none,
//! linear, YaRN, llama 3's frequency factors) and their rotation of query and key heads.
//!
//! A step computes the cosines and sines of its own positions once per table
//! ([`Rope::rows`]) rather than holding a table for the whole context.

use super::arch::RopeLayout;
use super::par::for_rows;

/// How positions are stretched beyond the trained context (`{arch}.rope.scaling.*`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN: low frequencies interpolated, high ones kept, blended over the dimensions
    /// between the correction bounds; cosines and sines scaled by `attn_factor ·
    /// (1 + 0.1 ln factor)`.
    Yarn {
        factor: f32,
        orig_ctx: usize,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    },
}

/// One RoPE table's parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub base: f32,
    pub scaling: RopeScaling,
    /// Per-pair divisors of the frequency (`rope_freqs.weight`, llama 3 scaling).
    pub freq_factors: Option<Vec<f32>>,
}

/// A head's rotation: effective frequency per pair and the magnitude scale.
#[derive(Debug, Clone)]
pub struct Rope {
    layout: RopeLayout,
    head_dim: usize,
    freqs: Vec<f32>,
    mscale: f32,
}

/// Cosines and sines of a step's positions, `[tokens, head_dim / 2]` each.
pub struct RopeRows {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(cfg: &RopeConfig, head_dim: usize, layout: RopeLayout) -> Self {
        let half = head_dim / 2;
        let (freq_scale, ext) = match cfg.scaling {
            RopeScaling::None => (1.0, None),
            RopeScaling::Linear { factor } => (1.0 / factor, None),
            RopeScaling::Yarn { factor, .. } => (1.0 / factor, Some(())),
        };
        let corr = match cfg.scaling {
            RopeScaling::Yarn {
                orig_ctx,
                beta_fast,
                beta_slow,
                ..
            } => yarn_corr_dims(head_dim, orig_ctx, cfg.base, beta_fast, beta_slow),
            _ => [0.0, 0.0],
        };
        let freqs = (0..half)
            .map(|i| {
                let ff = cfg
                    .freq_factors
                    .as_ref()
                    .and_then(|f| f.get(i))
                    .copied()
                    .unwrap_or(1.0);
                let extrap = 1.0 / cfg.base.powf((2 * i) as f32 / head_dim as f32) / ff;
                match ext {
                    None => extrap * freq_scale,
                    Some(()) => {
                        let mix = yarn_ramp(corr[0], corr[1], i);
                        extrap * (freq_scale * (1.0 - mix) + mix)
                    }
                }
            })
            .collect();
        let mscale = match cfg.scaling {
            RopeScaling::Yarn { attn_factor, .. } => {
                attn_factor * (1.0 + 0.1 * (1.0 / freq_scale).ln())
            }
            _ => 1.0,
        };
        Self {
            layout,
            head_dim,
            freqs,
            mscale,
        }
    }

    /// The cosines and sines of `positions`.
    pub fn rows(&self, positions: &[usize]) -> RopeRows {
        let half = self.freqs.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &pos in positions {
            for &f in &self.freqs {
                let a = pos as f32 * f;
                cos.push(a.cos() * self.mscale);
                sin.push(a.sin() * self.mscale);
            }
        }
        RopeRows { cos, sin }
    }

    /// Rotates every head of `x: [tokens, n_heads × head_dim]` by its token's angles.
    pub fn apply(&self, rows: &RopeRows, x: &mut [f32], n_heads: usize) {
        let hd = self.head_dim;
        let half = hd / 2;
        let layout = self.layout;
        for_rows(x, n_heads * hd, |t, row| {
            let cos = &rows.cos[t * half..(t + 1) * half];
            let sin = &rows.sin[t * half..(t + 1) * half];
            for head in row.chunks_exact_mut(hd) {
                match layout {
                    RopeLayout::Interleaved => {
                        for i in 0..half {
                            let (a, b) = (head[2 * i], head[2 * i + 1]);
                            head[2 * i] = a * cos[i] - b * sin[i];
                            head[2 * i + 1] = a * sin[i] + b * cos[i];
                        }
                    }
                    RopeLayout::Halves => {
                        let (lo, hi) = head.split_at_mut(half);
                        for i in 0..half {
                            let (a, b) = (lo[i], hi[i]);
                            lo[i] = a * cos[i] - b * sin[i];
                            hi[i] = a * sin[i] + b * cos[i];
                        }
                    }
                }
            }
        });
    }
}

/// The dimension at which a wavelength spans `n_rot` turns over the original context.
fn yarn_corr_dim(n_dims: usize, orig_ctx: usize, n_rot: f32, base: f32) -> f32 {
    n_dims as f32 * (orig_ctx as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

/// The pair range over which YaRN blends interpolated and kept frequencies.
fn yarn_corr_dims(
    n_dims: usize,
    orig_ctx: usize,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let start = yarn_corr_dim(n_dims, orig_ctx, beta_fast, base).floor();
    let end = yarn_corr_dim(n_dims, orig_ctx, beta_slow, base).ceil();
    [start.max(0.0), end.min(n_dims as f32 - 1.0)]
}

/// 1 below the range (frequency kept), 0 above it (interpolated), linear between.
fn yarn_ramp(low: f32, high: f32, pair: usize) -> f32 {
    let y = (pair as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(scaling: RopeScaling) -> RopeConfig {
        RopeConfig {
            base: 10_000.0,
            scaling,
            freq_factors: None,
        }
    }

    #[test]
    fn linear_scaling_divides_positions() {
        let plain = Rope::new(&cfg(RopeScaling::None), 8, RopeLayout::Halves);
        let lin = Rope::new(
            &cfg(RopeScaling::Linear { factor: 4.0 }),
            8,
            RopeLayout::Halves,
        );
        let (a, b) = (plain.rows(&[3]), lin.rows(&[12]));
        for (x, y) in a.cos.iter().zip(&b.cos) {
            assert!((x - y).abs() < 1e-5);
        }
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_interpolates_low_ones() {
        let yarn = Rope::new(
            &cfg(RopeScaling::Yarn {
                factor: 4.0,
                orig_ctx: 256,
                attn_factor: 1.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
            }),
            64,
            RopeLayout::Halves,
        );
        let plain = Rope::new(&cfg(RopeScaling::None), 64, RopeLayout::Halves);
        assert_eq!(yarn.freqs[0], plain.freqs[0]);
        let last = plain.freqs.len() - 1;
        assert!((yarn.freqs[last] - plain.freqs[last] / 4.0).abs() < 1e-9);
        assert!((yarn.mscale - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-6);
    }

    #[test]
    fn freq_factors_divide_each_pair() {
        let mut c = cfg(RopeScaling::None);
        c.freq_factors = Some(vec![1.0, 2.0, 8.0, 1.0]);
        let r = Rope::new(&c, 8, RopeLayout::Interleaved);
        let p = Rope::new(&cfg(RopeScaling::None), 8, RopeLayout::Interleaved);
        assert!((r.freqs[2] - p.freqs[2] / 8.0).abs() < 1e-9);
    }

    #[test]
    fn layouts_rotate_their_own_pairs() {
        let r = Rope::new(&cfg(RopeScaling::None), 4, RopeLayout::Halves);
        let rows = r.rows(&[1]);
        let mut x = vec![1.0, 0.0, 0.0, 0.0];
        r.apply(&rows, &mut x, 1);
        // Pair 0 is (x[0], x[2]) for the halves layout.
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[2] - 1f32.sin()).abs() < 1e-6);
        assert_eq!(x[1], 0.0);
        let r = Rope::new(&cfg(RopeScaling::None), 4, RopeLayout::Interleaved);
        let mut y = vec![1.0, 0.0, 0.0, 0.0];
        r.apply(&rows, &mut y, 1);
        assert!((y[1] - 1f32.sin()).abs() < 1e-6 && y[2] == 0.0);
    }
}
