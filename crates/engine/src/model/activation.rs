//! The gated feed-forward activations: `act(gate) · up` row by row.

use super::arch::Activation;
use super::par::for_rows;
use crate::sampler::fast_exp;

/// `act(gate) · up` over `gu: [rows, 2·ffn]` (each row: gate, then up).
pub fn gated(act: Activation, gu: &[f32], rows: usize, ffn: usize) -> Vec<f32> {
    let mut out = vec![0f32; rows * ffn];
    for_rows(&mut out, ffn, |t, o| {
        let (gate, up) = gu[t * 2 * ffn..(t + 1) * 2 * ffn].split_at(ffn);
        match act {
            Activation::Silu => {
                for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    *o = g / (1.0 + fast_exp(-g)) * u;
                }
            }
            Activation::GeluTanh => {
                for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                    *o = gelu_tanh(g) * u;
                }
            }
        }
    });
    out
}

/// GELU, tanh approximation: `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_tanh_known_values() {
        assert_eq!(gelu_tanh(0.0), 0.0);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert!((gelu_tanh(-3.0) + 0.003_637_4).abs() < 1e-5);
    }

    #[test]
    fn gated_multiplies_by_up() {
        let out = gated(Activation::GeluTanh, &[1.0, 2.0], 1, 1);
        assert!((out[0] - 2.0 * gelu_tanh(1.0)).abs() < 1e-6);
        let out = gated(Activation::Silu, &[0.0, 5.0], 1, 1);
        assert_eq!(out[0], 0.0);
    }
}
