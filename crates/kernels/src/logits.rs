//! Scans of one logits row for reported log-probabilities: the row's maximum with the number of
//! logits above a given one, and the sum of `exp(x - max)`. Our own code rather than a crate's
//! because it is what scoring a prompt costs besides the lm_head (every prompt row, a
//! 151 936-wide row on Qwen): written as eight independent lanes, so the compiler vectorises it
//! (SSE2 everywhere, AVX2 where the CPU has it, chosen at run time), with one polynomial `exp`
//! (`crate::exp`) instead of a libm call per logit. The lanes and the order of every addition are
//! fixed, so the result is the same bits on every path and for every thread count.
//!
//! Logits are read "cleaned": NaN as -inf (probability 0) and +inf as `f32::MAX`.

use crate::cpu::features;
use crate::exp::exp;

const LANES: usize = 8;
/// Elements summed in f32 lanes before the lanes are added into the f64 total (bounds the f32
/// rounding error of a long row).
const BLOCK: usize = 512;

/// A logit as the samplers and logprobs read it: NaN as -inf (probability 0), +inf as `f32::MAX`.
#[inline(always)]
pub fn clean(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x.min(f32::MAX)
    }
}

/// The row's largest (cleaned) logit, and how many logits are strictly larger than `than`
/// (cleaned): a token's rank is that count plus one. `(-inf, 0)` for an empty row.
pub fn max_and_count_above(row: &[f32], than: f32) -> (f32, usize) {
    #[cfg(target_arch = "x86_64")]
    if features().avx2_fma {
        // SAFETY: the CPU has AVX2 and FMA (run-time detection).
        return unsafe { max_and_count_above_avx2(row, than) };
    }
    max_and_count_above_lanes(row, than)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn max_and_count_above_avx2(row: &[f32], than: f32) -> (f32, usize) {
    max_and_count_above_lanes(row, than)
}

#[inline(always)]
fn max_and_count_above_lanes(row: &[f32], than: f32) -> (f32, usize) {
    let than = clean(than);
    let mut max = [f32::NEG_INFINITY; LANES];
    let mut count = [0u32; LANES];
    let chunks = row.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            let x = clean(c[l]);
            max[l] = max[l].max(x);
            count[l] = count[l].wrapping_add((x > than) as u32);
        }
    }
    let mut m = max.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut n: usize = count.iter().map(|&c| c as usize).sum();
    for &x in tail {
        let x = clean(x);
        m = m.max(x);
        n += (x > than) as usize;
    }
    (m, n)
}

/// `sum(exp(x - max))` over the row, `max` being its largest cleaned logit (finite): f32 lanes
/// over blocks of [`BLOCK`], each block's lanes added in f64.
pub fn exp_sum(row: &[f32], max: f32) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if features().avx2_fma {
        // SAFETY: the CPU has AVX2 and FMA (run-time detection).
        return unsafe { exp_sum_avx2(row, max) };
    }
    exp_sum_lanes(row, max)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_sum_avx2(row: &[f32], max: f32) -> f64 {
    exp_sum_lanes(row, max)
}

#[inline(always)]
fn exp_sum_lanes(row: &[f32], max: f32) -> f64 {
    let mut total = 0f64;
    let mut buf = [0f32; BLOCK];
    for b in row.chunks(BLOCK) {
        // the exps in a plain loop (which the compiler vectorises), then their lane sums
        let e = &mut buf[..b.len()];
        e.iter_mut().zip(b).for_each(|(o, &x)| *o = exp(clean(x) - max));
        let mut acc = [0f32; LANES];
        let chunks = e.chunks_exact(LANES);
        let tail = chunks.remainder();
        for c in chunks {
            for l in 0..LANES {
                acc[l] += c[l];
            }
        }
        for &x in tail {
            acc[0] += x;
        }
        total += acc.iter().map(|&a| f64::from(a)).sum::<f64>();
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (s >> 8) as f32 / (1u32 << 24) as f32 * 30.0 - 15.0
            })
            .collect()
    }

    #[test]
    fn exp_sum_matches_f64_and_every_path_gives_the_same_bits() {
        for n in [0, 1, 7, 8, 9, 511, 512, 513, 49_152, 151_936] {
            let mut r = row(n, n as u32 + 3);
            if n > 2 {
                r[1] = f32::NAN;
                r[2] = f32::NEG_INFINITY;
            }
            let (max, _) = max_and_count_above_lanes(&r, 0.0);
            if n == 0 {
                assert_eq!(max, f32::NEG_INFINITY);
                continue;
            }
            let want: f64 = r.iter().map(|&x| (f64::from(clean(x)) - f64::from(max)).exp()).sum();
            let got = exp_sum(&r, max);
            assert!((got - want).abs() <= 1e-6 * want, "n {n}: {got} vs {want}");
            assert_eq!(got.to_bits(), exp_sum_lanes(&r, max).to_bits(), "n {n}: SIMD path differs from the portable one");
        }
    }

    #[test]
    fn max_and_count_above_match_a_plain_scan() {
        for n in [1, 5, 8, 100, 4097] {
            let mut r = row(n, 11 * n as u32);
            r[0] = f32::NAN;
            if n > 3 {
                r[3] = f32::INFINITY;
            }
            for than in [-20.0, -1.0, 0.0, 3.5, 14.0, f32::MAX] {
                let want_max = r.iter().map(|&x| clean(x)).fold(f32::NEG_INFINITY, f32::max);
                let want_count = r.iter().filter(|&&x| clean(x) > than).count();
                assert_eq!(max_and_count_above(&r, than), (want_max, want_count), "n {n}, than {than}");
                assert_eq!(max_and_count_above_lanes(&r, than), (want_max, want_count));
            }
        }
    }
}
