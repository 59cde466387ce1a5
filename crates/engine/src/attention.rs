//! Causal attention over the paged KV cache for a ragged batch.
//!
//! One task per (token, KV head): the query heads that share the KV head (grouped-query
//! attention) are scored together, so each cached key and value is read once per group
//! rather than once per query head. Keys are walked block by block through the
//! sequence's block table (no per-position division). Softmax uses a vectorizable `exp`.
//!
//! A token's output depends only on its own query, its position and its sequence's cached
//! keys and values: never on which other tokens share the step, so batching does not change
//! results.

use rayon::prelude::*;

/// The shapes attention needs.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub block_size: usize,
}

/// One token of the step: where it is and which blocks hold its sequence.
#[derive(Debug, Clone, Copy)]
pub struct TokenCtx<'a> {
    pub pos: usize,
    pub block_table: &'a [u32],
}

/// `out[t]` (all heads, `n_head × head_dim`) = softmax(q·Kᵀ / √d)·V over positions
/// `0..=pos` of token `t`'s sequence. `q` is `[tokens, n_head × head_dim]`; `keys` and
/// `values` are one layer of the cache (`slot × n_kv_head × head_dim`), already holding this
/// step's keys and values. The block tables must cover every position (the caller checked).
pub fn attend(
    shape: AttnShape,
    q: &[f32],
    keys: &[f32],
    values: &[f32],
    tokens: &[TokenCtx<'_>],
    out: &mut [f32],
) {
    let AttnShape {
        n_head,
        n_kv_head,
        head_dim: hd,
        block_size,
    } = shape;
    let group = n_head / n_kv_head;
    let width = n_head * hd;
    let kv_dim = n_kv_head * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    debug_assert_eq!(out.len(), tokens.len() * width);
    out.par_chunks_mut(group * hd).enumerate().for_each_init(
        || (Vec::new(), Vec::new()),
        |(scores, inv): &mut (Vec<f32>, Vec<f32>), (idx, out)| {
            let (t, kvh) = (idx / n_kv_head, idx % n_kv_head);
            let TokenCtx { pos, block_table } = tokens[t];
            let n_ctx = pos + 1;
            let q = &q[t * width + kvh * group * hd..t * width + (kvh + 1) * group * hd];
            scores.clear();
            scores.resize(group * n_ctx, 0.0);
            // Scores, one row of `n_ctx` per query head of the group.
            for_each_slot(block_table, block_size, n_ctx, |j, slot| {
                let off = slot * kv_dim + kvh * hd;
                let k = &keys[off..off + hd];
                for (g, qh) in q.chunks_exact(hd).enumerate() {
                    scores[g * n_ctx + j] = dot(qh, k) * scale;
                }
            });
            inv.clear();
            for row in scores.chunks_exact_mut(n_ctx) {
                let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
                let mut sum = 0.0;
                for s in row.iter_mut() {
                    *s = exp(*s - max);
                }
                for s in row.iter() {
                    sum += *s;
                }
                inv.push(1.0 / sum);
            }
            out.fill(0.0);
            for_each_slot(block_table, block_size, n_ctx, |j, slot| {
                let off = slot * kv_dim + kvh * hd;
                let v = &values[off..off + hd];
                for (g, (o, inv)) in out.chunks_exact_mut(hd).zip(inv.iter()).enumerate() {
                    axpy(scores[g * n_ctx + j] * inv, v, o);
                }
            });
        },
    );
}

/// Calls `f(position, slot)` for positions `0..n_ctx` in order, block by block.
#[inline]
fn for_each_slot(table: &[u32], block_size: usize, n_ctx: usize, mut f: impl FnMut(usize, usize)) {
    let mut j = 0;
    for &block in table {
        if j >= n_ctx {
            break;
        }
        let base = block as usize * block_size;
        let len = block_size.min(n_ctx - j);
        for o in 0..len {
            f(j + o, base + o);
        }
        j += len;
    }
}

/// Dot product with eight independent accumulators so the compiler vectorizes it.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    // A pairwise tree: shorter dependency chain than a running sum.
    let s = [
        acc[0] + acc[4],
        acc[1] + acc[5],
        acc[2] + acc[6],
        acc[3] + acc[7],
    ];
    ((s[0] + s[2]) + (s[1] + s[3])) + tail
}

#[inline]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += alpha * v;
    }
}

/// `eˣ` for `x ≤ 0` (softmax arguments), within 2 ulp of the exact value; 0 below −87.3.
/// Branch-free arithmetic, so a loop over a slice vectorizes.
#[inline]
pub fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split in two so that `n · LN2_HI` is exact.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Round to nearest by adding and subtracting 1.5 · 2²³.
    const ROUND: f32 = 12_582_912.0;
    let x = x.max(-87.3);
    let n = (x * LOG2E + ROUND) - ROUND;
    let r = x - n * LN2_HI - n * LN2_LO;
    // Minimax polynomial for eʳ on |r| ≤ ln2/2.
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    // 2ⁿ from the exponent bits (n ≥ −126 here).
    e * f32::from_bits(((n as i32 + 127) << 23) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_on_the_softmax_range() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let got = exp(x) as f64;
            let ulp = (want as f32).abs() as f64 * f32::EPSILON as f64;
            worst = worst.max((got - want).abs() / ulp.max(f64::MIN_POSITIVE));
            x += 0.000_37;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-1000.0), exp(-87.3));
        assert!(exp(-87.3) > 0.0 && exp(-87.3) < 1e-37);
    }

    /// Straightforward attention, one head at a time, with `f64` softmax.
    fn reference(shape: AttnShape, q: &[f32], k: &[f32], v: &[f32], toks: &[TokenCtx]) -> Vec<f32> {
        let (hd, nh, nkv) = (shape.head_dim, shape.n_head, shape.n_kv_head);
        let kv_dim = nkv * hd;
        let mut out = vec![0f32; toks.len() * nh * hd];
        for (t, tok) in toks.iter().enumerate() {
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let qh = &q[t * nh * hd + h * hd..][..hd];
                let slot = |j: usize| {
                    tok.block_table[j / shape.block_size] as usize * shape.block_size
                        + j % shape.block_size
                };
                let s: Vec<f64> = (0..=tok.pos)
                    .map(|j| {
                        let kk = &k[slot(j) * kv_dim + kvh * hd..][..hd];
                        qh.iter()
                            .zip(kk)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (j, p) in e.iter().enumerate() {
                    let vv = &v[slot(j) * kv_dim + kvh * hd..][..hd];
                    for d in 0..hd {
                        out[t * nh * hd + h * hd + d] += (p / sum * vv[d] as f64) as f32;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn matches_reference_over_scattered_blocks_and_is_batch_invariant() {
        for head_dim in [16, 64] {
            check_against_reference(head_dim);
        }
    }

    fn check_against_reference(head_dim: usize) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let shape = AttnShape {
            n_head: 6,
            n_kv_head: 2,
            head_dim,
            block_size: 4,
        };
        let slots = 16 * shape.block_size;
        let kv_dim = shape.n_kv_head * shape.head_dim;
        let k: Vec<f32> = (0..slots * kv_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let v: Vec<f32> = (0..slots * kv_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        // Two sequences with scattered, interleaved blocks.
        let table_a = [7u32, 2, 11, 5, 0];
        let table_b = [3u32, 9, 14];
        let mut toks = Vec::new();
        for pos in [0, 3, 4, 17, 19] {
            toks.push(TokenCtx {
                pos,
                block_table: &table_a,
            });
        }
        for pos in [5, 11] {
            toks.push(TokenCtx {
                pos,
                block_table: &table_b,
            });
        }
        let width = shape.n_head * shape.head_dim;
        let q: Vec<f32> = (0..toks.len() * width)
            .map(|_| rng.random_range(-2.0..2.0))
            .collect();
        let mut out = vec![0f32; toks.len() * width];
        attend(shape, &q, &k, &v, &toks, &mut out);
        let want = reference(shape, &q, &k, &v, &toks);
        for (g, w) in out.iter().zip(&want) {
            assert!((g - w).abs() < 1e-5, "{g} vs {w}");
        }
        // Each token alone gives bit-identical output.
        for (t, tok) in toks.iter().enumerate() {
            let mut alone = vec![0f32; width];
            attend(
                shape,
                &q[t * width..(t + 1) * width],
                &k,
                &v,
                &[*tok],
                &mut alone,
            );
            for (a, b) in alone.iter().zip(&out[t * width..(t + 1) * width]) {
                assert_eq!(a.to_bits(), b.to_bits());
            }
        }
    }
}
