//! The x86 kernels of Q4_0 / Q4_1 / Q8_0 groups (AVX2, and AVX-512 VNNI where the CPU has it, chosen
//! at run time by `PackedInt8`): one group, and two groups per 512-bit instruction.

use super::*;
use crate::packed::k::x86::{bcast4_512, halves512, join512, minus_offset_share, minus_offset_share512, store_pairs};
use std::arch::x86_64::*;

/// How far ahead of the current group block to prefetch (unless `CpuFeatures::prefetch_ahead`
/// says): weights stream from memory once per step.
const PREFETCH_BYTES: usize = 1024;

#[inline(always)]
fn prefetch_bytes() -> usize {
    crate::cpu::features().prefetch_ahead.unwrap_or(PREFETCH_BYTES)
}

/// Integer partial sums of one activation row. AVX2 keeps the Q4 partial sums in i16 lanes
/// (8 groups x 2 products x 15 x 127 = 30480 < 32767, so no overflow) and widens once per block.
trait IntDot {
    /// acc += per-lane sums of four u8 x i8 products (Q4 quants, i16 partials on AVX2).
    unsafe fn q4(acc: __m256i, w: __m256i, a: __m256i) -> __m256i;
    /// Turns a Q4 accumulator into eight i32 sums.
    unsafe fn q4_finish(acc: __m256i) -> __m256i;
    /// acc (i32) += per-lane sums of four |w| x sign(a, w) products (Q8 quants).
    unsafe fn q8(acc: __m256i, aw: __m256i, sa: __m256i) -> __m256i;
    /// Whether Q8_0 blocks take the weights offset to unsigned (`w + 128` against `a`, less
    /// `128 sum(a)`: one `vpdpbusd` with its broadcast folded in per weight vector and row)
    /// instead of `sign` (a broadcast and a `vpsignb` more each). `maddubs` would saturate
    /// its i16 pairs at `255 x 127 x 2`, so only VNNI does.
    const Q8_OFFSET: bool;
}

struct Avx2;
struct Vnni;

impl IntDot for Avx2 {
    const Q8_OFFSET: bool = false;
    #[inline(always)]
    unsafe fn q4(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a))
    }
    #[inline(always)]
    unsafe fn q4_finish(acc: __m256i) -> __m256i {
        _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
    }
    #[inline(always)]
    unsafe fn q8(acc: __m256i, aw: __m256i, sa: __m256i) -> __m256i {
        // |w| <= 128 and |a| <= 127: a pair sums to at most 32512, inside i16
        _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sa), _mm256_set1_epi16(1)))
    }
}

impl IntDot for Vnni {
    const Q8_OFFSET: bool = true;
    #[inline(always)]
    unsafe fn q4(acc: __m256i, w: __m256i, a: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, w, a)
    }
    #[inline(always)]
    unsafe fn q4_finish(acc: __m256i) -> __m256i {
        acc
    }
    #[inline(always)]
    unsafe fn q8(acc: __m256i, aw: __m256i, sa: __m256i) -> __m256i {
        _mm256_dpbusd_epi32(acc, aw, sa)
    }
}

#[inline(always)]
unsafe fn bcast4(p: *const i8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q8_0: u8 = 2;

const fn format_of(f: u8) -> WeightFormat {
    match f {
        Q4_0 => WeightFormat::Q4_0,
        Q4_1 => WeightFormat::Q4_1,
        _ => WeightFormat::Q8_0,
    }
}

/// The float lanes of a kernel: 8 (one group) or 16 (two groups), with their i32 sums.
trait Lanes: Copy {
    type Int: Copy;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self;
    unsafe fn from_int(i: Self::Int) -> Self;
}

impl Lanes for __m256 {
    type Int = __m256i;
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        _mm256_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        _mm256_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn from_int(i: __m256i) -> Self {
        _mm256_cvtepi32_ps(i)
    }
}

impl Lanes for __m512 {
    type Int = __m512i;
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        _mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn mul(a: Self, b: Self) -> Self {
        _mm512_mul_ps(a, b)
    }
    #[inline(always)]
    unsafe fn fmadd(a: Self, b: Self, c: Self) -> Self {
        _mm512_fmadd_ps(a, b, c)
    }
    #[inline(always)]
    unsafe fn from_int(i: __m512i) -> Self {
        _mm512_cvtepi32_ps(i)
    }
}

/// One block's exact integer sums into the float accumulators, in the documented order:
/// `acc = fma(d_w * d_a, s, acc)`, then for Q4 `acc = fma(m_w, s_a, acc)` (Q4_0: `m_w = -8 d_w`;
/// Q4_1 passes its `m`).
#[inline(always)]
unsafe fn add_block<L: Lanes, const F: u8, const N: usize>(acc: &mut [L; N], d: L, m: Option<L>, isum: &[L::Int; N], acts: &[&[BlockQ8]; N], b: usize) {
    let m = if F == Q4_0 { Some(L::mul(d, L::splat(-8.0))) } else { m };
    for n in 0..N {
        let ab = acts[n].get_unchecked(b);
        acc[n] = L::fmadd(L::mul(d, L::splat(ab.d)), L::from_int(isum[n]), acc[n]);
        if let Some(m) = m {
            acc[n] = L::fmadd(m, L::splat(ab.s), acc[n]);
        }
    }
}

/// The kernel for one format (a const parameter, so no format test runs inside the loop).
#[inline(always)]
unsafe fn group_impl<D: IntDot, const F: u8, const N: usize>(group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
    let format = format_of(F);
    let gbb = group_block_bytes(format);
    let qoff = quants_offset(format);
    assert!(group.len() >= blocks * gbb);
    let gp = group.as_ptr();
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); N];
    // weights from memory at one or two rows: see `CpuFeatures::sw_prefetch`
    let prefetch = N > 2 || crate::cpu::features().sw_prefetch;
    let ahead = prefetch_bytes();
    for b in 0..blocks {
        // SAFETY (whole loop): b < blocks, the group holds `blocks` group blocks of gbb bytes and
        // every activation row `blocks` blocks (checked by the caller).
        let blk = gp.add(b * gbb);
        // every cache line of the group block PREFETCH_BYTES ahead
        let mut line = 0;
        while prefetch && line < gbb {
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(ahead + line) as *const i8);
            line += 64;
        }
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let q = blk.add(qoff);
        let mut isum = [_mm256_setzero_si256(); N];
        match F {
            Q4_0 | Q4_1 => {
                for v in 0..4 {
                    let raw = _mm256_loadu_si256(q.add(32 * v) as *const __m256i);
                    let lo = _mm256_and_si256(raw, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                    for n in 0..N {
                        let ap = acts[n].get_unchecked(b).qs.as_ptr();
                        isum[n] = D::q4(isum[n], lo, bcast4(ap.add(4 * v)));
                        isum[n] = D::q4(isum[n], hi, bcast4(ap.add(16 + 4 * v)));
                    }
                }
                for s in isum.iter_mut() {
                    *s = D::q4_finish(*s);
                }
            }
            _ if D::Q8_OFFSET => {
                // sum((w + 128) a) - 128 sum(a), started at the second term: the same exact
                // integer sum (each lane at most 32 x 255 x 127 besides it)
                for n in 0..N {
                    isum[n] = minus_offset_share(acts[n].get_unchecked(b), 128);
                }
                let offset = _mm256_set1_epi8(i8::MIN);
                for g in 0..8 {
                    let u = _mm256_xor_si256(_mm256_loadu_si256(q.add(32 * g) as *const __m256i), offset);
                    for n in 0..N {
                        let ap = acts[n].get_unchecked(b).qs.as_ptr();
                        isum[n] = _mm256_dpbusd_epi32(isum[n], u, bcast4(ap.add(4 * g)));
                    }
                }
            }
            _ => {
                for g in 0..8 {
                    let w = _mm256_loadu_si256(q.add(32 * g) as *const __m256i);
                    let aw = _mm256_sign_epi8(w, w);
                    for n in 0..N {
                        let ap = acts[n].get_unchecked(b).qs.as_ptr();
                        isum[n] = D::q8(isum[n], aw, _mm256_sign_epi8(bcast4(ap.add(4 * g)), w));
                    }
                }
            }
        }
        let m = match F {
            Q4_1 => Some(_mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * GROUP_ROWS) as *const __m128i))),
            _ => None,
        };
        add_block::<__m256, F, N>(&mut acc, d, m, &isum, &acts, b);
    }
    for n in 0..N {
        // SAFETY: the caller gives N pointers to eight writable floats each.
        _mm256_storeu_ps(dst[n], acc[n]);
    }
}

/// Two groups at once in 512-bit vectors (lanes 0-7: group 0, 8-15: group 1), each lane's
/// arithmetic exactly `group_impl`'s: the same exact integer block sums (`vpdpbusd`; for Q8_0
/// from weights offset to unsigned, minus the offset's share), then the same
/// two fmas per block in the same order, so the results are `group_impl`'s bits.
#[inline(always)]
unsafe fn pair_impl<const F: u8, const N: usize>(g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    let format = format_of(F);
    let gbb = group_block_bytes(format);
    let qoff = quants_offset(format);
    assert!(g0.len() >= blocks * gbb && g1.len() >= blocks * gbb);
    let (p0, p1) = (g0.as_ptr(), g1.as_ptr());
    let ahead = prefetch_bytes();
    let m4 = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); N];
    for b in 0..blocks {
        // SAFETY (whole loop): b < blocks, both groups hold `blocks` group blocks of gbb bytes
        // and every activation row `blocks` blocks (checked by the caller).
        let (b0, b1) = (p0.add(b * gbb), p1.add(b * gbb));
        let mut line = 0;
        while line < gbb {
            _mm_prefetch::<_MM_HINT_T0>(b0.wrapping_add(ahead + line) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(b1.wrapping_add(ahead + line) as *const i8);
            line += 64;
        }
        let d = halves512(b0, b1);
        let (q0, q1) = (b0.add(qoff), b1.add(qoff));
        let mut isum = [_mm512_setzero_si512(); N];
        match F {
            Q4_0 | Q4_1 => {
                for v in 0..4 {
                    let raw = join512(q0.add(32 * v), q1.add(32 * v));
                    let lo = _mm512_and_si512(raw, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), m4);
                    for n in 0..N {
                        let ap = acts[n].get_unchecked(b).qs.as_ptr();
                        isum[n] = _mm512_dpbusd_epi32(isum[n], lo, bcast4_512(ap.add(4 * v)));
                        isum[n] = _mm512_dpbusd_epi32(isum[n], hi, bcast4_512(ap.add(16 + 4 * v)));
                    }
                }
            }
            _ => {
                // vpdpbusd multiplies u8 by i8: the weights go in offset by 128 (`w ^ 0x80` is
                // `w + 128` as a u8, made once per weight vector and shared by every row)
                // against the activations, each row's sum started at `-128 sum(a)` (the block's
                // half sums): the same exact sums as |w| x sign(a, w) (each lane at most
                // 8 x 4 x 255 x 127 besides it), one instruction per weight vector and row, the
                // broadcast folded in.
                for n in 0..N {
                    isum[n] = minus_offset_share512(acts[n].get_unchecked(b));
                }
                let offset = _mm512_set1_epi8(i8::MIN);
                for g in 0..8 {
                    let u = _mm512_xor_si512(join512(q0.add(32 * g), q1.add(32 * g)), offset);
                    for n in 0..N {
                        isum[n] = _mm512_dpbusd_epi32(isum[n], u, bcast4_512(acts[n].get_unchecked(b).qs.as_ptr().add(4 * g)));
                    }
                }
            }
        }
        let m = match F {
            Q4_1 => Some(halves512(b0.add(2 * GROUP_ROWS), b1.add(2 * GROUP_ROWS))),
            _ => None,
        };
        add_block::<__m512, F, N>(&mut acc, d, m, &isum, &acts, b);
    }
    // SAFETY: the caller gives 2 x N pointers to eight writable floats each.
    store_pairs(&acc, dst);
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn pair_vnni512<const N: usize>(format: WeightFormat, g0: &[u8], g1: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
    match format {
        WeightFormat::Q4_0 => pair_impl::<Q4_0, N>(g0, g1, blocks, acts, dst),
        WeightFormat::Q4_1 => pair_impl::<Q4_1, N>(g0, g1, blocks, acts, dst),
        WeightFormat::Q8_0 => pair_impl::<Q8_0, N>(g0, g1, blocks, acts, dst),
        _ => unreachable!("{format:?} has no int8 dot path"),
    }
}

/// One entry point per instruction set, each dispatching on the format.
macro_rules! group_fn {
    ($name:ident, $features:literal, $dot:ty) => {
        #[target_feature(enable = $features)]
        pub(super) unsafe fn $name<const N: usize>(format: WeightFormat, group: &[u8], blocks: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
            match format {
                WeightFormat::Q4_0 => group_impl::<$dot, Q4_0, N>(group, blocks, acts, dst),
                WeightFormat::Q4_1 => group_impl::<$dot, Q4_1, N>(group, blocks, acts, dst),
                WeightFormat::Q8_0 => group_impl::<$dot, Q8_0, N>(group, blocks, acts, dst),
                _ => unreachable!("{format:?} has no int8 dot path"),
            }
        }
    };
}
group_fn!(group_avx2, "avx2,fma,f16c", Avx2);
group_fn!(group_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", Vnni);

/// The eight rows' results against each of N activation rows.
#[cfg(test)]
type GroupOut<const N: usize> = [[f32; GROUP_ROWS]; N];

#[cfg(test)]
pub(super) fn both<const N: usize>(p: &PackedInt8, g: usize, acts: [&[BlockQ8]; N]) -> Option<(GroupOut<N>, GroupOut<N>)> {
    let f = crate::cpu::features();
    if !(f.avx2_fma && f.avx512_vnni) {
        return None;
    }
    let (mut a, mut b) = ([[0f32; GROUP_ROWS]; N], [[0f32; GROUP_ROWS]; N]);
    // SAFETY: features checked above; sizes as in dot_group; a and b hold N x 8 floats.
    unsafe {
        group_avx2::<N>(p.format, &p.group_for_tests(g), p.blocks, acts, a.each_mut().map(|r| r.as_mut_ptr()));
        group_vnni::<N>(p.format, &p.group_for_tests(g), p.blocks, acts, b.each_mut().map(|r| r.as_mut_ptr()));
    }
    Some((a, b))
}
