//! `y = x W^T` for a batch of activation rows against one or several weight matrices that share
//! the same input (q/k/v, gate/up), multi-threaded over weight rows on the current rayon pool.
//!
//! Work is split over *output rows* only: each output element is produced by one call of a dot
//! kernel whose reduction order is fixed, so results are bitwise independent of the batch size,
//! of which rows share the batch, and of the thread count.

use crate::dot::dot_f32;
use crate::packed::float::PackedFloat;
use crate::packed::{PackedInt8, GROUP_ROWS, MAX_ACTS};
use crate::pool::DisjointOut;
use crate::q8::{quantize_rows, quantize_rows_super, ActSpan, QuantizedActivations};
use crate::weights::{Packed, QMatrix};

/// Activations prepared once for every matrix that reads them.
pub struct MatmulInput<'a> {
    pub x: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    /// Block scales, every row: what the int8 kernels read.
    q8: Option<QuantizedActivations>,
    /// What the Q4_K / Q5_K kernels read: super-block scales where a row allows them.
    q8_super: Option<SuperInput>,
}

/// `quantize_rows_super`'s rows, and which of them got super-block scales.
struct SuperInput {
    q: QuantizedActivations,
    super_rows: Vec<usize>,
    block_rows: Vec<usize>,
}

impl<'a> MatmulInput<'a> {
    /// `x` is `rows x cols` row-major. Quantizes to 8-bit blocks when any of `ws` uses the int8 path.
    pub fn new(x: &'a [f32], cols: usize, ws: &[&QMatrix]) -> Self {
        assert_eq!(x.len() % cols, 0, "activation length {} is not a multiple of {cols}", x.len());
        let rows = x.len() / cols;
        let int8 = |w: &&&QMatrix| matches!(w.packed(), Some(Packed::Int8(_)));
        let reads_super = |w: &&&QMatrix| matches!(w.packed(), Some(Packed::Int8(p)) if p.reads_super_span());
        let q8 = ws.iter().filter(int8).any(|w| !reads_super(&w)).then(|| quantize_parallel(x, cols, quantize_rows));
        let q8_super = ws.iter().any(|w| reads_super(&w)).then(|| {
            let q = quantize_parallel(x, cols, quantize_rows_super);
            let (super_rows, block_rows) = (0..rows).partition(|&r| q.spans[r] == ActSpan::Super);
            SuperInput { q, super_rows, block_rows }
        });
        Self { x, rows, cols, q8, q8_super }
    }
}

fn quantize_parallel(x: &[f32], cols: usize, quantize: fn(&[f32], usize) -> QuantizedActivations) -> QuantizedActivations {
    let rows = x.len() / cols;
    if rows < 2 {
        return quantize(x, cols);
    }
    // on the spinning pool (a rayon wake-up costs more than a row: 6 us at 8960 wide, and a
    // mixture of experts' prefill quantizes each expert's few dozen rows twice a layer): a
    // verify step's rows one per task, more rows 16 a task; each row's bytes do not depend on
    // who quantizes it
    let per_task = if rows < 32 { 1 } else { 16 };
    let tasks = rows.div_ceil(per_task);
    let parts: Vec<std::sync::OnceLock<QuantizedActivations>> = (0..tasks).map(|_| std::sync::OnceLock::new()).collect();
    crate::pool::parallel_for(tasks, &|t| {
        let r1 = ((t + 1) * per_task).min(rows);
        let _ = parts[t].set(quantize(&x[t * per_task * cols..r1 * cols], cols));
    });
    QuantizedActivations::concat(parts.into_iter().map(|p| p.into_inner().expect("every row quantized")).collect())
}

const BATCH_TILE: usize = 64;

/// `outs[m]` (shape `input.rows x ws[m].rows`) = input x ws[m]^T, for every m, in one parallel region.
pub fn matmul_many(input: &MatmulInput, ws: &[&QMatrix], outs: &mut [&mut [f32]]) {
    matmul_regions(&|_| input, ws, outs);
}

/// `outs[m]` = `inputs[reads[m]]` x ws[m]^T for every m, in one parallel region: matrices that
/// read different activations (a mixture of experts' projections, each expert its own rows), so
/// that a step runs one region where it would run one a matrix. Each output element is the same
/// kernel call on the same quantized input as in [`matmul_many`]: the same bits.
pub fn matmul_grouped(inputs: &[&MatmulInput], reads: &[usize], ws: &[&QMatrix], outs: &mut [&mut [f32]]) {
    assert_eq!(reads.len(), ws.len(), "matmul_grouped: one input index a matrix");
    assert!(reads.iter().all(|&i| i < inputs.len()), "matmul_grouped: an input index out of range");
    matmul_regions(&|m| inputs[reads[m]], ws, outs);
}

fn matmul_regions<'i>(input_of: &(dyn Fn(usize) -> &'i MatmulInput<'i> + Sync), ws: &[&QMatrix], outs: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), outs.len());
    for (m, (w, o)) in ws.iter().zip(outs.iter()).enumerate() {
        let input = input_of(m);
        assert_eq!(w.cols, input.cols, "matmul: weight has {} columns, input {}", w.cols, input.cols);
        assert_eq!(o.len(), input.rows * w.rows, "matmul: output buffer has the wrong size");
    }
    // every task writes a disjoint set of (batch row, weight row) elements
    let ptrs: Vec<DisjointOut> = outs.iter_mut().map(|o| DisjointOut::new(o)).collect();
    let mut tasks = Vec::new();
    for (m, w) in ws.iter().enumerate() {
        let input = input_of(m);
        // a multiple of the packed kernels' 8-row groups
        let rows_per_task = if input.rows <= 4 { 16 } else { 32 };
        // float kernels read several groups side by side for few activation rows
        let rows_per_task = match w.packed() {
            Some(Packed::Float(_)) => rows_per_task.max(crate::packed::float::groups_side_by_side(input.rows) * GROUP_ROWS),
            // Decode and verification (up to one batch tile of activation rows) stream the
            // weights from memory once: each thread takes long contiguous runs (about a quarter
            // of its share of the matrix) so the prefetchers see one stream instead of 16- or
            // 32-row pieces interleaved with the other thread's. Up to 8 rows from the start; up to a
            // whole tile since the 9-16-row verify steps of n-gram drafts (matmul_bench,
            // BENCH_ROTATE=1, 2 threads): the lm_head 1.24-1.34x faster at 9-16 rows, 1.05-1.1x
            // at 32-64, gate/up 1.08-1.18x, nothing slower. The split never changes a row's
            // arithmetic.
            _ if input.rows <= BATCH_TILE => rows_per_task.max((w.rows / (4 * rayon::current_num_threads().max(1))).next_multiple_of(GROUP_ROWS)),
            _ => rows_per_task,
        };
        let mut r = 0;
        while r < w.rows {
            let end = (r + rows_per_task).min(w.rows);
            tasks.push((m, r, end));
            r = end;
        }
    }
    let run = |&(m, r0, r1): &(usize, usize, usize)| {
        let (w, input) = (ws[m], input_of(m));
        let out = ptrs[m];
        match w.packed() {
            Some(Packed::Int8(p)) if p.reads_super_span() => {
                let s = input.q8_super.as_ref().expect("super-span input prepared by MatmulInput::new");
                let q = &s.q;
                if s.block_rows.is_empty() || s.super_rows.is_empty() {
                    let span = if s.block_rows.is_empty() { ActSpan::Super } else { ActSpan::Block };
                    packed_rows(&Int8Kernel { p, q, span, rows: None }, p.rows(), input.rows, r0, r1, out);
                } else {
                    // each row's own kernel; a row's results are the same bits in either batch
                    for (span, rows) in [(ActSpan::Super, &s.super_rows), (ActSpan::Block, &s.block_rows)] {
                        packed_rows(&Int8Kernel { p, q, span, rows: Some(rows) }, p.rows(), rows.len(), r0, r1, out);
                    }
                }
            }
            Some(Packed::Int8(p)) => {
                let q = input.q8.as_ref().expect("int8 input prepared by MatmulInput::new");
                packed_rows(&Int8Kernel { p, q, span: ActSpan::Block, rows: None }, p.rows(), input.rows, r0, r1, out);
            }
            Some(Packed::Float(p)) => packed_rows(&FloatKernel { p, input }, p.rows(), input.rows, r0, r1, out),
            None => f32_rows(w, input, r0, r1, out),
        }
    };
    crate::pool::parallel_for(tasks.len(), &|i| run(&tasks[i]));
}

pub fn matmul(input: &MatmulInput, w: &QMatrix, out: &mut [f32]) {
    matmul_many(input, &[w], &mut [out]);
}

/// One packed kernel: the eight rows of group `g` against activation rows `b..b + N`, results
/// written at `dst[i]` (eight floats each).
trait GroupKernel {
    /// Activation rows per weight pass the kernel handles best (8 or 4).
    fn widest(&self) -> usize;
    /// # Safety
    /// Every `dst[i]` must be valid for eight writes that no other thread makes.
    unsafe fn run<const N: usize>(&self, g: usize, b: usize, dst: [*mut f32; N]);
    /// The output row of the kernel's activation row `b` (the kernel may run a subset of the
    /// batch's rows).
    fn out_row(&self, b: usize) -> usize {
        b
    }
    /// Groups per call the kernel reads side by side for `n` activation rows (1: one at a time).
    fn side_by_side(&self, _n: usize) -> usize {
        1
    }
    /// Groups `g..g + G` against activation rows `b..b + N`, group `j`'s results at `dst[j]`;
    /// each group's results exactly `run`'s.
    /// # Safety
    /// As `run`, for every `dst[j][i]`.
    unsafe fn run_groups<const G: usize, const N: usize>(&self, g: usize, b: usize, dst: [[*mut f32; N]; G]) {
        for (j, d) in dst.into_iter().enumerate() {
            self.run::<N>(g + j, b, d);
        }
    }
}

struct Int8Kernel<'a> {
    p: &'a PackedInt8,
    q: &'a QuantizedActivations,
    /// The scale span of every row this kernel runs.
    span: ActSpan,
    /// The rows of `q` it runs, in order (`None`: all of them).
    rows: Option<&'a [usize]>,
}

impl Int8Kernel<'_> {
    #[inline]
    fn acts<const N: usize>(&self, b: usize) -> [&[crate::q8::BlockQ8]; N] {
        std::array::from_fn(|i| self.q.row(self.out_row(b + i)))
    }
}

impl GroupKernel for Int8Kernel<'_> {
    fn widest(&self) -> usize {
        // eight activation rows per weight pass where there are 32 vector registers
        if MAX_ACTS >= 8 && crate::cpu::features().avx512_vnni {
            8
        } else {
            4
        }
    }
    unsafe fn run<const N: usize>(&self, g: usize, b: usize, dst: [*mut f32; N]) {
        self.p.dot_group_span_to::<N>(g, self.span, self.acts(b), dst)
    }
    #[inline]
    fn out_row(&self, b: usize) -> usize {
        self.rows.map_or(b, |r| r[b])
    }
    fn side_by_side(&self, n: usize) -> usize {
        // (`PackedInt8::pair_min_rows` says where the pair pays)
        match self.p.pair_min_rows(self.span) {
            Some(rows) if n >= rows => 2,
            _ => 1,
        }
    }
    unsafe fn run_groups<const G: usize, const N: usize>(&self, g: usize, b: usize, dst: [[*mut f32; N]; G]) {
        let acts = self.acts(b);
        if G == 2 && self.p.pairs_in_one_pass(self.span) {
            self.p.dot_group_pair_span_to::<N>(g, self.span, acts, [dst[0], dst[1]]);
        } else {
            for (j, d) in dst.into_iter().enumerate() {
                self.p.dot_group_span_to::<N>(g + j, self.span, acts, d);
            }
        }
    }
}

struct FloatKernel<'a> {
    p: &'a PackedFloat,
    input: &'a MatmulInput<'a>,
}

impl GroupKernel for FloatKernel<'_> {
    fn widest(&self) -> usize {
        crate::packed::float::MAX_ACTS
    }
    unsafe fn run<const N: usize>(&self, g: usize, b: usize, dst: [*mut f32; N]) {
        let cols = self.input.cols;
        self.p.dot_group_to::<N>(g, std::array::from_fn(|i| &self.input.x[(b + i) * cols..(b + i + 1) * cols]), dst)
    }
    fn side_by_side(&self, n: usize) -> usize {
        crate::packed::float::groups_side_by_side(n)
    }
    unsafe fn run_groups<const G: usize, const N: usize>(&self, g: usize, b: usize, dst: [[*mut f32; N]; G]) {
        let cols = self.input.cols;
        self.p.dot_groups_to::<G, N>(g, std::array::from_fn(|i| &self.input.x[(b + i) * cols..(b + i + 1) * cols]), dst)
    }
}

/// Runs `k` for group `g` and activation rows `b..b + N` of an output of `rows` columns at `optr`
/// (the caller checked it holds every activation row): a full group writes straight into the
/// output, the last group of a matrix whose rows are not a multiple of 8 through a buffer.
fn write_group<K: GroupKernel, const N: usize>(k: &K, g: usize, b: usize, optr: *mut f32, rows: usize) {
    let base = g * GROUP_ROWS;
    if base + GROUP_ROWS <= rows {
        // SAFETY: out_row(b + i) * rows + base + 8 <= activation rows * rows, inside the output, and this
        // task alone writes rows base..base + 8.
        unsafe { k.run::<N>(g, b, std::array::from_fn(|i| optr.add(k.out_row(b + i) * rows + base))) };
    } else {
        let mut buf = [[0f32; GROUP_ROWS]; N];
        // SAFETY: each pointer addresses one row of `buf`.
        unsafe { k.run::<N>(g, b, buf.each_mut().map(|r| r.as_mut_ptr())) };
        for (i, y) in buf.iter().enumerate() {
            // SAFETY: as above, for the rows - base valid lanes.
            unsafe { std::ptr::copy_nonoverlapping(y.as_ptr(), optr.add(k.out_row(b + i) * rows + base), rows - base) };
        }
    }
}

/// Runs `k` for the `G` full groups `g..g + G` and activation rows `b..b + N`, straight into the
/// output (the caller checked that every group lies inside the matrix's `rows`).
fn write_groups<K: GroupKernel, const G: usize, const N: usize>(k: &K, g: usize, b: usize, optr: *mut f32, rows: usize) {
    assert!((g + G) * GROUP_ROWS <= rows);
    // SAFETY: as in write_group: every row base..base + 8 of these groups is inside the output and
    // written by this task alone.
    unsafe { k.run_groups::<G, N>(g, b, std::array::from_fn(|j| std::array::from_fn(|i| optr.add(k.out_row(b + i) * rows + (g + j) * GROUP_ROWS)))) };
}

/// Weight rows `r0..r1` (`r0` a multiple of 8) of a packed matrix with `rows` rows against `n`
/// activation rows: eight weight rows and up to `k.widest()` activation rows per kernel call,
/// activation rows in tiles so a task's weights stay in cache.
fn packed_rows<K: GroupKernel>(k: &K, rows: usize, n: usize, r0: usize, r1: usize, out: DisjointOut) {
    assert_eq!(r0 % GROUP_ROWS, 0);
    let (optr, olen) = out.raw();
    assert!((0..n).all(|b| (k.out_row(b) + 1) * rows <= olen), "matmul: an activation row outside the output");
    let wide = k.widest() >= 8;
    let mut b0 = 0;
    while b0 < n {
        let b1 = (b0 + BATCH_TILE).min(n);
        let (mut g, g_end) = (r0 / GROUP_ROWS, r1.div_ceil(GROUP_ROWS));
        // full groups side by side where the kernel wants that, up to eight activation rows a call
        let side = k.side_by_side(b1 - b0);
        'side: while side > 1 && g + side <= g_end && (g + side) * GROUP_ROWS <= rows {
            let mut b = b0;
            while b < b1 {
                let m = (b1 - b).min(8);
                match (side, m) {
                    (4, 1) => write_groups::<K, 4, 1>(k, g, b, optr, rows),
                    (2, 1) => write_groups::<K, 2, 1>(k, g, b, optr, rows),
                    (2, 2) => write_groups::<K, 2, 2>(k, g, b, optr, rows),
                    (2, 3) => write_groups::<K, 2, 3>(k, g, b, optr, rows),
                    (2, 4) => write_groups::<K, 2, 4>(k, g, b, optr, rows),
                    (2, 5) => write_groups::<K, 2, 5>(k, g, b, optr, rows),
                    (2, 6) => write_groups::<K, 2, 6>(k, g, b, optr, rows),
                    (2, 7) => write_groups::<K, 2, 7>(k, g, b, optr, rows),
                    (2, 8) => write_groups::<K, 2, 8>(k, g, b, optr, rows),
                    // the kernel has no such call: these groups go one at a time below
                    _ => break 'side,
                }
                b += m;
            }
            g += side;
        }
        for g in g..g_end {
            let mut b = b0;
            while wide && b + 8 <= b1 {
                write_group::<K, 8>(k, g, b, optr, rows);
                b += 8;
            }
            // 5 to 7 rows in one pass over the group's weights, not 4 + the rest: a verify step
            // of 1 + k tokens (k = 4..6) reads each weight once
            if wide {
                let n = match b1 - b {
                    7 => {
                        write_group::<K, 7>(k, g, b, optr, rows);
                        7
                    }
                    6 => {
                        write_group::<K, 6>(k, g, b, optr, rows);
                        6
                    }
                    5 => {
                        write_group::<K, 5>(k, g, b, optr, rows);
                        5
                    }
                    _ => 0,
                };
                b += n;
            }
            while b + 4 <= b1 {
                write_group::<K, 4>(k, g, b, optr, rows);
                b += 4;
            }
            match b1 - b {
                3 => write_group::<K, 3>(k, g, b, optr, rows),
                2 => write_group::<K, 2>(k, g, b, optr, rows),
                1 => write_group::<K, 1>(k, g, b, optr, rows),
                _ => {}
            }
        }
        b0 = b1;
    }
}

fn f32_rows(w: &QMatrix, input: &MatmulInput, r0: usize, r1: usize, out: DisjointOut) {
    let mut buf = vec![0f32; w.cols];
    for r in r0..r1 {
        w.dequantize_row_into(r, &mut buf);
        for b in 0..input.rows {
            let x = &input.x[b * input.cols..(b + 1) * input.cols];
            store(out, b * w.rows + r, dot_f32(&buf, x));
        }
    }
}

#[inline]
fn store(out: DisjointOut, idx: usize, v: f32) {
    let (ptr, len) = out.raw();
    assert!(idx < len);
    // SAFETY: idx is in bounds (checked above) and no other task writes this (batch, row) element.
    unsafe { *ptr.add(idx) = v }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::{quantize_row, WeightFormat};
    use crate::weights::WeightBytes;
    use rand::{Rng, SeedableRng};

    fn random_matrix(rng: &mut rand::rngs::StdRng, f: WeightFormat, rows: usize, cols: usize) -> QMatrix {
        if crate::packed::k::handles(f) || crate::packed::iq::handles(f) {
            // no quantizer for these: random blocks with sane scales
            let bytes =
                if crate::packed::k::handles(f) { crate::packed::k::random_raw(rng, f, rows, cols) } else { crate::packed::iq::random_raw(rng, f, rows, cols) };
            return QMatrix::new(f, rows, cols, WeightBytes::owned(bytes), "test").unwrap();
        }
        let mut bytes = Vec::new();
        for _ in 0..rows {
            let row: Vec<f32> = (0..cols).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            bytes.extend(quantize_row(f, &row));
        }
        QMatrix::new(f, rows, cols, WeightBytes::owned(bytes), "test").unwrap()
    }

    /// Every format with an int8 kernel.
    const INT8_FORMATS: [WeightFormat; 13] = [
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q8_0,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::IQ4NL,
        WeightFormat::IQ4XS,
        WeightFormat::MXFP4,
    ];

    /// `xs x w^T` on a pool of `threads` threads.
    fn run_on_threads(w: &QMatrix, xs: &[f32], threads: usize) -> Vec<f32> {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            let inp = MatmulInput::new(xs, w.cols, &[w]);
            let mut out = vec![0f32; inp.rows * w.rows];
            matmul(&inp, w, &mut out);
            out
        })
    }

    #[test]
    fn a_rows_result_is_bitwise_independent_of_batch_and_threads() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for f in [WeightFormat::F16, WeightFormat::F32].into_iter().chain(INT8_FORMATS) {
            let cols = if f.block_len() > 128 { 512 } else { 128 };
            let w = random_matrix(&mut rng, f, 100, cols);
            assert!(w.packed().is_some(), "{f:?} has a packed kernel");
            let mut x: Vec<f32> = (0..cols * 70).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            // every third row from row 2 on has one value that dwarfs its super-block: Q4_K / Q5_K
            // take those rows on block scales, the rest on super-block scales, in one batch
            for r in (2..70).step_by(3) {
                x[r * cols + 37] = 400.0;
            }
            if crate::packed::k::reads_super_span(f) {
                let spans = crate::q8::quantize_rows_super(&x, cols).spans;
                assert_eq!(spans.iter().filter(|&&s| s == ActSpan::Block).count(), 23, "{f:?}");
            }
            let run = |xs: &[f32], threads: usize| run_on_threads(&w, xs, threads);
            let full = run(&x, 2);
            // row 5 alone, with one thread
            let alone = run(&x[5 * cols..6 * cols], 1);
            assert_eq!(alone.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), full[5 * 100..6 * 100].iter().map(|v| v.to_bits()).collect::<Vec<_>>(), "{f:?}");
            // row 69 (in the scalar tail of the 4-row tiling) inside a batch of 3
            let three = run(&x[67 * cols..70 * cols], 2);
            assert_eq!(
                three[2 * 100..3 * 100].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                full[69 * 100..70 * 100].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{f:?}"
            );
            // every batch size up to 9 (one and two passes of the widest kernel, and tails), at
            // one and two threads
            for n in 1..=9 {
                for threads in [1, 2] {
                    let start = 60 - n - n % 3;
                    let part = run(&x[start * cols..(start + n) * cols], threads);
                    assert_eq!(
                        part.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        full[start * 100..(start + n) * 100].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{f:?}: batch of {n} at {threads} threads"
                    );
                }
            }
        }
    }

    #[test]
    fn verify_sized_batches_split_in_long_runs_give_the_same_bits() {
        // 400 weight rows: up to a batch tile (64 activation rows) two threads take runs of 56
        // rows, above it 32-row tasks; a row's result is the same bits either way
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for f in [WeightFormat::Q4K, WeightFormat::Q6K, WeightFormat::Q4_0] {
            let cols = if f.block_len() > 128 { 512 } else { 128 };
            let w = random_matrix(&mut rng, f, 400, cols);
            let x: Vec<f32> = (0..cols * 80).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            let run = |xs: &[f32], threads: usize| run_on_threads(&w, xs, threads);
            let full = run(&x, 2);
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for n in [9, 12, 16, 33, 64] {
                let part = run(&x[..n * cols], 2);
                assert_eq!(bits(&part), bits(&full[..n * 400]), "{f:?}: batch of {n}");
            }
        }
    }

    #[test]
    fn matmul_many_equals_separate_matmuls() {
        // a and b sharing the input x (rows of `cols`), in one call and one at a time
        let check = |a: &QMatrix, b: &QMatrix, x: &[f32]| {
            let (cols, n) = (a.cols, x.len() / a.cols);
            let (mut ya, mut yb) = (vec![0f32; n * a.rows], vec![0f32; n * b.rows]);
            matmul_many(&MatmulInput::new(x, cols, &[a, b]), &[a, b], &mut [&mut ya, &mut yb]);
            let (mut za, mut zb) = (vec![0f32; n * a.rows], vec![0f32; n * b.rows]);
            matmul(&MatmulInput::new(x, cols, &[a]), a, &mut za);
            matmul(&MatmulInput::new(x, cols, &[b]), b, &mut zb);
            assert_eq!(ya, za);
            assert_eq!(yb, zb);
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (a, b) = (random_matrix(&mut rng, WeightFormat::Q4_1, 40, 64), random_matrix(&mut rng, WeightFormat::Q8_0, 24, 64));
        let x: Vec<f32> = (0..64 * 3).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        check(&a, &b, &x);
        // a k-quant that reads super-block scales beside one that does not, on rows of both kinds
        let (a, b) = (random_matrix(&mut rng, WeightFormat::Q4K, 24, 512), random_matrix(&mut rng, WeightFormat::Q6K, 16, 512));
        let mut x: Vec<f32> = (0..512 * 5).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
        x[512 + 300] = 90.0;
        check(&a, &b, &x);
    }

    /// Matrices reading different inputs in one region (a mixture of experts' projections) give
    /// the bits of one call each: mixed formats (a k-quant reading super-block scales among them),
    /// inputs of different row counts, two matrices on one input, one and two threads.
    #[test]
    fn grouped_matmuls_equal_one_call_each() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let ws = [
            random_matrix(&mut rng, WeightFormat::Q4K, 48, 512),
            random_matrix(&mut rng, WeightFormat::Q6K, 40, 512),
            random_matrix(&mut rng, WeightFormat::Q8_0, 24, 512),
            random_matrix(&mut rng, WeightFormat::Q4K, 64, 512),
        ];
        let mut xs: Vec<Vec<f32>> = [1usize, 3, 2].iter().map(|&n| (0..512 * n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()).collect();
        xs[1][512 + 7] = 120.0; // a row on block scales beside rows on super-block scales
        let reads = [0usize, 1, 2, 0];
        for threads in [1, 2] {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
            pool.install(|| {
                let refs: Vec<&QMatrix> = ws.iter().collect();
                let inputs: Vec<MatmulInput> = xs.iter().map(|x| MatmulInput::new(x, 512, &refs)).collect();
                let mut outs: Vec<Vec<f32>> = ws.iter().zip(reads).map(|(w, i)| vec![0f32; inputs[i].rows * w.rows]).collect();
                let mut out_refs: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
                matmul_grouped(&inputs.iter().collect::<Vec<_>>(), &reads, &refs, &mut out_refs);
                for (m, (w, &i)) in ws.iter().zip(&reads).enumerate() {
                    let mut one = vec![0f32; inputs[i].rows * w.rows];
                    matmul(&MatmulInput::new(&xs[i], 512, &[w]), w, &mut one);
                    assert_eq!(bits(&outs[m]), bits(&one), "matrix {m} at {threads} threads");
                }
            });
        }
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// A matrix read in place (each group repacked by the thread that reads it) gives the bits of
    /// the same matrix repacked at load: every int8 format, batches from decode through pairs of
    /// groups (5+ rows) to prefill tiles (70 rows: two tiles), one and two threads, and two
    /// in-place matrices in one call (their groups share each thread's scratch).
    #[test]
    fn in_place_matrices_give_the_repacked_bits() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        for f in INT8_FORMATS {
            let cols = if f.block_len() > 128 { 512 } else { 128 };
            let (a, b) = (random_matrix(&mut rng, f, 100, cols), random_matrix(&mut rng, f, 36, cols));
            let in_place = |m: &QMatrix| QMatrix::new_in_place(m.format, m.rows, m.cols, WeightBytes::owned(m.bytes().to_vec()), "test").unwrap();
            let (ia, ib) = (in_place(&a), in_place(&b));
            let int8 = |m: &QMatrix| match m.packed() {
                Some(Packed::Int8(p)) => p.clone(),
                _ => panic!("{f:?} has an int8 kernel"),
            };
            assert!(ia.is_in_place() && int8(&ia).repacked_bytes().is_none(), "{f:?}: read in place, nothing repacked");
            assert!(!a.is_in_place() && int8(&a).repacked_bytes().is_some_and(|b| !b.is_empty()), "{f:?}");
            let mut x: Vec<f32> = (0..cols * 70).map(|_| rng.gen_range(-3.0f32..3.0)).collect();
            for r in (2..70).step_by(3) {
                x[r * cols + 37] = 400.0;
            }
            let bits = |v: &[f32]| v.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            for n in [1, 2, 5, 8, 9, 16, 70] {
                for threads in [1, 2] {
                    let xs = &x[..n * cols];
                    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                    let (mut ya, mut yb, mut za, mut zb) = (vec![0f32; n * 100], vec![0f32; n * 36], vec![0f32; n * 100], vec![0f32; n * 36]);
                    pool.install(|| {
                        matmul_many(&MatmulInput::new(xs, cols, &[&a, &b]), &[&a, &b], &mut [&mut ya, &mut yb]);
                        matmul_many(&MatmulInput::new(xs, cols, &[&ia, &ib]), &[&ia, &ib], &mut [&mut za, &mut zb]);
                    });
                    assert_eq!(bits(&za), bits(&ya), "{f:?}: {n} rows, {threads} threads");
                    assert_eq!(bits(&zb), bits(&yb), "{f:?}: {n} rows, {threads} threads (second matrix)");
                }
            }
        }
    }
}
