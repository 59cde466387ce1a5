//! `q·k` in integers for int8 keys.
//!
//! A task's query rows are rounded once to 16-bit codes, each row with its own scale
//! (`max |q| / 32767`), and every score is an exact integer sum of code × key code, turned
//! into a float by one multiply (the row's scale times the attention scale; the key's own
//! scale follows, as for every 8-bit cache). Integer sums do not depend on the order they
//! are taken in, so every path (portable, AVX2 `vpmaddwd`, AVX-VNNI and AVX-512 VNNI
//! `vpdpwssd`) gives the same bits, and a 16-bit query keeps about 2⁻¹⁶ of its largest
//! entry where the key itself keeps 2⁻⁸.
//!
//! With AVX2 a 16-element step costs one widening of 16 key bytes and one multiply-add
//! per query row (plus an add without VNNI), where the float path widened eight bytes
//! twice (to 32-bit integers, then to floats) and spent one FMA per row for eight.

/// The longest head the integer sums cannot overflow for: `512 · 32767 · 127 < 2³¹`.
pub(super) const MAX_HEAD_DIM: usize = 512;

/// Rounds each `hd`-long row of `q` to 16-bit codes: `codes[r][d] · scales[r] ≈ q[r][d]`.
/// A row of zeros gets a zero scale.
pub(super) fn quantize_rows(q: &[f32], hd: usize, codes: &mut Vec<i16>, scales: &mut Vec<f32>) {
    codes.clear();
    scales.clear();
    for row in q.chunks_exact(hd) {
        let max = row.iter().fold(0f32, |m, x| m.max(x.abs()));
        let scale = max / 32767.0;
        let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        codes.extend(row.iter().map(|x| (x * inv).round() as i16));
        scales.push(scale);
    }
}

/// `Σ q[d] · k[d]`, exact (see [`MAX_HEAD_DIM`]).
#[inline]
pub(super) fn dot(q: &[i16], k: &[i8]) -> i32 {
    q.iter().zip(k).map(|(&a, &b)| a as i32 * b as i32).sum()
}

/// `scores[r][j] = (q_r · k_j) · factors[r]` for every row of `q` (`hd` codes apart) and
/// every position `j` (its key at `keys[offs[j]..]`), on `path`'s instructions.
///
/// # Safety
/// `path` is supported by this CPU and at least AVX2; `hd` is a multiple of 16 and at most
/// [`MAX_HEAD_DIM`]; `q` holds `factors.len() · hd` codes; `offs[j] + hd` is within the keys
/// for every `j`; `scores` has room for `factors.len()` rows of `offs.len()`.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn score_rows(
    path: crate::kernels::KernelPath,
    q: *const i16,
    hd: usize,
    keys: *const i8,
    offs: &[usize],
    factors: &[f32],
    scores: *mut f32,
) {
    use crate::kernels::KernelPath;
    let mut g = 0;
    while g < factors.len() {
        let r = (factors.len() - g).min(x86::ROWS);
        let rows = x86::Rows {
            q: q.add(g * hd),
            hd,
            keys,
            offs,
            factors: &factors[g..g + r],
            scores: scores.add(g * offs.len()),
        };
        match path {
            KernelPath::Avx512Vnni => x86::rows_avx512_vnni(rows),
            KernelPath::AvxVnni => x86::rows_avx_vnni(rows),
            _ => x86::rows_avx2(rows),
        }
        g += r;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::super::tile4::{four_keys, prefetch_ahead, store_four};
    use std::arch::x86_64::*;

    /// Query rows scored together: three rows × four keys of accumulators, the three
    /// rows' codes and one key fit AVX2's sixteen registers.
    pub const ROWS: usize = 3;

    /// Up to [`ROWS`] query rows and where their scores go.
    pub struct Rows<'a> {
        pub q: *const i16,
        pub hd: usize,
        pub keys: *const i8,
        pub offs: &'a [usize],
        pub factors: &'a [f32],
        pub scores: *mut f32,
    }

    /// `acc + Σ` of adjacent pairs of 16-bit products, in 32-bit lanes.
    trait PairDot {
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    }
    struct Madd;
    struct VnniAvx;
    struct Vnni512;
    impl PairDot for Madd {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
        }
    }
    impl PairDot for VnniAvx {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_dpwssd_avx_epi32(acc, a, b)
        }
    }
    impl PairDot for Vnni512 {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_dpwssd_epi32(acc, a, b)
        }
    }

    /// # Safety
    /// AVX2; as [`super::score_rows`].
    #[target_feature(enable = "avx2")]
    pub unsafe fn rows_avx2(rows: Rows<'_>) {
        by_count::<Madd>(rows)
    }

    /// # Safety
    /// AVX2 and AVX-VNNI; as [`super::score_rows`].
    #[target_feature(enable = "avx2,avxvnni")]
    pub unsafe fn rows_avx_vnni(rows: Rows<'_>) {
        by_count::<VnniAvx>(rows)
    }

    /// # Safety
    /// AVX2, AVX-512VL and AVX-512 VNNI; as [`super::score_rows`].
    #[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
    pub unsafe fn rows_avx512_vnni(rows: Rows<'_>) {
        by_count::<Vnni512>(rows)
    }

    #[inline(always)]
    unsafe fn by_count<D: PairDot>(rows: Rows<'_>) {
        match rows.factors.len() {
            3 => tile::<D, 3>(rows),
            2 => tile::<D, 2>(rows),
            _ => tile::<D, 1>(rows),
        }
    }

    /// Four 8-lane sums reduced to four totals, lane `i` the total of `a[i]`.
    #[inline(always)]
    unsafe fn reduce4(a: [__m256i; 4]) -> __m128i {
        let t = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
        _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1))
    }

    /// `R` rows against keys four at a time (a short last group repeats its last key).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indices name tile coordinates
    unsafe fn tile<D: PairDot, const R: usize>(rows: Rows<'_>) {
        let Rows {
            q,
            hd,
            keys,
            offs,
            factors,
            scores,
        } = rows;
        let n_ctx = offs.len();
        let mut factor = [_mm_setzero_ps(); R];
        for r in 0..R {
            factor[r] = _mm_set1_ps(factors[r]);
        }
        let mut j = 0;
        while j < n_ctx {
            for kk in 0..4 {
                prefetch_ahead(keys, offs, j + kk, hd);
            }
            let k = four_keys(keys, offs, j);
            let mut acc = [[_mm256_setzero_si256(); 4]; R];
            let mut d = 0;
            while d < hd {
                let mut qv = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    qv[r] = _mm256_loadu_si256(q.add(r * hd + d) as *const __m256i);
                }
                for kk in 0..4 {
                    let kv = _mm256_cvtepi8_epi16(_mm_loadu_si128(k[kk].add(d) as *const __m128i));
                    for r in 0..R {
                        acc[r][kk] = D::dot(acc[r][kk], qv[r], kv);
                    }
                }
                d += 16;
            }
            for r in 0..R {
                let sums = _mm_cvtepi32_ps(reduce4(acc[r]));
                store_four(_mm_mul_ps(sums, factor[r]), scores.add(r * n_ctx), j, n_ctx);
            }
            j += 4;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_to_their_own_scale_and_zero_rows_stay_zero() {
        let q = [
            1.0, -0.5, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, -3.0, 3.0, 1.5, 0.001,
        ];
        let (mut codes, mut scales) = (Vec::new(), Vec::new());
        quantize_rows(&q, 4, &mut codes, &mut scales);
        assert_eq!(scales.len(), 3);
        assert_eq!(&codes[..4], &[32767, -16384, 8192, 0]);
        assert_eq!(&codes[4..8], &[0, 0, 0, 0]);
        assert_eq!(scales[1], 0.0);
        assert_eq!(&codes[8..11], &[-32767, 32767, 16384]);
        for (i, (c, x)) in codes.iter().zip(&q).enumerate() {
            let s = scales[i / 4];
            assert!((*c as f32 * s - x).abs() <= s * 0.5 + 1e-9, "{i}");
        }
    }

    #[test]
    fn the_longest_head_cannot_overflow() {
        let q = vec![i16::MIN + 1; MAX_HEAD_DIM];
        let k = vec![-127i8; MAX_HEAD_DIM];
        assert_eq!(dot(&q, &k) as i64, 32767 * 127 * MAX_HEAD_DIM as i64);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_path_gives_the_portable_sums() {
        use crate::kernels::KernelPath;
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for (hd, rows, n_ctx) in [(16, 1, 1), (64, 3, 7), (128, 5, 9), (MAX_HEAD_DIM, 2, 4)] {
            let q: Vec<i16> = (0..rows * hd).map(|_| rng.random()).collect();
            let keys: Vec<i8> = (0..(n_ctx + 2) * hd)
                .map(|_| rng.random_range(-127..=127))
                .collect();
            // Scattered positions, one repeated.
            let offs: Vec<usize> = (0..n_ctx).map(|j| ((j * 5) % (n_ctx + 2)) * hd).collect();
            let factors: Vec<f32> = (0..rows).map(|r| 0.001 * (r + 1) as f32).collect();
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| offs.iter().map(move |&o| (r, o)).collect::<Vec<_>>())
                .map(|(r, o)| dot(&q[r * hd..][..hd], &keys[o..o + hd]) as f32 * factors[r])
                .collect();
            for path in KernelPath::here().filter(|p| *p >= KernelPath::Avx2) {
                let mut got = vec![f32::NAN; rows * n_ctx];
                // SAFETY: the path is supported; hd is a multiple of 16 within the bound;
                // every offset plus hd is within `keys`; `got` holds rows × n_ctx.
                unsafe {
                    score_rows(
                        path,
                        q.as_ptr(),
                        hd,
                        keys.as_ptr(),
                        &offs,
                        &factors,
                        got.as_mut_ptr(),
                    )
                };
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{} hd {hd}", path.name());
            }
        }
    }
}
