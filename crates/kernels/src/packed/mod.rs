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
//! activation blocks) with their own group block layouts and kernels: see `packed/k.rs`.

use crate::buffer::WeightBytes;
use crate::formats::{WeightFormat, QK};
pub use crate::group::GROUP_ROWS;
use crate::q8::{ActSpan, BlockQ8};
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
    if k::handles(format) {
        return k::group_block_bytes(format);
    }
    if iq::handles(format) {
        return iq::group_block_bytes(format);
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
    let (in_k, in_iq) = (k::handles(format), iq::handles(format));
    #[cfg(target_arch = "x86_64")]
    if rows - g * GROUP_ROWS >= GROUP_ROWS && k::x86::packs_eight(format) && crate::cpu::features().avx2_fma {
        assert!(raw.len() >= (g + 1) * GROUP_ROWS * row_bytes && out.len() >= blocks * gbb, "pack_group: group {g} outside the matrix");
        for b in 0..blocks {
            let src: [*const u8; GROUP_ROWS] = std::array::from_fn(|lane| raw[(g * GROUP_ROWS + lane) * row_bytes + b * bb..].as_ptr());
            // SAFETY: AVX2 was detected at run time; each row's block b lies inside `raw` and the
            // group block inside `out` (asserted above); `packs_eight(format)`.
            unsafe { k::x86::pack_block8(format, src, out[b * gbb..].as_mut_ptr()) };
        }
        return;
    }
    for lane in 0..GROUP_ROWS.min(rows - g * GROUP_ROWS) {
        let r = g * GROUP_ROWS + lane;
        for b in 0..blocks {
            let src = &raw[r * row_bytes + b * bb..r * row_bytes + (b + 1) * bb];
            let dst = &mut out[b * gbb..(b + 1) * gbb];
            if in_k {
                k::pack_block(format, src, lane, dst);
                continue;
            }
            if in_iq {
                iq::pack_block(format, src, lane, dst);
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
        k::reads_super_span(self.format)
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
                (WeightFormat::Q4K, ActSpan::Super) => Some(k::x86::rows_q4k_super_vnni as k::x86::RowsKernel),
                (WeightFormat::Q6K, ActSpan::Block) => Some(k::x86::rows_q6k_vnni as k::x86::RowsKernel),
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
        if k::handles(self.format) {
            // SAFETY: `group` holds `blocks` group blocks and every activation row the matching
            // `act_blocks` blocks (checked above); dst as the caller promised.
            return k::dot_group_to::<N>(self.format, span, group, self.blocks, acts, dst);
        }
        if iq::handles(self.format) {
            // SAFETY: as for packed::k (block-scaled rows only: `reads_super_span` is false).
            return iq::dot_group_to::<N>(self.format, group, self.blocks, acts, dst);
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
    ///   On Zen 5 (`CpuFeatures::pairs_at_few_rows` false) Q4_0 / Q4_1 from three rows and
    ///   Q8_0 from eight: below, one group streamed 1.15-1.3x faster (matmul_bench, weights
    ///   streamed, 2 threads; Q8_0 at 16-64 rows the pair 1.4x).
    /// - Q4_K (super-scaled rows) and Q6_K (block-scaled) in `k::x86::pair_k`, only where
    ///   512-bit instructions run whole (on Zen 4 Q4_K's pair was 15-25% slower), and only from a
    ///   few rows on: below, the one-group kernel streamed the weights as fast or faster (Zen 5).
    ///   Q4_K from five rows (1.3-1.4x at 8-64); Q6_K from eight (its lm_head at five 8% slower,
    ///   at 9-17 1.15x), and only on rows under 4096 columns (a 1.5B model's ffn_down, 8960
    ///   columns, two streams 58 KB apart, was 1.1-1.4x slower at 5-9 rows).
    /// - The table formats in `iq::x86::pair_table`, where 512-bit instructions run whole: MXFP4
    ///   from two rows (1.2-1.4x at two, 2.2-2.7x at 4-64), IQ4_NL / IQ4_XS from three (at two the
    ///   pair was 10-15% slower, at 3-64 2-2.3x faster) (matmul_bench gate/up, 2 threads, Zen 5).
    pub fn pair_min_rows(&self, span: ActSpan) -> Option<usize> {
        let f = crate::cpu::features();
        if !(cfg!(target_arch = "x86_64") && f.avx512_vnni) {
            return None;
        }
        match (span, self.format) {
            (ActSpan::Block, WeightFormat::Q4_0 | WeightFormat::Q4_1) => (!f.split_512).then_some(if f.pairs_at_few_rows { 1 } else { 3 }),
            (ActSpan::Block, WeightFormat::Q8_0) => (!f.split_512).then_some(if f.pairs_at_few_rows { 1 } else { 8 }),
            (ActSpan::Block, WeightFormat::Q6K) if !f.split_512 && self.act_blocks * QK < 4096 => Some(8),
            (ActSpan::Super, WeightFormat::Q4K) if !f.split_512 => Some(5),
            (ActSpan::Block, WeightFormat::MXFP4) if !f.split_512 => Some(2),
            (ActSpan::Block, WeightFormat::IQ4NL | WeightFormat::IQ4XS) if !f.split_512 => Some(3),
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
            if k::handles(self.format) {
                // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected at run time
                // (pairs_in_one_pass, which admits Q4_K only with super-scaled rows and Q6_K only
                // with block-scaled ones); both groups hold `blocks` group blocks, every
                // activation row the matching `act_blocks` blocks; dst as promised.
                return self.with_groups::<2, _>(g, |[g0, g1]| k::x86::pair_k::<N>(self.format, g0, g1, self.blocks, acts, dst));
            }
            // SAFETY: AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C were detected at run time
            // (pairs_in_one_pass, which admits the other families only for block-scaled rows of
            // Q4_0 / Q4_1 / Q8_0 and the table formats); row lengths checked above; dst as promised.
            return self.pair_512::<N>(g, acts, dst);
        }
        self.dot_group_span_to::<N>(g, span, acts, dst[0]);
        self.dot_group_span_to::<N>(g + 1, span, acts, dst[1]);
    }

    /// Groups `g` and `g + 1` through the 512-bit two-group kernel of Q4_0 / Q4_1 / Q8_0
    /// (`x86::pair_vnni512`) or of the table formats (`iq::x86::pair_table`).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C present; the format one of those; every
    /// activation row `act_blocks` blocks; dst as `dot_group_pair_to`.
    #[cfg(target_arch = "x86_64")]
    #[inline]
    unsafe fn pair_512<const N: usize>(&self, g: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
        if iq::handles(self.format) {
            return self.with_groups::<2, _>(g, |[g0, g1]| iq::x86::pair_table::<N>(self.format, g0, g1, self.blocks, acts, dst));
        }
        self.with_groups::<2, _>(g, |[g0, g1]| x86::pair_vnni512::<N>(self.format, g0, g1, self.blocks, acts, dst));
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
impl PackedInt8 {
    /// `dot_group_pair_to` through the 512-bit two-group kernel of Q4_0 / Q4_1 / Q8_0 or of the
    /// table formats (IQ4_NL, IQ4_XS, MXFP4) whatever `pair_min_rows` says, so the kernel is
    /// checked on CPUs and at row counts whose matmuls do not take it.
    ///
    /// # Safety
    /// As `dot_group_pair_to`; AVX-512 VNNI present.
    pub(crate) unsafe fn dot_group_pair_512_for_tests<const N: usize>(&self, g: usize, acts: [&[BlockQ8]; N], dst: [[*mut f32; N]; 2]) {
        assert!(crate::cpu::features().avx512_vnni && Self::has_512_pair_for_tests(self.format));
        self.pair_512::<N>(g, acts, dst)
    }

    /// Whether `dot_group_pair_512_for_tests` takes `format`.
    pub(crate) fn has_512_pair_for_tests(format: WeightFormat) -> bool {
        matches!(format, WeightFormat::Q4_0 | WeightFormat::Q4_1 | WeightFormat::Q8_0 | WeightFormat::IQ4NL | WeightFormat::IQ4XS | WeightFormat::MXFP4)
    }
}

#[inline]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Scalar reference of the kernel (same arithmetic, so the same bits): one activation row
/// against the eight rows of a group.
pub fn dot_group_scalar(format: WeightFormat, group: &[u8], blocks: usize, a: &[BlockQ8]) -> [f32; GROUP_ROWS] {
    if k::handles(format) {
        return k::dot_group_scalar(format, ActSpan::Block, group, blocks, a);
    }
    if iq::handles(format) {
        return iq::dot_group_scalar(format, group, blocks, a);
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

pub mod float;
pub(crate) mod iq;
pub mod k;
#[cfg(test)]
mod k_tests;
#[cfg(test)]
mod test_rows;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
