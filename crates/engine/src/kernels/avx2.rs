//! The AVX2 + FMA paths: block expansion in registers, the few-rows and panel kernels, and
//! the 8-bit activation products.

use super::{block_scale, BlockType, BLOCK, MR, NR, NR_DECODE};
use std::arch::x86_64::*;

/// [`super::quantize_blocks_scalar`] eight lanes at a time, with the same bits: the
/// largest magnitude is order-free, `vmaxps` returns its second operand when the first
/// is NaN (so a NaN input is skipped, as `f32::max` does), the product is the same
/// single multiply, NaN products are zeroed, `vroundps` rounds half to even, and the
/// sum of the integers is exact.
///
/// # Safety
/// AVX2; `x` and `q` hold the same whole number of blocks, `d`, `s8` and `sums` one entry
/// each.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_blocks(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s8: &mut [f32],
    sums: &mut [i32],
) {
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    let lo = _mm256_set1_ps(-127.0);
    let hi = _mm256_set1_ps(127.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, ((d, s8), block_sum)) in d.iter_mut().zip(s8.iter_mut()).zip(sums).enumerate() {
        let p = x.as_ptr().add(b * BLOCK);
        let v = [
            _mm256_loadu_ps(p),
            _mm256_loadu_ps(p.add(8)),
            _mm256_loadu_ps(p.add(16)),
            _mm256_loadu_ps(p.add(24)),
        ];
        let mut m = _mm256_setzero_ps();
        for v in v {
            m = _mm256_max_ps(_mm256_and_ps(v, abs_mask), m);
        }
        let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        let m1 = _mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1));
        let (scale, inv) = block_scale(_mm_cvtss_f32(m1));
        let inv = _mm256_set1_ps(inv);
        let r = v.map(|v| {
            let p = _mm256_mul_ps(v, inv);
            let p = _mm256_and_ps(p, _mm256_cmp_ps(p, p, _CMP_ORD_Q));
            let p = _mm256_round_ps(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(p, lo), hi))
        });
        let sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let s4 = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256(sum, 1),
        );
        let s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0b01_00_11_10));
        let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0b00_00_00_01));
        let packed = _mm256_packs_epi16(
            _mm256_packs_epi32(r[0], r[1]),
            _mm256_packs_epi32(r[2], r[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(packed, order);
        _mm256_storeu_si256(q.as_mut_ptr().add(b * BLOCK) as *mut __m256i, bytes);
        *d = scale;
        *block_sum = _mm_cvtsi128_si32(s1);
        *s8 = scale * *block_sum as f32 / 8.0;
    }
}

/// How one block type expands into f32: both paths get their weights from here, so
/// they multiply identical values.
pub(super) trait Expand {
    const BYTES: usize;
    /// Expands the block at `p` into four vectors of eight weights (elements 0..8,
    /// 8..16, 16..24, 24..32).
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `p` points at `BYTES` readable bytes.
    unsafe fn expand(p: *const u8) -> [__m256; 4];
}

/// The block's f16 at byte `at`, in all eight lanes.
#[inline(always)]
unsafe fn splat_f16(p: *const u8, at: usize) -> __m256 {
    let bits = (p.add(at) as *const u16).read_unaligned();
    _mm256_cvtph_ps(_mm_set1_epi16(bits as i16))
}

/// Nibbles as `d · q + bias`: byte `j` holds element `j` (low nibble) and element
/// `j + 16` (high nibble). Each half of the bytes is widened to 32-bit lanes once; the
/// mask gives the low nibbles and a shift the high ones.
#[inline(always)]
unsafe fn expand_nibbles(qs: *const u8, d: __m256, bias: __m256) -> [__m256; 4] {
    let t0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs as *const __m128i));
    let t1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8) as *const __m128i));
    let mask = _mm256_set1_epi32(0x0F);
    let f = |v: __m256i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), d, bias);
    [
        f(_mm256_and_si256(t0, mask)),
        f(_mm256_and_si256(t1, mask)),
        f(_mm256_srli_epi32(t0, 4)),
        f(_mm256_srli_epi32(t1, 4)),
    ]
}

pub struct Q4_0;
pub struct Q4_1;
pub struct Q8_0;

impl Expand for Q4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn expand(p: *const u8) -> [__m256; 4] {
        let d = splat_f16(p, 0);
        expand_nibbles(p.add(2), d, _mm256_mul_ps(_mm256_set1_ps(-8.0), d))
    }
}

impl Expand for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn expand(p: *const u8) -> [__m256; 4] {
        expand_nibbles(p.add(4), splat_f16(p, 0), splat_f16(p, 2))
    }
}

impl Expand for Q8_0 {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn expand(p: *const u8) -> [__m256; 4] {
        let d = splat_f16(p, 0);
        let q = p.add(2);
        let cvt = |at: usize| {
            _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                    q.add(at) as *const __m128i
                ))),
                d,
            )
        };
        [cvt(0), cvt(8), cvt(16), cvt(24)]
    }
}

#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Few activation rows: weight blocks expanded in registers, `NR_DECODE` weight rows
/// and up to two activation rows per pass.
///
/// # Safety
/// AVX2, FMA and F16C; `data` holds `rows` rows of `k / 32` blocks of `kind`; `x` holds
/// `m` rows of `k` floats; `y` points at column 0 of this chunk in an output of row
/// stride `ldy`, writable for `m` rows and `rows` columns.
#[allow(clippy::too_many_arguments)]
pub unsafe fn decode_chunk(
    kind: BlockType,
    data: &[u8],
    rows: usize,
    x: &[f32],
    m: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    let (w, x) = (data.as_ptr(), x.as_ptr());
    match kind {
        BlockType::Q4_0 => decode_chunk_of::<Q4_0>(w, rows, x, m, k, y, ldy),
        BlockType::Q4_1 => decode_chunk_of::<Q4_1>(w, rows, x, m, k, y, ldy),
        BlockType::Q8_0 => decode_chunk_of::<Q8_0>(w, rows, x, m, k, y, ldy),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_chunk_of<E: Expand>(
    w: *const u8,
    rows: usize,
    x: *const f32,
    m: usize,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    let rb = k / BLOCK * E::BYTES;
    let mut i = 0;
    while i < m {
        let two = m - i >= 2;
        let (xp, yp) = (x.add(i * k), y.add(i * ldy));
        let mut j = 0;
        while j + NR_DECODE <= rows {
            if two {
                decode_2x4::<E>(w.add(j * rb), rb, xp, k, yp.add(j), ldy);
            } else {
                decode_1x4::<E>(w.add(j * rb), rb, xp, k, yp.add(j));
            }
            j += NR_DECODE;
        }
        while j < rows {
            decode_1x1::<E>(w.add(j * rb), xp, k, yp.add(j));
            if two {
                decode_1x1::<E>(w.add(j * rb), xp.add(k), k, yp.add(ldy + j));
            }
            j += 1;
        }
        i += if two { 2 } else { 1 };
    }
}

/// `acc += w · x` over one block: four FMAs in ascending `k`.
macro_rules! fma_block {
    ($acc:expr, $w:expr, $xp:expr) => {{
        let xp = $xp;
        let mut s = _mm256_fmadd_ps($w[0], _mm256_loadu_ps(xp), $acc);
        s = _mm256_fmadd_ps($w[1], _mm256_loadu_ps(xp.add(8)), s);
        s = _mm256_fmadd_ps($w[2], _mm256_loadu_ps(xp.add(16)), s);
        $acc = _mm256_fmadd_ps($w[3], _mm256_loadu_ps(xp.add(24)), s);
    }};
}

/// Asks for the same block position of the next four weight rows (the next tile), so
/// that streaming weights from memory overlaps this tile's arithmetic. A prefetch never
/// faults, so the address may run past the matrix.
#[inline(always)]
unsafe fn prefetch_next_tile(wb: *const u8, rb: usize) {
    for r in NR_DECODE..2 * NR_DECODE {
        _mm_prefetch::<_MM_HINT_T0>(wb.wrapping_add(r * rb) as *const i8);
    }
}

/// One activation row × one weight row.
#[inline(always)]
unsafe fn decode_1x1<E: Expand>(w: *const u8, x: *const f32, k: usize, y: *mut f32) {
    let mut a = _mm256_setzero_ps();
    for b in 0..k / BLOCK {
        let v = E::expand(w.add(b * E::BYTES));
        fma_block!(a, v, x.add(b * BLOCK));
    }
    *y = hsum(a);
}

/// One activation row × four weight rows (`rb` bytes apart): four independent chains.
#[inline(always)]
unsafe fn decode_1x4<E: Expand>(w: *const u8, rb: usize, x: *const f32, k: usize, y: *mut f32) {
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
    for b in 0..k / BLOCK {
        let (wb, xb) = (w.add(b * E::BYTES), x.add(b * BLOCK));
        prefetch_next_tile(wb, rb);
        let v = E::expand(wb);
        fma_block!(a0, v, xb);
        let v = E::expand(wb.add(rb));
        fma_block!(a1, v, xb);
        let v = E::expand(wb.add(2 * rb));
        fma_block!(a2, v, xb);
        let v = E::expand(wb.add(3 * rb));
        fma_block!(a3, v, xb);
    }
    *y = hsum(a0);
    *y.add(1) = hsum(a1);
    *y.add(2) = hsum(a2);
    *y.add(3) = hsum(a3);
}

/// Two activation rows (`k` floats apart) × four weight rows: each expansion used twice.
#[inline(always)]
unsafe fn decode_2x4<E: Expand>(
    w: *const u8,
    rb: usize,
    x: *const f32,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    let z = _mm256_setzero_ps();
    let (mut a0, mut a1, mut a2, mut a3) = (z, z, z, z);
    let (mut b0, mut b1, mut b2, mut b3) = (z, z, z, z);
    for b in 0..k / BLOCK {
        let (wb, xb) = (w.add(b * E::BYTES), x.add(b * BLOCK));
        prefetch_next_tile(wb, rb);
        let v = E::expand(wb);
        fma_block!(a0, v, xb);
        fma_block!(b0, v, xb.add(k));
        let v = E::expand(wb.add(rb));
        fma_block!(a1, v, xb);
        fma_block!(b1, v, xb.add(k));
        let v = E::expand(wb.add(2 * rb));
        fma_block!(a2, v, xb);
        fma_block!(b2, v, xb.add(k));
        let v = E::expand(wb.add(3 * rb));
        fma_block!(a3, v, xb);
        fma_block!(b3, v, xb.add(k));
    }
    for (j, (a, b)) in [(a0, b0), (a1, b1), (a2, b2), (a3, b3)]
        .into_iter()
        .enumerate()
    {
        *y.add(j) = hsum(a);
        *y.add(ldy + j) = hsum(b);
    }
}

/// Many activation rows: the chunk's weights are expanded once into `panel`
/// (`rows × k` f32), then multiplied in `MR × NR` register tiles.
///
/// # Safety
/// As [`decode_chunk`].
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
    panel.clear();
    panel.reserve(rows * k);
    let (w, p) = (data.as_ptr(), panel.as_mut_ptr());
    let blocks = rows * k / BLOCK;
    match kind {
        BlockType::Q4_0 => expand_panel::<Q4_0>(w, blocks, p),
        BlockType::Q4_1 => expand_panel::<Q4_1>(w, blocks, p),
        BlockType::Q8_0 => expand_panel::<Q8_0>(w, blocks, p),
    }
    // SAFETY: every one of the `rows × k` floats was written above (blocks are
    // contiguous, row after row).
    panel.set_len(rows * k);
    panel_gemm(x.as_ptr(), m, k, panel.as_ptr(), rows, y, ldy);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn expand_panel<E: Expand>(w: *const u8, blocks: usize, p: *mut f32) {
    for b in 0..blocks {
        let v = E::expand(w.add(b * E::BYTES));
        let at = p.add(b * BLOCK);
        _mm256_storeu_ps(at, v[0]);
        _mm256_storeu_ps(at.add(8), v[1]);
        _mm256_storeu_ps(at.add(16), v[2]);
        _mm256_storeu_ps(at.add(24), v[3]);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel_gemm(
    x: *const f32,
    m: usize,
    k: usize,
    p: *const f32,
    rows: usize,
    y: *mut f32,
    ldy: usize,
) {
    let mut i = 0;
    while i < m {
        let mr = (m - i).min(MR);
        let xp = x.add(i * k);
        let mut j = 0;
        while j < rows {
            let nr = (rows - j).min(NR);
            let (wp, yp) = (p.add(j * k), y.add(i * ldy + j));
            match (mr, nr) {
                (4, 3) => panel_tile::<4, 3>(xp, wp, k, yp, ldy),
                (4, 2) => panel_tile::<4, 2>(xp, wp, k, yp, ldy),
                (4, _) => panel_tile::<4, 1>(xp, wp, k, yp, ldy),
                (3, 3) => panel_tile::<3, 3>(xp, wp, k, yp, ldy),
                (3, 2) => panel_tile::<3, 2>(xp, wp, k, yp, ldy),
                (3, _) => panel_tile::<3, 1>(xp, wp, k, yp, ldy),
                (2, 3) => panel_tile::<2, 3>(xp, wp, k, yp, ldy),
                (2, 2) => panel_tile::<2, 2>(xp, wp, k, yp, ldy),
                (2, _) => panel_tile::<2, 1>(xp, wp, k, yp, ldy),
                (_, 3) => panel_tile::<1, 3>(xp, wp, k, yp, ldy),
                (_, 2) => panel_tile::<1, 2>(xp, wp, k, yp, ldy),
                _ => panel_tile::<1, 1>(xp, wp, k, yp, ldy),
            }
            j += nr;
        }
        i += mr;
    }
}

#[inline(always)]
unsafe fn panel_tile<const M: usize, const N: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    y: *mut f32,
    ldy: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); N]; M];
    let mut kk = 0;
    while kk < k {
        let mut wv = [_mm256_setzero_ps(); N];
        for (j, v) in wv.iter_mut().enumerate() {
            *v = _mm256_loadu_ps(w.add(j * k + kk));
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let xv = _mm256_loadu_ps(x.add(i * k + kk));
            for (a, wj) in row.iter_mut().zip(&wv) {
                *a = _mm256_fmadd_ps(*wj, xv, *a);
            }
        }
        kk += 8;
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            *y.add(i * ldy + j) = hsum(*a);
        }
    }
}

/// How a 4-bit block feeds the integer dot product: its 32 values as unsigned bytes in
/// element order, its scale `d`, and its offset per unit of `Σx` (`m` for Q4_1, `−8d`
/// for Q4_0), both in all eight lanes.
trait Unpack {
    const BYTES: usize;
    /// # Safety
    /// AVX2 and F16C; `p` points at `BYTES` readable bytes.
    unsafe fn unpack(p: *const u8) -> (__m256i, __m256, __m256);
}

/// Byte `j` of the 16 at `qs` holds element `j` (low nibble) and `j + 16` (high).
#[inline(always)]
unsafe fn nibbles_in_order(qs: *const u8) -> __m256i {
    let raw = _mm_loadu_si128(qs as *const __m128i);
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(raw, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    _mm256_set_m128i(hi, lo)
}

impl Unpack for Q4_0 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> (__m256i, __m256, __m256) {
        let d = splat_f16(p, 0);
        (
            nibbles_in_order(p.add(2)),
            d,
            _mm256_mul_ps(_mm256_set1_ps(-8.0), d),
        )
    }
}

impl Unpack for Q4_1 {
    const BYTES: usize = 20;
    #[inline(always)]
    unsafe fn unpack(p: *const u8) -> (__m256i, __m256, __m256) {
        (nibbles_in_order(p.add(4)), splat_f16(p, 0), splat_f16(p, 2))
    }
}

/// Raw view of [`super::QuantRows`], moved row by row.
#[derive(Clone, Copy)]
struct QX {
    q: *const i8,
    d: *const f32,
    s8: *const f32,
    k: usize,
}

impl QX {
    #[inline(always)]
    unsafe fn row(self, i: usize) -> Self {
        let nb = self.k / BLOCK;
        Self {
            q: self.q.add(i * self.k),
            d: self.d.add(i * nb),
            s8: self.s8.add(i * nb),
            k: self.k,
        }
    }
}

/// Quantized activation rows: weight rows in tiles of `NR_DECODE`, activation rows in
/// pairs.
///
/// # Safety
/// AVX2, FMA and F16C; `kind` is Q4_0 or Q4_1; `data` holds `rows` rows of `q.k / 32`
/// blocks; `y` points at column 0 of this chunk in an output of row stride `ldy`,
/// writable for `q.m` rows and `rows` columns.
pub unsafe fn q8_chunk(
    kind: BlockType,
    data: &[u8],
    rows: usize,
    q: &super::QuantRows,
    y: *mut f32,
    ldy: usize,
) {
    let x = QX {
        q: q.q.as_ptr(),
        d: q.d.as_ptr(),
        s8: q.s8.as_ptr(),
        k: q.k,
    };
    match kind {
        BlockType::Q4_1 => q8_chunk_of::<Q4_1>(data.as_ptr(), rows, x, q.m, y, ldy),
        _ => q8_chunk_of::<Q4_0>(data.as_ptr(), rows, x, q.m, y, ldy),
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_chunk_of<U: Unpack>(
    w: *const u8,
    rows: usize,
    x: QX,
    m: usize,
    y: *mut f32,
    ldy: usize,
) {
    let rb = x.k / BLOCK * U::BYTES;
    let mut i = 0;
    while i < m {
        let (xr, yp) = (x.row(i), y.add(i * ldy));
        let two = m - i >= 2;
        let mut j = 0;
        while j + NR_DECODE <= rows {
            let (wj, yj) = (w.add(j * rb), yp.add(j));
            if two {
                q8_tile::<U, 2, NR_DECODE>(wj, rb, xr, yj, ldy);
            } else {
                q8_tile::<U, 1, NR_DECODE>(wj, rb, xr, yj, ldy);
            }
            j += NR_DECODE;
        }
        while j < rows {
            let (wj, yj) = (w.add(j * rb), yp.add(j));
            if two {
                q8_tile::<U, 2, 1>(wj, rb, xr, yj, ldy);
            } else {
                q8_tile::<U, 1, 1>(wj, rb, xr, yj, ldy);
            }
            j += 1;
        }
        i += if two { 2 } else { 1 };
    }
}

/// `M` quantized activation rows × `N` weight rows (`rb` bytes apart). Per output and
/// block, in this order: `acc += m_w · s8_x` (the offset term, spread over the lanes),
/// then `acc += (d_w · d_x) · Σ q_w q_x`, the sum exact in integers (`maddubs`, `madd`).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // indices name tile coordinates
unsafe fn q8_tile<U: Unpack, const M: usize, const N: usize>(
    w: *const u8,
    rb: usize,
    x: QX,
    y: *mut f32,
    ldy: usize,
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); N]; M];
    for b in 0..x.k / BLOCK {
        let wb = w.add(b * U::BYTES);
        if N == NR_DECODE {
            prefetch_next_tile(wb, rb);
        }
        let mut xq = [_mm256_setzero_si256(); M];
        let mut dx = [_mm256_setzero_ps(); M];
        let mut sx = [_mm256_setzero_ps(); M];
        for i in 0..M {
            let r = x.row(i);
            xq[i] = _mm256_loadu_si256(r.q.add(b * BLOCK) as *const __m256i);
            dx[i] = _mm256_set1_ps(*r.d.add(b));
            sx[i] = _mm256_set1_ps(*r.s8.add(b));
        }
        for j in 0..N {
            let (qw, dw, mw) = U::unpack(wb.add(j * rb));
            for i in 0..M {
                let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(qw, xq[i]), ones);
                let a = _mm256_fmadd_ps(mw, sx[i], acc[i][j]);
                acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx[i]), a);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, a) in row.iter().enumerate() {
            *y.add(i * ldy + j) = hsum(*a);
        }
    }
}
