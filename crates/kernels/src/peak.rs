//! The machine's int8 multiply-accumulate peak, measured: the instruction the int8 matmul kernels
//! spend their time in (`vpdpbusd` on 256-bit vectors with AVX-512 VNNI, else AVX2's chain of
//! `vpmaddubsw`, `vpmaddwd` and `vpaddd`), run back to back on registers with enough independent
//! accumulators to hide its latency. What a compute-bound step (prefill, a verify step of many
//! tokens) could reach at best: `bench offline` reports prefill as a share of it, as it reports
//! decode as a share of the memory's read bandwidth. Written here (no crate measures one
//! instruction's throughput).

/// Multiply-accumulates per second the calling thread reaches with the int8 kernels' dot
/// instruction, over about `seconds`; 0 where there is no SIMD path (the scalar kernels).
pub fn int8_macs_per_second(seconds: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512_vnni || f.avx2_fma {
            let run = |iters: u64| -> u64 {
                // SAFETY: the features each path needs were detected at run time (cpu::features)
                unsafe {
                    if f.avx512_vnni {
                        x86::dpbusd(iters)
                    } else {
                        x86::maddubs(iters)
                    }
                }
            };
            // calibrate to ~1/10 of the time, then measure the rest
            let mut iters = 1u64 << 14;
            loop {
                let t = std::time::Instant::now();
                std::hint::black_box(run(iters));
                let e = t.elapsed().as_secs_f64();
                if e > seconds / 10.0 || iters > 1 << 40 {
                    let n = ((seconds / e.max(1e-9)) * iters as f64).max(1.0) as u64;
                    let t = std::time::Instant::now();
                    std::hint::black_box(run(n));
                    return (n * x86::MACS_PER_ITER) as f64 / t.elapsed().as_secs_f64();
                }
                iters *= 4;
            }
        }
    }
    let _ = seconds;
    0.0
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// 12 independent accumulators of eight i32 lanes, each four products a lane per step.
    const CHAINS: usize = 12;
    pub const MACS_PER_ITER: u64 = (CHAINS * 32) as u64;

    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    pub unsafe fn dpbusd(iters: u64) -> u64 {
        let (a, b) = (std::hint::black_box(_mm256_set1_epi8(3)), std::hint::black_box(_mm256_set1_epi8(-5)));
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        for _ in 0..iters {
            for c in acc.iter_mut() {
                *c = _mm256_dpbusd_epi32(*c, a, b);
            }
        }
        fold(acc)
    }

    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs(iters: u64) -> u64 {
        let b = std::hint::black_box(_mm256_set1_epi8(-5));
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_si256(); CHAINS];
        for _ in 0..iters {
            for c in acc.iter_mut() {
                // the accumulator's bytes as the unsigned operand: nothing to hoist out of the loop
                *c = _mm256_add_epi32(*c, _mm256_madd_epi16(_mm256_maddubs_epi16(*c, b), ones));
            }
        }
        fold(acc)
    }

    #[target_feature(enable = "avx2")]
    unsafe fn fold(acc: [__m256i; CHAINS]) -> u64 {
        let s = acc.iter().fold(_mm256_setzero_si256(), |s, &c| _mm256_add_epi32(s, c));
        _mm256_extract_epi32::<0>(s) as u32 as u64
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peak_is_a_positive_rate_where_there_is_simd() {
        let f = crate::cpu::features();
        let r = super::int8_macs_per_second(0.02);
        if cfg!(target_arch = "x86_64") && (f.avx2_fma || f.avx512_vnni) {
            // any x86-64 core with AVX2 does billions a second
            assert!(r > 1e9, "{r}");
        } else {
            assert_eq!(r, 0.0);
        }
    }
}
