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

pub mod packed;
pub use packed::{KernelPath, PackedQ4};

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
    /// The same weights interleaved for the batched integer kernel (decode rows): always
    /// for 4-bit weights that allow it, for Q8_0 only after
    /// [`BlockMatrix::with_q8_decode_rows`].
    packed: Option<PackedQ4>,
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
        let packed = PackedQ4::new(kind, rows, cols, &data);
        Ok(Self {
            kind,
            rows,
            cols,
            data,
            packed,
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
        let packed = PackedQ4::new(kind, rows, cols, &data);
        Some(BlockMatrix {
            kind,
            rows,
            cols,
            data,
            packed,
        })
    }

    /// Gives a Q8_0 matrix the 8-bit decode-row path as well: its weights are kept a
    /// second time in the interleaved layout, and [`BlockMatrix::matmul_split`] then
    /// quantizes decode rows' activations for it as it does for 4-bit weights. Other
    /// types, and Q8_0 weights whose scales the layout cannot hold exactly, are returned
    /// unchanged (f32 activations for every row).
    pub fn with_q8_decode_rows(mut self) -> Self {
        if self.kind == BlockType::Q8_0 && self.packed.is_none() {
            self.packed = PackedQ4::new_q8_0(self.rows, self.cols, &self.data);
        }
        self
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.kind.block_bytes()
    }

    /// Bytes the weights take (both layouts of a 4-bit matrix).
    pub fn size_bytes(&self) -> usize {
        self.data.len() + self.packed.as_ref().map_or(0, PackedQ4::size_bytes)
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

    /// `x: [m, cols]` → `[m, rows]`, every row with f32 activations.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        self.matmul_split(x, m, m)
    }

    /// Whether [`BlockMatrix::matmul_split`] quantizes activations for this block type.
    pub fn takes_q8_activations(&self) -> bool {
        match self.kind {
            BlockType::Q4_0 | BlockType::Q4_1 => true,
            BlockType::Q8_0 => self.packed.is_some(),
        }
    }

    /// `x: [m, cols]` → `[m, rows]`. Rows `0..exact` keep f32 activations; rows
    /// `exact..m` (decode rows) are quantized to 8 bits per block of 32 first when the
    /// weights are 4-bit ([`BlockMatrix::takes_q8_activations`]), and multiplied with
    /// integer dot products. Either way a row's result depends only on that row and on
    /// which of the two groups it is in, never on how many rows share the call.
    pub fn matmul_split(&self, x: &[f32], m: usize, exact: usize) -> Vec<f32> {
        self.matmul_split_on(KernelPath::active(), x, m, exact)
    }

    /// [`BlockMatrix::matmul_split`] on a given instruction-set path (one this CPU lacks
    /// runs the best one below it). Each path gives a row the same bits alone or in any
    /// batch; the integer paths of decode rows all give the same bits as each other.
    pub fn matmul_split_on(&self, path: KernelPath, x: &[f32], m: usize, exact: usize) -> Vec<f32> {
        let path = path.or_supported();
        assert_eq!(x.len(), m * self.cols, "activation shape");
        let n = self.rows;
        let mut y = vec![0f32; m * n];
        if m == 0 || n == 0 {
            return y;
        }
        let k = self.cols;
        let exact = if self.takes_q8_activations() {
            exact.min(m)
        } else {
            m
        };
        let quant = (exact < m).then(|| QuantRows::new_on(path, &x[exact * k..], m - exact, k));
        let panel = exact >= PANEL_MIN_M;
        let rows_per_task = if panel {
            PANEL_ROWS
        } else {
            // Enough tasks to balance the pool, each a whole number of register tiles.
            // Whole groups of the packed layout (a multiple of NR_DECODE too).
            (n / (rayon::current_num_threads() * 8))
                .clamp(1, 256)
                .next_multiple_of(packed::GROUP)
        };
        let out = OutPtr(y.as_mut_ptr());
        let tasks = n.div_ceil(rows_per_task);
        (0..tasks).into_par_iter().for_each(|task| {
            let first = task * rows_per_task;
            let rows = rows_per_task.min(n - first);
            // SAFETY: task `task` writes only columns `first..first + rows` of the `m × n`
            // output, and every task's range is disjoint.
            unsafe {
                if exact > 0 {
                    self.chunk(path, &x[..exact * k], exact, first, rows, out, panel);
                }
                if let Some(q) = &quant {
                    self.chunk_q8(path, q, first, rows, OutPtr(out.0.add(exact * n)));
                }
            }
        });
        y
    }

    /// Computes output columns `first..first + rows` for every quantized activation row.
    ///
    /// # Safety
    /// `out` points to a `q.m × self.rows` buffer that no one else writes in these columns;
    /// the matrix takes 8-bit activations ([`BlockMatrix::takes_q8_activations`]).
    unsafe fn chunk_q8(
        &self,
        path: KernelPath,
        q: &QuantRows,
        first: usize,
        rows: usize,
        out: OutPtr,
    ) {
        if let Some(p) = &self.packed {
            // SAFETY: `first` is a multiple of the group size (tasks are whole groups),
            // `path` is supported (checked by the caller), shapes as documented.
            packed::q8_chunk(path, p, first, rows, q, out.0, self.rows);
            return;
        }
        let rb = self.row_bytes();
        let data = &self.data[first * rb..(first + rows) * rb];
        #[cfg(target_arch = "x86_64")]
        {
            if path >= KernelPath::Avx2 {
                // SAFETY: AVX2, FMA and F16C are present (checked above); shapes as documented.
                avx2::q8_chunk(self.kind, data, rows, q, out.0.add(first), self.rows);
                return;
            }
        }
        for (r, row) in data.chunks_exact(rb).enumerate() {
            for i in 0..q.m {
                *out.0.add(i * self.rows + first + r) = row_dot_q8_scalar(self.kind, row, q, i);
            }
        }
    }

    /// Computes output columns `first..first + rows` for every activation row.
    ///
    /// # Safety
    /// `out` points to an `m × self.rows` buffer that no one else writes in these columns.
    #[allow(clippy::too_many_arguments)]
    unsafe fn chunk(
        &self,
        path: KernelPath,
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
            if path >= KernelPath::Avx2 {
                // SAFETY: AVX2, FMA and F16C are present (the path is supported); shapes
                // as documented.
                let y = out.0.add(first);
                if panel && path >= KernelPath::Avx512 {
                    // SAFETY: AVX-512F is present too (the path is supported).
                    PANEL.with_borrow_mut(|buf| {
                        avx512::panel_chunk(
                            self.kind, data, rows, x, m, self.cols, buf, y, self.rows,
                        )
                    });
                } else if panel {
                    PANEL.with_borrow_mut(|buf| {
                        avx2::panel_chunk(self.kind, data, rows, x, m, self.cols, buf, y, self.rows)
                    });
                } else {
                    avx2::decode_chunk(self.kind, data, rows, x, m, self.cols, y, self.rows);
                }
                return;
            }
        }
        let _ = (panel, path);
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
pub(crate) fn has_avx2_fma() -> bool {
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

/// Activation rows quantized to 8 bits per block of 32: `x ≈ d · q`, `q ∈ [-127, 127]`.
pub struct QuantRows {
    /// Rows.
    pub m: usize,
    /// Floats per row (a multiple of [`BLOCK`]).
    pub k: usize,
    /// `m × k` quantized values.
    q: Vec<i8>,
    /// `m × k/32` block scales.
    d: Vec<f32>,
    /// `m × k/32`: `d · Σq / 8` of each block. Spread over the 8 lanes of an accumulator
    /// it adds up to the block's `d · Σq` (a division by 8 is exact).
    s8: Vec<f32>,
    /// `m × k/32`: `Σq` of each block, the integer behind `s8` (the AVX2 path of 8-bit
    /// weights turns a sum over signed weights into one over the stored unsigned ones
    /// with it).
    sums: Vec<i32>,
}

impl QuantRows {
    /// Quantizes `m` rows of `k` floats (round half to even, scale from the block's
    /// largest magnitude; a NaN becomes 0). Each row depends on nothing but itself.
    pub fn new(x: &[f32], m: usize, k: usize) -> Self {
        Self::new_on(KernelPath::active(), x, m, k)
    }

    /// [`QuantRows::new`] on a given instruction-set path: every path gives the same bits.
    /// Large inputs are split over the rayon pool by rows.
    pub fn new_on(path: KernelPath, x: &[f32], m: usize, k: usize) -> Self {
        assert_eq!(x.len(), m * k, "activation shape");
        let nb = k / BLOCK;
        let mut q = vec![0i8; m * k];
        let mut d = vec![0f32; m * nb];
        let mut s8 = vec![0f32; m * nb];
        let mut sums = vec![0i32; m * nb];
        #[cfg(target_arch = "x86_64")]
        let simd = path.or_supported() >= KernelPath::Avx2;
        #[cfg(not(target_arch = "x86_64"))]
        let simd = {
            let _ = path;
            false
        };
        let quantize =
            |x: &[f32], q: &mut [i8], d: &mut [f32], s8: &mut [f32], sums: &mut [i32]| {
                #[cfg(target_arch = "x86_64")]
                if simd {
                    // SAFETY: AVX2 is present (the path is supported); the slices hold
                    // whole blocks, `d`, `s8` and `sums` one entry per block.
                    unsafe { avx2::quantize_blocks(x, q, d, s8, sums) };
                    return;
                }
                let _ = simd;
                quantize_blocks_scalar(x, q, d, s8, sums);
            };
        // Rows per task: about 32 KiB of input each, so that a batched decode step's rows
        // (16 × 576 floats and up) are shared by the pool while a single row stays on
        // this thread.
        let rows_per_task = (8_192 / k.max(1)).max(1);
        if m <= rows_per_task {
            quantize(x, &mut q, &mut d, &mut s8, &mut sums);
        } else {
            x.par_chunks(rows_per_task * k)
                .zip(q.par_chunks_mut(rows_per_task * k))
                .zip(d.par_chunks_mut(rows_per_task * nb))
                .zip(s8.par_chunks_mut(rows_per_task * nb))
                .zip(sums.par_chunks_mut(rows_per_task * nb))
                .for_each(|((((x, q), d), s8), sums)| quantize(x, q, d, s8, sums));
        }
        Self {
            m,
            k,
            q,
            d,
            s8,
            sums,
        }
    }
}

/// One block's scale from its largest magnitude, and the inverse the values are
/// multiplied by (0 for an all-zero, infinite or NaN-scaled block).
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    let scale = amax / 127.0;
    let inv = if scale > 0.0 && scale.is_finite() {
        1.0 / scale
    } else {
        0.0
    };
    (scale, inv)
}

/// The portable quantizer, the definition every SIMD path reproduces bit for bit.
fn quantize_blocks_scalar(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s8: &mut [f32],
    sums: &mut [i32],
) {
    for ((((xs, qs), d), s8), block_sum) in x
        .chunks_exact(BLOCK)
        .zip(q.chunks_exact_mut(BLOCK))
        .zip(d.iter_mut())
        .zip(s8.iter_mut())
        .zip(sums.iter_mut())
    {
        // `f32::max` skips a NaN operand, so a NaN never becomes the scale.
        let amax = xs.iter().fold(0f32, |a, v| v.abs().max(a));
        let (scale, inv) = block_scale(amax);
        let mut sum = 0i32;
        for (o, v) in qs.iter_mut().zip(xs) {
            let p = v * inv;
            // |v · inv| ≤ 127 up to rounding; the clamp keeps an overflow in range and
            // a NaN (from a NaN input, or ∞ · 0) becomes 0.
            let r = if p.is_nan() {
                0
            } else {
                p.round_ties_even().clamp(-127.0, 127.0) as i8
            };
            sum += i32::from(r);
            *o = r;
        }
        *d = scale;
        *s8 = scale * sum as f32 / 8.0;
        *block_sum = sum;
    }
}

/// The dot product of one 4-bit weight row with quantized activation row `i`: the same
/// terms as the SIMD kernel (for machines without AVX2).
fn row_dot_q8_scalar(kind: BlockType, row: &[u8], q: &QuantRows, i: usize) -> f32 {
    let nb = q.k / BLOCK;
    let mut acc = 0f32;
    for (b, block) in row.chunks_exact(kind.block_bytes()).enumerate() {
        let d = read_f16(block, 0);
        let (mn, qs) = match kind {
            BlockType::Q4_1 => (read_f16(block, 2), &block[4..20]),
            _ => (-8.0 * d, &block[2..18]),
        };
        let xq = &q.q[i * q.k + b * BLOCK..i * q.k + (b + 1) * BLOCK];
        let mut isum = 0i32;
        for j in 0..16 {
            isum += i32::from(qs[j] & 0x0F) * i32::from(xq[j]);
            isum += i32::from(qs[j] >> 4) * i32::from(xq[j + 16]);
        }
        acc += mn * q.s8[i * nb + b] * 8.0;
        acc += isum as f32 * (d * q.d[i * nb + b]);
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

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
    fn quantized_rows_stay_close_to_the_dequantized_product() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for kind in [BlockType::Q4_0, BlockType::Q4_1] {
            let w = random_blocks(kind, 37, 96, 5);
            let m = 5;
            let x: Vec<f32> = (0..m * 96).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want = reference(&w, &x, m);
            // Rows 0..2 f32, rows 2..5 quantized.
            let got = w.matmul_split(&x, m, 2);
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                let tol = if i < 2 * w.rows { 1e-4 } else { 1e-2 };
                assert!(
                    (g - r).abs() <= tol * scale,
                    "{kind:?} output {i}: {g} vs {r}"
                );
            }
            // The integer path against its scalar twin (same terms, other summation order).
            let q = QuantRows::new(&x[2 * 96..], 3, 96);
            let rb = w.row_bytes();
            for i in 0..3 {
                for n in 0..w.rows {
                    let s = row_dot_q8_scalar(kind, &w.data[n * rb..(n + 1) * rb], &q, i);
                    let g = got[(2 + i) * w.rows + n];
                    assert!(
                        (s - g).abs() <= 1e-5 * scale,
                        "{kind:?} {i},{n}: {s} vs {g}"
                    );
                }
            }
        }
    }

    #[test]
    fn quantized_rows_alone_are_bit_identical_to_a_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for kind in [BlockType::Q4_0, BlockType::Q4_1] {
            let w = random_blocks(kind, 37, 128, 13);
            let m = 11;
            let x: Vec<f32> = (0..m * 128).map(|_| rng.random_range(-2.0..2.0)).collect();
            // Every split of the batch: the quantized rows must not notice their company.
            for exact in [0, 3, 4, 6] {
                let batch = w.matmul_split(&x, m, exact);
                for i in exact..m {
                    let alone = w.matmul_split(&x[i * 128..(i + 1) * 128], 1, 0);
                    for j in 0..w.rows {
                        assert_eq!(
                            alone[j].to_bits(),
                            batch[i * w.rows + j].to_bits(),
                            "{kind:?} exact={exact} row {i} col {j}"
                        );
                    }
                }
                let f32_rows = w.matmul(&x[..exact * 128], exact);
                assert_eq!(&batch[..exact * w.rows], &f32_rows[..], "{kind:?}");
            }
        }
    }

    #[test]
    fn q8_0_weights_keep_f32_activations_in_a_split_call() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let w = random_blocks(BlockType::Q8_0, 9, 64, 3);
        let x: Vec<f32> = (0..3 * 64).map(|_| rng.random_range(-1.0..1.0)).collect();
        assert!(!w.takes_q8_activations());
        assert_eq!(w.matmul_split(&x, 3, 0), w.matmul(&x, 3));
    }

    #[test]
    fn quantizing_zero_and_non_finite_rows_stays_in_range() {
        let mut x = vec![0f32; 64];
        x[40] = f32::NAN;
        x[41] = 1.0;
        let q = QuantRows::new(&x, 1, 64);
        assert_eq!(q.d[0], 0.0);
        assert!(q.q[..32].iter().all(|&v| v == 0));
        assert_eq!(q.s8[0], 0.0);
        // The NaN is skipped by the scale and quantized to 0.
        assert_eq!(q.d[1], 1.0 / 127.0);
        assert_eq!((q.q[40], q.q[41]), (0, 127));
        assert!(q.q.iter().all(|&v| (-127..=127).contains(&v)));
        let q = QuantRows::new(&[0.5f32; 32], 1, 32);
        assert_eq!(q.q[0], 127);
        assert_eq!(q.s8[0], 0.5 / 127.0 * (127.0 * 32.0) / 8.0);
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

    /// A random matrix that takes 8-bit decode rows (Q8_0 repacked for them).
    fn random_q8_rows(kind: BlockType, rows: usize, cols: usize, seed: u64) -> BlockMatrix {
        let w = random_blocks(kind, rows, cols, seed).with_q8_decode_rows();
        assert!(w.takes_q8_activations(), "{kind:?}");
        w
    }

    #[test]
    fn every_path_quantizes_activations_to_the_scalar_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(33);
        // Large enough to be split over the pool, with a short last task.
        let (m, k) = (70, 576);
        let mut x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
        // Exact ties (±0.5, ±2.5 steps of a block whose scale is 1), zeros, huge values,
        // NaN and infinities.
        let block = &mut x[..32];
        block[0] = 127.0;
        for (i, v) in [0.5f32, -0.5, 2.5, -2.5, 1.5, 126.5]
            .into_iter()
            .enumerate()
        {
            block[1 + i] = v;
        }
        x[32..64].fill(0.0);
        x[64] = f32::NAN;
        x[100] = f32::INFINITY;
        x[140] = f32::NEG_INFINITY;
        x[170] = f32::NAN;
        x[200] = 3.0e38;
        let want = QuantRows::new_on(KernelPath::Scalar, &x, m, k);
        assert_eq!(&want.q[1..7], &[0, 0, 2, -2, 2, 126]);
        for path in KernelPath::here() {
            let got = QuantRows::new_on(path, &x, m, k);
            assert_eq!(got.q, want.q, "{path:?}");
            assert_eq!(
                got.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{path:?}"
            );
            assert_eq!(
                got.s8.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                want.s8.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{path:?}"
            );
            assert_eq!(got.sums, want.sums, "{path:?}");
            // A row alone quantizes as it does among the others.
            let alone = QuantRows::new_on(path, &x[5 * k..6 * k], 1, k);
            assert_eq!(alone.q, want.q[5 * k..6 * k], "{path:?}");
        }
    }

    #[test]
    fn every_integer_path_gives_the_scalar_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        for kind in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            // Rows not a multiple of the group (a padded last group), several tasks.
            for (n, k) in [(37, 96), (53, 160), (130, 64)] {
                let w = random_q8_rows(kind, n, k, 17);
                assert!(w.packed.is_some());
                for m in [1, 2, 5, 8, 9, 17] {
                    let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                    let want = w.matmul_split_on(KernelPath::Scalar, &x, m, 0);
                    for path in KernelPath::here() {
                        let got = w.matmul_split_on(path, &x, m, 0);
                        for (i, (g, s)) in got.iter().zip(&want).enumerate() {
                            assert_eq!(
                                g.to_bits(),
                                s.to_bits(),
                                "{kind:?} {path:?} n={n} m={m} output {i}: {g} vs {s}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_path_keeps_a_row_identical_alone_and_in_a_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(22);
        for path in KernelPath::here() {
            // Q8_0 twice: f32 activations only, and with 8-bit decode rows.
            for (kind, q8_rows) in [
                (BlockType::Q4_0, true),
                (BlockType::Q4_1, true),
                (BlockType::Q8_0, false),
                (BlockType::Q8_0, true),
            ] {
                let (n, k, m) = (45, 128, 13);
                let w = random_blocks(kind, n, k, 19);
                let w = if q8_rows { w.with_q8_decode_rows() } else { w };
                assert_eq!(w.takes_q8_activations(), q8_rows, "{kind:?}");
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                for exact in [0, 2, 5, m] {
                    let batch = w.matmul_split_on(path, &x, m, exact);
                    for i in 0..m {
                        let row = &x[i * k..(i + 1) * k];
                        // A decode row alone is a split call with no f32 rows; an f32 row
                        // alone keeps its f32 activations.
                        let alone = w.matmul_split_on(path, row, 1, usize::from(i < exact));
                        for j in 0..n {
                            assert_eq!(
                                alone[j].to_bits(),
                                batch[i * n + j].to_bits(),
                                "{path:?} {kind:?} exact={exact} row {i} col {j}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_packed_kernel_agrees_with_the_gguf_integer_kernel_and_the_f32_product() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        for kind in [BlockType::Q4_0, BlockType::Q4_1] {
            let (n, k, m) = (40, 192, 6);
            let w = random_blocks(kind, n, k, 29);
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            let want = reference(&w, &x, m);
            let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
            let q = QuantRows::new(&x, m, k);
            let rb = w.row_bytes();
            for path in KernelPath::here() {
                let got = w.matmul_split_on(path, &x, m, 0);
                for i in 0..m {
                    for j in 0..n {
                        let g = got[i * n + j];
                        // Same terms, another order: within float rounding of the GGUF twin.
                        let twin = row_dot_q8_scalar(kind, &w.data[j * rb..(j + 1) * rb], &q, i);
                        assert!(
                            (g - twin).abs() <= 1e-5 * scale,
                            "{path:?} {i},{j}: {g} vs {twin}"
                        );
                        // 8-bit activations: close to the exact product.
                        let r = want[i * n + j];
                        assert!(
                            (g - r).abs() <= 1e-2 * scale,
                            "{path:?} {i},{j}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }

    /// `Σ_b d_w · d_x · Σ q_w q_x` in f64: the product the 8-bit kernels compute, for Q8_0
    /// weights.
    fn q8_0_twin(w: &BlockMatrix, q: &QuantRows, i: usize, n: usize) -> f32 {
        let rb = w.row_bytes();
        let nb = q.k / BLOCK;
        let row = &w.data[n * rb..(n + 1) * rb];
        let mut acc = 0f64;
        for (b, block) in row.chunks_exact(34).enumerate() {
            let isum: i32 = (0..BLOCK)
                .map(|j| i32::from(block[2 + j] as i8) * i32::from(q.q[i * q.k + b * BLOCK + j]))
                .sum();
            acc += f64::from(read_f16(block, 0)) * f64::from(q.d[i * nb + b]) * f64::from(isum);
        }
        acc as f32
    }

    #[test]
    fn q8_0_decode_rows_agree_with_the_integer_product_and_the_f32_product() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(24);
        let (n, k, m) = (40, 192, 6);
        let w = random_q8_rows(BlockType::Q8_0, n, k, 31);
        let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-1.0..1.0)).collect();
        let want = reference(&w, &x, m);
        let scale = want.iter().fold(0f32, |a, v| a.max(v.abs()));
        let q = QuantRows::new(&x, m, k);
        for path in KernelPath::here() {
            // Two rows f32, four decode rows.
            let got = w.matmul_split_on(path, &x, m, 2);
            for i in 0..m {
                for j in 0..n {
                    let (g, r) = (got[i * n + j], want[i * n + j]);
                    if i < 2 {
                        assert!(
                            (g - r).abs() <= 1e-4 * scale,
                            "{path:?} {i},{j}: {g} vs {r}"
                        );
                        continue;
                    }
                    // The offset form `d·(q + 128) − 128·d` only reorders exact terms.
                    let twin = q8_0_twin(&w, &q, i, j);
                    assert!(
                        (g - twin).abs() <= 1e-5 * scale,
                        "{path:?} {i},{j}: {g} vs {twin}"
                    );
                    assert!(
                        (g - r).abs() <= 1e-2 * scale,
                        "{path:?} {i},{j}: {g} vs {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_0_with_scales_the_layout_cannot_hold_keeps_f32_activations() {
        // −128 · 1024 overflows f16: the matrix stays on the f32 path for every row.
        let mut block = vec![0u8; 34];
        block[..2].copy_from_slice(&f16::from_f32(1024.0).to_bits().to_le_bytes());
        block[2] = 3;
        let w = BlockMatrix::new(BlockType::Q8_0, 1, 32, block)
            .expect("one block")
            .with_q8_decode_rows();
        assert!(w.packed.is_none());
        assert!(!w.takes_q8_activations());
        let x = vec![0.5f32; 32];
        assert_eq!(w.matmul_split(&x, 1, 0), vec![1024.0 * 3.0 * 0.5]);
        assert!(PackedQ4::new_q8_0(1, 32, &w.data).is_none());
        // A 4-bit matrix is returned as it was.
        let q4 = random_blocks(BlockType::Q4_1, 3, 64, 1);
        let again = q4.clone().with_q8_decode_rows();
        assert_eq!(again.size_bytes(), q4.size_bytes());
    }

    #[test]
    fn unpackable_weights_fall_back_to_the_gguf_kernels() {
        // A Q4_0 scale so large that −8·d overflows f16: not packed, still multiplied.
        let mut block = vec![0u8; 18];
        block[..2].copy_from_slice(&f16::from_f32(16384.0).to_bits().to_le_bytes());
        block[2] = 0x19;
        let w = BlockMatrix::new(BlockType::Q4_0, 1, 32, block).expect("one block");
        assert!(w.packed.is_none());
        let x = vec![1e-4f32; 32];
        let got = w.matmul_split(&x, 1, 0);
        let want = reference(&w, &x, 1);
        assert!(
            (got[0] - want[0]).abs() <= 1e-2 * want[0].abs().max(1.0),
            "{got:?} {want:?}"
        );
        assert!(PackedQ4::new(BlockType::Q8_0, 1, 32, &[0; 34]).is_none());
    }

    #[test]
    fn the_512_bit_f32_panel_gives_the_256_bit_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(25);
        for kind in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            // Odd chunks (a padding row), tails of the 6 × 8 tile, several tasks.
            for (n, k, m) in [(37, 96, 4), (101, 64, 7), (96, 128, 13), (49, 32, 22)] {
                let w = random_blocks(kind, n, k, 37);
                let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let want = w.matmul_split_on(KernelPath::Avx2, &x, m, m);
                for path in [KernelPath::Avx512, KernelPath::Avx512Vnni] {
                    let got = w.matmul_split_on(path, &x, m, m);
                    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            r.to_bits(),
                            "{kind:?} {path:?} n={n} m={m} output {i}: {g} vs {r}"
                        );
                    }
                }
            }
        }
    }

    /// Every path against the scalar definition, bit for bit, on odd shapes and every
    /// tile remainder of the row loop (1..=17 rows, and 64), and each row alone against
    /// the same row in the batch.
    #[test]
    fn integer_paths_match_scalar_for_every_row_count_and_alone() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(41);
        for kind in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            // A last group of 5 weight rows (one half empty), of 11 (a partial second
            // half), and a matrix smaller than one group.
            for (n, k) in [(37, 96), (27, 32), (7, 160)] {
                let w = random_q8_rows(kind, n, k, 43);
                let ms: Vec<usize> = (1..=17).chain([64]).collect();
                let x: Vec<f32> = (0..64 * k).map(|_| rng.random_range(-2.0..2.0)).collect();
                let alone: Vec<Vec<f32>> = (0..64)
                    .map(|i| w.matmul_split_on(KernelPath::Scalar, &x[i * k..(i + 1) * k], 1, 0))
                    .collect();
                for path in KernelPath::here() {
                    for &m in &ms {
                        let got = w.matmul_split_on(path, &x[..m * k], m, 0);
                        for i in 0..m {
                            for j in 0..n {
                                assert_eq!(
                                    got[i * n + j].to_bits(),
                                    alone[i][j].to_bits(),
                                    "{kind:?} {path:?} n={n} k={k} m={m} row {i} col {j}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// The largest integer sums a block can hold: every weight at its largest (nibbles of
    /// 15, Q8_0 bytes of 127 and −128) times activations of ±127, where the 16-bit partial
    /// sums of the `maddubs` paths come closest to overflowing.
    #[test]
    fn integer_paths_are_exact_at_the_largest_block_sums() {
        for kind in [BlockType::Q4_0, BlockType::Q4_1, BlockType::Q8_0] {
            let (n, k) = (19, 64);
            let bb = kind.block_bytes();
            let mut data = Vec::new();
            for r in 0..n {
                for _ in 0..k / BLOCK {
                    data.extend_from_slice(&f16::from_f32(0.25).to_bits().to_le_bytes());
                    if kind == BlockType::Q4_1 {
                        data.extend_from_slice(&f16::from_f32(-1.0).to_bits().to_le_bytes());
                    }
                    let header = if kind == BlockType::Q4_1 { 4 } else { 2 };
                    // Odd rows of Q8_0 hold −128 (offset byte 0), even ones 127 (255).
                    let byte = match kind {
                        BlockType::Q8_0 if r % 2 == 1 => 0x80,
                        BlockType::Q8_0 => 0x7F,
                        _ => 0xFF,
                    };
                    data.extend(std::iter::repeat_n(byte, bb - header));
                }
            }
            let w = BlockMatrix::new(kind, n, k, data)
                .expect("valid blocks")
                .with_q8_decode_rows();
            assert!(w.takes_q8_activations());
            // Rows of +1 and −1 (every value quantizes to ±127), and one that alternates.
            let m = 6;
            let mut x = Vec::with_capacity(m * k);
            for i in 0..m {
                for j in 0..k {
                    x.push(match i % 3 {
                        0 => 1.0,
                        1 => -1.0,
                        _ if j % 2 == 0 => 1.0,
                        _ => -1.0,
                    });
                }
            }
            let want = w.matmul_split_on(KernelPath::Scalar, &x, m, 0);
            for path in KernelPath::here() {
                let got = w.matmul_split_on(path, &x, m, 0);
                for (i, (g, s)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), s.to_bits(), "{kind:?} {path:?} output {i}");
                }
            }
            // And the scalar definition is the exact product (all terms exact in f32).
            let exact = reference(&w, &x, m);
            for (i, (s, e)) in want.iter().zip(&exact).enumerate() {
                assert!(
                    (s - e).abs() <= 1e-3 * e.abs().max(1.0),
                    "{kind:?} {i}: {s} vs {e}"
                );
            }
        }
    }

    #[test]
    fn kernel_paths_parse_and_never_pick_one_the_cpu_lacks() {
        for p in KernelPath::ALL {
            assert_eq!(KernelPath::parse(p.name()), Some(p));
            assert!(p.or_supported().supported());
            assert!(p.or_supported() <= p);
        }
        assert_eq!(KernelPath::parse("avx1024"), None);
        assert!(KernelPath::Scalar.supported());
        assert!(KernelPath::best().supported());
        assert!(KernelPath::active().supported());
    }
}
