//! Batched decode rows against 4-bit weights repacked for integer dot products.
//!
//! The GGUF layout keeps each weight row's blocks together, so a SIMD dot product over a
//! block yields eight or sixteen partial sums of *one* output, which then need a horizontal
//! reduction and a scale per output and block. Here, at load, each group of [`GROUP`]
//! weight rows is interleaved block by block, four weights at a time: one 64-byte vector
//! holds four consecutive weights of sixteen rows. A `vpdpbusd` (or `maddubs` + `madd`)
//! of that vector with one activation row's four matching 8-bit values, broadcast, adds
//! four products to each of sixteen outputs at once; eight of them cover a block of 32.
//! The block's sixteen integer sums are then scaled with one multiply and two FMAs for all
//! sixteen outputs, and each output's lane holds its own result until the end: no
//! horizontal sums. A weight block is unpacked once per tile of up to [`MT_512`]
//! activation rows, not once per row.
//!
//! Per block, every output lane computes, in this order,
//! `acc = fma(m_w, d_x · Σq_x, acc)` then `acc = fma(f32(Σ q_w q_x), d_w · d_x, acc)`,
//! with the integer sum exact. Every path (scalar, AVX2, AVX-VNNI, AVX-512, AVX-512 VNNI)
//! does exactly these operations, so all of them give the same bits, and an output never
//! depends on which other rows share the call.
//!
//! Q8_0 weights (the `lm_head` of the default model) fit the same scheme one byte a weight:
//! a signed weight `q` is stored as the unsigned `q + 128` with the offset `m = −128·d`
//! (exact in f16 whenever `d` is finite and not too large), so `d·q = d·(q + 128) + m` and the
//! arithmetic above is unchanged. A group's block then holds eight 64-byte vectors of four
//! weights × 16 rows instead of four vectors of nibbles. `vpdpbusd` takes those bytes as
//! they are. `maddubs` would saturate on the 16-bit sum of two products of up to
//! 255 · 127, so the AVX-512BW path splits each byte into its two nibbles and adds `16 ×`
//! the high nibbles' sum, and the AVX2 path multiplies the signed `q` (`|q|` against the
//! activation with `q`'s sign) and adds `128 ×` the activations' block sum: the same exact
//! integer every way.

use half::f16;

use super::{BlockType, QuantRows, BLOCK};

/// Weight rows interleaved together (the lanes of a 512-bit vector of i32 sums).
pub const GROUP: usize = 16;
/// Bytes of one group's block: 16 `d` and 16 `m` as f16, then 16 × 32 nibbles.
const GROUP_BLOCK_BYTES: usize = 2 * GROUP * 2 + GROUP * BLOCK / 2;
/// The same for 8-bit weights: 16 × 32 bytes after the scales.
const WIDE_GROUP_BLOCK_BYTES: usize = 2 * GROUP * 2 + GROUP * BLOCK;

/// Bytes of one group's block for nibbles (`WIDE = false`) or bytes (`WIDE = true`).
const fn block_bytes(wide: bool) -> usize {
    if wide {
        WIDE_GROUP_BLOCK_BYTES
    } else {
        GROUP_BLOCK_BYTES
    }
}
/// Activation rows per tile on the 512-bit paths (16 accumulators + 8 sums fit 32 registers).
pub const MT_512: usize = 8;
/// Activation rows per tile on the 256-bit paths (16 registers); 4-bit weights on the
/// AVX2 path take twice as many (`Dot256::NIBBLE_ROWS`).
pub const MT_256: usize = 4;

/// A 4-bit (or, from Q8_0, 8-bit) matrix in the interleaved layout (rows padded to a
/// multiple of [`GROUP`] with zero weights).
#[derive(Debug, Clone)]
pub struct PackedQ4 {
    pub rows: usize,
    pub cols: usize,
    /// One byte a weight (from Q8_0) rather than one nibble.
    wide: bool,
    data: Vec<u8>,
}

impl PackedQ4 {
    /// Repacks GGUF Q4_0 or Q4_1 rows (`row_bytes` each). `None` for other types, or for a
    /// Q4_0 scale whose offset `−8·d` is not exact in f16 (the caller keeps the GGUF
    /// kernels then).
    pub fn new(kind: BlockType, rows: usize, cols: usize, src: &[u8]) -> Option<Self> {
        let (header, has_m) = match kind {
            BlockType::Q4_0 => (2, false),
            BlockType::Q4_1 => (4, true),
            BlockType::Q8_0 => return None,
        };
        let bb = kind.block_bytes();
        let nb = cols / BLOCK;
        let groups = rows.div_ceil(GROUP);
        let mut data = vec![0u8; groups * nb * GROUP_BLOCK_BYTES];
        for r in 0..rows {
            let (g, lane) = (r / GROUP, r % GROUP);
            for b in 0..nb {
                let blk = &src[(r * nb + b) * bb..(r * nb + b + 1) * bb];
                let d = u16::from_le_bytes([blk[0], blk[1]]);
                let m = if has_m {
                    u16::from_le_bytes([blk[2], blk[3]])
                } else {
                    let off = -8.0 * f16::from_bits(d).to_f32();
                    let m = f16::from_f32(off);
                    if m.to_f32() != off {
                        return None;
                    }
                    m.to_bits()
                };
                let out = &mut data[(g * nb + b) * GROUP_BLOCK_BYTES..][..GROUP_BLOCK_BYTES];
                out[2 * lane..2 * lane + 2].copy_from_slice(&d.to_le_bytes());
                out[2 * GROUP + 2 * lane..2 * GROUP + 2 * lane + 2]
                    .copy_from_slice(&m.to_le_bytes());
                // Byte j of a GGUF block holds element j (low nibble) and j + 16 (high):
                // the four bytes of quad p give elements 4p..4p+4 and 16+4p..16+4p+4.
                let qs = &blk[header..header + 16];
                for p in 0..4 {
                    let at = 4 * GROUP + p * 4 * GROUP + 4 * lane;
                    out[at..at + 4].copy_from_slice(&qs[4 * p..4 * p + 4]);
                }
            }
        }
        Some(Self {
            rows,
            cols,
            wide: false,
            data,
        })
    }

    /// Repacks GGUF Q8_0 rows as unsigned bytes `q + 128` with the offset `−128·d`. `None`
    /// when some block's offset is not exact in f16 (a scale above 511.75, or not finite):
    /// the caller keeps f32 activations for that matrix then.
    pub fn new_q8_0(rows: usize, cols: usize, src: &[u8]) -> Option<Self> {
        let bb = BlockType::Q8_0.block_bytes();
        let nb = cols / BLOCK;
        let groups = rows.div_ceil(GROUP);
        let mut data = vec![0u8; groups * nb * WIDE_GROUP_BLOCK_BYTES];
        for r in 0..rows {
            let (g, lane) = (r / GROUP, r % GROUP);
            for b in 0..nb {
                let blk = &src[(r * nb + b) * bb..(r * nb + b + 1) * bb];
                let d = u16::from_le_bytes([blk[0], blk[1]]);
                let off = -128.0 * f16::from_bits(d).to_f32();
                let m = f16::from_f32(off);
                if m.to_f32() != off {
                    return None;
                }
                let out =
                    &mut data[(g * nb + b) * WIDE_GROUP_BLOCK_BYTES..][..WIDE_GROUP_BLOCK_BYTES];
                out[2 * lane..2 * lane + 2].copy_from_slice(&d.to_le_bytes());
                out[2 * GROUP + 2 * lane..2 * GROUP + 2 * lane + 2]
                    .copy_from_slice(&m.to_bits().to_le_bytes());
                // Quad p holds elements 4p..4p+4; flipping the sign bit adds 128.
                for p in 0..8 {
                    let at = 4 * GROUP + p * 4 * GROUP + 4 * lane;
                    for e in 0..4 {
                        out[at + e] = blk[2 + 4 * p + e] ^ 0x80;
                    }
                }
            }
        }
        Some(Self {
            rows,
            cols,
            wide: true,
            data,
        })
    }

    /// Bytes the packed weights take.
    pub fn size_bytes(&self) -> usize {
        self.data.len()
    }

    fn group_bytes(&self) -> usize {
        self.cols / BLOCK * block_bytes(self.wide)
    }
}

/// The instruction-set path of the integer kernels, in increasing order of capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum KernelPath {
    Scalar,
    /// 256-bit, `maddubs` + `madd` for the integer sums.
    Avx2,
    /// 256-bit with `vpdpbusd` (AVX-VNNI).
    AvxVnni,
    /// 512-bit (AVX-512F/BW), `maddubs` + `madd`.
    Avx512,
    /// 512-bit with `vpdpbusd` (AVX-512 VNNI).
    Avx512Vnni,
}

impl KernelPath {
    pub const ALL: [KernelPath; 5] = [
        Self::Scalar,
        Self::Avx2,
        Self::AvxVnni,
        Self::Avx512,
        Self::Avx512Vnni,
    ];

    /// The name `STRATA_KERNEL` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::Scalar => "scalar",
            Self::Avx2 => "avx2",
            Self::AvxVnni => "avxvnni",
            Self::Avx512 => "avx512",
            Self::Avx512Vnni => "avx512vnni",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == s)
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = super::has_avx2_fma();
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl");
            match self {
                Self::Scalar => true,
                Self::Avx2 => avx2,
                Self::AvxVnni => avx2 && is_x86_feature_detected!("avxvnni"),
                Self::Avx512 => avx512,
                Self::Avx512Vnni => avx512 && is_x86_feature_detected!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Self::Scalar
        }
    }

    /// Every path this CPU supports, lowest first (the scalar one always).
    pub fn here() -> impl Iterator<Item = Self> {
        Self::ALL.into_iter().filter(|p| p.supported())
    }

    /// The best path this CPU supports.
    pub fn best() -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|p| p.supported())
            .unwrap_or(Self::Scalar)
    }

    /// The path in use: `STRATA_KERNEL` when set to a path this CPU supports (a path it
    /// lacks gives the best one below it), otherwise the best one. Read once.
    pub fn active() -> Self {
        use std::sync::OnceLock;
        static ACTIVE: OnceLock<KernelPath> = OnceLock::new();
        *ACTIVE.get_or_init(|| {
            let Ok(want) = std::env::var("STRATA_KERNEL") else {
                return Self::best();
            };
            let Some(want) = Self::parse(want.trim()) else {
                tracing::warn!(value = %want, "unknown STRATA_KERNEL; using the best path");
                return Self::best();
            };
            let got = Self::ALL
                .into_iter()
                .rev()
                .find(|p| *p <= want && p.supported())
                .unwrap_or(Self::Scalar);
            if got != want {
                tracing::warn!(
                    wanted = want.name(),
                    using = got.name(),
                    "kernel path not supported here"
                );
            }
            got
        })
    }

    /// `self` if this CPU runs it, else the best supported path below it.
    pub fn or_supported(self) -> Self {
        Self::ALL
            .into_iter()
            .rev()
            .find(|p| *p <= self && p.supported())
            .unwrap_or(Self::Scalar)
    }
}

/// Output columns `first..first + rows` (`first` a multiple of [`GROUP`]) for every
/// quantized activation row, written to `out` (row stride `ldy`, column 0 of the matrix).
///
/// # Safety
/// `out` is writable for `q.m` rows of `ldy ≥ w.rows` floats and no one else writes these
/// columns; `q.k == w.cols`; `path` is supported by this CPU.
pub unsafe fn q8_chunk(
    path: KernelPath,
    w: &PackedQ4,
    first: usize,
    rows: usize,
    q: &QuantRows,
    out: *mut f32,
    ldy: usize,
) {
    debug_assert_eq!(first % GROUP, 0);
    let gb = w.group_bytes();
    let g0 = first / GROUP;
    let g1 = (first + rows).div_ceil(GROUP);
    for g in g0..g1 {
        let wg = &w.data[g * gb..(g + 1) * gb];
        let col = g * GROUP;
        let valid = (w.rows.min(first + rows) - col).min(GROUP);
        let y = out.add(col);
        let wide = w.wide;
        match path {
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512Vnni => x86::group_512_vnni(wg, q, y, ldy, valid, wide),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => x86::group_512_bw(wg, q, y, ldy, valid, wide),
            #[cfg(target_arch = "x86_64")]
            KernelPath::AvxVnni => x86::group_256_vnni(wg, q, y, ldy, valid, wide),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 => x86::group_256_avx2(wg, q, y, ldy, valid, wide),
            _ if wide => group_scalar::<true>(wg, q, y, ldy, valid),
            _ => group_scalar::<false>(wg, q, y, ldy, valid),
        }
    }
}

/// One group of weight rows for every activation row, one output at a time: the same
/// operations as the SIMD lanes.
///
/// # Safety
/// As [`q8_chunk`], for columns `0..valid` from `y`.
unsafe fn group_scalar<const WIDE: bool>(
    wg: &[u8],
    q: &QuantRows,
    y: *mut f32,
    ldy: usize,
    valid: usize,
) {
    let nb = q.k / BLOCK;
    let gbb = block_bytes(WIDE);
    for i in 0..q.m {
        let xq = &q.q[i * q.k..(i + 1) * q.k];
        for lane in 0..valid {
            let mut acc = 0f32;
            for b in 0..nb {
                let blk = &wg[b * gbb..(b + 1) * gbb];
                let dw = f16::from_bits(u16::from_le_bytes([blk[2 * lane], blk[2 * lane + 1]]));
                let at = 2 * GROUP + 2 * lane;
                let mw = f16::from_bits(u16::from_le_bytes([blk[at], blk[at + 1]]));
                let xb = &xq[b * BLOCK..(b + 1) * BLOCK];
                let mut sum = 0i32;
                if WIDE {
                    for p in 0..8 {
                        let at = 4 * GROUP + p * 4 * GROUP + 4 * lane;
                        for e in 0..4 {
                            sum += i32::from(blk[at + e]) * i32::from(xb[4 * p + e]);
                        }
                    }
                } else {
                    for p in 0..4 {
                        let at = 4 * GROUP + p * 4 * GROUP + 4 * lane;
                        for e in 0..4 {
                            let byte = blk[at + e];
                            sum += i32::from(byte & 0x0F) * i32::from(xb[4 * p + e]);
                            sum += i32::from(byte >> 4) * i32::from(xb[16 + 4 * p + e]);
                        }
                    }
                }
                let (dx, sx) = (q.d[i * nb + b], q.s8[i * nb + b] * 8.0);
                acc = mw.to_f32().mul_add(sx, acc);
                acc = (sum as f32).mul_add(dw.to_f32() * dx, acc);
            }
            *y.add(i * ldy + lane) = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{block_bytes, QuantRows, BLOCK, GROUP, MT_256, MT_512};
    use std::arch::x86_64::*;

    /// `acc + Σ_4 u8(a) · i8(b)` per 32-bit lane (the weights are `a`, at most 15, so the
    /// 16-bit pair sums of `maddubs` never saturate: 2 · 15 · 127 < 32767).
    ///
    /// `dot8` is the same for full bytes `a` (up to 255), exact in 32 bits either way.
    trait Dot512 {
        unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
        unsafe fn dot8(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
    }
    /// The 256-bit paths sum one block of one tile row in an accumulator of their own
    /// form, turned into eight exact 32-bit sums once per block by `done`.
    ///
    /// `nib` adds `Σ_4 u8(a) · i8(b)` per 32-bit lane for nibbles `a` (at most 15). Full
    /// bytes `u` (stored as `q + 128`) are first prepared once per weight vector for all
    /// the tile's rows (`prep`); `bytes` then adds each row's products, and `bytes_done`
    /// turns the block's accumulator into `Σ u · x` per lane, given the row's `Σx` over
    /// the block. Every sum is exact, so each form gives the same integers as the 512-bit
    /// paths.
    trait Dot256 {
        unsafe fn nib(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
        unsafe fn nib_done(acc: __m256i) -> __m256i;
        unsafe fn prep(u: __m256i) -> [__m256i; 2];
        unsafe fn bytes(acc: __m256i, w: [__m256i; 2], x: __m256i) -> __m256i;
        unsafe fn bytes_done(acc: __m256i, x_sum: i32) -> __m256i;
        /// Activation rows a tile of 4-bit weights takes: [`MT_256`], or twice that where
        /// it was measured faster.
        const NIBBLE_ROWS: usize;
        /// The same for 8-bit weights.
        const BYTE_ROWS: usize;
    }
    struct Vnni512;
    struct Madd512;
    struct Vnni256;
    struct Madd256;

    impl Dot512 for Vnni512 {
        #[inline(always)]
        unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(acc, a, b)
        }
        #[inline(always)]
        unsafe fn dot8(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            _mm512_dpbusd_epi32(acc, a, b)
        }
    }
    impl Dot512 for Madd512 {
        #[inline(always)]
        unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            let pairs = _mm512_maddubs_epi16(a, b);
            _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))
        }
        #[inline(always)]
        unsafe fn dot8(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            let mask = _mm512_set1_epi8(0x0F);
            let lo = _mm512_maddubs_epi16(_mm512_and_si512(a, mask), b);
            let hi = _mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(a, 4), mask), b);
            let lo = _mm512_madd_epi16(lo, _mm512_set1_epi16(1));
            let hi = _mm512_madd_epi16(hi, _mm512_set1_epi16(16));
            _mm512_add_epi32(acc, _mm512_add_epi32(lo, hi))
        }
    }
    impl Dot256 for Vnni256 {
        // Not measured on a CPU with AVX-VNNI: kept at four rows.
        const NIBBLE_ROWS: usize = MT_256;
        const BYTE_ROWS: usize = MT_256;
        #[inline(always)]
        unsafe fn nib(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(acc, a, b)
        }
        #[inline(always)]
        unsafe fn nib_done(acc: __m256i) -> __m256i {
            acc
        }
        #[inline(always)]
        unsafe fn prep(u: __m256i) -> [__m256i; 2] {
            [u, u]
        }
        #[inline(always)]
        unsafe fn bytes(acc: __m256i, w: [__m256i; 2], x: __m256i) -> __m256i {
            _mm256_dpbusd_avx_epi32(acc, w[0], x)
        }
        #[inline(always)]
        unsafe fn bytes_done(acc: __m256i, _x_sum: i32) -> __m256i {
            acc
        }
    }
    /// `maddubs` gives 16-bit sums of two products. For nibbles they are added up in 16
    /// bits over the whole block and widened by one `madd` at its end (not one per
    /// `maddubs`). No 16-bit sum can overflow: a nibble times an activation is at most
    /// 15 · 127 in magnitude, a pair 3,810, and a block adds eight pairs into each 16-bit
    /// lane (30,480 < 32,767).
    ///
    /// Full bytes would saturate `maddubs` (255 · 127 · 2 > 32,767), so they are taken as
    /// the signed `q = u − 128`: `maddubs(|q|, sign(x, q))` multiplies `|q| ≤ 128` by
    /// `±x` (activations are at most 127 in magnitude), a pair at most 32,512, widened by
    /// a `madd` each; `128 · Σx` at the block's end makes `Σ q·x` the stored bytes'
    /// `Σ u·x`. One `maddubs` and one accumulator a row per weight vector, where splitting
    /// each byte into its nibbles took two of each.
    impl Dot256 for Madd256 {
        // Eight: a block's per-row work is fixed, and the unpacking of its nibbles (a
        // fifth of it at four rows) is shared by the tile. `kernel_bench 16 64` on a
        // 2-vCPU Zen 3, three interleaved rounds, time at eight rows ÷ at four: 0.87–1.0
        // (most 0.90–0.97) for the 3072×576, 576×1536 and 49152×576 4-bit shapes.
        const NIBBLE_ROWS: usize = 2 * MT_256;
        // Eight for bytes too, now that a row needs one accumulator (with the nibble
        // split's two, eight rows spilled and four were faster). The 49152×576 Q8_0
        // `lm_head` at 16 rows, `kernel_bench 1 16 64`, three interleaved rounds on the
        // Zen 3: 6.36 ms (nibble split, four rows), 5.95 (sign, four), 5.06 (sign, eight).
        const BYTE_ROWS: usize = 2 * MT_256;
        #[inline(always)]
        unsafe fn nib(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_add_epi16(acc, _mm256_maddubs_epi16(a, b))
        }
        #[inline(always)]
        unsafe fn nib_done(acc: __m256i) -> __m256i {
            _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
        }
        #[inline(always)]
        unsafe fn prep(u: __m256i) -> [__m256i; 2] {
            let q = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
            [_mm256_abs_epi8(q), q]
        }
        #[inline(always)]
        unsafe fn bytes(acc: __m256i, w: [__m256i; 2], x: __m256i) -> __m256i {
            let pairs = _mm256_maddubs_epi16(w[0], _mm256_sign_epi8(x, w[1]));
            _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
        }
        #[inline(always)]
        unsafe fn bytes_done(acc: __m256i, x_sum: i32) -> __m256i {
            _mm256_add_epi32(acc, _mm256_set1_epi32(x_sum << 7))
        }
    }

    /// Raw view of the activation rows from row `i` on.
    #[derive(Clone, Copy)]
    struct Rows {
        q: *const i8,
        d: *const f32,
        s8: *const f32,
        sums: *const i32,
        k: usize,
    }

    impl Rows {
        fn of(q: &QuantRows, i: usize) -> Self {
            let nb = q.k / BLOCK;
            // SAFETY: i ≤ q.m, so the offsets stay within (or one past) the buffers.
            unsafe {
                Self {
                    q: q.q.as_ptr().add(i * q.k),
                    d: q.d.as_ptr().add(i * nb),
                    s8: q.s8.as_ptr().add(i * nb),
                    sums: q.sums.as_ptr().add(i * nb),
                    k: q.k,
                }
            }
        }
        /// Four activation bytes `at..at + 4` of row `i`, in every 32-bit lane.
        #[inline(always)]
        unsafe fn quad(self, i: usize, at: usize) -> i32 {
            (self.q.add(i * self.k + at) as *const i32).read_unaligned()
        }
        /// `Σq` of row `i`'s block `b`.
        #[inline(always)]
        unsafe fn sum(self, i: usize, b: usize) -> i32 {
            *self.sums.add(i * (self.k / BLOCK) + b)
        }
        /// `d` and `s8` of row `i`'s block `b` as stored.
        #[inline(always)]
        unsafe fn raw_scales(self, i: usize, b: usize) -> (f32, f32) {
            let nb = self.k / BLOCK;
            (*self.d.add(i * nb + b), *self.s8.add(i * nb + b))
        }
        #[inline(always)]
        unsafe fn scales(self, i: usize, b: usize) -> (f32, f32) {
            let nb = self.k / BLOCK;
            (*self.d.add(i * nb + b), *self.s8.add(i * nb + b) * 8.0)
        }
    }

    /// The 512-bit paths, one function per instruction set so that the compiler never
    /// emits an instruction of a feature the CPU may lack.
    ///
    /// # Safety
    /// AVX-512F/BW/VL, FMA, F16C and AVX-512 VNNI; as [`super::q8_chunk`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")]
    pub unsafe fn group_512_vnni(
        wg: &[u8],
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
        wide: bool,
    ) {
        if wide {
            group_512::<Vnni512, true>(wg, q, y, ldy, valid)
        } else {
            group_512::<Vnni512, false>(wg, q, y, ldy, valid)
        }
    }

    /// # Safety
    /// AVX-512F/BW/VL, FMA and F16C; as [`super::q8_chunk`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,fma,f16c")]
    pub unsafe fn group_512_bw(
        wg: &[u8],
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
        wide: bool,
    ) {
        if wide {
            group_512::<Madd512, true>(wg, q, y, ldy, valid)
        } else {
            group_512::<Madd512, false>(wg, q, y, ldy, valid)
        }
    }

    #[inline(always)]
    unsafe fn group_512<D: Dot512, const WIDE: bool>(
        wg: &[u8],
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
    ) {
        let mut i = 0;
        while i < q.m {
            let x = Rows::of(q, i);
            let yi = y.add(i * ldy);
            let wp = wg.as_ptr();
            match (q.m - i).min(MT_512) {
                8 => tile_512::<D, WIDE, 8>(wp, x, yi, ldy, valid),
                7 => tile_512::<D, WIDE, 7>(wp, x, yi, ldy, valid),
                6 => tile_512::<D, WIDE, 6>(wp, x, yi, ldy, valid),
                5 => tile_512::<D, WIDE, 5>(wp, x, yi, ldy, valid),
                4 => tile_512::<D, WIDE, 4>(wp, x, yi, ldy, valid),
                3 => tile_512::<D, WIDE, 3>(wp, x, yi, ldy, valid),
                2 => tile_512::<D, WIDE, 2>(wp, x, yi, ldy, valid),
                _ => tile_512::<D, WIDE, 1>(wp, x, yi, ldy, valid),
            }
            i += MT_512;
        }
    }

    /// `M` activation rows × the group's 16 weight rows.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indices name tile rows
    unsafe fn tile_512<D: Dot512, const WIDE: bool, const M: usize>(
        w: *const u8,
        x: Rows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
    ) {
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); M];
        let gbb = block_bytes(WIDE);
        for b in 0..x.k / BLOCK {
            let blk = w.add(b * gbb);
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(2 * gbb) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(2 * gbb + 64) as *const i8);
            if WIDE {
                for line in 2..gbb / 64 {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(2 * gbb + 64 * line) as *const i8);
                }
            }
            let mut s = [_mm512_setzero_si512(); M];
            if WIDE {
                for p in 0..8 {
                    let v = _mm512_loadu_si512(blk.add(4 * GROUP + p * 64) as *const __m512i);
                    for i in 0..M {
                        let xq = _mm512_set1_epi32(x.quad(i, b * BLOCK + 4 * p));
                        s[i] = D::dot8(s[i], v, xq);
                    }
                }
            } else {
                for p in 0..4 {
                    let v = _mm512_loadu_si512(blk.add(4 * GROUP + p * 64) as *const __m512i);
                    let lo = _mm512_and_si512(v, mask);
                    let hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), mask);
                    for i in 0..M {
                        let xl = _mm512_set1_epi32(x.quad(i, b * BLOCK + 4 * p));
                        s[i] = D::dot(s[i], lo, xl);
                    }
                    for i in 0..M {
                        let xh = _mm512_set1_epi32(x.quad(i, b * BLOCK + 16 + 4 * p));
                        s[i] = D::dot(s[i], hi, xh);
                    }
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk as *const __m256i));
            let mw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(2 * GROUP) as *const __m256i));
            for i in 0..M {
                let (dx, sx) = x.scales(i, b);
                let a = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx), acc[i]);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), scale, a);
            }
        }
        let keep: __mmask16 = if valid >= GROUP {
            0xFFFF
        } else {
            (1u16 << valid) - 1
        };
        for i in 0..M {
            _mm512_mask_storeu_ps(y.add(i * ldy), keep, acc[i]);
        }
    }

    /// # Safety
    /// AVX2, FMA, F16C and AVX-VNNI; as [`super::q8_chunk`].
    #[target_feature(enable = "avx2,avxvnni,fma,f16c")]
    pub unsafe fn group_256_vnni(
        wg: &[u8],
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
        wide: bool,
    ) {
        if wide {
            group_256::<Vnni256, true>(wg, q, y, ldy, valid)
        } else {
            group_256::<Vnni256, false>(wg, q, y, ldy, valid)
        }
    }

    /// # Safety
    /// AVX2, FMA and F16C; as [`super::q8_chunk`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn group_256_avx2(
        wg: &[u8],
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
        wide: bool,
    ) {
        if wide {
            group_256::<Madd256, true>(wg, q, y, ldy, valid)
        } else {
            group_256::<Madd256, false>(wg, q, y, ldy, valid)
        }
    }

    #[inline(always)]
    unsafe fn group_256<D: Dot256, const WIDE: bool>(
        wg: &[u8],
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
    ) {
        // The group's two halves of eight rows, each its own pass.
        for half in 0..2 {
            let hv = valid.saturating_sub(8 * half).min(8);
            if hv == 0 {
                break;
            }
            tiles::<D, WIDE>(wg.as_ptr(), half, q, y.add(8 * half), ldy, hv);
        }
    }

    /// One half of a group for every activation row, `D::NIBBLE_ROWS` (4-bit weights) or
    /// `D::BYTE_ROWS` (8-bit) rows a tile: [`MT_256`] or up to twice that.
    #[inline(always)]
    unsafe fn tiles<D: Dot256, const WIDE: bool>(
        wp: *const u8,
        half: usize,
        q: &QuantRows,
        y: *mut f32,
        ldy: usize,
        hv: usize,
    ) {
        let step = if WIDE { D::BYTE_ROWS } else { D::NIBBLE_ROWS };
        debug_assert!((MT_256..=2 * MT_256).contains(&step));
        let mut i = 0;
        while i < q.m {
            let (x, yi) = (Rows::of(q, i), y.add(i * ldy));
            match (q.m - i).min(step) {
                8 => tile_256::<D, WIDE, 8>(wp, half, x, yi, ldy, hv),
                7 => tile_256::<D, WIDE, 7>(wp, half, x, yi, ldy, hv),
                6 => tile_256::<D, WIDE, 6>(wp, half, x, yi, ldy, hv),
                5 => tile_256::<D, WIDE, 5>(wp, half, x, yi, ldy, hv),
                4 => tile_256::<D, WIDE, 4>(wp, half, x, yi, ldy, hv),
                3 => tile_256::<D, WIDE, 3>(wp, half, x, yi, ldy, hv),
                2 => tile_256::<D, WIDE, 2>(wp, half, x, yi, ldy, hv),
                _ => tile_256::<D, WIDE, 1>(wp, half, x, yi, ldy, hv),
            }
            i += step;
        }
    }

    /// `M` activation rows × eight weight rows (half `half` of the group). No software
    /// prefetch: asking for the lines ahead made the single-row pass over the Q8_0
    /// `lm_head` slower (3.8 → 4.7–6.4 ms on a shared 2-vCPU EPYC), the hardware's stream
    /// prefetcher keeps up with it.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indices name tile rows
    unsafe fn tile_256<D: Dot256, const WIDE: bool, const M: usize>(
        w: *const u8,
        half: usize,
        x: Rows,
        y: *mut f32,
        ldy: usize,
        valid: usize,
    ) {
        let mask = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); M];
        let gbb = block_bytes(WIDE);
        for b in 0..x.k / BLOCK {
            let blk = w.add(b * gbb);
            let mut s = [_mm256_setzero_si256(); M];
            if WIDE {
                for p in 0..8 {
                    let at = blk.add(4 * GROUP + p * 64 + 32 * half);
                    let w = D::prep(_mm256_loadu_si256(at as *const __m256i));
                    for i in 0..M {
                        let xq = _mm256_set1_epi32(x.quad(i, b * BLOCK + 4 * p));
                        s[i] = D::bytes(s[i], w, xq);
                    }
                }
                for i in 0..M {
                    s[i] = D::bytes_done(s[i], x.sum(i, b));
                }
            } else {
                for p in 0..4 {
                    let at = blk.add(4 * GROUP + p * 64 + 32 * half);
                    let v = _mm256_loadu_si256(at as *const __m256i);
                    let lo = _mm256_and_si256(v, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), mask);
                    for i in 0..M {
                        let xl = _mm256_set1_epi32(x.quad(i, b * BLOCK + 4 * p));
                        s[i] = D::nib(s[i], lo, xl);
                    }
                    for i in 0..M {
                        let xh = _mm256_set1_epi32(x.quad(i, b * BLOCK + 16 + 4 * p));
                        s[i] = D::nib(s[i], hi, xh);
                    }
                }
                for i in 0..M {
                    s[i] = D::nib_done(s[i]);
                }
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * half) as *const __m128i));
            let mw = _mm256_cvtph_ps(_mm_loadu_si128(
                blk.add(2 * GROUP + 16 * half) as *const __m128i
            ));
            // `m_w · (8 · s8_x)` is `(8 · m_w) · s8_x` exactly (scaling by 8 is exact), so
            // the factor of 8 is paid once per tile instead of once per row.
            let mw8 = _mm256_mul_ps(mw, _mm256_set1_ps(8.0));
            for i in 0..M {
                let (dx, s8) = x.raw_scales(i, b);
                let a = _mm256_fmadd_ps(mw8, _mm256_set1_ps(s8), acc[i]);
                let scale = _mm256_mul_ps(dw, _mm256_set1_ps(dx));
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[i]), scale, a);
            }
        }
        for i in 0..M {
            if valid == 8 {
                _mm256_storeu_ps(y.add(i * ldy), acc[i]);
            } else {
                let mut lanes = [0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i]);
                std::ptr::copy_nonoverlapping(lanes.as_ptr(), y.add(i * ldy), valid);
            }
        }
    }
}
