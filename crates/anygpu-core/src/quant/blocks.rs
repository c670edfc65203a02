//! ggml's quantized block layouts, byte for byte (ggml-common.h).
//!
//! Every field is a byte array, so each struct has alignment 1 and a `&[u8]` of whole blocks can
//! be viewed as `&[Block]` in place, whatever its address (GGUF tensor data is only 32-byte
//! aligned relative to the data section, and memory maps or test buffers may be less aligned).
//! Multi-byte fields are little-endian, as in GGUF.

use bytemuck::{Pod, Zeroable};
use half::f16;

use crate::error::{Error, Result};

use super::GgmlType;

/// Weights per super-block of the k-quants.
pub const QK_K: usize = 256;
/// Weights per block of the legacy quants (Q4_0 .. Q8_0).
pub const QK: usize = 32;

#[inline(always)]
pub(crate) fn f16_le(b: [u8; 2]) -> f32 {
    f16::from_bits(u16::from_le_bytes(b)).to_f32()
}

/// Q4_0: one f16 scale and 32 4-bit weights, w = d * (q - 8). Byte j of `qs` holds weight j in
/// its low nibble and weight j + 16 in its high nibble, so one byte load feeds both halves.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}

/// Q4_1: f16 scale and f16 minimum, w = d * q + m, nibbles laid out as in Q4_0. The minimum
/// makes a dot product `d * sum(q * x) + m * sum(x)`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qs: [u8; QK / 2],
}

/// Q5_0: Q4_0 plus a fifth bit per weight, bit j of the little-endian u32 `qh` for weight j;
/// w = d * (q - 16).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_0 {
    pub d: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q5_1: Q4_1 plus a fifth bit per weight in `qh` as in Q5_0; w = d * q + m.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}

/// Q8_0: f16 scale and 32 signed bytes, w = d * q.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [i8; QK],
}

/// Q2_K: 256 weights in 16 groups of 16; each group has a 4-bit scale (low nibble of `scales`)
/// and a 4-bit min (high nibble), both scaled by the f16 `d` / `dmin`: w = d*sc*q - dmin*m.
/// `qs` packs four 2-bit weights per byte: byte l of each 32-byte half holds, at shift 2j, the
/// weight 32j + l of that 128-weight half.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}

/// Q3_K: 2 low bits in `qs` (as in Q2_K) plus a high bit in `hmask` (bit 4n+j of byte l for the
/// same weight); a clear high bit subtracts 4, so q is in -4..=3. Sixteen 6-bit signed scales
/// (stored +32) are packed into 12 bytes: low nibbles in bytes 0..8, top 2 bits in bytes 8..12.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; 12],
    pub d: [u8; 2],
}

/// Q4_K: 8 groups of 32 with a 6-bit scale and 6-bit min each (packed in 12 bytes, see
/// [`scale_min_k4`]); w = d*sc*q - dmin*m. Byte l of each 32-byte chunk k holds weight 64k + l
/// (low nibble) and 64k + 32 + l (high nibble).
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qs: [u8; QK_K / 2],
}

/// Q5_K: Q4_K plus a fifth bit per weight: bit 2k (low nibble) or 2k+1 (high nibble) of
/// `qh[l]` for the weights of chunk k.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; 12],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// Q6_K: 16 groups of 16 with a signed 8-bit scale each; w = d * sc * (q - 32) with q 6 bits:
/// 4 in `ql`, 2 in `qh`. Per 128-weight half n, weight 32i + l (i in 0..4) takes its low bits
/// from `ql[64n + l + 32(i%2)]` (nibble i/2) and its high bits from `qh[32n + l]` at shift 2i.
#[repr(C)]
#[derive(Clone, Copy, Debug, Pod, Zeroable)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: [u8; 2],
}

/// A block layout and the ggml type it belongs to.
pub trait Block: Pod {
    const TYPE: GgmlType;
}

macro_rules! block_type {
    ($($t:ty => $g:ident),* $(,)?) => {$(
        impl Block for $t {
            const TYPE: GgmlType = GgmlType::$g;
        }
    )*};
}

block_type!(
    BlockQ4_0 => Q4_0,
    BlockQ4_1 => Q4_1,
    BlockQ5_0 => Q5_0,
    BlockQ5_1 => Q5_1,
    BlockQ8_0 => Q8_0,
    BlockQ2K => Q2K,
    BlockQ3K => Q3K,
    BlockQ4K => Q4K,
    BlockQ5K => Q5K,
    BlockQ6K => Q6K,
);

/// Views `bytes` as whole blocks, in place.
pub fn as_blocks<B: Block>(bytes: &[u8]) -> Result<&[B]> {
    bytemuck::try_cast_slice(bytes).map_err(|e| {
        Error::Format(format!(
            "{} data of {} bytes is not a whole number of {}-byte blocks ({e})",
            B::TYPE.name(),
            bytes.len(),
            std::mem::size_of::<B>()
        ))
    })
}

/// The 6-bit scale and min of group `j` (0..8) of a Q4_K / Q5_K block (ggml's
/// `get_scale_min_k4`): groups 0..4 use the low 6 bits of bytes j and j+4; groups 4..8 take
/// their low nibbles from byte j+4 and their top 2 bits from the spare bits of bytes j-4 and j.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The 16 signed 6-bit scales of a Q3_K block, with the +32 bias removed.
#[inline(always)]
pub fn q3k_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 0x0F } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = ((low | (high << 4)) as i8).wrapping_sub(32);
    }
    out
}

impl BlockQ4_0 {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
}
impl BlockQ4_1 {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
    #[inline(always)]
    pub fn m(&self) -> f32 {
        f16_le(self.m)
    }
}
impl BlockQ5_0 {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
    #[inline(always)]
    pub fn qh(&self) -> u32 {
        u32::from_le_bytes(self.qh)
    }
}
impl BlockQ5_1 {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
    #[inline(always)]
    pub fn m(&self) -> f32 {
        f16_le(self.m)
    }
    #[inline(always)]
    pub fn qh(&self) -> u32 {
        u32::from_le_bytes(self.qh)
    }
}
impl BlockQ8_0 {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
}
impl BlockQ2K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
    #[inline(always)]
    pub fn dmin(&self) -> f32 {
        f16_le(self.dmin)
    }
}
impl BlockQ3K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
}
impl BlockQ4K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
    #[inline(always)]
    pub fn dmin(&self) -> f32 {
        f16_le(self.dmin)
    }
}
impl BlockQ5K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
    #[inline(always)]
    pub fn dmin(&self) -> f32 {
        f16_le(self.dmin)
    }
}
impl BlockQ6K {
    #[inline(always)]
    pub fn d(&self) -> f32 {
        f16_le(self.d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_type_sizes() {
        fn check<B: Block>() {
            assert_eq!(std::mem::size_of::<B>(), B::TYPE.type_size(), "{}", B::TYPE);
            assert_eq!(std::mem::align_of::<B>(), 1, "{}", B::TYPE);
        }
        check::<BlockQ4_0>();
        check::<BlockQ4_1>();
        check::<BlockQ5_0>();
        check::<BlockQ5_1>();
        check::<BlockQ8_0>();
        check::<BlockQ2K>();
        check::<BlockQ3K>();
        check::<BlockQ4K>();
        check::<BlockQ5K>();
        check::<BlockQ6K>();
    }
}
