//! Run-time CPU feature detection. Kernels pick their SIMD path once per process from these
//! flags; nothing is decided at compile time, so one binary runs on every x86-64 machine.

use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuFeatures {
    pub avx2_fma: bool,
    pub avx512_vnni: bool,
    /// 512-bit instructions run as two 256-bit halves (AMD Zen 4): two 256-bit passes cost
    /// about what one 512-bit pass does, so the kernels' two-group 512-bit pass gains little
    /// (`SPECULA_SPLIT_512=0` / `=1` overrides the detection, for benchmarks).
    pub split_512: bool,
    /// Whether the int8 kernels prefetch the weights one block ahead into L1 at every activation
    /// row count. Off on AMD Zen 4, where those prefetches made a stream from memory at few rows
    /// slower; there the k-quant kernels prefetch into L2 further ahead instead, by their own
    /// rules (`packed::k`) (`SPECULA_SW_PREFETCH=0` / `=1` overrides, for benchmarks). On, on Zen 3
    /// (the same CPU family, without AVX-512), where the Zen 4 rules left a one-row decode's
    /// weights without a prefetch and decode ran 1.2-1.3x slower (Qwen3-30B-A3B shape) and
    /// 1.1-1.15x (1.5B) at one and two threads, prefill unchanged (alternated runs, Zen 3 Milan).
    pub sw_prefetch: bool,
    /// Bytes ahead of the group block being read that those L1 prefetches reach; None: the
    /// kernel's own default (about one group block). AMD Zen 5: 16 KiB, where one block ahead left
    /// a one-row decode matmul at 44 GB/s and 16 KiB reached 70 (`matmul_bench`, Q4_K gate/up,
    /// weights from memory, 2 threads; Q6_K's lm_head at four rows 1.5x faster)
    /// (`SPECULA_PREFETCH_AHEAD=<bytes>` overrides, for benchmarks; 0: the kernels' defaults).
    pub prefetch_ahead: Option<usize>,
    /// Whether Q4_0 / Q4_1 / Q8_0 matmuls take two groups per 512-bit pass at one or two
    /// activation rows (decode). Yes on Intel (Sapphire Rapids: +10% decode, K15); not on AMD
    /// Zen 5, where the one-group kernel streamed the weights 1.15-1.3x faster at one and two
    /// rows (Q8_0 up to four) and the pair pays from three rows (Q8_0: eight) (K18).
    pub pairs_at_few_rows: bool,
}

/// The features this process uses. `SPECULA_NO_SIMD=1` forces the portable paths and
/// `SPECULA_NO_VNNI=1` (or `SPECULA_NO_AVX512=1`) the AVX2 path (for tests and benchmarks:
/// scripts/test.sh runs the kernel tests a second time with it, so both paths run on a CPU that
/// has AVX-512 VNNI).
pub fn features() -> CpuFeatures {
    static F: OnceLock<CpuFeatures> = OnceLock::new();
    *F.get_or_init(|| {
        if std::env::var_os("SPECULA_NO_SIMD").is_some_and(|v| v == "1") {
            return CpuFeatures { avx2_fma: false, avx512_vnni: false, split_512: false, sw_prefetch: false, prefetch_ahead: None, pairs_at_few_rows: false };
        }
        let mut f = detect();
        if avx512_switched_off() {
            f.avx512_vnni = false;
        }
        match std::env::var_os("SPECULA_SPLIT_512") {
            Some(v) if v == "0" => f.split_512 = false,
            Some(v) if v == "1" => f.split_512 = true,
            _ => {}
        }
        if let Some(b) = std::env::var("SPECULA_PREFETCH_AHEAD").ok().and_then(|v| v.parse::<usize>().ok()) {
            f.prefetch_ahead = (b > 0).then_some(b);
        }
        match std::env::var_os("SPECULA_SW_PREFETCH") {
            Some(v) if v == "0" => f.sw_prefetch = false,
            Some(v) if v == "1" => f.sw_prefetch = true,
            _ => {}
        }
        f
    })
}

fn env_is_1(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| v == "1")
}

/// Whether the environment turned the AVX-512 VNNI path off (`SPECULA_NO_VNNI=1` or
/// `SPECULA_NO_AVX512=1`; `SPECULA_NO_SIMD=1` turns off every SIMD path).
fn avx512_switched_off() -> bool {
    env_is_1("SPECULA_NO_VNNI") || env_is_1("SPECULA_NO_AVX512")
}

/// What the CPU itself offers, before the environment switches (the tests compare it with
/// `features`, to say which paths they could not run).
pub fn detected() -> CpuFeatures {
    detect()
}

/// Names of the kernel paths, as the tests report them.
pub const PATH_SCALAR: &str = "scalar";
pub const PATH_AVX2: &str = "avx2";
pub const PATH_VNNI: &str = "avx512-vnni";

/// The path the dispatching kernels take in this process.
pub fn dispatched_path() -> &'static str {
    let f = features();
    if f.avx512_vnni {
        PATH_VNNI
    } else if f.avx2_fma {
        PATH_AVX2
    } else {
        PATH_SCALAR
    }
}

/// The SIMD paths a kernel test must have run in this process: every path the CPU has that the
/// environment did not switch off.
pub fn expected_paths() -> Vec<&'static str> {
    let (cpu, simd_off) = (detected(), env_is_1("SPECULA_NO_SIMD"));
    let mut paths = Vec::new();
    if cpu.avx2_fma && !simd_off {
        paths.push(PATH_AVX2);
    }
    if cpu.avx512_vnni && !simd_off && !avx512_switched_off() {
        paths.push(PATH_VNNI);
    }
    paths
}

/// For kernel tests: under CI (the `CI` variable set), fails when a path of `expected_paths` is
/// missing from `ran` (a CPU with AVX-512 VNNI whose VNNI kernels were never exercised); prints
/// the paths either way, so a local run says what it covered.
pub fn assert_expected_paths_ran(ran: &std::collections::BTreeSet<&'static str>) {
    let missing: Vec<_> = expected_paths().into_iter().filter(|p| !ran.contains(p)).collect();
    eprintln!("kernel paths ran: {ran:?}; expected on this CPU and environment: {:?}", expected_paths());
    if std::env::var_os("CI").is_some() {
        assert!(missing.is_empty(), "kernel paths this CPU has were not exercised: {missing:?} (ran {ran:?})");
    } else if !missing.is_empty() {
        eprintln!("warning: kernel paths not exercised: {missing:?}");
    }
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
        split_512: amd_zen4(),
        sw_prefetch: !amd_zen4(),
        prefetch_ahead: (amd_family() == Some(0x1A)).then_some(16 * 1024),
        pairs_at_few_rows: amd_family() != Some(0x1A),
    }
}

/// AMD Zen 4: family 0x19 with AVX-512 (Zen 3, the same family, has none).
#[cfg(target_arch = "x86_64")]
fn amd_zen4() -> bool {
    amd_family() == Some(0x19) && is_x86_feature_detected!("avx512f")
}

/// The CPU family of an AMD processor (0x19: Zen 3 / Zen 4, 0x1A: Zen 5), `None` on other vendors.
#[cfg(target_arch = "x86_64")]
fn amd_family() -> Option<u32> {
    use std::arch::x86_64::__cpuid;
    // leaves 0 and 1 exist on every x86-64 processor
    let (v, l1) = (__cpuid(0), __cpuid(1));
    let vendor: Vec<u8> = [v.ebx, v.edx, v.ecx].iter().flat_map(|r| r.to_le_bytes()).collect();
    if vendor != b"AuthenticAMD" {
        return None;
    }
    let base = (l1.eax >> 8) & 0xF;
    Some(if base == 0xF { base + ((l1.eax >> 20) & 0xFF) } else { base })
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> CpuFeatures {
    CpuFeatures { avx2_fma: false, avx512_vnni: false, split_512: false, sw_prefetch: false, prefetch_ahead: None, pairs_at_few_rows: false }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The environment switches do what scripts/test.sh relies on: with `SPECULA_NO_VNNI=1` (or
    /// `SPECULA_NO_AVX512=1`) the kernels dispatch to AVX2 on a CPU that has AVX-512 VNNI, and
    /// without it to VNNI. Prints the CPU's paths and the one this process runs.
    #[test]
    fn the_dispatched_path_follows_the_cpu_and_the_switches() {
        let (cpu, used) = (detected(), features());
        eprintln!("cpu: avx2+fma {}, avx512-vnni {}; dispatched: {}", cpu.avx2_fma, cpu.avx512_vnni, dispatched_path());
        if env_is_1("SPECULA_NO_SIMD") {
            assert_eq!(dispatched_path(), PATH_SCALAR);
            return;
        }
        assert_eq!(used.avx2_fma, cpu.avx2_fma);
        assert_eq!(used.avx512_vnni, cpu.avx512_vnni && !avx512_switched_off());
        let expected = expected_paths();
        assert_eq!(dispatched_path(), expected.last().copied().unwrap_or(PATH_SCALAR));
    }
}
