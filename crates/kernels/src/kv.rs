//! The KV cache's element types and one layer's plane of keys or values stored in one of them.
//!
//! A plane holds, per slot (block * block_size + offset), `n_kv_heads * head_dim` values: f32,
//! f16 or bf16 as they are, q8_0 (blocks of 32 values: an f16 scale and 32 signed bytes, ggml's
//! `block_q8_0` arithmetic, the scales kept apart from the bytes) or q4_0 (an f16 scale and 32
//! 4-bit values, ggml's `block_q4_0`, of each head rotated first: see [`rotate`]). Within a block
//! one KV head's values are one contiguous run, which is what attention streams (a task reads one
//! KV head): head-major (`[kv head][offset][head_dim]`) for values and quantized keys, and for
//! the plain types' keys in blocks of a multiple of 16 slots dimension-major
//! (`[kv head][head_dim][offset]`, [`KvOrder::DimMajor`]). Attention ([`crate::attention`]) reads
//! every type in place, converting in registers; nothing here knows which slots a sequence owns.

use std::fmt;
use std::str::FromStr;

/// The cache's geometry: slots per block and the shape of one slot's keys (or values).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

/// Where a plane's values sit: slot-major (`[slot][kv head][head_dim]`, plain f32 slices),
/// head-major within each block (`[kv head][offset][head_dim]`: the model's values, and its keys
/// in the quantized types, whose 32-value blocks run along a head) or dimension-major within
/// each block's KV head (`[kv head][head_dim][offset]`: the model's keys in the plain types, so
/// that one vector load holds one dimension of sixteen keys and the scores need no horizontal
/// sums). A block's KV head is the same run of `block_size * head_dim` values in the last two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvOrder {
    SlotMajor,
    HeadMajor,
    DimMajor,
}

/// Slots a block must hold (a multiple of) for its keys to be stored dimension-major: the
/// widest kernel's lanes (sixteen f32), so a vector of keys never straddles two blocks.
pub const DIM_MAJOR_SLOTS: usize = 16;

impl KvOrder {
    /// Element index of `slot`'s first value of KV head `kvh` (dimension `d` is
    /// [`Self::stride`]` * d` further on).
    #[inline(always)]
    pub fn offset(self, l: &KvLayout, slot: usize, kvh: usize) -> usize {
        match self {
            KvOrder::SlotMajor => slot * l.kv_width() + kvh * l.head_dim,
            KvOrder::HeadMajor => {
                let (b, o) = (slot / l.block_size, slot % l.block_size);
                ((b * l.n_kv_heads + kvh) * l.block_size + o) * l.head_dim
            }
            KvOrder::DimMajor => {
                let (b, o) = (slot / l.block_size, slot % l.block_size);
                (b * l.n_kv_heads + kvh) * l.block_size * l.head_dim + o
            }
        }
    }

    /// Elements between a slot's consecutive dimensions.
    #[inline(always)]
    pub fn stride(self, l: &KvLayout) -> usize {
        match self {
            KvOrder::SlotMajor | KvOrder::HeadMajor => 1,
            KvOrder::DimMajor => l.block_size,
        }
    }

    /// The order of the model cache's plane of `role` in `dtype` with `layout`.
    pub fn for_plane(role: KvRole, dtype: KvDtype, layout: &KvLayout) -> Self {
        if role == KvRole::Keys && !dtype.has_scales() && layout.block_size.is_multiple_of(DIM_MAJOR_SLOTS) {
            KvOrder::DimMajor
        } else {
            KvOrder::HeadMajor
        }
    }
}

/// What the KV cache stores (`--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum KvDtype {
    F32,
    #[default]
    F16,
    Bf16,
    Q8_0,
    Q4_0,
}

/// q8_0's (and q4_0's) block: 32 values share one scale.
pub const Q8_BLOCK: usize = 32;

impl KvDtype {
    pub const ALL: [KvDtype; 5] = [KvDtype::F32, KvDtype::F16, KvDtype::Bf16, KvDtype::Q8_0, KvDtype::Q4_0];

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
            KvDtype::Q8_0 => "q8_0",
            KvDtype::Q4_0 => "q4_0",
        }
    }

    /// Bytes `n` values take (q8_0 and q4_0: `n` a multiple of 32, each block 32 or 16 bytes and a
    /// 2-byte scale).
    pub fn bytes(self, n: usize) -> usize {
        self.data_bytes(n) + if self.has_scales() { n / Q8_BLOCK * 2 } else { 0 }
    }

    /// Bytes `n` values take in the plane's main buffer (the quantized types' scales apart).
    pub(crate) fn data_bytes(self, n: usize) -> usize {
        match self {
            KvDtype::F32 => n.saturating_mul(4),
            KvDtype::F16 | KvDtype::Bf16 => n.saturating_mul(2),
            KvDtype::Q8_0 => n,
            KvDtype::Q4_0 => n / 2,
        }
    }

    /// Whether values come in blocks of 32 with an f16 scale each.
    pub(crate) fn has_scales(self) -> bool {
        matches!(self, KvDtype::Q8_0 | KvDtype::Q4_0)
    }

    /// Whether each head is stored rotated ([`rotate`]): the quantized types, whose levels would
    /// otherwise be spent on a few outlier channels (a query's dot with a rotated key is the same
    /// as with the key; attention rotates the queries alike and turns its output back). As
    /// llama.cpp rotates its quantized K and V; measured on Qwen2.5 it halves q8_0's KL at depth
    /// (docs/benchmarks.md).
    pub fn rotated(self) -> bool {
        self.has_scales()
    }

    /// Whether heads of `head_dim` values can be stored in this type (a quantized block may not
    /// straddle two heads).
    pub fn supports_head_dim(self, head_dim: usize) -> bool {
        !self.has_scales() || head_dim.is_multiple_of(Q8_BLOCK)
    }
}

/// Which of a layer's two planes: the quantized types rotate keys and values in blocks of
/// different sizes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvRole {
    Keys,
    Values,
}

impl KvRole {
    /// The Hadamard block [`rotate`] mixes for heads of `head_dim` values: for keys the largest
    /// power of two that divides it (at most 256), for values at most 64 (llama.cpp's sizes: a
    /// smaller rotation measured better for values).
    pub fn rotation_size(self, head_dim: usize) -> usize {
        let whole = 1usize << head_dim.trailing_zeros();
        match self {
            KvRole::Keys => whole.min(256),
            KvRole::Values => whole.min(64),
        }
    }
}

/// The sign flip of dimension `d` before the Hadamard transform (a fixed pseudo-random diagonal,
/// so that no channel pattern lines up with the transform's rows).
#[inline]
fn sign(d: usize) -> f32 {
    if (d as u32).wrapping_mul(0x9E37_79B9).rotate_left(7) & 0x100 != 0 {
        -1.0
    } else {
        1.0
    }
}

/// The normalised Walsh-Hadamard transform of each run of `n` values (a power of two), in place.
fn hadamard(x: &mut [f32], n: usize) {
    let norm = 1.0 / (n as f32).sqrt();
    for run in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for i in (0..n).step_by(2 * h) {
                for j in i..i + h {
                    let (a, b) = (run[j], run[j + h]);
                    run[j] = a + b;
                    run[j + h] = a - b;
                }
            }
            h *= 2;
        }
        run.iter_mut().for_each(|v| *v *= norm);
    }
}

/// Rotates one head's values (an orthogonal map: random signs, then a normalised Hadamard
/// transform over blocks of `n`, a power of two), the form the quantized types store keys and
/// values in and attention's queries are taken to. Dot products between two rotated vectors are those of the
/// originals, and an outlier channel is spread over its whole block instead of setting one
/// quantization block's scale alone (QuaRot; llama.cpp and ik_llama.cpp rotate their 4-bit K the
/// same way).
pub fn rotate(head: &mut [f32], n: usize) {
    for (d, v) in head.iter_mut().enumerate() {
        *v *= sign(d);
    }
    hadamard(head, n);
}

/// [`rotate`]'s inverse.
pub fn unrotate(head: &mut [f32], n: usize) {
    hadamard(head, n);
    for (d, v) in head.iter_mut().enumerate() {
        *v *= sign(d);
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown KV cache type '{0}' (one of f32, f16, bf16, q8_0, q4_0)")]
pub struct UnknownKvDtype(pub String);

impl FromStr for KvDtype {
    type Err = UnknownKvDtype;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL.into_iter().find(|d| d.name().eq_ignore_ascii_case(s)).ok_or_else(|| UnknownKvDtype(s.to_string()))
    }
}

/// One layer's keys (or values): `slots * width` values of one type, in [`KvOrder::for_plane`]'s
/// order within each block.
pub struct KvPlane {
    dtype: KvDtype,
    order: KvOrder,
    /// The Hadamard block each head is stored rotated in (0: not rotated).
    rot: usize,
    layout: KvLayout,
    width: usize,
    /// f32 / f16 / bf16 values little-endian, q8_0's signed bytes (one per value) or q4_0's
    /// nibbles (16 bytes per 32 values: value `j` of a block in byte `j % 16`, low nibble for the
    /// first 16, high for the rest, as ggml packs them).
    data: crate::buffer::Buffer,
    /// q8_0 and q4_0: one f16 scale per 32 values, `slot * width / 32 + block`.
    scales: Vec<u16>,
}

/// A plane could not be allocated (the allocator refused).
#[derive(Debug, thiserror::Error)]
#[error("cannot allocate {bytes} bytes for a KV plane")]
pub struct PlaneAllocError {
    pub bytes: usize,
}

fn zeroed<T: Clone + Default>(n: usize) -> Result<Vec<T>, PlaneAllocError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| PlaneAllocError { bytes: n.saturating_mul(std::mem::size_of::<T>()) })?;
    v.resize(n, T::default());
    Ok(v)
}

impl KvPlane {
    /// A zeroed plane of `blocks` blocks (written once, so its pages are resident).
    pub fn new(role: KvRole, dtype: KvDtype, layout: KvLayout, blocks: usize) -> Result<Self, PlaneAllocError> {
        assert!(dtype.supports_head_dim(layout.head_dim), "a quantized head is whole blocks");
        let width = layout.kv_width();
        let n = blocks.saturating_mul(layout.block_size).saturating_mul(width);
        let bytes = dtype.data_bytes(n);
        let data = crate::buffer::Buffer::try_zeroed_resident(bytes).ok_or(PlaneAllocError { bytes })?;
        let scales = if dtype.has_scales() { zeroed(n / Q8_BLOCK)? } else { Vec::new() };
        let rot = if dtype.rotated() { role.rotation_size(layout.head_dim) } else { 0 };
        Ok(Self { dtype, order: KvOrder::for_plane(role, dtype, &layout), rot, layout, width, data, scales })
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn order(&self) -> KvOrder {
        self.order
    }

    pub fn width(&self) -> usize {
        self.width
    }

    pub fn slots(&self) -> usize {
        self.data.len() / self.dtype.data_bytes(self.width).max(1)
    }

    /// Bytes the plane holds.
    pub fn bytes(&self) -> usize {
        self.data.len() + 2 * self.scales.len()
    }

    /// Stores one slot's `n_kv_heads * head_dim` values, rounded to the plane's type (f16 and
    /// bf16 to nearest even; q8_0 as ggml's `quantize_row_q8_0`: scale = max |x| / 127, values
    /// rounded half away from zero, the scale kept as f16; q4_0 each head [`rotate`]d, then as
    /// `quantize_row_q4_0`: scale = the signed value of largest magnitude / -8, levels 0..15 around 8).
    pub fn write(&mut self, slot: usize, values: &[f32]) {
        assert_eq!(values.len(), self.width, "one slot's values");
        let hd = self.layout.head_dim;
        let mut rotated = Vec::new();
        let stride = self.order.stride(&self.layout);
        for (kvh, head) in values.chunks_exact(hd).enumerate() {
            let at = self.order.offset(&self.layout, slot, kvh);
            if self.rot > 0 {
                rotated.clear();
                rotated.extend_from_slice(head);
                rotate(&mut rotated, self.rot);
                self.write_head(at, stride, &rotated);
            } else {
                self.write_head(at, stride, head);
            }
        }
    }

    /// One head's values from element `e`, `stride` elements apart (1 for the quantized types).
    fn write_head(&mut self, e: usize, stride: usize, values: &[f32]) {
        let w = values.len();
        debug_assert!(stride == 1 || !self.dtype.has_scales(), "quantized heads are contiguous");
        let plain = |data: &mut [u8], size: usize, bytes: &dyn Fn(f32) -> [u8; 4]| {
            for (d, &v) in values.iter().enumerate() {
                let at = (e + d * stride) * size;
                data[at..at + size].copy_from_slice(&bytes(v)[..size]);
            }
        };
        match self.dtype {
            KvDtype::F32 => plain(&mut self.data, 4, &|v| v.to_le_bytes()),
            KvDtype::F16 => plain(&mut self.data, 2, &|v| {
                let [a, b] = half::f16::from_f32(v).to_bits().to_le_bytes();
                [a, b, 0, 0]
            }),
            KvDtype::Bf16 => plain(&mut self.data, 2, &|v| {
                let [a, b] = half::bf16::from_f32(v).to_bits().to_le_bytes();
                [a, b, 0, 0]
            }),
            KvDtype::Q8_0 => {
                let q = &mut self.data[e..e + w];
                let s = &mut self.scales[e / Q8_BLOCK..(e + w) / Q8_BLOCK];
                for ((qb, sb), x) in q.chunks_exact_mut(Q8_BLOCK).zip(s.iter_mut()).zip(values.chunks_exact(Q8_BLOCK)) {
                    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                    let d = amax / 127.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    for (o, &v) in qb.iter_mut().zip(x) {
                        *o = ((v * id).round() as i8) as u8;
                    }
                    *sb = half::f16::from_f32(d).to_bits();
                }
            }
            KvDtype::Q4_0 => {
                let q = &mut self.data[e / 2..(e + w) / 2];
                let s = &mut self.scales[e / Q8_BLOCK..(e + w) / Q8_BLOCK];
                for ((qb, sb), x) in q.chunks_exact_mut(Q8_BLOCK / 2).zip(s.iter_mut()).zip(values.chunks_exact(Q8_BLOCK)) {
                    let max = x.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                    let d = max / -8.0;
                    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                    let level = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
                    for (j, o) in qb.iter_mut().enumerate() {
                        *o = level(x[j]) | (level(x[j + Q8_BLOCK / 2]) << 4);
                    }
                    *sb = half::f16::from_f32(d).to_bits();
                }
            }
        }
    }

    /// Slot `slot`'s values back as f32, heads in order (the reference the tests compare against;
    /// a rotated type's heads turned back).
    pub fn read(&self, slot: usize) -> Vec<f32> {
        let v = self.view();
        let hd = self.layout.head_dim;
        let stride = self.order.stride(&self.layout);
        let mut out: Vec<f32> = (0..self.layout.n_kv_heads)
            .flat_map(|h| (0..hd).map(move |d| (h, d)))
            .map(|(h, d)| v.get(self.order.offset(&self.layout, slot, h) + d * stride))
            .collect();
        if self.rot > 0 {
            out.chunks_exact_mut(hd).for_each(|h| unrotate(h, self.rot));
        }
        out
    }

    pub fn view(&self) -> KvView<'_> {
        KvView { dtype: self.dtype, order: self.order, rot: self.rot, data: &self.data, scales: &self.scales }
    }

    /// Bytes one block of the plane takes in [`Self::copy_block_out`]'s form.
    pub fn block_bytes(&self) -> usize {
        self.dtype.bytes(self.layout.block_size * self.width)
    }

    /// Appends block `block`'s stored bytes to `out` as they are (the values, then the quantized
    /// types' scales little-endian): a block is one run of the plane (whatever its order within),
    /// so this is a copy.
    pub fn copy_block_out(&self, block: usize, out: &mut Vec<u8>) {
        let n = self.layout.block_size * self.width;
        let vb = self.dtype.data_bytes(n);
        out.extend_from_slice(&self.data[block * vb..(block + 1) * vb]);
        if self.dtype.has_scales() {
            let per = n / Q8_BLOCK;
            out.extend(self.scales[block * per..(block + 1) * per].iter().flat_map(|s| s.to_le_bytes()));
        }
    }

    /// Overwrites block `block` with bytes [`Self::copy_block_out`] gave (of a plane of the same
    /// type and layout). `bytes` must be [`Self::block_bytes`] long.
    pub fn copy_block_in(&mut self, block: usize, bytes: &[u8]) {
        assert_eq!(bytes.len(), self.block_bytes(), "one block's bytes");
        let n = self.layout.block_size * self.width;
        let vb = self.dtype.data_bytes(n);
        let (values, scales) = bytes.split_at(vb);
        self.data[block * vb..(block + 1) * vb].copy_from_slice(values);
        if self.dtype.has_scales() {
            let per = n / Q8_BLOCK;
            for (d, s) in self.scales[block * per..(block + 1) * per].iter_mut().zip(scales.chunks_exact(2)) {
                *d = u16::from_le_bytes([s[0], s[1]]);
            }
        }
    }
}

/// A plane as attention reads it.
#[derive(Clone, Copy)]
pub struct KvView<'a> {
    pub dtype: KvDtype,
    pub order: KvOrder,
    /// The Hadamard block the heads are stored rotated in (0: not rotated).
    pub rot: usize,
    pub(crate) data: &'a [u8],
    pub(crate) scales: &'a [u16],
}

impl<'a> KvView<'a> {
    /// Plain f32 values (`slots * width`) seen as a plane.
    pub fn f32(values: &'a [f32]) -> Self {
        // SAFETY: any f32 storage is valid as bytes (u8 has no alignment or validity needs), and
        // the length covers exactly the same memory.
        let data = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) };
        Self { dtype: KvDtype::F32, order: KvOrder::SlotMajor, rot: 0, data, scales: &[] }
    }

    /// How many values the view holds.
    pub fn len(&self) -> usize {
        match self.dtype {
            KvDtype::F32 => self.data.len() / 4,
            KvDtype::F16 | KvDtype::Bf16 => self.data.len() / 2,
            KvDtype::Q8_0 => self.data.len().min(self.scales.len() * Q8_BLOCK),
            KvDtype::Q4_0 => (2 * self.data.len()).min(self.scales.len() * Q8_BLOCK),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Value `e` as f32 (the scalar reading every SIMD path matches).
    #[inline(always)]
    pub fn get(&self, e: usize) -> f32 {
        match self.dtype {
            KvDtype::F32 => f32::from_le_bytes([self.data[4 * e], self.data[4 * e + 1], self.data[4 * e + 2], self.data[4 * e + 3]]),
            KvDtype::F16 => half::f16::from_bits(u16::from_le_bytes([self.data[2 * e], self.data[2 * e + 1]])).to_f32(),
            KvDtype::Bf16 => half::bf16::from_bits(u16::from_le_bytes([self.data[2 * e], self.data[2 * e + 1]])).to_f32(),
            KvDtype::Q8_0 => (self.data[e] as i8) as f32 * half::f16::from_bits(self.scales[e / Q8_BLOCK]).to_f32(),
            KvDtype::Q4_0 => {
                let byte = self.data[e / Q8_BLOCK * (Q8_BLOCK / 2) + e % (Q8_BLOCK / 2)];
                let level = if e % Q8_BLOCK < Q8_BLOCK / 2 { byte & 0x0F } else { byte >> 4 };
                (level as i32 - 8) as f32 * half::f16::from_bits(self.scales[e / Q8_BLOCK]).to_f32()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_type_round_trips_within_its_precision() {
        let layout = KvLayout { block_size: 2, n_heads: 4, n_kv_heads: 2, head_dim: 32 };
        let w = 64;
        let vals: Vec<f32> = (0..w).map(|i| ((i as f32) * 0.731).sin() * 3.0).collect();
        for dtype in KvDtype::ALL {
            let mut p = KvPlane::new(KvRole::Keys, dtype, layout, 2).unwrap();
            p.write(1, &vals);
            assert!(p.read(0).iter().chain(&p.read(2)).chain(&p.read(3)).all(|&x| x == 0.0), "{dtype}: neighbours untouched");
            let back = p.read(1);
            let tol = match dtype {
                KvDtype::F32 => 0.0,
                KvDtype::F16 => 3.0 * 2f32.powi(-11),
                KvDtype::Bf16 => 3.0 * 2f32.powi(-8),
                // the quantized types store the rotated head: each value's error is a mix of its
                // head's, so bounded in the mean (below), not one by one
                KvDtype::Q8_0 | KvDtype::Q4_0 => f32::INFINITY,
            };
            for (a, b) in vals.iter().zip(&back) {
                assert!((a - b).abs() <= tol * a.abs().max(1.0), "{dtype}: {a} -> {b}");
            }
            let rms = |x: &mut dyn Iterator<Item = f32>| (x.map(|v| v * v).sum::<f32>() / w as f32).sqrt();
            let err = rms(&mut vals.iter().zip(&back).map(|(a, b)| a - b));
            // a level is 1/127 (q8_0) or 1/8 (q4_0) of the block's largest value, and this smooth
            // head, rotated, has a few large coefficients: the error's rms about a level
            let bound = match dtype {
                KvDtype::Q4_0 => 0.15,
                KvDtype::Q8_0 => 0.015,
                _ => 3.0 * 2f32.powi(-8),
            };
            assert!(err <= bound * rms(&mut vals.iter().copied()), "{dtype}: rms error {err}");
            assert_eq!(p.bytes(), dtype.bytes(4 * w), "{dtype}");
        }
    }

    #[test]
    fn a_block_copied_out_and_in_reads_back_the_same_values_and_leaves_its_neighbours() {
        let layout = KvLayout { block_size: 4, n_heads: 4, n_kv_heads: 2, head_dim: 32 };
        for dtype in KvDtype::ALL {
            let mut src = KvPlane::new(KvRole::Keys, dtype, layout, 3).unwrap();
            for slot in 0..12 {
                src.write(slot, &(0..64).map(|i| ((slot * 64 + i) as f32 * 0.37).sin()).collect::<Vec<_>>());
            }
            let mut bytes = Vec::new();
            src.copy_block_out(1, &mut bytes);
            assert_eq!(bytes.len(), src.block_bytes(), "{dtype}");
            assert_eq!(src.block_bytes() * 3, src.bytes(), "{dtype}: blocks tile the plane");
            let mut dst = KvPlane::new(KvRole::Keys, dtype, layout, 3).unwrap();
            dst.copy_block_in(2, &bytes);
            for off in 0..4 {
                assert_eq!(dst.read(8 + off), src.read(4 + off), "{dtype}: slot {off} of the block");
            }
            assert!((0..8).all(|s| dst.read(s).iter().all(|&x| x == 0.0)), "{dtype}: other blocks untouched");
        }
    }

    #[test]
    fn q8_0_is_ggmls_block_arithmetic_on_the_rotated_head() {
        // the stored bytes are ggml's quantize_row_q8_0 of the rotated values: scale max |x| / 127,
        // rounded half away from zero
        let layout = KvLayout { block_size: 1, n_heads: 1, n_kv_heads: 1, head_dim: 32 };
        let x: Vec<f32> = (0..32).map(|i| ((i as f32) * 1.3).cos() * (1.0 + i as f32 / 4.0)).collect();
        let mut p = KvPlane::new(KvRole::Keys, KvDtype::Q8_0, layout, 1).unwrap();
        p.write(0, &x);
        let mut r = x.clone();
        rotate(&mut r, 32);
        let amax = r.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = half::f16::from_f32(amax / 127.0).to_f32();
        let v = p.view();
        for (j, &rv) in r.iter().enumerate() {
            assert_eq!(v.get(j), (rv * (127.0 / amax)).round() * d, "value {j}");
        }
        // an all-zero head has scale 0 and stays zero
        p.write(0, &[0.0; 32]);
        assert!(p.read(0).iter().all(|&v| v == 0.0));
    }

    /// Head-major within a block: a block's keys of one head are one run of block_size * head_dim.
    #[test]
    fn a_blocks_keys_of_one_head_are_contiguous() {
        let l = KvLayout { block_size: 4, n_heads: 6, n_kv_heads: 3, head_dim: 8 };
        let o = KvOrder::HeadMajor;
        assert_eq!((o.offset(&l, 0, 0), o.offset(&l, 1, 0), o.offset(&l, 3, 0), o.offset(&l, 0, 1)), (0, 8, 24, 32));
        assert_eq!(o.offset(&l, 5, 2), ((3 + 2) * 4 + 1) * 8, "block 1, head 2, offset 1");
        assert_eq!(KvOrder::SlotMajor.offset(&l, 5, 2), 5 * 24 + 16);
    }

    /// Dimension-major within a block: a block's keys of one head are the same run as head-major
    /// ones, each dimension's `block_size` slots side by side.
    #[test]
    fn a_blocks_dimension_major_keys_are_the_same_run_transposed() {
        let l = KvLayout { block_size: 16, n_heads: 6, n_kv_heads: 3, head_dim: 8 };
        let o = KvOrder::DimMajor;
        assert_eq!((o.offset(&l, 0, 0), o.offset(&l, 1, 0), o.offset(&l, 0, 1)), (0, 1, 128));
        assert_eq!(o.offset(&l, 16 + 5, 2), (3 + 2) * 128 + 5, "block 1, head 2, offset 5");
        assert_eq!((o.stride(&l), KvOrder::HeadMajor.stride(&l)), (16, 1));
        for (dtype, bs, want) in [(KvDtype::F16, 16, o), (KvDtype::F32, 32, o), (KvDtype::Bf16, 8, KvOrder::HeadMajor), (KvDtype::Q8_0, 16, KvOrder::HeadMajor)]
        {
            let l = KvLayout { block_size: bs, ..l };
            assert_eq!(KvOrder::for_plane(KvRole::Keys, dtype, &l), want, "{dtype} keys, blocks of {bs}");
            assert_eq!(KvOrder::for_plane(KvRole::Values, dtype, &l), KvOrder::HeadMajor);
        }
        // a slot written dimension-major reads back, and lands where the order says
        let l = KvLayout { block_size: 16, n_heads: 2, n_kv_heads: 2, head_dim: 8 };
        let mut p = KvPlane::new(KvRole::Keys, KvDtype::F32, l, 2).unwrap();
        let vals: Vec<f32> = (0..16).map(|i| i as f32 + 0.5).collect();
        p.write(19, &vals);
        assert_eq!(p.read(19), vals);
        let v = p.view();
        assert_eq!(v.get(o.offset(&l, 19, 1) + 3 * 16), 11.5, "head 1, dimension 3");
        assert!(p.read(18).iter().all(|&x| x == 0.0) && p.read(20).iter().all(|&x| x == 0.0));
    }

    #[test]
    fn names_parse_back() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
        }
        assert!("q4_k".parse::<KvDtype>().unwrap_err().to_string().contains("one of f32, f16, bf16, q8_0, q4_0"));
    }

    #[test]
    fn q4_0_is_ggmls_block_arithmetic_on_the_rotated_head() {
        // the stored levels are ggml's quantize_row_q4_0 of the rotated values
        let layout = KvLayout { block_size: 1, n_heads: 1, n_kv_heads: 1, head_dim: 32 };
        let x: Vec<f32> = (0..32).map(|i| ((i as f32) * 1.7).sin() * (1.0 + i as f32 / 8.0)).collect();
        let mut p = KvPlane::new(KvRole::Keys, KvDtype::Q4_0, layout, 1).unwrap();
        p.write(0, &x);
        let mut r = x.clone();
        rotate(&mut r, 32);
        let max = r.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
        let d = half::f16::from_f32(max / -8.0).to_f32();
        let v = p.view();
        for (j, &rv) in r.iter().enumerate() {
            let level = ((rv * (-8.0 / max) + 8.5) as i32).min(15);
            assert_eq!(v.get(j), (level - 8) as f32 * d, "value {j}");
        }
        // the largest magnitude maps to level 0 exactly (-8 * d = max)
        let at = r.iter().position(|&v| v == max).unwrap();
        assert_eq!(v.get(at), -8.0 * d);
    }

    #[test]
    fn rotation_is_orthogonal_and_spreads_an_outlier_channel() {
        for hd in [32, 64, 96, 128, 256] {
            let a: Vec<f32> = (0..hd).map(|i| ((i as f32) * 0.91).sin()).collect();
            let b: Vec<f32> = (0..hd).map(|i| ((i as f32) * 0.37).cos() + if i == 5 { 40.0 } else { 0.0 }).collect();
            let n = KvRole::Keys.rotation_size(hd);
            assert_eq!(n, if hd == 96 { 32 } else { hd }, "head {hd}");
            let (mut ra, mut rb) = (a.clone(), b.clone());
            rotate(&mut ra, n);
            rotate(&mut rb, n);
            let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| (p * q) as f64).sum::<f64>();
            assert!((dot(&a, &b) - dot(&ra, &rb)).abs() < 1e-4 * dot(&b, &b).sqrt(), "head {hd}: dots kept");
            let mut back = rb.clone();
            unrotate(&mut back, n);
            assert!(back.iter().zip(&b).all(|(x, y)| (x - y).abs() < 1e-4 * 40.0), "head {hd}: inverse");
            // the outlier of 40 is spread: no rotated value keeps more than its block's share
            let n = n as f32;
            assert!(rb.iter().all(|v| v.abs() < 40.0 / n.sqrt() + 0.5 * n.sqrt()), "head {hd}: outlier spread");
        }
        // a head with one outlier channel loses less through q4_0 rotated than it would plain
        let layout = KvLayout { block_size: 1, n_heads: 1, n_kv_heads: 1, head_dim: 128 };
        let x: Vec<f32> = (0..128).map(|i| ((i as f32) * 0.77).sin() + if i == 3 { 30.0 } else { 0.0 }).collect();
        let mut p = KvPlane::new(KvRole::Keys, KvDtype::Q4_0, layout, 1).unwrap();
        p.write(0, &x);
        let err_rotated: f32 = p.read(0).iter().zip(&x).map(|(a, b)| (a - b).powi(2)).sum();
        // the same levels without the rotation: the outlier's block is all scale, its 31 others 0
        let plain: f32 = x
            .chunks(32)
            .map(|blk| {
                let max = blk.iter().fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = max / -8.0;
                blk.iter().map(|&v| (((v / d + 8.5) as i32).min(15) - 8) as f32 * d - v).map(|e| e * e).sum::<f32>()
            })
            .sum();
        assert!(err_rotated < 0.7 * plain, "rotated {err_rotated} vs plain {plain}");
    }
}
