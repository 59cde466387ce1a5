//! The encoder's self-attention: each input over its own tokens, one task per (input, head).
//!
//! A head is small (MiniLM: 32 channels, inputs of up to 512 tokens), so a dot product per
//! score spends as much on its horizontal sum and its call as on the multiplies. Instead,
//! each task gathers its head into tiles the vector units read straight through:
//! - the keys transposed (`[channel][token]`), so a score tile is [`QUERIES`] queries by
//!   [`LANES`] keys, accumulated in registers over the channels;
//! - the values as rows (`[token][channel]`), so a context tile is [`QUERIES`] queries by
//!   [`LANES`] channels, accumulated over the keys.
//!
//! Token and channel counts are padded with zeros to whole tiles: a zero channel adds
//! nothing to a score, and the scores of padding keys are never read. The softmax is
//! normalised once per query at the end (a multiply by `1 / Σ`), not per key.

use rayon::prelude::*;

use crate::attention::exp;

/// Floats in one vector tile: a 256-bit register of f32.
const LANES: usize = 8;
/// Queries (rows of scores and of context) computed together per tile.
const QUERIES: usize = 4;

/// One projection's rows inside a buffer: token `i`'s vector is
/// `data[i·stride + offset..][..hidden]`.
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
}

impl<'a> Rows<'a> {
    fn at(&self, token: usize, from: usize, len: usize) -> &'a [f32] {
        &self.data[token * self.stride + self.offset + from..][..len]
    }
}

/// Self-attention of each input over its own tokens.
///
/// `qkv` are the query, key and value rows, `hidden` wide each; `spans` the `(first row,
/// length)` of each input. The result is the context, `hidden` wide, heads side by side,
/// in token order.
pub fn attention(
    qkv: [Rows; 3],
    spans: &[(usize, usize)],
    hidden: usize,
    heads: usize,
) -> Vec<f32> {
    let d = hidden / heads;
    let tasks: Vec<(usize, usize, usize)> = spans
        .iter()
        .flat_map(|&(start, n)| (0..heads).map(move |head| (start, n, head)))
        .collect();
    let parts: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(start, n, head)| Head::gather(qkv, start, n, head * d, d).context())
        .collect();
    let total: usize = spans.iter().map(|s| s.1).sum();
    let mut out = vec![0f32; total * hidden];
    let dp = pad(d, LANES);
    for (&(start, n, head), part) in tasks.iter().zip(&parts) {
        for i in 0..n {
            out[(start + i) * hidden + head * d..][..d].copy_from_slice(&part[i * dp..][..d]);
        }
    }
    out
}

fn pad(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// One head of one input, gathered into padded tiles.
struct Head {
    /// Tokens.
    n: usize,
    /// Tokens, padded to whole key tiles.
    np: usize,
    /// Channels, padded to whole lanes.
    dp: usize,
    /// `[query (padded to whole query tiles)][dp]`, scaled by `1/√d`.
    queries: Vec<f32>,
    /// `[dp][np]`: the keys transposed.
    keys_t: Vec<f32>,
    /// `[np][dp]`.
    values: Vec<f32>,
}

impl Head {
    fn gather(qkv: [Rows; 3], start: usize, n: usize, from: usize, d: usize) -> Self {
        let [q_rows, k_rows, v_rows] = qkv;
        let (np, dp) = (pad(n, LANES), pad(d, LANES));
        let nq = pad(n, QUERIES);
        let scale = 1.0 / (d as f32).sqrt();
        let mut queries = vec![0f32; nq * dp];
        let mut keys_t = vec![0f32; dp * np];
        let mut values = vec![0f32; np * dp];
        for j in 0..n {
            let q = q_rows.at(start + j, from, d);
            for (o, x) in queries[j * dp..][..d].iter_mut().zip(q) {
                *o = x * scale;
            }
            for (c, &k) in k_rows.at(start + j, from, d).iter().enumerate() {
                keys_t[c * np + j] = k;
            }
            values[j * dp..][..d].copy_from_slice(v_rows.at(start + j, from, d));
        }
        Self {
            n,
            np,
            dp,
            queries,
            keys_t,
            values,
        }
    }

    /// The context rows `[n][dp]`: softmax(q·kᵀ) · v for every query.
    fn context(&self) -> Vec<f32> {
        let (n, np, dp) = (self.n, self.np, self.dp);
        let mut ctx = vec![0f32; pad(n, QUERIES) * dp];
        let mut scores = vec![0f32; QUERIES * np];
        for (qt, out) in ctx.chunks_exact_mut(QUERIES * dp).enumerate() {
            let q = &self.queries[qt * QUERIES * dp..][..QUERIES * dp];
            self.scores(q, &mut scores);
            let mut inv = [0f32; QUERIES];
            for (row, inv) in scores.chunks_exact_mut(np).zip(&mut inv) {
                *inv = softmax_unnormalised(&mut row[..n]);
            }
            self.weigh_values(&scores, out);
            for (row, inv) in out.chunks_exact_mut(dp).zip(inv) {
                row.iter_mut().for_each(|v| *v *= inv);
            }
        }
        ctx.truncate(n * dp);
        ctx
    }

    /// `scores[qi][j] = q[qi] · k[j]` for the tile's queries and every (padded) key.
    fn scores(&self, q: &[f32], scores: &mut [f32]) {
        let (np, dp) = (self.np, self.dp);
        for jt in (0..np).step_by(LANES) {
            let mut acc = [[0f32; LANES]; QUERIES];
            for c in 0..dp {
                let k: &[f32; LANES] = tile(&self.keys_t[c * np + jt..]);
                for (qi, acc) in acc.iter_mut().enumerate() {
                    let x = q[qi * dp + c];
                    for (a, k) in acc.iter_mut().zip(k) {
                        *a = x.mul_add(*k, *a);
                    }
                }
            }
            for (qi, acc) in acc.iter().enumerate() {
                scores[qi * np + jt..][..LANES].copy_from_slice(acc);
            }
        }
    }

    /// `out[qi] = Σ_j p[qi][j] · v[j]` over the real keys (`p`: unnormalised weights).
    fn weigh_values(&self, p: &[f32], out: &mut [f32]) {
        let (n, np, dp) = (self.n, self.np, self.dp);
        for ct in (0..dp).step_by(LANES) {
            let mut acc = [[0f32; LANES]; QUERIES];
            for j in 0..n {
                let v: &[f32; LANES] = tile(&self.values[j * dp + ct..]);
                for (qi, acc) in acc.iter_mut().enumerate() {
                    let w = p[qi * np + j];
                    for (a, v) in acc.iter_mut().zip(v) {
                        *a = w.mul_add(*v, *a);
                    }
                }
            }
            for (qi, acc) in acc.iter().enumerate() {
                out[qi * dp + ct..][..LANES].copy_from_slice(acc);
            }
        }
    }
}

/// The first [`LANES`] floats of `xs` as one tile.
#[inline(always)]
fn tile(xs: &[f32]) -> &[f32; LANES] {
    // Callers index whole tiles of padded buffers, so the slice is always long enough.
    match xs.first_chunk::<LANES>() {
        Some(t) => t,
        None => unreachable!("tiles are padded"),
    }
}

/// `row[j] = exp(row[j] - max)`; returns `1 / Σ row`.
fn softmax_unnormalised(row: &mut [f32]) -> f32 {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
    // The engine's vectorizing exp (≤ 2 ulp on softmax arguments): libm's scalar expf was
    // most of the attention time on long inputs.
    row.iter_mut().for_each(|s| *s = exp(*s - max));
    1.0 / row.iter().sum::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The textbook form: a dot product per score, a division per weight.
    fn reference(
        qkv: [Rows; 3],
        spans: &[(usize, usize)],
        hidden: usize,
        heads: usize,
    ) -> Vec<f32> {
        let [q, k, v] = qkv;
        let d = hidden / heads;
        let total: usize = spans.iter().map(|s| s.1).sum();
        let mut out = vec![0f32; total * hidden];
        for &(start, n) in spans {
            for h in 0..heads {
                for i in 0..n {
                    let qi = q.at(start + i, h * d, d);
                    let s: Vec<f64> = (0..n)
                        .map(|j| {
                            let kj = k.at(start + j, h * d, d);
                            qi.iter().zip(kj).map(|(a, b)| (a * b) as f64).sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for c in 0..d {
                        let val: f64 = (0..n)
                            .map(|j| e[j] / sum * v.at(start + j, h * d, d)[c] as f64)
                            .sum();
                        out[(start + i) * hidden + h * d + c] = val as f32;
                    }
                }
            }
        }
        out
    }

    fn pseudo_random(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    }

    #[test]
    fn tiles_equal_the_textbook_form_at_every_padding() {
        // Head widths and input lengths that fill tiles exactly and that leave remainders
        // of keys, queries and channels; a fused [q | k | v] buffer and separate ones.
        for (hidden, heads) in [(64, 2), (36, 3), (40, 8)] {
            let spans = [(0, 1), (1, 8), (9, 13), (22, 3)];
            let rows = 25;
            let fused = pseudo_random(rows * 3 * hidden, hidden as u64);
            let part = |offset| Rows {
                data: &fused,
                stride: 3 * hidden,
                offset,
            };
            let qkv = [part(0), part(hidden), part(2 * hidden)];
            let got = attention(qkv, &spans, hidden, heads);
            let want = reference(qkv, &spans, hidden, heads);
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                    "hidden {hidden} heads {heads} at {i}: {g} vs {w}"
                );
            }
        }
    }

    #[test]
    fn an_input_attends_to_itself_alone() {
        let (hidden, heads) = (16, 2);
        let data = pseudo_random(10 * 3 * hidden, 7);
        let part = |offset| Rows {
            data: &data,
            stride: 3 * hidden,
            offset,
        };
        let qkv = [part(0), part(hidden), part(2 * hidden)];
        let together = attention(qkv, &[(0, 4), (4, 6)], hidden, heads);
        let first = attention(qkv, &[(0, 4)], hidden, heads);
        assert_eq!(&together[..4 * hidden], &first[..]);
    }
}
