//! Run-time CPU feature detection. Kernels pick their SIMD path once per process from these
//! flags; nothing is decided at compile time, so one binary runs on every x86-64 machine.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2_fma: bool,
    pub avx512_vnni: bool,
}

/// The features this process uses. `SPECULA_NO_SIMD=1` forces the portable paths and
/// `SPECULA_NO_VNNI=1` the AVX2 path (for tests and benchmarks).
pub fn features() -> CpuFeatures {
    static F: OnceLock<CpuFeatures> = OnceLock::new();
    *F.get_or_init(|| {
        if std::env::var_os("SPECULA_NO_SIMD").is_some_and(|v| v == "1") {
            return CpuFeatures { avx2_fma: false, avx512_vnni: false };
        }
        let mut f = detect();
        if std::env::var_os("SPECULA_NO_VNNI").is_some_and(|v| v == "1") {
            f.avx512_vnni = false;
        }
        f
    })
}

#[cfg(target_arch = "x86_64")]
fn detect() -> CpuFeatures {
    CpuFeatures {
        avx2_fma: is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"),
        avx512_vnni: is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vnni"),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures { avx2_fma: false, avx512_vnni: false }
}

/// A one-line description for start-up logs.
pub fn describe() -> String {
    let f = features();
    let path = if f.avx512_vnni {
        "avx512-vnni"
    } else if f.avx2_fma {
        "avx2+fma"
    } else {
        "portable"
    };
    format!("kernels: {path}")
}
