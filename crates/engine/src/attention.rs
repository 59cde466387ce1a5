//! Causal attention over the paged KV cache for a ragged batch.
//!
//! One task per (token, KV head): the query heads that share the KV head (grouped-query
//! attention) are scored together, so each cached key and value is read once per group
//! rather than once per query head. Positions are mapped to cache offsets once per task,
//! block by block through the sequence's block table. With AVX2, scores come from a
//! register tile of three query heads × four keys (FMA accumulators, one reduction tree
//! per four dot products) and `P·V` from three heads × 32 output columns held in registers
//! over all positions; softmax uses a vectorizable `exp`. Both passes ask for the keys and
//! values they will read `tile4::AHEAD` positions in advance (a sequence's blocks are
//! scattered over the cache). Without AVX2 (or for head sizes not a multiple of 8) a
//! portable loop computes the same.
//!
//! With 8-bit entries ([`crate::kv::quant8`]) the same loops run over the raw codes (int8
//! widened, E4M3 mapped onto f16 bit patterns) and each head's scale is applied once per
//! position: a score is multiplied by its key's scale after the dot product, and a
//! probability by its value's scale before `P·V` (after the softmax sum, which is taken
//! over the true probabilities). Int8 keys are scored in integers against a 16-bit copy
//! of the query ([`int_keys`]).
//!
//! A token's output depends only on its own query, its position and its sequence's cached
//! keys and values: never on which other tokens share the step, so batching does not change
//! results.

mod int_keys;
#[cfg(target_arch = "x86_64")]
mod tile4;

use half::f16;
use rayon::prelude::*;

use crate::kernels::KernelPath;
use crate::kv::cache::KvBuf;
use crate::kv::quant8::{E4m3, Scaled};

/// A KV-cache entry type attention reads.
pub trait KvElem: Copy + Send + Sync {
    fn to_f32(self) -> f32;
    /// Eight consecutive entries as f32.
    ///
    /// # Safety
    /// AVX2 and F16C; `p` points at eight readable entries.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
    /// The entries as int8 codes, for the integer `q·k` ([`int_keys`]): int8 only.
    #[inline(always)]
    fn int8_codes(_entries: &[Self]) -> Option<&[i8]> {
        None
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
}

impl KvElem for i8 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }
    #[inline(always)]
    fn int8_codes(entries: &[Self]) -> Option<&[i8]> {
        Some(entries)
    }
}

/// E4M3 codes read in the cache's raw unit (the number times 2⁻⁸; the scales carry 2⁸).
impl KvElem for E4m3 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.raw()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // Eight bytes widened to 16 bits; sign to bit 15, exponent and mantissa up 7.
        let w = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
        let magnitude = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
        let sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
        _mm256_cvtph_ps(_mm_or_si128(magnitude, sign))
    }
}

/// 8-bit entries' scales: entry `i` of the layer is `code · scales[i / group]`.
#[derive(Clone, Copy)]
struct Scales<'a> {
    scales: &'a [f32],
    group: usize,
}

impl<'a> Scales<'a> {
    fn of<C>(buf: &'a Scaled<C>) -> Self {
        Self {
            scales: &buf.scales,
            group: buf.group,
        }
    }
}

/// The shapes attention needs.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// The factor on `q·k` (`1/√head_dim` for most families).
    pub scale: f32,
    /// A query at position `p` sees keys `p - window + 1 ..= p` only (a sliding layer).
    pub window: Option<usize>,
    /// `cap · tanh(score / cap)` before softmax (Gemma 2).
    pub softcap: Option<f32>,
}

impl AttnShape {
    /// Full causal attention scaled by `1/√head_dim`, without soft-capping.
    pub fn causal(n_head: usize, n_kv_head: usize, head_dim: usize, block_size: usize) -> Self {
        Self {
            n_head,
            n_kv_head,
            head_dim,
            block_size,
            scale: 1.0 / (head_dim as f32).sqrt(),
            window: None,
            softcap: None,
        }
    }
}

/// One token of the step: where it is and which blocks hold its sequence.
#[derive(Debug, Clone, Copy)]
pub struct TokenCtx<'a> {
    pub pos: usize,
    pub block_table: &'a [u32],
}

/// `out[t]` (all heads, `n_head × head_dim`) = softmax(q·Kᵀ · scale)·V over positions
/// `0..=pos` of token `t`'s sequence (the last `window` of them in a sliding layer), the
/// scores soft-capped first when asked. `q` is `[tokens, n_head × head_dim]`; `keys` and
/// `values` are one layer of the cache (`slot × n_kv_head × head_dim`), already holding this
/// step's keys and values. The block tables must cover every position (the caller checked).
pub fn attend(
    shape: AttnShape,
    q: &[f32],
    keys: &KvBuf,
    values: &KvBuf,
    tokens: &[TokenCtx<'_>],
    out: &mut [f32],
) {
    dispatch(shape, q, keys, values, tokens, out, KernelPath::active());
}

/// [`attend`] on a given instruction-set path (tests check each one this CPU has):
/// dispatches on the keys' type.
fn dispatch(
    shape: AttnShape,
    q: &[f32],
    keys: &KvBuf,
    values: &KvBuf,
    tokens: &[TokenCtx<'_>],
    out: &mut [f32],
    path: KernelPath,
) {
    let run = Run {
        shape,
        q,
        tokens,
        path: path.or_supported(),
    };
    match keys {
        KvBuf::F16(k) => with_values(run, k, None, values, out),
        KvBuf::F32(k) => with_values(run, k, None, values, out),
        KvBuf::Int8(k) => with_values(run, &k.data, Some(Scales::of(k)), values, out),
        KvBuf::Fp8(k) => with_values(run, &k.data, Some(Scales::of(k)), values, out),
    }
}

/// What one call attends with, besides the cache and the output.
#[derive(Clone, Copy)]
struct Run<'a, 't> {
    shape: AttnShape,
    q: &'a [f32],
    tokens: &'a [TokenCtx<'t>],
    /// A path this CPU supports.
    path: KernelPath,
}

/// [`dispatch`] once the keys' type is known: dispatches on the values'.
fn with_values<K: KvElem>(
    run: Run<'_, '_>,
    keys: &[K],
    ks: Option<Scales<'_>>,
    values: &KvBuf,
    out: &mut [f32],
) {
    match values {
        KvBuf::F16(v) => attend_with(run, pair(keys, ks, v, None), out),
        KvBuf::F32(v) => attend_with(run, pair(keys, ks, v, None), out),
        KvBuf::Int8(v) => attend_with(run, pair(keys, ks, &v.data, Some(Scales::of(v))), out),
        KvBuf::Fp8(v) => attend_with(run, pair(keys, ks, &v.data, Some(Scales::of(v))), out),
    }
}

/// One layer's typed keys and values with their scales (8-bit entries).
#[derive(Clone, Copy)]
struct KvPair<'a, K, V> {
    keys: &'a [K],
    ks: Option<Scales<'a>>,
    values: &'a [V],
    vs: Option<Scales<'a>>,
}

fn pair<'a, K, V>(
    keys: &'a [K],
    ks: Option<Scales<'a>>,
    values: &'a [V],
    vs: Option<Scales<'a>>,
) -> KvPair<'a, K, V> {
    KvPair {
        keys,
        ks,
        values,
        vs,
    }
}

/// [`attend`] over typed entries on `path` (one this CPU supports).
fn attend_with<K: KvElem, V: KvElem>(run: Run<'_, '_>, kv: KvPair<'_, K, V>, out: &mut [f32]) {
    let Run {
        shape,
        q,
        tokens,
        path,
    } = run;
    let KvPair {
        keys,
        ks,
        values,
        vs,
    } = kv;
    let AttnShape {
        n_head,
        n_kv_head,
        head_dim: hd,
        block_size,
        scale,
        window,
        softcap,
    } = shape;
    let group = n_head / n_kv_head;
    let width = n_head * hd;
    let kv_dim = n_kv_head * hd;
    debug_assert_eq!(out.len(), tokens.len() * width);
    out.par_chunks_mut(group * hd).enumerate().for_each_init(
        Scratch::default,
        |scratch, (idx, out)| {
            let (t, kvh) = (idx / n_kv_head, idx % n_kv_head);
            let TokenCtx { pos, block_table } = tokens[t];
            let q = &q[t * width + kvh * group * hd..t * width + (kvh + 1) * group * hd];
            // Where position j's key and value start, for j in 0..=pos (inside the window).
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            scratch.offs.clear();
            scratch.slots.clear();
            let scaled = ks.is_some() || vs.is_some();
            for_each_slot(block_table, block_size, pos + 1, |j, slot| {
                if j >= first {
                    scratch.offs.push(slot * kv_dim + kvh * hd);
                    if scaled {
                        scratch.slots.push(slot);
                    }
                }
            });
            scratch.gather_scales(ks, vs, kv_dim, kvh * hd);
            let head = Head {
                q,
                group,
                hd,
                scale,
                softcap,
                path,
            };
            #[cfg(target_arch = "x86_64")]
            {
                if path >= KernelPath::Avx2 && hd.is_multiple_of(8) {
                    // SAFETY: `path` is supported, so AVX2, FMA and F16C are present (and
                    // AVX-512F/VL from `Avx512` up); every offset plus `hd` lies inside
                    // `keys` and `values` (the block tables cover the positions).
                    unsafe {
                        if path >= KernelPath::Avx512 && wide_tile::<K, V>() {
                            avx2::attend_group_avx512(&head, keys, values, scratch, out);
                        } else {
                            avx2::attend_group(&head, keys, values, scratch, out);
                        }
                    }
                    return;
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = path;
            attend_group(&head, keys, values, scratch, out);
        },
    );
}

/// Whether entries of these types run the AVX2 tile's AVX-512 copy where the CPU has it.
/// Measured on the portable build (AMD EPYC, AVX-512): with 16- and 32-bit entries the copy
/// takes a quarter less time in prefill attention and the same in decode; with 8-bit ones
/// it took 3–7 % longer in three decode runs of four (measured, not yet explained), so
/// they keep the AVX2 entry.
fn wide_tile<K, V>() -> bool {
    std::mem::size_of::<K>() >= 2 && std::mem::size_of::<V>() >= 2
}

/// One task's query heads: the `group` heads sharing a KV head, `hd` floats each.
struct Head<'a> {
    q: &'a [f32],
    group: usize,
    hd: usize,
    scale: f32,
    softcap: Option<f32>,
    /// A path this CPU supports.
    path: KernelPath,
}

/// Per-thread buffers, reused from task to task.
#[derive(Default)]
struct Scratch {
    /// Offset of each position's key (and value) in the layer's cache.
    offs: Vec<usize>,
    /// Each position's slot (8-bit entries only: where its scales are).
    slots: Vec<usize>,
    /// `group × n_ctx` scores, then unnormalized probabilities.
    scores: Vec<f32>,
    /// `1 / Σ` of each row of probabilities.
    inv: Vec<f32>,
    /// Each position's key scale and value scale (8-bit entries; empty otherwise).
    kscale: Vec<f32>,
    vscale: Vec<f32>,
    /// The query rows as 16-bit codes, and each row's factor from a code sum to its score
    /// (the row's scale times the attention scale): int8 keys only.
    q16: Vec<i16>,
    qfactor: Vec<f32>,
}

impl Scratch {
    /// Each position's key and value scale, read once per task (a head's numbers share
    /// one group: the group is a whole number of heads).
    ///
    /// The head starts `head_at` numbers into its slot of `kv_dim`; a group divides the
    /// slot, so slot `s`'s scale is `s · (kv_dim / group) + head_at / group`: two divisions
    /// a task, none a position.
    fn gather_scales(
        &mut self,
        ks: Option<Scales<'_>>,
        vs: Option<Scales<'_>>,
        kv_dim: usize,
        head_at: usize,
    ) {
        for (dst, src) in [(&mut self.kscale, ks), (&mut self.vscale, vs)] {
            dst.clear();
            if let Some(Scales { scales, group }) = src {
                debug_assert!(kv_dim.is_multiple_of(group));
                let (per_slot, first) = (kv_dim / group, head_at / group);
                dst.extend(self.slots.iter().map(|&s| scales[s * per_slot + first]));
            }
        }
    }

    /// Multiplies each row's score at position `j` by the key's scale there (8-bit keys),
    /// giving the true `q·k`.
    #[inline(always)]
    fn scale_scores(&mut self) {
        scale_columns(&mut self.scores, &self.kscale);
    }

    /// Multiplies each row's probability at position `j` by the value's scale there
    /// (8-bit values), after the softmax sum was taken over the true probabilities.
    #[inline(always)]
    fn scale_probabilities(&mut self) {
        scale_columns(&mut self.scores, &self.vscale);
    }

    /// With int8 keys (and a head [`int_keys`] can sum exactly), rounds the task's query
    /// rows to 16-bit codes and returns the keys' codes; otherwise `None`.
    fn int_keys<'k, K: KvElem>(&mut self, h: &Head<'_>, keys: &'k [K]) -> Option<&'k [i8]> {
        let codes = K::int8_codes(keys).filter(|_| h.hd <= int_keys::MAX_HEAD_DIM)?;
        int_keys::quantize_rows(h.q, h.hd, &mut self.q16, &mut self.qfactor);
        for f in &mut self.qfactor {
            *f *= h.scale;
        }
        Some(codes)
    }

    /// `scores[g][j]` from the integer sums of the query codes and position `j`'s key
    /// codes, on any CPU (the SIMD paths give the same bits).
    fn int_scores(&mut self, keys: &[i8], hd: usize) {
        let n_ctx = self.offs.len();
        for (g, (qg, f)) in self.q16.chunks_exact(hd).zip(&self.qfactor).enumerate() {
            for (j, &off) in self.offs.iter().enumerate() {
                self.scores[g * n_ctx + j] = int_keys::dot(qg, &keys[off..off + hd]) as f32 * f;
            }
        }
    }

    /// Sizes the score buffer for `group` rows over this task's positions, all zero;
    /// returns the number of positions.
    #[inline(always)]
    fn zero_scores(&mut self, group: usize) -> usize {
        let n_ctx = self.offs.len();
        self.scores.clear();
        self.scores.resize(group * n_ctx, 0.0);
        n_ctx
    }
}

/// `rows[r][j] *= col[j]` for every row of `col.len()` entries; nothing when `col` is
/// empty.
#[inline(always)]
fn scale_columns(rows: &mut [f32], col: &[f32]) {
    if col.is_empty() {
        return;
    }
    for row in rows.chunks_exact_mut(col.len()) {
        for (x, c) in row.iter_mut().zip(col) {
            *x *= c;
        }
    }
}

/// Turns each row of scores into `exp(s − max)` in place and records `1 / Σ` per row. The
/// sum runs in eight lanes over a row of fixed length, so it does not depend on the batch.
#[inline(always)]
fn softmax_rows(scores: &mut [f32], n_ctx: usize, inv: &mut Vec<f32>) {
    inv.clear();
    for row in scores.chunks_exact_mut(n_ctx) {
        let max = row.iter().fold(f32::NEG_INFINITY, |m, &s| m.max(s));
        for s in row.iter_mut() {
            *s = exp(*s - max);
        }
        let mut lanes = [0f32; 8];
        let chunks = row.chunks_exact(8);
        let rest = chunks.remainder();
        for c in chunks {
            for (l, v) in lanes.iter_mut().zip(c) {
                *l += v;
            }
        }
        for (l, v) in lanes.iter_mut().zip(rest) {
            *l += v;
        }
        inv.push(1.0 / pairwise8(lanes));
    }
}

/// `cap · tanh(score / cap)` on every score, when a cap is set.
#[inline(always)]
fn soft_cap(scores: &mut [f32], cap: Option<f32>) {
    if let Some(c) = cap {
        for s in scores {
            *s = c * (*s / c).tanh();
        }
    }
}

/// Sum of eight lanes as a pairwise tree: a shorter dependency chain than a running sum.
fn pairwise8(a: [f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Portable path (no AVX2, or a head size that is not a multiple of 8).
fn attend_group<K: KvElem, V: KvElem>(
    h: &Head<'_>,
    keys: &[K],
    values: &[V],
    s: &mut Scratch,
    out: &mut [f32],
) {
    let (hd, n_ctx) = (h.hd, s.zero_scores(h.group));
    if let Some(codes) = s.int_keys(h, keys) {
        s.int_scores(codes, hd);
    } else {
        for (j, &off) in s.offs.iter().enumerate() {
            let k = &keys[off..off + hd];
            for (g, qh) in h.q.chunks_exact(hd).enumerate() {
                s.scores[g * n_ctx + j] = dot(qh, k) * h.scale;
            }
        }
    }
    s.scale_scores();
    soft_cap(&mut s.scores, h.softcap);
    softmax_rows(&mut s.scores, n_ctx, &mut s.inv);
    s.scale_probabilities();
    out.fill(0.0);
    for (j, &off) in s.offs.iter().enumerate() {
        let v = &values[off..off + hd];
        for (g, o) in out.chunks_exact_mut(hd).enumerate() {
            axpy(s.scores[g * n_ctx + j], v, o);
        }
    }
    for (o, inv) in out.chunks_exact_mut(hd).zip(&s.inv) {
        for x in o {
            *x *= inv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::tile4::{four_keys, prefetch_ahead, store_four};
    use super::{int_keys, soft_cap, softmax_rows, Head, KvElem, Scratch};
    use std::arch::x86_64::*;

    /// Query heads scored together against each key: three rows × four keys of 8-lane
    /// accumulators fit the sixteen registers with the query vectors.
    const ROWS: usize = 3;

    /// The AVX2 path of [`super::attend_group`]. Every score, every probability and every
    /// output element goes through the same operations in the same order whatever else is
    /// in the batch.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; `h.hd` is a multiple of 8; `s.offs[j] + h.hd` is within `keys` and
    /// `values` for every `j`; `out` holds `h.group × h.hd` floats.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn attend_group<K: KvElem, V: KvElem>(
        h: &Head<'_>,
        keys: &[K],
        values: &[V],
        s: &mut Scratch,
        out: &mut [f32],
    ) {
        tile(h, keys, values, s, out)
    }

    /// [`attend_group`] compiled for AVX-512F/VL: the same 256-bit operations in the same
    /// order, so the same bits, but with 32 vector registers for the 3 × 4 tile's
    /// accumulators, query rows and keys instead of 16, and the softmax's loops 512 bits
    /// wide. A portable (`x86-64-v3`) build gets these only through this copy.
    ///
    /// # Safety
    /// As [`attend_group`], and AVX-512F and AVX-512VL.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
    pub unsafe fn attend_group_avx512<K: KvElem, V: KvElem>(
        h: &Head<'_>,
        keys: &[K],
        values: &[V],
        s: &mut Scratch,
        out: &mut [f32],
    ) {
        tile(h, keys, values, s, out)
    }

    /// The body of both entries, compiled into each with its instruction set.
    #[inline(always)]
    unsafe fn tile<K: KvElem, V: KvElem>(
        h: &Head<'_>,
        keys: &[K],
        values: &[V],
        s: &mut Scratch,
        out: &mut [f32],
    ) {
        let (hd, n_ctx) = (h.hd, s.zero_scores(h.group));
        if let Some(codes) = s.int_keys(h, keys) {
            if hd.is_multiple_of(16) {
                let (q, sc) = (s.q16.as_ptr(), s.scores.as_mut_ptr());
                int_keys::score_rows(h.path, q, hd, codes.as_ptr(), &s.offs, &s.qfactor, sc);
            } else {
                s.int_scores(codes, hd);
            }
        } else {
            float_scores(h, keys, s);
        }
        s.scale_scores();
        soft_cap(&mut s.scores, h.softcap);
        softmax_rows(&mut s.scores, n_ctx, &mut s.inv);
        s.scale_probabilities();
        let (p, o) = (s.scores.as_ptr(), out.as_mut_ptr());
        let mut g = 0;
        while g < h.group {
            let r = (h.group - g).min(ROWS);
            let (pg, og, inv) = (p.add(g * n_ctx), o.add(g * hd), &s.inv[g..g + r]);
            let mut d = 0;
            while d + 32 <= hd {
                match r {
                    3 => pv_pass::<V, 3, 4>(pg, n_ctx, values.as_ptr(), &s.offs, d, inv, og, hd),
                    2 => pv_pass::<V, 2, 4>(pg, n_ctx, values.as_ptr(), &s.offs, d, inv, og, hd),
                    _ => pv_pass::<V, 1, 4>(pg, n_ctx, values.as_ptr(), &s.offs, d, inv, og, hd),
                }
                d += 32;
            }
            while d < hd {
                match r {
                    3 => pv_pass::<V, 3, 1>(pg, n_ctx, values.as_ptr(), &s.offs, d, inv, og, hd),
                    2 => pv_pass::<V, 2, 1>(pg, n_ctx, values.as_ptr(), &s.offs, d, inv, og, hd),
                    _ => pv_pass::<V, 1, 1>(pg, n_ctx, values.as_ptr(), &s.offs, d, inv, og, hd),
                }
                d += 8;
            }
            g += r;
        }
    }

    /// `scores[g][j] = (q_g · k_j) · scale` in floats, three rows at a time.
    #[inline(always)]
    unsafe fn float_scores<K: KvElem>(h: &Head<'_>, keys: &[K], s: &mut Scratch) {
        let (hd, n_ctx) = (h.hd, s.offs.len());
        let (q, sc) = (h.q.as_ptr(), s.scores.as_mut_ptr());
        let mut g = 0;
        while g < h.group {
            let r = (h.group - g).min(ROWS);
            let (qg, sg) = (q.add(g * hd), sc.add(g * n_ctx));
            match r {
                3 => score_rows::<K, 3>(qg, hd, keys.as_ptr(), &s.offs, h.scale, sg),
                2 => score_rows::<K, 2>(qg, hd, keys.as_ptr(), &s.offs, h.scale, sg),
                _ => score_rows::<K, 1>(qg, hd, keys.as_ptr(), &s.offs, h.scale, sg),
            }
            g += r;
        }
    }

    /// Four dot products from their 8-lane accumulators, each reduced by the same tree.
    #[inline(always)]
    unsafe fn reduce4(a: [__m256; 4]) -> __m128 {
        let t = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1))
    }

    /// `scores[r][j] = (q_r · k_j) · scale` for `R` query rows (`hd` apart) and every
    /// position, keys four at a time (a short last group repeats its last key).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // indices name tile coordinates
    unsafe fn score_rows<K: KvElem, const R: usize>(
        q: *const f32,
        hd: usize,
        keys: *const K,
        offs: &[usize],
        scale: f32,
        scores: *mut f32,
    ) {
        let n_ctx = offs.len();
        let scale = _mm_set1_ps(scale);
        let mut j = 0;
        let key_bytes = hd * std::mem::size_of::<K>();
        while j < n_ctx {
            for kk in 0..4 {
                prefetch_ahead(keys, offs, j + kk, key_bytes);
            }
            let k = four_keys(keys, offs, j);
            let mut acc = [[_mm256_setzero_ps(); 4]; R];
            let mut d = 0;
            while d < hd {
                let mut qv = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    qv[r] = _mm256_loadu_ps(q.add(r * hd + d));
                }
                for kk in 0..4 {
                    let kv = K::load8(k[kk].add(d));
                    for r in 0..R {
                        acc[r][kk] = _mm256_fmadd_ps(qv[r], kv, acc[r][kk]);
                    }
                }
                d += 8;
            }
            for r in 0..R {
                store_four(
                    _mm_mul_ps(reduce4(acc[r]), scale),
                    scores.add(r * n_ctx),
                    j,
                    n_ctx,
                );
            }
            j += 4;
        }
    }

    /// Output columns `d..d + 8C` of `R` rows: `Σ_j p[r][j] · v_j`, times `inv[r]`.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn pv_pass<V: KvElem, const R: usize, const C: usize>(
        p: *const f32,
        n_ctx: usize,
        values: *const V,
        offs: &[usize],
        d: usize,
        inv: &[f32],
        out: *mut f32,
        hd: usize,
    ) {
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let pass_bytes = 8 * C * std::mem::size_of::<V>();
        for (j, &off) in offs.iter().enumerate() {
            prefetch_ahead(values.add(d), offs, j, pass_bytes);
            let v = values.add(off + d);
            // Each value vector is loaded once and used by every row while it is live:
            // R × C accumulators + R probabilities + one value (16 registers at 3 × 4), so
            // the 16-register AVX2 build does not spill an accumulator every position.
            let mut pr = [_mm256_setzero_ps(); R];
            for r in 0..R {
                pr[r] = _mm256_set1_ps(*p.add(r * n_ctx + j));
            }
            for c in 0..C {
                let vc = V::load8(v.add(8 * c));
                for r in 0..R {
                    acc[r][c] = _mm256_fmadd_ps(pr[r], vc, acc[r][c]);
                }
            }
        }
        for r in 0..R {
            let s = _mm256_set1_ps(inv[r]);
            for c in 0..C {
                _mm256_storeu_ps(out.add(r * hd + d + 8 * c), _mm256_mul_ps(acc[r][c], s));
            }
        }
    }
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
pub fn dot<E: KvElem>(a: &[f32], b: &[E]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y.to_f32())
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i].to_f32();
        }
    }
    pairwise8(acc) + tail
}

#[inline]
fn axpy<E: KvElem>(alpha: f32, x: &[E], y: &mut [f32]) {
    for (o, v) in y.iter_mut().zip(x) {
        *o += alpha * v.to_f32();
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
    use crate::kv::cache::{KvCache, KvDtype};

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
                let first = shape.window.map_or(0, |w| (tok.pos + 1).saturating_sub(w));
                let s: Vec<f64> = (first..=tok.pos)
                    .map(|j| {
                        let kk = &k[slot(j) * kv_dim + kvh * hd..][..hd];
                        let s = qh
                            .iter()
                            .zip(kk)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            * shape.scale as f64;
                        match shape.softcap {
                            Some(c) => c as f64 * (s / c as f64).tanh(),
                            None => s,
                        }
                    })
                    .collect();
                let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for (i, p) in e.iter().enumerate() {
                    let vv = &v[slot(first + i) * kv_dim + kvh * hd..][..hd];
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
        // Query groups of 3 (the default model), 4 (a tile of three and one) and 1; head
        // sizes a multiple of 32, of 8 only, and of neither (the portable path).
        for (n_head, n_kv_head) in [(6, 2), (8, 2), (2, 2)] {
            for head_dim in [16, 64, 12] {
                let causal = AttnShape::causal(n_head, n_kv_head, head_dim, 4);
                // A sliding layer with Gemma 2's soft-cap and its own scale.
                let sliding = AttnShape {
                    scale: 0.3,
                    window: Some(5),
                    softcap: Some(2.0),
                    ..causal
                };
                for shape in [causal, sliding] {
                    for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Int8, KvDtype::Fp8E4m3] {
                        let mut simd_bits: Option<Vec<u32>> = None;
                        for path in KernelPath::here() {
                            let out = check_against_reference(shape, path, dtype);
                            // Every SIMD path runs the same tile in the same order (its
                            // AVX-512 copy only has more registers): the same bits.
                            if path >= KernelPath::Avx2 {
                                let bits: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                                match &simd_bits {
                                    Some(first) => assert_eq!(
                                        first,
                                        &bits,
                                        "{shape:?} {dtype}: {} differs",
                                        path.name()
                                    ),
                                    None => simd_bits = Some(bits),
                                }
                            }
                        }
                    }
                }
            }
        }
    }

    /// The cache holds `dtype` entries and the reference gets the same stored values (f16
    /// rounding, 8-bit codes times their head's scale). Returns the batch's output.
    fn check_against_reference(shape: AttnShape, path: KernelPath, dtype: KvDtype) -> Vec<f32> {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let slots = 16 * shape.block_size;
        let kv_dim = shape.n_kv_head * shape.head_dim;
        let mut cache = KvCache::with_heads(
            1,
            16,
            shape.block_size,
            shape.n_kv_head,
            shape.head_dim,
            dtype,
        );
        for slot in 0..slots {
            // Heads of different magnitudes, as real keys have.
            let row = |rng: &mut rand::rngs::StdRng| -> Vec<f32> {
                (0..kv_dim)
                    .map(|i| rng.random_range(-1.0..1.0) * (1 + i / shape.head_dim) as f32)
                    .collect()
            };
            let (k, v) = (row(&mut rng), row(&mut rng));
            cache.keys[0].write(slot * kv_dim, &k);
            cache.values[0].write(slot * kv_dim, &v);
        }
        let k: Vec<f32> = (0..slots * kv_dim).map(|i| cache.keys[0].get(i)).collect();
        let v: Vec<f32> = (0..slots * kv_dim)
            .map(|i| cache.values[0].get(i))
            .collect();
        let (kb, vb) = (&cache.keys[0], &cache.values[0]);
        let run = |q: &[f32], toks: &[TokenCtx<'_>], out: &mut [f32]| {
            dispatch(shape, q, kb, vb, toks, out, path);
        };
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
        run(&q, &toks, &mut out);
        // Int8 keys meet the query as its 16-bit codes: the reference gets those too.
        let q_seen = if dtype == KvDtype::Int8 && shape.head_dim <= int_keys::MAX_HEAD_DIM {
            let (mut codes, mut scales) = (Vec::new(), Vec::new());
            int_keys::quantize_rows(&q, shape.head_dim, &mut codes, &mut scales);
            let hd = shape.head_dim;
            codes
                .iter()
                .enumerate()
                .map(|(i, &c)| c as f32 * scales[i / hd])
                .collect()
        } else {
            q.clone()
        };
        let want = reference(shape, &q_seen, &k, &v, &toks);
        for (g, w) in out.iter().zip(&want) {
            assert!(
                (g - w).abs() < 1e-5 * (1.0 + w.abs()),
                "{shape:?} {} {dtype}: {g} vs {w}",
                path.name()
            );
        }
        // Each token alone gives bit-identical output.
        for (t, tok) in toks.iter().enumerate() {
            let mut alone = vec![0f32; width];
            run(&q[t * width..(t + 1) * width], &[*tok], &mut alone);
            for (a, b) in alone.iter().zip(&out[t * width..(t + 1) * width]) {
                assert_eq!(a.to_bits(), b.to_bits());
            }
        }
        out
    }
}
