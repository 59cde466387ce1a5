//! 8-bit KV-cache entries: int8 or fp8 (E4M3) codes with one f32 scale per group of
//! numbers. The cache makes a group one KV head of one token (`head_dim` numbers), so a
//! head's scale follows its own magnitude and attention applies it once per score
//! (`q·k` is reduced over raw codes, then multiplied by the key's scale; each probability
//! is multiplied by the value's scale before `P·V`).
//!
//! A group's scale is `max |x| / 127` (int8, codes rounded to nearest) or `max |x| / 448`
//! (E4M3, the largest finite E4M3 number; codes rounded to nearest even). An E4M3 code is
//! read through the half-precision bit pattern it maps onto: sign to bit 15, exponent and
//! mantissa shifted up by 7 bits. That pattern is the E4M3 number times 2⁻⁸ (the exponent
//! biases are 7 and 15) for normal and subnormal codes alike, so one `vcvtph2ps` decodes
//! eight codes; the 2⁸ is folded into the stored scale.

use half::f16;

/// An E4M3 code (`1 sign, 4 exponent (bias 7), 3 mantissa bits`; the `fn` variant vLLM
/// calls `fp8_e4m3`: no infinities, largest finite 448).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct E4m3(pub u8);

impl E4m3 {
    /// The largest finite E4M3 number.
    pub const MAX: f32 = 448.0;

    /// `y` rounded to the nearest E4M3 number (ties to even), saturating at ±448.
    pub fn from_f32(y: f32) -> Self {
        let sign = if y.is_sign_negative() { 0x80 } else { 0 };
        // `min` returns 448 for NaN too: a NaN key saturates instead of poisoning a scale.
        let a = y.abs().min(Self::MAX);
        let magnitude = if a < 2f32.powi(-6) {
            // Subnormal: multiples of 2⁻⁹ (0..=8; 8 is the smallest normal, code 0x08).
            (a * 512.0).round_ties_even() as u8
        } else {
            // Rebias the f32 exponent (127) to E4M3's (7) and keep 3 mantissa bits,
            // rounding the 20 dropped bits to nearest even.
            let b = a.to_bits() - ((127 - 7) << 23);
            let lsb = (b >> 20) & 1;
            ((b + 0x7FFFF + lsb) >> 20) as u8
        };
        Self(sign | magnitude.min(0x7E))
    }

    /// The half-precision bit pattern whose value is this code's number times 2⁻⁸.
    #[inline(always)]
    pub const fn f16_bits(self) -> u16 {
        let c = self.0 as u16;
        ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    }

    /// The code's number times 2⁻⁸ (the unit the cache's scales are stored in).
    #[inline(always)]
    pub fn raw(self) -> f32 {
        f16::from_bits(self.f16_bits()).to_f32()
    }

    /// The code's number.
    pub fn to_f32(self) -> f32 {
        self.raw() * 256.0
    }
}

/// An 8-bit code type with its range.
pub trait Code8: Copy + Default + Send + Sync + 'static {
    /// The largest magnitude a code holds; a group's `max |x|` maps onto it.
    const RANGE: f32;
    /// `raw()` is the code's number times this; stored scales are divided by it.
    const RAW_UNIT: f32;
    /// `y` (within `±RANGE`) as the nearest code.
    fn encode(y: f32) -> Self;
    /// The code's number times [`Self::RAW_UNIT`].
    fn raw(self) -> f32;
    fn to_bits(self) -> u8;
    fn from_bits(b: u8) -> Self;
}

impl Code8 for i8 {
    const RANGE: f32 = 127.0;
    const RAW_UNIT: f32 = 1.0;
    #[inline]
    fn encode(y: f32) -> Self {
        // `as` saturates (and maps NaN to 0).
        y.round() as i8
    }
    #[inline(always)]
    fn raw(self) -> f32 {
        self as f32
    }
    fn to_bits(self) -> u8 {
        self as u8
    }
    fn from_bits(b: u8) -> Self {
        b as i8
    }
}

impl Code8 for E4m3 {
    const RANGE: f32 = E4m3::MAX;
    const RAW_UNIT: f32 = 1.0 / 256.0;
    #[inline]
    fn encode(y: f32) -> Self {
        Self::from_f32(y)
    }
    #[inline(always)]
    fn raw(self) -> f32 {
        E4m3::raw(self)
    }
    fn to_bits(self) -> u8 {
        self.0
    }
    fn from_bits(b: u8) -> Self {
        Self(b)
    }
}

/// One layer's keys or values as 8-bit codes: `data[i] · scales[i / group]` is entry `i`.
pub struct Scaled<C> {
    pub data: Vec<C>,
    /// One per group, in raw units: entry = `code.raw() · scale`.
    pub scales: Vec<f32>,
    /// Numbers sharing one scale (the cache's `head_dim`).
    pub group: usize,
}

impl<C: Code8> Scaled<C> {
    /// `len` zero entries in groups of `group` (which divides `len`).
    pub fn new(len: usize, group: usize) -> Self {
        Self {
            data: vec![C::default(); len],
            scales: vec![0.0; len / group.max(1)],
            group: group.max(1),
        }
    }

    /// Quantizes `src` into entries `at..`, one scale per group; `at` and `src.len()` are
    /// whole groups (one token's slot is).
    pub fn write(&mut self, at: usize, src: &[f32]) {
        let g = self.group;
        debug_assert!(at.is_multiple_of(g) && src.len().is_multiple_of(g));
        for (k, chunk) in src.chunks_exact(g).enumerate() {
            let amax = chunk.iter().fold(0f32, |m, x| m.max(x.abs()));
            let scale = amax / C::RANGE;
            let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
            let start = at + k * g;
            for (o, &x) in self.data[start..start + g].iter_mut().zip(chunk) {
                *o = C::encode(x * inv);
            }
            self.scales[start / g] = scale / C::RAW_UNIT;
        }
    }

    #[inline]
    pub fn get(&self, i: usize) -> f32 {
        self.data[i].raw() * self.scales[i / self.group]
    }

    /// Bytes `n` entries (whole groups) take in the block layout: the codes, then their
    /// groups' scales as little-endian f32.
    pub fn bytes_for(&self, n: usize) -> usize {
        n + 4 * (n / self.group)
    }

    /// Appends entries `at..at + n` (whole groups) in the block layout.
    pub fn read_le(&self, at: usize, n: usize, out: &mut Vec<u8>) {
        out.extend(self.data[at..at + n].iter().map(|c| c.to_bits()));
        let g = self.group;
        for s in &self.scales[at / g..(at + n) / g] {
            out.extend_from_slice(&s.to_le_bytes());
        }
    }

    /// Stores entries from `at` on from the block layout of `src.len()` bytes (whole
    /// groups, as [`Self::bytes_for`] counts them).
    pub fn write_le(&mut self, at: usize, src: &[u8]) {
        let g = self.group;
        let n = src.len() * g / (g + 4);
        let (codes, scales) = src.split_at(n);
        for (o, &b) in self.data[at..at + n].iter_mut().zip(codes) {
            *o = C::from_bits(b);
        }
        for (o, c) in self.scales[at / g..].iter_mut().zip(scales.chunks_exact(4)) {
            *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_round_to_nearest_even_and_saturate() {
        assert_eq!(E4m3::from_f32(1.0), E4m3(0x38));
        assert_eq!(E4m3::from_f32(-1.0), E4m3(0xB8));
        assert_eq!(E4m3::from_f32(448.0), E4m3(0x7E));
        assert_eq!(E4m3::from_f32(1e9), E4m3(0x7E));
        assert_eq!(E4m3::from_f32(f32::NAN).0 & 0x7F, 0x7E);
        assert_eq!(E4m3::from_f32(0.0), E4m3(0));
        // Smallest subnormal 2⁻⁹, smallest normal 2⁻⁶.
        assert_eq!(E4m3::from_f32(2f32.powi(-9)), E4m3(0x01));
        assert_eq!(E4m3::from_f32(2f32.powi(-6)), E4m3(0x08));
        assert_eq!(E4m3::from_f32(2f32.powi(-11)), E4m3(0)); // below half the smallest
                                                             // 1.0625 is halfway between 1.0 and 1.125: ties go to the even mantissa (1.0);
                                                             // 1.1875 is halfway between 1.125 and 1.25: to 1.25.
        assert_eq!(E4m3::from_f32(1.0625).to_f32(), 1.0);
        assert_eq!(E4m3::from_f32(1.1875).to_f32(), 1.25);
        assert_eq!(E4m3::from_f32(1.07).to_f32(), 1.125);
    }

    #[test]
    fn every_finite_e4m3_code_decodes_and_reencodes_to_itself() {
        for b in 0u8..=255 {
            if b & 0x7F == 0x7F {
                continue; // NaN in E4M3
            }
            let c = E4m3(b);
            let v = c.to_f32();
            assert!(v.is_finite() && v.abs() <= 448.0, "{b:#x} -> {v}");
            let back = E4m3::from_f32(v);
            // ±0 both decode to 0.
            assert!(back == c || (v == 0.0 && back.0 & 0x7F == 0), "{b:#x}");
        }
        // The decoded values are the E4M3 numbers: exponent bias 7, subnormals below 2⁻⁶.
        assert_eq!(E4m3(0x08).to_f32(), 2f32.powi(-6));
        assert_eq!(E4m3(0x07).to_f32(), 7.0 * 2f32.powi(-9));
        assert_eq!(E4m3(0x7E).to_f32(), 448.0);
        assert_eq!(E4m3(0x40).to_f32(), 2.0);
    }

    fn group_error<C: Code8>(x: &[f32]) -> f32 {
        let mut s = Scaled::<C>::new(x.len(), x.len());
        s.write(0, x);
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        (0..x.len())
            .map(|i| (s.get(i) - x[i]).abs() / amax)
            .fold(0.0, f32::max)
    }

    #[test]
    fn a_group_keeps_its_largest_entry_and_bounded_error() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 64) as f32 - 31.5) * 0.173)
            .collect();
        // int8: half a step of max/127.
        assert!(group_error::<i8>(&x) <= 0.5 / 127.0 + 1e-6);
        // E4M3: 3 mantissa bits, half an ulp is 1/16 of the value at most.
        assert!(group_error::<E4m3>(&x) <= 1.0 / 16.0 + 1e-6);
        for x0 in [[3.0f32, -1.5, 0.0, 0.25], [-7.5, 7.5, 2.0, 1.0]] {
            let mut s = Scaled::<i8>::new(4, 4);
            s.write(0, &x0);
            let amax = x0.iter().fold(0f32, |m, v| m.max(v.abs()));
            let big = x0.iter().position(|v| v.abs() == amax).unwrap_or(0);
            assert!((s.get(big) - x0[big]).abs() <= amax * 1e-6);
            let mut f = Scaled::<E4m3>::new(4, 4);
            f.write(0, &x0);
            assert!((f.get(big) - x0[big]).abs() <= amax * 1e-6);
        }
    }

    #[test]
    fn an_all_zero_group_stays_zero() {
        let mut s = Scaled::<E4m3>::new(8, 4);
        s.write(4, &[0.0; 4]);
        assert!((0..8).all(|i| s.get(i) == 0.0));
    }

    #[test]
    fn groups_round_trip_through_the_block_layout() {
        let mut a = Scaled::<i8>::new(16, 4);
        let x: Vec<f32> = (0..8).map(|i| i as f32 - 3.0).collect();
        a.write(4, &x);
        let mut bytes = Vec::new();
        a.read_le(4, 8, &mut bytes);
        assert_eq!(bytes.len(), a.bytes_for(8));
        assert_eq!(bytes.len(), 8 + 2 * 4);
        let mut b = Scaled::<i8>::new(16, 4);
        b.write_le(8, &bytes);
        for i in 0..8 {
            assert_eq!(b.get(8 + i), a.get(4 + i));
        }
        assert_eq!(b.get(4), 0.0);
    }
}
