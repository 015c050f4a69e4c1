//! The machine's memory read bandwidth, measured the way the fastest streaming kernel reads, so
//! that a decode step's share of it is a share of what the hardware gives rather than of what one
//! naive loop reaches. Each [`ReadKernel`] sums a buffer's 64-bit words (wrapping, so every kernel
//! gives the same checksum, which the tests hold): one stream of scalar words the compiler
//! vectorises (what `bench offline` measured before), then several streams per thread read in
//! lockstep (more misses in flight than one stream's prefetcher keeps), with software prefetch
//! ahead of each stream, in 256-bit loads (AVX2) and 512-bit loads (AVX-512). The caller splits a
//! buffer over its threads (one share each) and keeps the best kernel's figure; `bench offline`
//! prints every kernel's. Written here: no crate measures this, and the point is the loads.

/// One way of streaming a buffer. [`ReadKernel::available`] lists the ones this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadKernel {
    /// Eight scalar lanes over one stream (vectorised by the compiler).
    OneStream,
    /// Four streams, two 256-bit loads each per 64-byte line, read in lockstep.
    Avx2Streams,
    /// The same, each stream prefetching [`PREFETCH_AHEAD`] bytes ahead.
    Avx2StreamsPrefetch,
    /// Four streams, one 512-bit load per line, prefetching ahead.
    Avx512StreamsPrefetch,
}

/// Streams per thread in the multi-stream kernels.
pub const STREAMS: usize = 4;
/// How far ahead of its loads each stream prefetches.
pub const PREFETCH_AHEAD: usize = 1024;

impl ReadKernel {
    pub const ALL: [ReadKernel; 4] = [Self::OneStream, Self::Avx2Streams, Self::Avx2StreamsPrefetch, Self::Avx512StreamsPrefetch];

    pub fn name(self) -> &'static str {
        match self {
            Self::OneStream => "1 stream, scalar lanes",
            Self::Avx2Streams => "4 streams, 256-bit loads",
            Self::Avx2StreamsPrefetch => "4 streams, 256-bit loads, prefetch",
            Self::Avx512StreamsPrefetch => "4 streams, 512-bit loads, prefetch",
        }
    }

    /// The kernels this CPU runs (`cpu::features`, so `SPECULA_NO_SIMD` / `SPECULA_NO_AVX512`
    /// leave the wider ones out).
    pub fn available() -> Vec<ReadKernel> {
        let f = crate::cpu::features();
        Self::ALL
            .into_iter()
            .filter(|k| match k {
                Self::OneStream => true,
                Self::Avx2Streams | Self::Avx2StreamsPrefetch => f.avx2_fma,
                Self::Avx512StreamsPrefetch => f.avx512_vnni,
            })
            .collect()
    }

    /// The wrapping sum of `b`'s native-endian 64-bit words (a tail shorter than a word is
    /// added as one zero-padded word), whichever kernel reads it.
    pub fn read(self, b: &[u8]) -> u64 {
        #[cfg(target_arch = "x86_64")]
        {
            let f = crate::cpu::features();
            // SAFETY: each arm runs only where its features were detected at run time
            match self {
                Self::Avx2Streams if f.avx2_fma => return unsafe { x86::streams_avx2::<false>(b) },
                Self::Avx2StreamsPrefetch if f.avx2_fma => return unsafe { x86::streams_avx2::<true>(b) },
                Self::Avx512StreamsPrefetch if f.avx512_vnni => return unsafe { x86::streams_avx512(b) },
                _ => {}
            }
        }
        one_stream(b)
    }
}

/// The portable kernel: eight independent lanes over whole 64-byte lines, then the tail.
pub fn one_stream(b: &[u8]) -> u64 {
    let lines = b.len() / 64 * 64;
    let mut acc = [0u64; 8];
    for c in b[..lines].chunks_exact(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            *a = a.wrapping_add(word(&c[8 * j..8 * j + 8]));
        }
    }
    acc.iter().fold(tail_sum(&b[lines..]), |x, &y| x.wrapping_add(y))
}

fn word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w[..b.len()].copy_from_slice(b);
    u64::from_ne_bytes(w)
}

/// The words of a tail shorter than a line (the last one zero-padded).
fn tail_sum(b: &[u8]) -> u64 {
    b.chunks(8).fold(0u64, |s, c| s.wrapping_add(word(c)))
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{tail_sum, PREFETCH_AHEAD, STREAMS};
    use std::arch::x86_64::*;

    /// The buffer's whole lines cut into `STREAMS` equal runs (the rest goes to the tail): the
    /// lines in each run, and the bytes the runs cover.
    fn runs(len: usize) -> (usize, usize) {
        let per = len / 64 / STREAMS;
        (per, per * 64 * STREAMS)
    }

    #[target_feature(enable = "avx2")]
    unsafe fn hsum256(v: __m256i) -> u64 {
        let mut w = [0u64; 4];
        _mm256_storeu_si256(w.as_mut_ptr() as *mut __m256i, v);
        w.iter().fold(0, |s, &x| s.wrapping_add(x))
    }

    /// `STREAMS` runs read in lockstep, a 64-byte line of each per round (two 256-bit loads),
    /// with `PREFETCH` a line `PREFETCH_AHEAD` bytes ahead in each.
    #[target_feature(enable = "avx2")]
    pub unsafe fn streams_avx2<const PREFETCH: bool>(b: &[u8]) -> u64 {
        let (per, covered) = runs(b.len());
        let p = b.as_ptr();
        let run = per * 64;
        let mut acc = [_mm256_setzero_si256(); 2 * STREAMS];
        for i in 0..per {
            for s in 0..STREAMS {
                let at = s * run + i * 64;
                if PREFETCH && i * 64 + PREFETCH_AHEAD < run {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(at + PREFETCH_AHEAD) as *const i8);
                }
                // SAFETY: at + 64 <= covered <= b.len()
                let lo = _mm256_loadu_si256(p.add(at) as *const __m256i);
                let hi = _mm256_loadu_si256(p.add(at + 32) as *const __m256i);
                acc[2 * s] = _mm256_add_epi64(acc[2 * s], lo);
                acc[2 * s + 1] = _mm256_add_epi64(acc[2 * s + 1], hi);
            }
        }
        let mut sum = tail_sum(&b[covered..]);
        for a in acc {
            sum = sum.wrapping_add(hsum256(a));
        }
        sum
    }

    /// As [`streams_avx2`] with prefetch, one 512-bit load a line.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn streams_avx512(b: &[u8]) -> u64 {
        let (per, covered) = runs(b.len());
        let p = b.as_ptr();
        let run = per * 64;
        let mut acc = [_mm512_setzero_si512(); STREAMS];
        for i in 0..per {
            for (s, a) in acc.iter_mut().enumerate() {
                let at = s * run + i * 64;
                if i * 64 + PREFETCH_AHEAD < run {
                    _mm_prefetch::<_MM_HINT_T0>(p.add(at + PREFETCH_AHEAD) as *const i8);
                }
                // SAFETY: at + 64 <= covered <= b.len()
                *a = _mm512_add_epi64(*a, _mm512_loadu_si512(p.add(at) as *const __m512i));
            }
        }
        let mut sum = tail_sum(&b[covered..]);
        for a in acc {
            sum = sum.wrapping_add(_mm512_reduce_add_epi64(a) as u64);
        }
        sum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel this CPU runs gives the portable kernel's checksum, for lengths that leave
    /// every kind of tail (no whole line, lines that do not divide into the streams, a word cut).
    #[test]
    fn every_kernel_sums_the_same_words() {
        let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        let kernels = ReadKernel::available();
        println!("read kernels run here: {:?}", kernels);
        for len in [0, 7, 63, 64, 65, 255, 256, 1000, 64 * 4 * 17 + 3, 299_999, 300_000] {
            let b = &data[..len];
            let want = tail_sum(b);
            for k in &kernels {
                assert_eq!(k.read(b), want, "{k:?} at {len} bytes");
            }
        }
        // and at an unaligned start
        for k in &kernels {
            assert_eq!(k.read(&data[5..100_005]), tail_sum(&data[5..100_005]), "{k:?} unaligned");
        }
    }
}
