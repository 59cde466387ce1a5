//! The f32 panel path at 512 bits, giving the same bits as the 256-bit one: each 16-lane
//! accumulator holds the 8-lane accumulators of two weight rows side by side (the panel
//! interleaves the rows of each pair eight floats at a time), and an activation row's
//! eight floats are broadcast to both halves. Every lane therefore sees the same FMAs in
//! the same order as on the AVX2 path, and the two halves are summed with its horizontal
//! sum, so a row's result is the same on either path, alone or in a batch, and the
//! few-rows path (AVX2) stays its exact twin. What the width buys is half the
//! instructions per FMA and, with 32 registers, a 6 × 8 tile (24 accumulators) that loads
//! each weight and activation vector once per six or eight FMAs instead of once per three
//! or four.

use super::avx2::{hsum, Expand, Q4_0, Q4_1, Q8_0};
use super::{BlockType, BLOCK};
use std::arch::x86_64::*;

/// Activation rows per tile.
const MR: usize = 6;
/// Pairs of weight rows per tile.
const NP: usize = 4;

/// As [`super::avx2::panel_chunk`]; the panel holds `rows` rounded up to pairs (a
/// missing last row is zeros and its outputs are not stored).
///
/// # Safety
/// AVX-512F, AVX2, FMA and F16C; shapes as [`super::avx2::decode_chunk`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn panel_chunk(
    kind: BlockType,
    data: &[u8],
    rows: usize,
    x: &[f32],
    m: usize,
    k: usize,
    panel: &mut Vec<f32>,
    y: *mut f32,
    ldy: usize,
) {
    let pairs = rows.div_ceil(2);
    panel.clear();
    // Zeroed, so that the padding row of an odd chunk multiplies to nothing.
    panel.resize(pairs * 2 * k, 0.0);
    let (w, p) = (data.as_ptr(), panel.as_mut_ptr());
    match kind {
        BlockType::Q4_0 => expand_pairs::<Q4_0>(w, rows, k, p),
        BlockType::Q4_1 => expand_pairs::<Q4_1>(w, rows, k, p),
        BlockType::Q8_0 => expand_pairs::<Q8_0>(w, rows, k, p),
    }
    panel_gemm(x.as_ptr(), m, k, panel.as_ptr(), rows, y, ldy);
}

/// Row `r` goes to pair `r / 2`, half `r % 2`: its floats `8c..8c + 8` at
/// `(pair · k + 8c) · 2 + 8 · half`.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn expand_pairs<E: Expand>(w: *const u8, rows: usize, k: usize, p: *mut f32) {
    let nb = k / BLOCK;
    for r in 0..rows {
        let base = p.add((r / 2) * 2 * k + 8 * (r % 2));
        for b in 0..nb {
            let v = E::expand(w.add((r * nb + b) * E::BYTES));
            for (c, vc) in v.iter().enumerate() {
                _mm256_storeu_ps(base.add((b * BLOCK + 8 * c) * 2), *vc);
            }
        }
    }
}

#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn panel_gemm(
    x: *const f32,
    m: usize,
    k: usize,
    p: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
) {
    let pairs = rows.div_ceil(2);
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(MR);
        let xp = x.add(i * k);
        let mut j = 0;
        while j < pairs {
            let np = (pairs - j).min(NP);
            let (wp, yp) = (p.add(j * 2 * k), y.add(i * ldy + 2 * j));
            // Outputs this tile may store: two per pair, one fewer for a padding row.
            let cols = (rows - 2 * j).min(2 * np);
            macro_rules! tiles {
                ($($a:literal, $b:literal);*) => {
                    match (mr, np) {
                        $(($a, $b) => tile::<$a, $b>(xp, wp, k, yp, ldy, cols),)*
                        _ => unreachable!("tile shapes cover 1..=MR × 1..=NP"),
                    }
                };
            }
            tiles!(6, 4; 6, 3; 6, 2; 6, 1; 5, 4; 5, 3; 5, 2; 5, 1; 4, 4; 4, 3; 4, 2; 4, 1;
                   3, 4; 3, 3; 3, 2; 3, 1; 2, 4; 2, 3; 2, 2; 2, 1; 1, 4; 1, 3; 1, 2; 1, 1);
            j += np;
        }
        i += mr;
    }
}

/// `M` activation rows × `N` pairs of weight rows; stores the first `cols` of the
/// tile's `2N` outputs per row.
#[inline(always)]
unsafe fn tile<const M: usize, const N: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    y: *mut f32,
    ldy: usize,
    cols: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); N]; M];
    let mut kk = 0;
    while kk < k {
        let mut wv = [_mm512_setzero_ps(); N];
        for (j, v) in wv.iter_mut().enumerate() {
            *v = _mm512_loadu_ps(w.add(j * 2 * k + 2 * kk));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            // Eight floats in both halves (the 256-bit broadcast of AVX-512F, as f64).
            let x8 = _mm256_loadu_pd(x.add(i * k + kk) as *const f64);
            let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(x8));
            for (a, wj) in row.iter_mut().zip(&wv) {
                *a = _mm512_fmadd_ps(*wj, xv, *a);
            }
        }
        kk += 8;
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            let lo = _mm512_castps512_ps256(*a);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
            let at = y.add(i * ldy + 2 * j);
            if 2 * j < cols {
                *at = hsum(lo);
            }
            if 2 * j + 1 < cols {
                *at.add(1) = hsum(hi);
            }
        }
    }
}
