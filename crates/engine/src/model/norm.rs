//! RMSNorm over rows: the pre-norms of every family, Gemma's post-norms, and Qwen 3's and
//! Gemma 3's per-head query/key norms (rows of one head).
//!
//! Gemma's `(1 + w)` scaling needs no case here: llama.cpp's GGUF converter stores Gemma
//! norm weights with the 1 already added, so every family multiplies by the stored weight.

use super::par::for_rows;

/// RMSNorm over rows of `weight.len()`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, weight, eps);
    out
}

/// [`rms_norm`] in place.
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for_rows(x, n, |_, row| {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / n as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *v * inv * w;
        }
    });
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
}
