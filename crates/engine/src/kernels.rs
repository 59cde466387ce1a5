//! Matrix products over GGUF block-quantized weights with f32 activations.
//!
//! candle's quantized matmul quantizes the activations to 8 bits before its integer dot
//! products, and has no SIMD path for Q4_1; both cost accuracy or speed on the default
//! model. Here the weights stay in their GGUF blocks (Q4_0, Q4_1 or Q8_0: 0.56–1.06 bytes a
//! weight, so decode reads 4–7× less memory than f32) and are expanded to f32 right before
//! the FMAs: the result is the f32 product with the stored weights.
//!
//! `y[m][n] = Σ_k x[m][k] · w[n][k]` for `x: [M, K]` and `w: [N, K]`. Work is split over
//! chunks of weight rows across the rayon pool. Two paths, chosen by the number of
//! activation rows `M`:
//!
//! - **Few rows** (decode, `M <` [`PANEL_MIN_M`]): each weight block is expanded in
//!   registers and used at once, [`NR_DECODE`] weight rows at a time so that enough
//!   independent FMA chains are in flight to hide their latency.
//! - **Many rows** (prefill, batched decode): each task expands its chunk of weight rows
//!   once into an f32 panel (kept in L2), then runs a register-tiled micro-kernel of
//!   [`MR`] activation rows × [`NR`] weight rows over it.
//!
//! Both paths compute every output with the same arithmetic in the same order: one 8-lane
//! accumulator per output, FMAs over `k` in ascending order, then the same horizontal sum.
//! An output therefore does not depend on how many other rows share the step, which is what
//! makes greedy decoding identical alone and in a batch.

use half::f16;
use rayon::prelude::*;

/// Weights per block for every supported type.
pub const BLOCK: usize = 32;
/// Activation rows at and above which weights are expanded into an f32 panel first.
pub const PANEL_MIN_M: usize = 4;
/// Micro-kernel tile of the panel path: activation rows …
pub const MR: usize = 4;
/// … times weight rows (`MR × NR` accumulators, plus `NR` weight vectors, fit the 16
/// AVX2 registers).
pub const NR: usize = 3;
/// Weight rows whose blocks are expanded together on the few-rows path.
pub const NR_DECODE: usize = 4;
/// Weight rows per task on the panel path (a multiple of [`NR`]); the panel takes
/// `PANEL_ROWS × K × 4` bytes (110 KiB at K = 576, 288 KiB at K = 1536).
pub const PANEL_ROWS: usize = 48;

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

/// The output matrix, written by several tasks at once, each to its own columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint column ranges of the buffer, which outlives the parallel
// loop (it is joined before `matmul` returns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

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
        assert_eq!(x.len(), m * self.cols, "activation shape");
        let n = self.rows;
        let mut y = vec![0f32; m * n];
        if m == 0 || n == 0 {
            return y;
        }
        let panel = m >= PANEL_MIN_M;
        let rows_per_task = if panel {
            PANEL_ROWS
        } else {
            // Enough tasks to balance the pool, each a whole number of register tiles.
            (n / (rayon::current_num_threads() * 8))
                .clamp(1, 256)
                .next_multiple_of(NR_DECODE)
        };
        let out = OutPtr(y.as_mut_ptr());
        let tasks = n.div_ceil(rows_per_task);
        (0..tasks).into_par_iter().for_each(|task| {
            let first = task * rows_per_task;
            let rows = rows_per_task.min(n - first);
            // SAFETY: task `task` writes only columns `first..first + rows` of the `m × n`
            // output, and every task's range is disjoint.
            unsafe { self.chunk(x, m, first, rows, out, panel) };
        });
        y
    }

    /// Computes output columns `first..first + rows` for every activation row.
    ///
    /// # Safety
    /// `out` points to an `m × self.rows` buffer that no one else writes in these columns.
    unsafe fn chunk(
        &self,
        x: &[f32],
        m: usize,
        first: usize,
        rows: usize,
        out: OutPtr,
        panel: bool,
    ) {
        let rb = self.row_bytes();
        let data = &self.data[first * rb..(first + rows) * rb];
        #[cfg(target_arch = "x86_64")]
        {
            if has_avx2_fma() {
                // SAFETY: AVX2, FMA and F16C are present (checked above); shapes as documented.
                let y = out.0.add(first);
                if panel {
                    PANEL.with_borrow_mut(|buf| {
                        avx2::panel_chunk(self.kind, data, rows, x, m, self.cols, buf, y, self.rows)
                    });
                } else {
                    avx2::decode_chunk(self.kind, data, rows, x, m, self.cols, y, self.rows);
                }
                return;
            }
        }
        let _ = panel;
        let mut col = vec![0f32; m];
        for (r, row) in data.chunks_exact(rb).enumerate() {
            row_dot_scalar(self.kind, row, x, self.cols, &mut col);
            for (i, v) in col.iter().enumerate() {
                *out.0.add(i * self.rows + first + r) = *v;
            }
        }
    }
}

thread_local! {
    /// Each pool thread's f32 panel of expanded weights.
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
fn has_avx2_fma() -> bool {
    use std::sync::OnceLock;
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
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

/// Dot products of one weight row with every activation row: `out[i] = w · x[i]`.
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
    use super::{BlockType, BLOCK, MR, NR, NR_DECODE};
    use std::arch::x86_64::*;

    /// How one block type expands into f32: both paths get their weights from here, so
    /// they multiply identical values.
    trait Expand {
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
    unsafe fn hsum(v: __m256) -> f32 {
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
