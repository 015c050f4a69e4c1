//! The x86 kernels of the float groups (F16 / BF16 / F32 against f32 activations; AVX2 with FMA).

use super::*;
use std::arch::x86_64::*;

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn group_f16<const G: usize, const N: usize>(w: &[u16], cols: usize, xs: [&[f32]; N], dst: [[*mut f32; N]; G]) {
    assert!(w.len() >= G * cols * GROUP_ROWS);
    let mut acc = [[_mm256_setzero_ps(); N]; G];
    let wp = w.as_ptr();
    for c in 0..cols {
        let x: [__m256; N] = std::array::from_fn(|n| _mm256_set1_ps(*xs[n].get_unchecked(c)));
        for j in 0..G {
            // SAFETY: c < cols, j < G; the slice holds G groups of cols columns of eight f16.
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add((j * cols + c) * GROUP_ROWS) as *const __m128i));
            for n in 0..N {
                acc[j][n] = _mm256_fmadd_ps(wv, x[n], acc[j][n]);
            }
        }
    }
    for j in 0..G {
        for n in 0..N {
            _mm256_storeu_ps(dst[j][n], acc[j][n]);
        }
    }
}

#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn group_f32<const G: usize, const N: usize>(w: &[f32], cols: usize, xs: [&[f32]; N], dst: [[*mut f32; N]; G]) {
    assert!(w.len() >= G * cols * GROUP_ROWS);
    let mut acc = [[_mm256_setzero_ps(); N]; G];
    let wp = w.as_ptr();
    for c in 0..cols {
        let x: [__m256; N] = std::array::from_fn(|n| _mm256_set1_ps(*xs[n].get_unchecked(c)));
        for j in 0..G {
            // SAFETY: as above, eight f32 per column.
            let wv = _mm256_loadu_ps(wp.add((j * cols + c) * GROUP_ROWS));
            for n in 0..N {
                acc[j][n] = _mm256_fmadd_ps(wv, x[n], acc[j][n]);
            }
        }
    }
    for j in 0..G {
        for n in 0..N {
            _mm256_storeu_ps(dst[j][n], acc[j][n]);
        }
    }
}
