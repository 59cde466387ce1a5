//! Matrix products over GGUF block-quantized weights with f32 activations.
//!
//! candle's quantized matmul quantizes the activations to 8 bits before its integer dot
//! products, and has no SIMD path for Q4_1; both cost accuracy or speed on the default
//! model. Here the weights stay in their GGUF blocks (Q4_0, Q4_1 or Q8_0: 0.56–1.06 bytes a
//! weight, so decode reads 4–7× less memory than f32) and are expanded to f32 in registers,
//! block by block, right before the FMAs: the result is the f32 product with the stored
//! weights, as exact as a dequantized GEMM up to summation order.
//!
//! `y[m][n] = Σ_k x[m][k] · w[n][k]` for `x: [M, K]` and `w: [N, K]`. Work is split over
//! weight rows across the rayon pool; each weight block is expanded once per tile of up to
//! [`M_TILE`] activation rows.

use half::f16;
use rayon::prelude::*;

/// Weights per block for every supported type.
pub const BLOCK: usize = 32;
/// Activation rows that share one expansion of a weight block.
pub const M_TILE: usize = 4;

/// GGUF block types this module multiplies directly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockType {
    /// `{ d: f16, qs: [u8; 16] }`, `w = d · (q − 8)`.
    Q4_0,
    /// `{ d: f16, m: f16, qs: [u8; 16] }`, `w = d · q + m`.
    Q4_1,
    /// `{ d: f16, qs: [i8; 32] }`, `w = d · q`.
    Q8_0,
}

impl BlockType {
    /// Bytes per block of 32 weights.
    pub const fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }
}

/// A `[rows, cols]` weight matrix kept in GGUF block layout (row-major, each row
/// `cols / 32` blocks).
#[derive(Debug, Clone)]
pub struct BlockMatrix {
    pub kind: BlockType,
    pub rows: usize,
    pub cols: usize,
    data: Vec<u8>,
}

/// Why raw bytes cannot form a block matrix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("{cols} columns is not a multiple of the block size {BLOCK}")]
    Cols { cols: usize },
    #[error("expected {expected} bytes of blocks, got {got}")]
    Len { expected: usize, got: usize },
}

impl BlockMatrix {
    pub fn new(
        kind: BlockType,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
    ) -> Result<Self, BlockError> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(BlockError::Cols { cols });
        }
        let expected = rows * (cols / BLOCK) * kind.block_bytes();
        if data.len() != expected {
            return Err(BlockError::Len {
                expected,
                got: data.len(),
            });
        }
        Ok(Self {
            kind,
            rows,
            cols,
            data,
        })
    }

    /// Stacks matrices of the same type and width on top of each other.
    pub fn concat_rows(parts: Vec<BlockMatrix>) -> Option<BlockMatrix> {
        let first = parts.first()?;
        let (kind, cols) = (first.kind, first.cols);
        if parts.iter().any(|p| p.kind != kind || p.cols != cols) {
            return None;
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Some(BlockMatrix {
            kind,
            rows,
            cols,
            data,
        })
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.kind.block_bytes()
    }

    /// Bytes the weights take.
    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    /// The weights of row `n` as f32 (for tests and debugging).
    pub fn dequantize_row(&self, n: usize) -> Vec<f32> {
        let rb = self.row_bytes();
        let row = &self.data[n * rb..(n + 1) * rb];
        let mut out = Vec::with_capacity(self.cols);
        for block in row.chunks_exact(self.kind.block_bytes()) {
            let mut w = [0f32; BLOCK];
            expand_scalar(self.kind, block, &mut w);
            out.extend_from_slice(&w);
        }
        out
    }

    /// `x: [m, cols]` → `[m, rows]`.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        debug_assert_eq!(x.len(), m * self.cols);
        let n = self.rows;
        // Transposed result: one contiguous run of `m` outputs per weight row.
        let mut yt = vec![0f32; n * m];
        let rb = self.row_bytes();
        let rows_per_task = (n / (rayon::current_num_threads() * 8)).clamp(1, 256);
        yt.par_chunks_mut(m * rows_per_task)
            .enumerate()
            .for_each(|(task, out)| {
                let first = task * rows_per_task;
                for (r, out_row) in out.chunks_exact_mut(m).enumerate() {
                    let row = &self.data[(first + r) * rb..(first + r + 1) * rb];
                    row_dot(self.kind, row, x, self.cols, out_row);
                }
            });
        if m == 1 {
            return yt;
        }
        let mut y = vec![0f32; m * n];
        for (j, col) in yt.chunks_exact(m).enumerate() {
            for (i, &v) in col.iter().enumerate() {
                y[i * n + j] = v;
            }
        }
        y
    }
}

/// Dot products of one weight row with every activation row: `out[i] = w · x[i]`.
fn row_dot(kind: BlockType, row: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            unsafe { avx2::row_dot(kind, row, x, k, out) };
            return;
        }
    }
    row_dot_scalar(kind, row, x, k, out);
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
}

fn read_f16(b: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// Expands one block to 32 f32 weights.
fn expand_scalar(kind: BlockType, block: &[u8], w: &mut [f32; BLOCK]) {
    let d = read_f16(block, 0);
    match kind {
        BlockType::Q4_0 => {
            let qs = &block[2..18];
            for j in 0..16 {
                w[j] = d * ((qs[j] & 0x0F) as f32 - 8.0);
                w[j + 16] = d * ((qs[j] >> 4) as f32 - 8.0);
            }
        }
        BlockType::Q4_1 => {
            let m = read_f16(block, 2);
            let qs = &block[4..20];
            for j in 0..16 {
                w[j] = d * (qs[j] & 0x0F) as f32 + m;
                w[j + 16] = d * (qs[j] >> 4) as f32 + m;
            }
        }
        BlockType::Q8_0 => {
            for j in 0..BLOCK {
                w[j] = d * (block[2 + j] as i8) as f32;
            }
        }
    }
}

fn row_dot_scalar(kind: BlockType, row: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    out.fill(0.0);
    let mut w = [0f32; BLOCK];
    for (b, block) in row.chunks_exact(kind.block_bytes()).enumerate() {
        expand_scalar(kind, block, &mut w);
        for (i, o) in out.iter_mut().enumerate() {
            let xs = &x[i * k + b * BLOCK..i * k + (b + 1) * BLOCK];
            *o += w.iter().zip(xs).map(|(a, c)| a * c).sum::<f32>();
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{read_f16, BlockType, BLOCK, M_TILE};
    use std::arch::x86_64::*;

    /// Expands one block into four vectors of eight weights (elements 0..8, 8..16, 16..24,
    /// 24..32).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn expand(kind: BlockType, block: &[u8]) -> [__m256; 4] {
        let d = _mm256_set1_ps(read_f16(block, 0));
        match kind {
            BlockType::Q4_0 | BlockType::Q4_1 => {
                let (off, bias) = match kind {
                    BlockType::Q4_1 => (4, _mm256_set1_ps(read_f16(block, 2))),
                    _ => (2, _mm256_set1_ps(-8.0 * read_f16(block, 0))),
                };
                // SAFETY: the block holds 16 bytes of nibbles at `off` (length checked by
                // the caller's chunking).
                let qs = _mm_loadu_si128(block.as_ptr().add(off) as *const __m128i);
                let mask = _mm_set1_epi8(0x0F);
                let lo = _mm_and_si128(qs, mask);
                let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
                let cvt = |v: __m128i| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                [
                    _mm256_fmadd_ps(cvt(lo), d, bias),
                    _mm256_fmadd_ps(cvt(_mm_srli_si128(lo, 8)), d, bias),
                    _mm256_fmadd_ps(cvt(hi), d, bias),
                    _mm256_fmadd_ps(cvt(_mm_srli_si128(hi, 8)), d, bias),
                ]
            }
            BlockType::Q8_0 => {
                let p = block.as_ptr().add(2);
                let cvt = |at: usize| {
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                            p.add(at) as *const __m128i
                        ))),
                        d,
                    )
                };
                [cvt(0), cvt(8), cvt(16), cvt(24)]
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// # Safety
    /// The CPU must support AVX2 and FMA; `row` holds `k / 32` blocks of `kind` and `x`
    /// holds `out.len()` rows of `k` floats.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn row_dot(kind: BlockType, row: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
        let bb = kind.block_bytes();
        let nblocks = k / BLOCK;
        let m = out.len();
        let mut i0 = 0;
        while i0 < m {
            let tile = (m - i0).min(M_TILE);
            let mut acc = [_mm256_setzero_ps(); M_TILE];
            for b in 0..nblocks {
                let w = expand(kind, &row[b * bb..(b + 1) * bb]);
                for (t, a) in acc.iter_mut().enumerate().take(tile) {
                    let xp = x.as_ptr().add((i0 + t) * k + b * BLOCK);
                    let mut s = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xp), *a);
                    s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), s);
                    s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), s);
                    *a = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), s);
                }
            }
            for t in 0..tile {
                out[i0 + t] = hsum(acc[t]);
            }
            i0 += tile;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn random_blocks(kind: BlockType, rows: usize, cols: usize, seed: u64) -> BlockMatrix {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let nblocks = rows * cols / BLOCK;
        let mut data = Vec::with_capacity(nblocks * kind.block_bytes());
        for _ in 0..nblocks {
            let d = f16::from_f32(rng.random_range(-0.1..0.1)).to_bits();
            data.extend_from_slice(&d.to_le_bytes());
            if kind == BlockType::Q4_1 {
                let m = f16::from_f32(rng.random_range(-0.5..0.5)).to_bits();
                data.extend_from_slice(&m.to_le_bytes());
            }
            let header = if kind == BlockType::Q4_1 { 4 } else { 2 };
            let nq = kind.block_bytes() - header;
            for _ in 0..nq {
                data.push(rng.random());
            }
        }
        BlockMatrix::new(kind, rows, cols, data).expect("valid blocks")
    }

    fn reference(w: &BlockMatrix, x: &[f32], m: usize) -> Vec<f32> {
        let mut y = vec![0f32; m * w.rows];
        for n in 0..w.rows {
            let row = w.dequantize_row(n);
            for i in 0..m {
                let xs = &x[i * w.cols..(i + 1) * w.cols];
                y[i * w.rows + n] = row
                    .iter()
                    .zip(xs)
                    .map(|(a, b)| (*a as f64 * *b as f64) as f32)
                    .sum();
            }
        }
        y
    }

    #[test]
    fn matmul_matches_dequantized_product_for_every_type_and_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for kind in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            for m in [1, 3, 4, 9] {
                let w = random_blocks(kind, 37, 96, 7);
                let x: Vec<f32> = (0..m * 96).map(|_| rng.random_range(-1.0..1.0)).collect();
                let got = w.matmul(&x, m);
                let want = reference(&w, &x, m);
                for (g, r) in got.iter().zip(&want) {
                    assert!(
                        (g - r).abs() <= 1e-4 * r.abs().max(1.0),
                        "{kind:?} m={m}: {g} vs {r}"
                    );
                }
                let mut scalar = vec![0f32; m];
                let rb = w.row_bytes();
                row_dot_scalar(kind, &w.data[..rb], &x, 96, &mut scalar);
                for i in 0..m {
                    assert!(
                        (scalar[i] - want[i * w.rows]).abs()
                            <= 1e-4 * want[i * w.rows].abs().max(1.0)
                    );
                }
            }
        }
    }

    #[test]
    fn one_row_at_a_time_is_bit_identical_to_a_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        for kind in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            // 37 rows: groups of four plus a remainder, across several tasks.
            let w = random_blocks(kind, 37, 128, 11);
            let m = 9;
            let x: Vec<f32> = (0..m * 128).map(|_| rng.random_range(-1.0..1.0)).collect();
            let batch = w.matmul(&x, m);
            for i in 0..m {
                let alone = w.matmul(&x[i * 128..(i + 1) * 128], 1);
                for j in 0..w.rows {
                    assert_eq!(
                        alone[j].to_bits(),
                        batch[i * w.rows + j].to_bits(),
                        "{kind:?} row {i} col {j}"
                    );
                }
            }
        }
    }

    #[test]
    fn q4_1_expansion_is_d_times_q_plus_m() {
        let mut block = vec![0u8; 20];
        block[..2].copy_from_slice(&f16::from_f32(0.5).to_bits().to_le_bytes());
        block[2..4].copy_from_slice(&f16::from_f32(-1.0).to_bits().to_le_bytes());
        block[4] = 0x3A; // element 0: 0xA = 10, element 16: 0x3 = 3
        let w = BlockMatrix::new(BlockType::Q4_1, 1, 32, block).expect("one block");
        let row = w.dequantize_row(0);
        assert_eq!(row[0], 0.5 * 10.0 - 1.0);
        assert_eq!(row[16], 0.5 * 3.0 - 1.0);
        assert_eq!(row[1], -1.0);
    }

    #[test]
    fn bad_shapes_are_errors() {
        assert_eq!(
            BlockMatrix::new(BlockType::Q8_0, 1, 33, vec![]).unwrap_err(),
            BlockError::Cols { cols: 33 }
        );
        assert!(matches!(
            BlockMatrix::new(BlockType::Q8_0, 2, 32, vec![0; 34]),
            Err(BlockError::Len { .. })
        ));
    }
}
