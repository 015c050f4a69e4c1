//! Int8-dot weights repacked eight rows at a time, and the matmul micro-kernel that reads them.
//!
//! GGUF stores a Q4_0 / Q4_1 / Q8_0 matrix row by row, so a dot kernel that reads it produces one
//! output per pass and spends most of its instructions on per-block bookkeeping (unpack the nibbles,
//! convert the scales, fold eight partial lanes) for a single 32-element product. Here each block
//! index holds the same block of eight consecutive rows, interleaved so that 32-bit lane `r` of a
//! vector holds four weights of row `r`: one broadcast of four activation bytes and one
//! `dpbusd` (or `maddubs` + add) then advance eight rows at once, the eight float results are
//! already in the lanes of the output vector, and each unpacked weight vector serves up to
//! `MAX_ACTS` activation rows. candle has no such kernel for these formats; this one is ours.
//! With AVX-512, two groups share each 512-bit instruction (`dot_group_pair_to`): at one or two
//! activation rows a step is bound by these instructions once the weights stream at memory speed,
//! and the pair halves them (decode at batch 1-2: about +10% tok/s on a 2-core Sapphire Rapids).
//! Where 512-bit instructions run as two halves (AMD Zen 4, `CpuFeatures::split_512`) the pair
//! made one or two activation rows slower, so the matmul uses it there only from three rows on.
//!
//! Layout of one *group block* (eight rows, one block index; rows past the matrix's end are zero):
//! - Q4_1: `d[8]` f16, `m[8]` f16, then 4 vectors of 32 bytes. Byte `t` of lane `r` of vector `v`
//!   is byte `4v + t` of row `r`'s ggml block: its low nibble is element `4v + t`, its high
//!   nibble element `16 + 4v + t`. So vector `v` unpacks to element groups `v` and `v + 4`.
//! - Q4_0: `d[8]` f16, then the same 4 vectors (the offset 8 is folded in as `m = -8 d`).
//! - Q8_0: `d[8]` f16, then 8 vectors; lane `r` of vector `g` is elements `4g..4g+4` of row `r`.
//!
//! Arithmetic (identical on every path, so AVX2, AVX-512 VNNI and the scalar reference give the
//! same bits, and a row's result never depends on the batch or the thread split): for each block
//! in index order, the exact integer sum `s` of the 32 products, then
//! `acc = fma(d_w * d_a, s, acc)` and, for Q4_0/Q4_1, `acc = fma(m_w, s_a, acc)` where
//! `s_a = d_a * sum(q_a)`.
//!
//! Q5_0, Q5_1, Q4_K, Q5_K and Q6_K use the same structure (groups of eight rows, the same int8
//! activation blocks) with their own group block layouts and kernels: see `packed_k.rs`.

use crate::buffer::WeightBytes;
use crate::formats::{WeightFormat, QK};
pub use crate::group::GROUP_ROWS;
use crate::q8::{ActSpan, BlockQ8};
use crate::{packed_iq, packed_k};
use half::f16;

/// Activation rows one kernel call processes (more are handled by further calls).
pub const MAX_ACTS: usize = 8;

/// A matrix of an int8-dot format in groups of eight rows.
#[derive(Clone, Debug)]
pub struct PackedInt8 {
    format: WeightFormat,
    rows: usize,
    /// Format blocks per row (of 32, or of 256 for the k-quants).
    blocks: usize,
    /// Activation blocks of 32 per row.
    act_blocks: usize,
    store: Store,
}

/// Where a matrix's group blocks come from.
#[derive(Clone, Debug)]
enum Store {
    /// Repacked once at load; huge-page backed when large (`buffer`).
    Repacked(crate::buffer::Buffer),
    /// The file's ggml rows, read where they lie (a memory map, shared with every process that
    /// maps the file and never copied into this one's memory): each group is repacked when a
    /// kernel reads it, into a per-thread scratch (`with_groups`). Same layout, same kernels,
    /// same bits as `Repacked`; the price is the repacking on every read.
    InPlace { raw: WeightBytes, id: u64 },
}

/// Bytes of one group block (eight rows, one block index) of `format`.
fn group_block_bytes(format: WeightFormat) -> usize {
    if packed_k::handles(format) {
        return packed_k::group_block_bytes(format);
    }
    if packed_iq::handles(format) {
        return packed_iq::group_block_bytes(format);
    }
    GROUP_ROWS * format.block_bytes()
}

/// Where the quants start inside a group block.
fn quants_offset(format: WeightFormat) -> usize {
    match format {
        WeightFormat::Q4_1 => 4 * GROUP_ROWS,
        _ => 2 * GROUP_ROWS,
    }
}

/// Writes group `g` of a matrix of `rows` rows of `blocks` ggml blocks each (`raw`, all of it)
/// into `out` (the group's `blocks` group blocks, zeroed: rows past the end stay zero).
fn pack_group(format: WeightFormat, rows: usize, blocks: usize, raw: &[u8], g: usize, out: &mut [u8]) {
    let bb = format.block_bytes();
    let row_bytes = blocks * bb;
    let gbb = group_block_bytes(format);
    let qoff = quants_offset(format);
    let scales = if format == WeightFormat::Q4_1 { 4 } else { 2 };
    let (k, iq) = (packed_k::handles(format), packed_iq::handles(format));
    #[cfg(target_arch = "x86_64")]
    if rows - g * GROUP_ROWS >= GROUP_ROWS && packed_k::x86::packs_eight(format) && crate::cpu::features().avx2_fma {
        assert!(raw.len() >= (g + 1) * GROUP_ROWS * row_bytes && out.len() >= blocks * gbb, "pack_group: group {g} outside the matrix");
        for b in 0..blocks {
            let src: [*const u8; GROUP_ROWS] = std::array::from_fn(|lane| raw[(g * GROUP_ROWS + lane) * row_bytes + b * bb..].as_ptr());
            // SAFETY: AVX2 was detected at run time; each row's block b lies inside `raw` and the
            // group block inside `out` (asserted above); `packs_eight(format)`.
            unsafe { packed_k::x86::pack_block8(format, src, out[b * gbb..].as_mut_ptr()) };
        }
        return;
    }
    for lane in 0..GROUP_ROWS.min(rows - g * GROUP_ROWS) {
        let r = g * GROUP_ROWS + lane;
        for b in 0..blocks {
            let src = &raw[r * row_bytes + b * bb..r * row_bytes + (b + 1) * bb];
            let dst = &mut out[b * gbb..(b + 1) * gbb];
            if k {
                packed_k::pack_block(format, src, lane, dst);
                continue;
            }
            if iq {
                packed_iq::pack_block(format, src, lane, dst);
                continue;
            }
            // d (and m): lane r of the f16 arrays
            dst[2 * lane..2 * lane + 2].copy_from_slice(&src[0..2]);
            if scales == 4 {
                dst[2 * GROUP_ROWS + 2 * lane..2 * GROUP_ROWS + 2 * lane + 2].copy_from_slice(&src[2..4]);
            }
            // quants: four bytes at a time, vector v holds bytes 4v..4v+4 of the block's quants
            let qs = &src[scales..];
            for (v, chunk) in qs.chunks_exact(4).enumerate() {
                let at = qoff + v * 32 + lane * 4;
                dst[at..at + 4].copy_from_slice(chunk);
            }
        }
    }
}

/// Hints that `bytes[at..at + len]` (clamped to `bytes`) will be read soon.
#[inline]
fn prefetch(bytes: &[u8], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        let end = at.saturating_add(len).min(bytes.len());
        let mut i = at;
        while i < end {
            // SAFETY: a prefetch of an address inside `bytes`; it never faults or writes.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(bytes.as_ptr().add(i) as *const i8) };
            i += 64;
        }
    }
}

/// Per-thread repacked groups of `Store::InPlace` matrices: two slots (a pair of groups is read
/// in one pass), each remembering which matrix and group it holds, so the activation rows of a
/// prefill tile, which call the kernel once per eight rows, repack each group once.
struct Scratch {
    slots: [(u64, usize, Vec<u8>); 2],
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = const { std::cell::RefCell::new(Scratch { slots: [(0, 0, Vec::new()), (0, 0, Vec::new())] }) };
}

/// Ids of in-place matrices (0 is no matrix): a scratch slot is never mistaken for another
/// matrix's, even one mapped later at the same address.
static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl PackedInt8 {
    /// Repacks `rows` rows of ggml blocks (`raw.len() == rows * format.row_bytes(cols)`).
    /// Returns `None` for formats without an integer dot path.
    pub fn pack(format: WeightFormat, rows: usize, cols: usize, raw: &[u8]) -> Option<Self> {
        if !format.has_int8_dot() {
            return None;
        }
        let blocks = cols / format.block_len();
        assert_eq!(raw.len(), rows * blocks * format.block_bytes(), "pack: byte length does not match the shape");
        let groups = rows.div_ceil(GROUP_ROWS);
        let gbb = group_block_bytes(format);
        let mut bytes = crate::buffer::Buffer::zeroed(groups * blocks * gbb);
        // each group's bytes are written from its own eight rows only: groups pack in parallel
        // (the layout, and so every result, is the same as one thread's)
        let pack = |(g, out): (usize, &mut [u8])| pack_group(format, rows, blocks, raw, g, out);
        if bytes.len() >= 1 << 20 {
            use rayon::prelude::*;
            bytes.par_chunks_mut((blocks * gbb).max(1)).enumerate().for_each(pack);
        } else {
            bytes.chunks_mut((blocks * gbb).max(1)).enumerate().for_each(pack);
        }
        Some(Self { format, rows, blocks, act_blocks: cols / QK, store: Store::Repacked(bytes) })
    }

    /// The matrix over `raw` (ggml rows, `rows * format.row_bytes(cols)` bytes) as it lies: no
    /// copy, each group repacked when read. Returns `None` for formats without an integer dot path.
    pub fn in_place(format: WeightFormat, rows: usize, cols: usize, raw: WeightBytes) -> Option<Self> {
        if !format.has_int8_dot() {
            return None;
        }
        let blocks = cols / format.block_len();
        assert_eq!(raw.as_slice().len(), rows * blocks * format.block_bytes(), "in_place: byte length does not match the shape");
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Some(Self { format, rows, blocks, act_blocks: cols / QK, store: Store::InPlace { raw, id } })
    }

    /// Whether the groups are repacked on every read (`in_place`) rather than held repacked.
    pub fn is_in_place(&self) -> bool {
        matches!(self.store, Store::InPlace { .. })
    }

    pub fn format(&self) -> WeightFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The repacked group blocks (group after group, each its blocks in order), where the matrix
    /// holds them (`None` in place): what a device backend uploads to run the same kernel there.
    pub fn repacked_bytes(&self) -> Option<&[u8]> {
        match &self.store {
            Store::Repacked(b) => Some(b),
            Store::InPlace { .. } => None,
        }
    }

    #[cfg(test)]
    pub(crate) fn bytes_for_tests(&self) -> &[u8] {
        match &self.store {
            Store::Repacked(b) => b,
            Store::InPlace { .. } => panic!("an in-place matrix holds no repacked bytes"),
        }
    }

    /// Group `g`'s repacked bytes (a copy, whichever the store).
    #[cfg(test)]
    pub(crate) fn group_for_tests(&self, g: usize) -> Vec<u8> {
        self.with_groups::<1, _>(g, |[b]| b.to_vec())
    }

    pub fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP_ROWS)
    }

    fn group_len(&self) -> usize {
        self.blocks * group_block_bytes(self.format)
    }

    /// Calls `f` with the bytes of row groups `g..g + G` (each all its block indices, in order),
    /// `G` <= 2: slices of the repacked matrix, or this thread's scratch repacked from the rows
    /// in place (only where the scratch does not hold those groups already).
    #[inline]
    fn with_groups<const G: usize, R>(&self, g: usize, f: impl FnOnce([&[u8]; G]) -> R) -> R {
        let len = self.group_len();
        match &self.store {
            Store::Repacked(bytes) => f(std::array::from_fn(|j| &bytes[(g + j) * len..(g + j + 1) * len])),
            Store::InPlace { raw, id } => SCRATCH.with(|s| {
                let mut s = s.borrow_mut();
                let group_raw = GROUP_ROWS * self.blocks * self.format.block_bytes();
                if s.slots[0].0 != *id || s.slots[0].1 != g {
                    // ask for the groups after these while these are repacked and read (the
                    // repacking reads eight rows side by side, which the hardware prefetchers
                    // follow poorly)
                    prefetch(raw.as_slice(), (g + 2 * G) * group_raw, G * group_raw);
                }
                for (j, (sid, sg, buf)) in s.slots.iter_mut().enumerate().take(G) {
                    if (*sid, *sg) != (*id, g + j) {
                        // bytes no row writes (a partial last group's missing rows, a layout's
                        // padding) read as zeros, as in a matrix repacked at load: cleared when
                        // the slot changes matrix (each group of one matrix writes the same
                        // bytes, into a buffer of the same length) and for a partial group
                        if *sid != *id || (g + j + 1) * GROUP_ROWS > self.rows {
                            buf.clear();
                            buf.resize(len, 0);
                        }
                        pack_group(self.format, self.rows, self.blocks, raw.as_slice(), g + j, buf);
                        (*sid, *sg) = (*id, g + j);
                    }
                }
                f(std::array::from_fn(|j| &s.slots[j].2[..]))
            }),
        }
    }

    /// Results of the eight rows of group `g` against each of `N` (1..=MAX_ACTS) activation rows:
    /// `out[n][lane]` = row `8g + lane` dot activation `n` (lanes past the last row are 0).
    pub fn dot_group<const N: usize>(&self, g: usize, acts: [&[BlockQ8]; N]) -> [[f32; GROUP_ROWS]; N] {
        self.dot_group_span(g, ActSpan::Block, acts)
    }

    /// As `dot_group` for activation rows of scale span `span` (`ActSpan::Super` only where
    /// `reads_super_span`).
    pub fn dot_group_span<const N: usize>(&self, g: usize, span: ActSpan, acts: [&[BlockQ8]; N]) -> [[f32; GROUP_ROWS]; N] {
        let mut out = [[0f32; GROUP_ROWS]; N];
        // SAFETY: each pointer addresses one row of `out`: eight writable floats.
        unsafe { self.dot_group_span_to(g, span, acts, out.each_mut().map(|r| r.as_mut_ptr())) };
        out
    }

    /// Whether this matrix has a kernel for `ActSpan::Super` activation rows (Q4_K, Q5_K).
    pub fn reads_super_span(&self) -> bool {
        packed_k::reads_super_span(self.format)
    }

    /// As `dot_group`, writing activation `n`'s eight results at `dst[n]` (the matmul writes them
    /// straight into its output rows).
    ///
    /// # Safety
    /// Every `dst[n]` must be valid for writes of eight `f32`, and no other thread may access them.
    #[inline]
    pub unsafe fn dot_group_to<const N: usize>(&self, g: usize, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
        self.dot_group_span_to(g, ActSpan::Block, acts, dst)
    }

    /// As `dot_group_to` for activation rows of scale span `span`.
    ///
    /// # Safety
    /// As `dot_group_to`.
    #[inline]
    pub unsafe fn dot_group_span_to<const N: usize>(&self, g: usize, span: ActSpan, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
        assert!((1..=MAX_ACTS).contains(&N));
        assert!(span == ActSpan::Block || self.reads_super_span(), "{:?} has no kernel for super-block activation scales", self.format);
        for a in &acts {
            assert_eq!(a.len(), self.act_blocks, "activation row has the wrong number of blocks");
        }
        #[cfg(target_arch = "x86_64")]
        if let Store::InPlace { raw, .. } = &self.store {
            let native = match (self.format, span) {
                (WeightFormat::Q4K, ActSpan::Super) => Some(packed_k::x86::rows_q4k_super_vnni as packed_k::x86::RowsKernel),
                (WeightFormat::Q6K, ActSpan::Block) => Some(packed_k::x86::rows_q6k_vnni as packed_k::x86::RowsKernel),
                _ => None,
            };
            if let (1, Some(kernel), true) = (N, native, crate::cpu::features().avx512_vnni) {
                // decode over a matrix read in place: the rows straight from the file's blocks
                let row_bytes = self.blocks * self.format.block_bytes();
                let first = g * GROUP_ROWS;
                let n = GROUP_ROWS.min(self.rows - first);
                let bytes = raw.as_slice();
                assert!(bytes.len() >= (first + n) * row_bytes, "group {g} outside the matrix");
                let rows: [*const u8; GROUP_ROWS] = std::array::from_fn(|i| bytes[(first + i.min(n - 1)) * row_bytes..].as_ptr());
                let mut out = [0f32; GROUP_ROWS];
                // SAFETY: AVX2, FMA, F16C and AVX-512 VNNI/VL were detected at run time; each of
                // the first n rows holds `blocks` blocks (asserted above) and the activation row
                // `act_blocks` = 8 * blocks blocks (checked above); lanes past the matrix stay 0,
                // as a repacked group's zero rows give.
                kernel(&rows[..n], self.blocks, acts[0], &mut out[..n]);
                std::ptr::copy_nonoverlapping(out.as_ptr(), dst[0], GROUP_ROWS);
                return;
            }
        }
        // SAFETY: as the caller promised, for the group's bytes
        self.with_groups::<1, _>(g, |[group]| unsafe { self.dot_bytes_to::<N>(group, span, acts, dst) })
    }

    /// `dot_group_span_to` on one group's bytes (`group_len()` of them, the checks done).
    ///
    /// # Safety
    /// As `dot_group_to`; `group` holds `blocks` group blocks and every activation row
    /// `act_blocks` blocks.
    #[inline]
    unsafe fn dot_bytes_to<const N: usize>(&self, group: &[u8], span: ActSpan, acts: [&[BlockQ8]; N], dst: [*mut f32; N]) {
        if packed_k::handles(self.format) {
            // SAFETY: `group` holds `blocks` group blocks and every activation row the matching
            // `act_blocks` blocks (checked above); dst as the caller promised.
            return packed_k::dot_group_to::<N>(self.format, span, group, self.blocks, acts, dst);
        }
        if packed_iq::handles(self.format) {
            // SAFETY: as for packed_k (block-scaled rows only: `reads_super_span` is false).
            return packed_iq::dot_group_to::<N>(self.format, group, self.blocks, acts, dst);
        }
        #[cfg(target_arch = "x86_64")]
        {
            let f = crate::cpu::features();
            if f.avx512_vnni {
                // SAFETY: AVX2, FMA, F16C and AVX-512 VNNI/VL were detected at run time; `group`
                // holds `blocks` group blocks and every activation row `blocks` blocks; dst as promised.
                return x86::group_vnni::<N>(self.format, group, self.blocks, acts, dst);
            }
            if f.avx2_fma {
                // SAFETY: AVX2, FMA and F16C were detected at run time; sizes and dst as above.
                return x86::group_avx2::<N>(self.format, group, self.blocks, acts, dst);
            }
        }
        for (a, d) in acts.iter().zip(dst) {
            let y = dot_group_scalar(self.format, group, self.blocks, a);
            // SAFETY: d is valid for eight writes (the caller's promise).
            std::ptr::copy_nonoverlapping(y.as_ptr(), d, GROUP_ROWS);
        }
    }

    /// Whether `dot_group_pair_span_to` reads two groups in one pass (512-bit vectors) on this
    /// CPU for this matrix's format and activation rows of scale span `span`.
    pub fn pairs_in_one_pass(&self, span: ActSpan) -> bool {
        self.pair_min_rows(span).is_some()
    }

    /// From how many activation rows a matmul over this matrix takes groups in pairs (one pass
    /// of 512-bit vectors); None where it never does. The results are the same bits either way:
    /// only speed decides (matmul_bench, weights streamed from memory).
    /// - Q4_0/Q4_1/Q8_0: at any row count where 512-bit instructions run whole; never where they
    ///   are split in two (Zen 4): there the one-group kernel was as fast or faster at every row
    ///   count (matmul_bench, gate/up 8960 x 1536, 2 threads, two rounds, pair -> one group: Q4_0
    ///   1.4x at 3 rows, 1.35x at 4, 1.1x at 8 and 16, 1.0-1.05x at 64; Q4_1 1.4-1.65x at 3, 1.3-1.45x
    ///   at 4, 1.0-1.1x at 8-64; Q8_0, with its weights offset to unsigned, 1.15-1.25x at 4, equal
    ///   at 8, 1.1x at 16, 1.3x at 64 and 512). Before, Zen 4 took the pair from three rows.
    /// - Q4_K (super-scaled rows) and Q6_K (block-scaled) in `packed_k::x86::pair_k`, only where
    ///   512-bit instructions run whole (on Zen 4 Q4_K's pair was 15-25% slower), and only from a
    ///   few rows on: below, the one-group kernel streamed the weights as fast or faster (Zen 5).
    ///   Q4_K from five rows (1.3-1.4x at 8-64); Q6_K from eight (its lm_head at five 8% slower,
    ///   at 9-17 1.15x), and only on rows under 4096 columns (a 1.5B model's ffn_down, 8960
    ///   columns, two streams 58 KB apart, was 1.1-1.4x slower at 5-9 rows).
    pub fn pair_min_rows(&self, span: ActSpan) -> Option<usize> {
        let f = crate::cpu::features();
        if !(cfg!(target_arch = "x86_64") && f.avx512_vnni) {
            return None;
        }
        match (span, self.format) {
            (ActSpan::Block, WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0) => (!f.split_512).then_some(1),
            (ActSpan::Block, WeightFormat::Q6K) if !f.split_512 && self.act_blocks * QK < 4096 => Some(8),
            (ActSpan::Super, WeightFormat::Q4K) if !f.split_512 => Some(5),
            _ => None,
        }
    }

    /// Groups `g` and `g + 1` against `N` activation rows: `dst[j][n]` receives what
    /// `dot_group_to` writes for group `g + j`, bit for bit. With AVX-512 the two groups share
    /// each instruction (one 512-bit vector holds a block of both: half the unpacking, broadcasts
    /// and dot instructions per weight, which is what bounds a step of one or a few tokens once
    /// the weights stream at memory speed); elsewhere it is two `dot_group_to` calls.
    ///
    /// # Safety
    /// As `dot_group_to`, for every `dst[j][n]`; `g + 1 < self.groups()`.
    #[inline]
    pub unsafe fn dot_group_pair_to<const N: usize>(&self, g: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
        self.dot_group_pair_span_to::<N>(g, ActSpan::Block, acts, dst)
    }

    /// As `dot_group_pair_to` for activation rows of scale span `span`.
    ///
    /// # Safety
    /// As `dot_group_pair_to`.
    #[inline]
    pub unsafe fn dot_group_pair_span_to<const N: usize>(&self, g: usize, span: ActSpan, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
        assert!(g + 1 < self.groups(), "group pair {g}, {} out of {}", g + 1, self.groups());
        #[cfg(target_arch = "x86_64")]
        if self.pairs_in_one_pass(span) {
            for a in &acts {
                assert_eq!(a.len(), self.act_blocks, "activation row has the wrong number of blocks");
            }
            if packed_k::handles(self.format) {
                // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected at run time
                // (pairs_in_one_pass, which admits Q4_K only with super-scaled rows and Q6_K only
                // with block-scaled ones); both groups hold `blocks` group blocks, every
                // activation row the matching `act_blocks` blocks; dst as promised.
                return self.with_groups::<2, _>(g, |[g0, g1]| packed_k::x86::pair_k::<N>(self.format, g0, g1, self.blocks, acts, dst));
            }
            // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected at run time; both
            // groups hold `blocks` group blocks, every activation row `blocks` blocks; dst as promised.
            return self.with_groups::<2, _>(g, |[g0, g1]| x86::pair_vnni512::<N>(self.format, g0, g1, self.blocks, acts, dst));
        }
        self.dot_group_span_to::<N>(g, span, acts, dst[0]);
        self.dot_group_span_to::<N>(g + 1, span, acts, dst[1]);
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
impl PackedInt8 {
    /// `dot_group_pair_to` through the 512-bit two-group kernel of Q4_0 / Q4_1 / Q8_0 whatever
    /// `pair_min_rows` says, so the kernel is checked on CPUs whose matmuls do not take it.
    ///
    /// # Safety
    /// As `dot_group_pair_to`; AVX-512 VNNI present.
    pub(crate) unsafe fn dot_group_pair_512_for_tests<const N: usize>(&self, g: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
        assert!(crate::cpu::features().avx512_vnni && !packed_k::handles(self.format));
        self.with_groups::<2, _>(g, |[g0, g1]| x86::pair_vnni512::<N>(self.format, g0, g1, self.blocks, acts, dst));
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Scalar reference of the kernel (same arithmetic, so the same bits): one activation row
/// against the eight rows of a group.
pub fn dot_group_scalar(format: WeightFormat, group: &[u8], blocks: usize, a: &[BlockQ8]) -> [f32; GROUP_ROWS] {
    if packed_k::handles(format) {
        return packed_k::dot_group_scalar(format, ActSpan::Block, group, blocks, a);
    }
    if packed_iq::handles(format) {
        return packed_iq::dot_group_scalar(format, group, blocks, a);
    }
    let gbb = group_block_bytes(format);
    let qoff = quants_offset(format);
    let mut acc = [0f32; GROUP_ROWS];
    for (b, ab) in a.iter().enumerate().take(blocks) {
        let blk = &group[b * gbb..(b + 1) * gbb];
        for (lane, acc) in acc.iter_mut().enumerate() {
            let d = f16_at(blk, 2 * lane);
            let mut s = 0i32;
            match format {
                WeightFormat::Q4_0 | WeightFormat::Q4_1 => {
                    for v in 0..4 {
                        for t in 0..4 {
                            let q = blk[qoff + v * 32 + lane * 4 + t];
                            s += (q & 0xF) as i32 * ab.qs[4 * v + t] as i32;
                            s += (q >> 4) as i32 * ab.qs[16 + 4 * v + t] as i32;
                        }
                    }
                }
                WeightFormat::Q8_0 => {
                    for g in 0..8 {
                        for t in 0..4 {
                            s += (blk[qoff + g * 32 + lane * 4 + t] as i8) as i32 * ab.qs[4 * g + t] as i32;
                        }
                    }
                }
                _ => unreachable!("{format:?} has no int8 dot path"),
            }
            *acc = (d * ab.d).mul_add(s as f32, *acc);
            match format {
                WeightFormat::Q4_1 => *acc = f16_at(blk, 2 * GROUP_ROWS + 2 * lane).mul_add(ab.s, *acc),
                WeightFormat::Q4_0 => *acc = (d * -8.0).mul_add(ab.s, *acc),
                _ => {}
            }
        }
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use crate::packed_k::x86::{bcast4_512, halves512, join512, store_pairs};
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
                    // sum((w + 128) a) - 128 sum(a): the same exact integer sum (each lane at most
                    // 32 x 255 x 127 before the subtraction)
                    let offset = _mm256_set1_epi8(i8::MIN);
                    for g in 0..8 {
                        let u = _mm256_xor_si256(_mm256_loadu_si256(q.add(32 * g) as *const __m256i), offset);
                        for n in 0..N {
                            let ap = acts[n].get_unchecked(b).qs.as_ptr();
                            isum[n] = _mm256_dpbusd_epi32(isum[n], u, bcast4(ap.add(4 * g)));
                        }
                    }
                    for n in 0..N {
                        let h = acts[n].get_unchecked(b).h;
                        isum[n] = _mm256_sub_epi32(isum[n], _mm256_set1_epi32(128 * (h[0] as i32 + h[1] as i32)));
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
    /// from activations offset to unsigned, minus the offset's share), then the same
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
        let zero = _mm512_setzero_si512();
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
                    // vpdpbusd multiplies u8 by i8: the activations go in offset by 128 (`a ^ 0x80`
                    // is `a + 128` as a u8, made once per block and row) against the signed
                    // weights, and `128 * sum(w)`, one more vpdpbusd shared by every activation
                    // row, is taken off. The same exact sums as |w| x sign(a, w) (each term at most
                    // 255 x 128), in one instruction per weight vector and row instead of two,
                    // plus none of the per-vector abs and sign mask.
                    let mut offset = [[0u8; QK]; N];
                    for (n, o) in offset.iter_mut().enumerate() {
                        let a = _mm256_loadu_si256(acts[n].get_unchecked(b).qs.as_ptr() as *const __m256i);
                        _mm256_storeu_si256(o.as_mut_ptr() as *mut __m256i, _mm256_xor_si256(a, _mm256_set1_epi8(i8::MIN)));
                    }
                    let mut w_sum = zero;
                    for g in 0..8 {
                        let w = join512(q0.add(32 * g), q1.add(32 * g));
                        w_sum = _mm512_dpbusd_epi32(w_sum, _mm512_set1_epi8(i8::MIN), w);
                        for n in 0..N {
                            isum[n] = _mm512_dpbusd_epi32(isum[n], bcast4_512(offset[n].as_ptr().add(4 * g) as *const i8), w);
                        }
                    }
                    for s in isum.iter_mut() {
                        *s = _mm512_sub_epi32(*s, w_sum);
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
    pub(super) unsafe fn pair_vnni512<const N: usize>(
        format: WeightFormat,
        g0: &[u8],
        g1: &[u8],
        blocks: usize,
        acts: [&[BlockQ8]; N],
        dst: [[*mut f32; N]; 2],
    ) {
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{dequantize_row, quantize_row};
    use crate::q8::{quantize_rows, QuantizedActivations};
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-2.0f32..2.0)).collect()
    }

    fn random_raw(rng: &mut rand::rngs::StdRng, f: WeightFormat, rows: usize, cols: usize) -> Vec<u8> {
        (0..rows).flat_map(|_| quantize_row(f, &rand_vec(rng, cols))).collect()
    }

    const FORMATS: [WeightFormat; 3] = [WeightFormat::Q4_0, WeightFormat::Q4_1, WeightFormat::Q8_0];

    #[test]
    fn simd_equals_the_scalar_reference_bitwise_for_any_number_of_activations() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for f in FORMATS {
            for (rows, cols) in [(8, 32), (13, 64), (24, 576)] {
                let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
                let acts: Vec<_> = (0..4).map(|_| quantize_rows(&rand_vec(&mut rng, cols), cols)).collect();
                for g in 0..p.groups() {
                    let four = p.dot_group::<4>(g, [acts[0].row(0), acts[1].row(0), acts[2].row(0), acts[3].row(0)]);
                    let eight = p.dot_group::<8>(g, std::array::from_fn(|i| acts[i % 4].row(0)));
                    let two = p.dot_group::<2>(g, [acts[2].row(0), acts[3].row(0)]);
                    for (n, a) in acts.iter().enumerate() {
                        let one = p.dot_group::<1>(g, [a.row(0)])[0];
                        let reference = dot_group_scalar(f, &p.group_for_tests(g), p.blocks, a.row(0));
                        assert_eq!(one.map(f32::to_bits), reference.map(f32::to_bits), "{f:?} {rows}x{cols}");
                        assert_eq!(four[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?}: 4-row path differs");
                        assert_eq!(eight[n + 4].map(f32::to_bits), reference.map(f32::to_bits), "{f:?}: 8-row path differs");
                        if n >= 2 {
                            assert_eq!(two[n - 2].map(f32::to_bits), reference.map(f32::to_bits), "{f:?}: 2-row path differs");
                        }
                    }
                }
            }
        }
    }

    /// A matrix large enough to pack in parallel has the bytes of packing its rows piecewise
    /// (small matrices, packed on one thread), for every layout.
    #[test]
    fn parallel_packing_gives_the_sequential_layout() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for f in [WeightFormat::Q8_0, WeightFormat::Q4_0, WeightFormat::Q4K, WeightFormat::Q6K] {
            let (rows, cols) = (2003, 1024);
            let raw: Vec<u8> = if packed_k::handles(f) { packed_k::random_raw(&mut rng, f, rows, cols) } else { random_raw(&mut rng, f, rows, cols) };
            let big = PackedInt8::pack(f, rows, cols, &raw).unwrap();
            assert!(big.bytes_for_tests().len() >= 1 << 20, "{f:?}: the test matrix takes the parallel path");
            let rb = f.row_bytes(cols);
            let mut pieces = Vec::new();
            for r in (0..rows).step_by(64) {
                let end = (r + 64).min(rows);
                let part = PackedInt8::pack(f, end - r, cols, &raw[r * rb..end * rb]).unwrap();
                assert!(part.bytes_for_tests().len() < 1 << 20);
                pieces.extend_from_slice(part.bytes_for_tests());
            }
            assert!(big.bytes_for_tests()[..] == pieces[..], "{f:?}");
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vnni_and_avx2_agree_bitwise() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for f in FORMATS {
            let p = PackedInt8::pack(f, 16, 576, &random_raw(&mut rng, f, 16, 576)).unwrap();
            // extreme activations: every element at +-127 after quantization
            let x: Vec<f32> = (0..576).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
            let (a, b) = (quantize_rows(&rand_vec(&mut rng, 576), 576), quantize_rows(&x, 576));
            let Some((x2, vn)) = x86::both::<2>(&p, 1, [a.row(0), b.row(0)]) else {
                eprintln!("skipping: this CPU has no AVX-512 VNNI");
                return;
            };
            assert_eq!(x2.map(|r| r.map(f32::to_bits)), vn.map(|r| r.map(f32::to_bits)), "{f:?}");
        }
    }

    /// The two-group pass gives each group exactly the one-group kernel's bits (scalar reference),
    /// for every format, several activation counts and a partial last group.
    #[test]
    fn group_pairs_equal_the_one_group_kernel_bitwise() {
        fn check<const N: usize>(p: &PackedInt8, acts: &[QuantizedActivations], f: WeightFormat) {
            let rows: [&[BlockQ8]; N] = std::array::from_fn(|i| acts[i % acts.len()].row(0));
            for g in 0..p.groups() - 1 {
                let mut out = [[[0f32; GROUP_ROWS]; N]; 2];
                let [o0, o1] = &mut out;
                // SAFETY: each pointer addresses one row of `out`.
                unsafe { p.dot_group_pair_to::<N>(g, rows, [o0.each_mut().map(|r| r.as_mut_ptr()), o1.each_mut().map(|r| r.as_mut_ptr())]) };
                let mut forced = None;
                #[cfg(target_arch = "x86_64")]
                if crate::cpu::features().avx512_vnni && !crate::packed_k::handles(f) {
                    // the 512-bit pair itself, also where the matmul does not take it (Zen 4)
                    let mut out512 = [[[0f32; GROUP_ROWS]; N]; 2];
                    let [a, b] = &mut out512;
                    // SAFETY: as above; AVX-512 VNNI was detected.
                    unsafe { p.dot_group_pair_512_for_tests::<N>(g, rows, [a.each_mut().map(|r| r.as_mut_ptr()), b.each_mut().map(|r| r.as_mut_ptr())]) };
                    forced = Some(out512);
                }
                for (j, group_out) in out.iter().enumerate() {
                    for (n, row) in rows.iter().enumerate() {
                        let reference = dot_group_scalar(f, &p.group_for_tests(g + j), p.blocks, row);
                        assert_eq!(group_out[n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} group {} activation {n} of {N}", g + j);
                        if let Some(o) = &forced {
                            assert_eq!(o[j][n].map(f32::to_bits), reference.map(f32::to_bits), "{f:?} 512-bit pair, group {} activation {n} of {N}", g + j);
                        }
                    }
                }
            }
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for f in FORMATS {
            for (rows, cols) in [(16, 32), (29, 64), (40, 576)] {
                let p = PackedInt8::pack(f, rows, cols, &random_raw(&mut rng, f, rows, cols)).unwrap();
                let mut acts: Vec<_> = (0..5).map(|_| quantize_rows(&rand_vec(&mut rng, cols), cols)).collect();
                // extreme activations: every element at +-127 after quantization
                acts.push(quantize_rows(&(0..cols).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect::<Vec<f32>>(), cols));
                check::<1>(&p, &acts, f);
                check::<2>(&p, &acts, f);
                check::<3>(&p, &acts, f);
                check::<4>(&p, &acts, f);
                check::<6>(&p, &acts, f);
                check::<8>(&p, &acts, f);
            }
        }
    }

    /// Independent oracle: the float dot of the dequantized ggml row with the dequantized
    /// activations, within the error the 8-bit activations allow.
    #[test]
    fn packed_dot_approximates_the_float_dot_of_dequantized_weights() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (rows, cols) = (11, 576);
        let x = rand_vec(&mut rng, cols);
        let q = quantize_rows(&x, cols);
        for f in FORMATS {
            let raw = random_raw(&mut rng, f, rows, cols);
            let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
            for r in 0..rows {
                let mut wd = vec![0f32; cols];
                dequantize_row(f, &raw[r * f.row_bytes(cols)..(r + 1) * f.row_bytes(cols)], &mut wd);
                let exact: f32 = wd.iter().zip(&x).map(|(a, b)| a * b).sum();
                let got = p.dot_group::<1>(r / GROUP_ROWS, [q.row(0)])[0][r % GROUP_ROWS];
                // activation quantization error: |x_i - q_i| <= amax/254 per element
                let bound = wd.iter().map(|v| v.abs()).sum::<f32>() * 2.0 / 254.0 + 1e-4;
                assert!((exact - got).abs() <= bound, "{f:?} row {r}: {exact} vs {got} (bound {bound})");
            }
            // the padding lanes of the last group are zero
            let last = p.dot_group::<1>(p.groups() - 1, [q.row(0)])[0];
            assert!(last[rows % GROUP_ROWS..].iter().all(|&v| v == 0.0));
        }
    }

    /// Q8_0 bytes a quantizer never writes but a file may hold (-128, next to +127 and 0) against
    /// activations at both ends: every path, one group or two, gives the scalar reference's bits.
    #[test]
    fn q8_0_weight_bytes_at_the_ends_of_i8_give_the_reference_sums() {
        let (rows, cols) = (16, 64);
        let f = WeightFormat::Q8_0;
        let bb = f.block_bytes();
        let mut raw = vec![0u8; rows * f.row_bytes(cols)];
        for (i, blk) in raw.chunks_exact_mut(bb).enumerate() {
            blk[..2].copy_from_slice(&f16::from_f32(0.01 * (1 + i % 5) as f32).to_le_bytes());
            for (j, q) in blk[2..].iter_mut().enumerate() {
                *q = [0x80u8, 0x7F, 0x00, 0x81][(i + j) % 4];
            }
        }
        let p = PackedInt8::pack(f, rows, cols, &raw).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| if i % 2 == 0 { -1.0 } else { 1.0 }).collect();
        let ones = vec![1.0f32; cols];
        let (a, b) = (quantize_rows(&x, cols), quantize_rows(&ones, cols));
        let mut out = [[[0f32; GROUP_ROWS]; 2]; 2];
        let [o0, o1] = &mut out;
        // SAFETY: each pointer addresses one row of `out`.
        unsafe { p.dot_group_pair_to::<2>(0, [a.row(0), b.row(0)], [o0.each_mut().map(|r| r.as_mut_ptr()), o1.each_mut().map(|r| r.as_mut_ptr())]) };
        for (g, group_out) in out.iter().enumerate() {
            for (n, act) in [a.row(0), b.row(0)].into_iter().enumerate() {
                let reference = dot_group_scalar(f, &p.group_for_tests(g), p.blocks, act);
                assert_eq!(group_out[n].map(f32::to_bits), reference.map(f32::to_bits), "group {g} activation {n}");
                assert_eq!(p.dot_group::<1>(g, [act])[0].map(f32::to_bits), reference.map(f32::to_bits));
            }
        }
    }

    #[test]
    fn extreme_weights_do_not_overflow_the_integer_sums() {
        // every weight at the top of its range (nibble 15 / byte +-127) against activations all at 127:
        // the largest integer sums there are, checked against the scalar reference's i32 sums
        let cols = 64;
        let x = vec![1.0f32; cols];
        let q = quantize_rows(&x, cols);
        let w: Vec<f32> = (0..cols).map(|i| if i % 32 == 0 { -1.0 } else { 1.0 }).collect();
        for f in FORMATS {
            let row = quantize_row(f, &w);
            let mut wd = vec![0f32; cols];
            dequantize_row(f, &row, &mut wd);
            let expected: f32 = wd.iter().sum();
            let raw: Vec<u8> = (0..8).flat_map(|_| row.clone()).collect();
            let p = PackedInt8::pack(f, 8, cols, &raw).unwrap();
            let got = p.dot_group::<1>(0, [q.row(0)])[0];
            let reference = dot_group_scalar(f, &p.group_for_tests(0), p.blocks, q.row(0));
            assert_eq!(got.map(f32::to_bits), reference.map(f32::to_bits), "{f:?}");
            assert!(got.iter().all(|v| (v - expected).abs() < 1e-3 * expected), "{f:?}: {got:?} vs {expected}");
        }
    }
}
