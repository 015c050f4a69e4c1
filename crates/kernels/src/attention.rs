//! Causal attention of a flattened batch of queries over a paged KV cache stored in any
//! [`KvDtype`], read in place (eight values converted in registers at a time).
//!
//! The cache stores, per slot (block * block_size + offset), `n_kv_heads * head_dim` keys and as
//! many values. One (query row, head) is reduced by one fixed rule whatever shares its batch,
//! however its prompt was chunked and however many threads run:
//! - keys are visited in tiles of [`TILE`] positions at absolute boundaries (`p / TILE`), each
//!   tile an online-softmax step (running max, the running sum and output rescaled by
//!   `exp(old - new)`), a span of [`SPAN`] positions starting from an empty state;
//! - the spans' partial results (max, sum, output) are folded in position order, then divided.
//!
//! So a long prompt's rows share each key and value tile across [`Q_BLOCK`] rows and every head
//! of a KV head's group (flash attention's tiling: memory stays bounded by the tiles), and one
//! decoding sequence at depth splits its spans over the threads, their partials merged after in
//! the same fold: the bits are those of the unsplit reduction. Verifying 1 + k drafted rows reads
//! the cache once for all of them.
//!
//! Our own kernel, not a crate's: no Rust crate has paged CPU attention over quantized caches,
//! and the fixed reduction order (batch invariance) is ours to keep.

use crate::exp::{exp, exp_shifted_sum, lane_max};
pub use crate::kv::KvLayout;
use crate::kv::{KvDtype, KvOrder, KvView, Q8_BLOCK};
use crate::pool::DisjointOut;

/// One sequence's share of the flattened batch.
#[derive(Clone, Copy, Debug)]
pub struct SeqSpan<'a> {
    /// First query row of this sequence in the flattened batch.
    pub q_start: usize,
    /// Number of query rows (tokens) this step.
    pub q_len: usize,
    /// Tokens in context after this step (the last query is at position context_len - 1).
    pub context_len: usize,
    pub block_table: &'a [u32],
}

/// Keys per online-softmax step. 128, not 64: a tile's fixed costs (the rescale, the passes'
/// loads and stores of the outputs, the bookkeeping) over twice the keys made a decode layer at
/// 16k 5% faster in L3 on one thread and 6% (q8_0) or 5% (q4_0) faster from memory on two; f16
/// from memory on two threads moved 0-5%, within the host's noise (Zen 3); a 512-row prompt
/// chunk did not change.
pub const TILE: usize = 128;
/// Keys per partial result; the fold unit that a decode step at depth splits over the threads.
pub const SPAN: usize = 16 * TILE;
/// Query rows per task: with a KV head's whole group of query heads, the vectors that share one
/// read of each key and value tile.
pub const Q_BLOCK: usize = 16;

/// `q`: [tokens, n_heads * head_dim]; `out`: same shape. Keys and values in plain f32 slices,
/// slot-major (the draft heads' own small caches); the model's cache goes through
/// [`paged_attention_windowed`].
pub fn paged_attention(q: &[f32], out: &mut [f32], k_cache: &[f32], v_cache: &[f32], layout: &KvLayout, seqs: &[SeqSpan], scale: f32) {
    paged_attention_windowed(q, out, KvView::f32(k_cache), KvView::f32(v_cache), layout, seqs, scale, None, None)
}

/// Attention over keys and values of any stored type, restricted to a sliding window: with
/// `window = Some(w)` the query at position `p` sees keys at positions `(p - w, p]` only, the `w`
/// most recent including itself (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`: key `p0` is masked when
/// `p - p0 >= w`). `None`: the whole causal context. `sinks` (gpt-oss's attention sinks): one
/// logit per query head that joins each softmax's denominator and gets no value.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_windowed(
    q: &[f32],
    out: &mut [f32],
    k: KvView,
    v: KvView,
    layout: &KvLayout,
    seqs: &[SeqSpan],
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) {
    assert!(window != Some(0), "a sliding window must hold at least the query's own position");
    assert!(sinks.is_none_or(|s| s.len() == layout.n_heads), "one attention sink per query head");
    assert!(layout.n_kv_heads > 0 && layout.n_heads.is_multiple_of(layout.n_kv_heads), "query heads in whole groups");
    assert!(k.dtype == v.dtype, "keys and values of one type");
    assert!(k.order == v.order || (k.order == KvOrder::DimMajor && v.order == KvOrder::HeadMajor), "keys and values in one order, or the model cache's pair");
    assert!(k.dtype.supports_head_dim(layout.head_dim), "quantized heads are whole blocks");
    let qw = layout.n_heads * layout.head_dim;
    assert!(out.len() >= q.len());
    let slots_needed = seqs
        .iter()
        .filter(|s| s.q_len > 0)
        .flat_map(|s| s.block_table[..s.context_len.div_ceil(layout.block_size)].iter())
        .map(|&b| (b as usize + 1) * layout.block_size)
        .max()
        .unwrap_or(0);
    assert!(slots_needed * layout.kv_width() <= k.len().min(v.len()), "a block table points past the cache");
    for s in seqs {
        assert!(s.q_len <= s.context_len && (s.q_start + s.q_len) * qw <= q.len(), "a sequence's rows lie outside the batch");
    }
    let a = Attn { q, k, v, layout: *layout, scale, window, sinks, group: layout.n_heads / layout.n_kv_heads, simd: Simd::for_head(layout.head_dim) };
    a.run(seqs, out)
}

/// Calls the SIMD kernel `$f` monomorphised for the view's type (`D`: 0 f32, 1 f16, 2 bf16, 3 q8_0,
/// 4 q4_0).
#[cfg(target_arch = "x86_64")]
macro_rules! by_dtype {
    ($dtype:expr, $($f:ident)::+ ($($arg:expr),* $(,)?)) => {
        match $dtype {
            KvDtype::F32 => $($f)::+::<0>($($arg),*),
            KvDtype::F16 => $($f)::+::<1>($($arg),*),
            KvDtype::Bf16 => $($f)::+::<2>($($arg),*),
            KvDtype::Q8_0 => $($f)::+::<3>($($arg),*),
            KvDtype::Q4_0 => $($f)::+::<4>($($arg),*),
        }
    };
}

/// Calls `$m::score_groups` (one pass of the dimension-major scores) monomorphised for a plain
/// type and `$nb` vectors (at most [`SCORE_VECTORS`]).
#[cfg(target_arch = "x86_64")]
macro_rules! dim_major_pass {
    ($m:ident, $dtype:expr, $nb:expr, $args:tt) => {
        match $dtype {
            KvDtype::F32 => dim_major_pass!(@nb $m, 0, $nb, $args),
            KvDtype::F16 => dim_major_pass!(@nb $m, 1, $nb, $args),
            KvDtype::Bf16 => dim_major_pass!(@nb $m, 2, $nb, $args),
            _ => unreachable!("quantized keys are stored head-major"),
        }
    };
    (@nb $m:ident, $d:literal, $nb:expr, ($($arg:expr),*)) => {
        match $nb {
            1 => $m::score_groups::<$d, 1>($($arg),*),
            2 => $m::score_groups::<$d, 2>($($arg),*),
            3 => $m::score_groups::<$d, 3>($($arg),*),
            4 => $m::score_groups::<$d, 4>($($arg),*),
            5 => $m::score_groups::<$d, 5>($($arg),*),
            _ => $m::score_groups::<$d, 6>($($arg),*),
        }
    };
}

/// The kernels one call runs, picked from the CPU's features and the head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Simd {
    /// The portable reference (`dot_ref`'s order): the bits of the other two.
    Scalar,
    /// Eight f32 lanes (AVX2, FMA, F16C); heads of a multiple of 8.
    Avx2,
    /// The same lanes two vectors or sixteen dimensions at a time (AVX-512 F/BW/VL, detected with
    /// VNNI as the int8 kernels' path); heads of a multiple of 16. The AVX2 path's bits.
    Avx512,
}

impl Simd {
    fn for_head(head_dim: usize) -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let f = crate::cpu::features();
            if f.avx2_fma && f16c() && head_dim.is_multiple_of(8) {
                return if f.avx512_vnni && head_dim.is_multiple_of(16) { Simd::Avx512 } else { Simd::Avx2 };
            }
        }
        let _ = head_dim;
        Simd::Scalar
    }

    /// Whether the AVX2 helpers (prefetch, the softmax's lanes) may run: both SIMD paths.
    fn avx2(self) -> bool {
        self != Simd::Scalar
    }

    /// Vectors whose weighted values one pass accumulates, for values of `dtype` and a unit of
    /// `rows` query rows.
    fn value_vectors(self, dtype: KvDtype, rows: usize) -> usize {
        match self {
            Simd::Avx512 => VALUE_VECTORS_512,
            Simd::Avx2 if rows == 1 && !dtype.has_scales() => VALUE_VECTORS_ROW,
            _ => VALUE_VECTORS,
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn f16c() -> bool {
    static F: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *F.get_or_init(|| std::arch::is_x86_feature_detected!("f16c"))
}

/// Query rows `t0..t1` of sequence `si` against KV head `kvh`: `(t1 - t0) * group` query vectors,
/// vector `v` the row `t0 + v / group` and the head `kvh * group + v % group`.
struct Unit {
    si: usize,
    kvh: usize,
    t0: usize,
    t1: usize,
}

/// A softmax reduction's running state for `nv` vectors: max, sum and the unnormalised output.
#[derive(Clone)]
struct State {
    m: Vec<f32>,
    l: Vec<f32>,
    acc: Vec<f32>,
    hd: usize,
}

impl State {
    fn new(nv: usize, hd: usize) -> Self {
        Self { m: vec![f32::NEG_INFINITY; nv], l: vec![0.0; nv], acc: vec![0.0; nv * hd], hd }
    }

    fn reset(&mut self) {
        self.m.fill(f32::NEG_INFINITY);
        self.l.fill(0.0);
        self.acc.fill(0.0);
    }

    /// Folds a later span's state in (vectors that saw no key there are skipped).
    fn fold(&mut self, part: &State) {
        let hd = self.hd;
        for i in 0..self.m.len() {
            let pm = part.m[i];
            if pm == f32::NEG_INFINITY {
                continue;
            }
            let m = self.m[i].max(pm);
            let (alpha, beta) = (exp(self.m[i] - m), exp(pm - m));
            self.l[i] = self.l[i] * alpha + part.l[i] * beta;
            for (a, &b) in self.acc[i * hd..(i + 1) * hd].iter_mut().zip(&part.acc[i * hd..(i + 1) * hd]) {
                *a = (*a * alpha) + b * beta;
            }
            self.m[i] = m;
        }
    }

    /// Folds one more logit with no value (an attention sink) into vector `i`.
    fn fold_sink(&mut self, i: usize, sink: f32) {
        let m = self.m[i].max(sink);
        let alpha = exp(self.m[i] - m);
        self.l[i] = self.l[i] * alpha + exp(sink - m);
        self.acc[self.hd * i..self.hd * (i + 1)].iter_mut().for_each(|a| *a *= alpha);
        self.m[i] = m;
    }
}

thread_local! {
    /// A thread's scratch for the split decode's tasks, kept from one task to the next.
    static SCRATCH: std::cell::RefCell<Option<Scratch>> = const { std::cell::RefCell::new(None) };
}

/// One task's working memory.
struct Scratch {
    nv: usize,
    /// Where key `a0 + j` of the current tile starts for this KV head (element index; in the
    /// values' order: dimension-major keys are found a group at a time).
    offs: Vec<usize>,
    /// Scores, then weights, of the current tile: `nv` rows of `TILE`.
    s: Vec<f32>,
    /// Per vector: the tile's rescale of its running state.
    alpha: Vec<f32>,
    /// Per vector: its keys in the current tile, `lo..hi` (empty: `lo == hi`).
    range: Vec<(usize, usize)>,
    /// The current span's state.
    span: State,
    /// The unit's queries in pairs for the AVX-512 scores (`avx512::pack_queries`), or by
    /// dimension for the dimension-major keys' (`pack_queries_dim`).
    qpack: Vec<f32>,
    /// Where the next tile's keys (and values) start, `next_len` of them: the SIMD kernels
    /// prefetch them while they read this tile, and they are the next tile's `offs`.
    next: Vec<usize>,
    next_len: usize,
}

impl Scratch {
    fn new(a: &Attn, u: &Unit) -> Self {
        let nv = (u.t1 - u.t0) * a.group;
        Self {
            nv,
            offs: vec![0; TILE],
            s: vec![0.0; nv * TILE],
            alpha: vec![1.0; nv],
            range: vec![(0, 0); nv],
            span: State::new(nv, a.layout.head_dim),
            qpack: Vec::new(),
            next: vec![0; TILE],
            next_len: 0,
        }
    }
}

#[derive(Clone, Copy)]
struct Attn<'a> {
    q: &'a [f32],
    k: KvView<'a>,
    v: KvView<'a>,
    layout: KvLayout,
    scale: f32,
    window: Option<usize>,
    sinks: Option<&'a [f32]>,
    group: usize,
    simd: Simd,
}

impl Attn<'_> {
    fn run(&self, seqs: &[SeqSpan], out: &mut [f32]) {
        if self.k.rot > 0 {
            // the cache holds rotated keys: so do the queries (the dots are the same); `finish`
            // turns the outputs back from the values' rotation
            let mut q = self.q.to_vec();
            let hd = self.layout.head_dim;
            let qw = self.layout.n_heads * hd;
            for s in seqs {
                q[s.q_start * qw..(s.q_start + s.q_len) * qw].chunks_exact_mut(hd).for_each(|h| crate::kv::rotate(h, self.k.rot));
            }
            return Attn { q: &q, ..*self }.run_rotated(seqs, out);
        }
        self.run_rotated(seqs, out)
    }

    /// [`Self::run`] with the queries in the cache's space.
    fn run_rotated(&self, seqs: &[SeqSpan], out: &mut [f32]) {
        let layout = &self.layout;
        let mut units = Vec::new();
        for (si, s) in seqs.iter().enumerate() {
            for kvh in 0..layout.n_kv_heads {
                let mut t0 = 0;
                while t0 < s.q_len {
                    let t1 = (t0 + Q_BLOCK).min(s.q_len);
                    units.push(Unit { si, kvh, t0, t1 });
                    t0 = t1;
                }
            }
        }
        let optr = DisjointOut::new(out);
        // Waking the pool costs more than a small attention (a decode step at short context):
        // only go parallel when there are enough query-key products to share.
        let work: usize = seqs.iter().map(|s| s.q_len * self.window.map_or(s.context_len, |w| w.min(s.context_len))).sum::<usize>() * layout.n_heads;
        let threads = rayon::current_num_threads().max(1);
        let split = units.len() < 4 * threads && units.iter().any(|u| self.spans(seqs, u).len() > 1);
        if !split {
            let run = |u: &Unit| {
                let mut sc = Scratch::new(self, u);
                let mut total = State::new(sc.nv, layout.head_dim);
                let spans = self.spans(seqs, u);
                for span in spans.clone() {
                    // the next span's first tile is prefetched while this span's last is read
                    self.span_state(seqs, u, span, Some(span + 1).filter(|n| spans.contains(n)), &mut sc);
                    total.fold(&sc.span);
                }
                self.finish(seqs, u, &mut total, &optr);
            };
            if units.len() < 2 || work < 2 * 1024 {
                units.iter().for_each(run);
            } else {
                crate::pool::parallel_for(units.len(), &|i| run(&units[i]));
            }
            return;
        }
        // a few units over many spans (decode at depth): one task per (unit, span), partials
        // kept, then each unit folds its spans in order
        let mut firsts = vec![0];
        let mut tasks = Vec::new();
        for (ui, u) in units.iter().enumerate() {
            tasks.extend(self.spans(seqs, u).map(|span| (ui, span)));
            firsts.push(tasks.len());
        }
        let partials: Vec<std::sync::Mutex<Option<State>>> = (0..tasks.len()).map(|_| std::sync::Mutex::new(None)).collect();
        // the pool hands tasks out in order, so a thread most likely runs task i + threads after
        // task i (i + 1 when they run here in turn): it prefetches that span's first tile as it
        // reads its own last one, and keeps its scratch from one task to the next (a layer at
        // 16k from memory, f16, Zen 5, two threads: 0.49-0.52 -> 0.476-0.488 ms)
        let sequential = work < 2 * 1024;
        let stride = if sequential { 1 } else { threads };
        let run = |i: usize| {
            let (ui, span) = tasks[i];
            let u = &units[ui];
            let then = tasks.get(i + stride).filter(|&&(uj, _)| uj == ui).map(|&(_, sj)| sj);
            let part = SCRATCH.with(|cell| {
                let nv = (u.t1 - u.t0) * self.group;
                let mut fresh = None;
                let mut kept = cell.try_borrow_mut().ok();
                let sc = match kept.as_deref_mut() {
                    Some(Some(sc)) if sc.nv == nv && sc.span.hd == layout.head_dim => sc,
                    Some(slot) => slot.insert(Scratch::new(self, u)),
                    None => fresh.insert(Scratch::new(self, u)),
                };
                self.span_state(seqs, u, span, then, sc);
                sc.span.clone()
            });
            *partials[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(part);
        };
        if sequential {
            (0..tasks.len()).for_each(run);
        } else {
            crate::pool::parallel_for(tasks.len(), &run);
        }
        for (ui, u) in units.iter().enumerate() {
            let mut total = State::new((u.t1 - u.t0) * self.group, layout.head_dim);
            for p in &partials[firsts[ui]..firsts[ui + 1]] {
                let part = p.lock().unwrap_or_else(|e| e.into_inner()).take();
                // every task ran: parallel_for returns after all of them (or resumes their panic)
                total.fold(part.as_ref().expect("every span's partial was computed"));
            }
            self.finish(seqs, u, &mut total, &optr);
        }
    }

    /// Row `t`'s keys: positions `lo..end`.
    fn row_keys(&self, s: &SeqSpan, t: usize) -> (usize, usize) {
        let end = s.context_len - s.q_len + t + 1;
        (self.window.map_or(0, |w| end.saturating_sub(w)), end)
    }

    /// The keys `lo..end` that some row of the unit sees: its first row's first to its last
    /// row's last.
    fn unit_keys(&self, s: &SeqSpan, u: &Unit) -> (usize, usize) {
        (self.row_keys(s, u.t0).0, self.row_keys(s, u.t1 - 1).1)
    }

    /// The spans (by index) that any row of the unit sees.
    fn spans(&self, seqs: &[SeqSpan], u: &Unit) -> std::ops::Range<usize> {
        let (lo, end) = self.unit_keys(&seqs[u.si], u);
        lo / SPAN..end.div_ceil(SPAN)
    }

    /// Element index of position `p`'s first value of the unit's KV head in a plane of `order`.
    fn offset(&self, order: KvOrder, s: &SeqSpan, u: &Unit, p: usize) -> usize {
        let bs = self.layout.block_size;
        order.offset(&self.layout, s.block_table[p / bs] as usize * bs + p % bs, u.kvh)
    }

    /// [`Self::offset`] of positions `a0..a0 + out.len()`, one block's run at a time: the
    /// divisions by the block size, once per key, cost a decode step at depth more than its
    /// softmax.
    fn offsets(&self, order: KvOrder, s: &SeqSpan, u: &Unit, a0: usize, out: &mut [usize]) {
        let bs = self.layout.block_size;
        let step = match order {
            KvOrder::HeadMajor => self.layout.head_dim,
            KvOrder::SlotMajor => self.layout.kv_width(),
            KvOrder::DimMajor => 1,
        };
        let mut j = 0;
        while j < out.len() {
            let p = a0 + j;
            let run = (bs - p % bs).min(out.len() - j);
            let first = self.offset(order, s, u, p);
            for (i, o) in out[j..j + run].iter_mut().enumerate() {
                *o = first + i * step;
            }
            j += run;
        }
    }

    /// The unit's state over span `span`, from empty, into `sc.span`: its tiles in order.
    fn span_state(&self, seqs: &[SeqSpan], u: &Unit, span: usize, then: Option<usize>, sc: &mut Scratch) {
        let s = &seqs[u.si];
        let (p0, p1) = self.span_keys(s, u, span);
        sc.span.reset();
        let (g, hd) = (self.group, self.layout.head_dim);
        let qw = self.layout.n_heads * hd;
        let at = |i: usize| (s.q_start + u.t0 + i / g) * qw + (u.kvh * g + i % g) * hd;
        if self.k.order == KvOrder::DimMajor && self.simd.avx2() {
            pack_queries_dim(&mut sc.qpack, self.q, sc.nv, hd, at);
        } else {
            #[cfg(target_arch = "x86_64")]
            if self.simd == Simd::Avx512 {
                avx512::pack_queries(&mut sc.qpack, self.q, sc.nv, hd, at);
            }
        }
        // the end of the tile starting at `a`
        let tile_end = |a: usize| ((a / TILE + 1) * TILE).min(p1);
        let mut a0 = p0;
        self.offsets(self.v.order, s, u, a0, &mut sc.offs[..tile_end(a0).saturating_sub(a0)]);
        while a0 < p1 {
            let a1 = tile_end(a0);
            // the next tile's rows, which this tile's kernels prefetch as they go (in the values'
            // order: a dimension-major block's keys are the same run as its values' rows), then
            // are that tile's offsets: each tile's computed once
            let (n0, n1) = match then {
                Some(t) if a1 == p1 => {
                    let (t0, t1) = self.span_keys(s, u, t);
                    (t0, ((t0 / TILE + 1) * TILE).min(t1))
                }
                _ => (a1, (a1 + TILE).min(p1)),
            };
            sc.next_len = n1 - n0;
            self.offsets(self.v.order, s, u, n0, &mut sc.next[..sc.next_len]);
            self.tile(s, u, a0, a1, sc);
            std::mem::swap(&mut sc.offs, &mut sc.next);
            a0 = a1;
        }
    }

    /// The keys `p0..p1` of span `span` that some row of the unit sees.
    fn span_keys(&self, s: &SeqSpan, u: &Unit, span: usize) -> (usize, usize) {
        let (lo, end) = self.unit_keys(s, u);
        ((span * SPAN).max(lo), ((span + 1) * SPAN).min(end))
    }

    /// One online-softmax step over keys `a0..a1` (inside one tile) for every vector of the unit.
    fn tile(&self, s: &SeqSpan, u: &Unit, a0: usize, a1: usize, sc: &mut Scratch) {
        let hd = self.layout.head_dim;
        let n = a1 - a0;
        // the rows the kernels prefetch: the next tile's (none on the scalar path)
        let next: &[usize] = if self.simd.avx2() { &sc.next[..sc.next_len] } else { &[] };
        let g = self.group;
        for (i, r) in sc.range.iter_mut().enumerate() {
            let (lo, end) = self.row_keys(s, u.t0 + i / g);
            let (x, y) = (lo.max(a0), end.min(a1));
            *r = if x < y { (x - a0, y - a0) } else { (0, 0) };
        }
        // scores, up to six vectors at a time over the union of their keys
        let qw = self.layout.n_heads * hd;
        let qptr = |i: usize| -> usize { (s.q_start + u.t0 + i / g) * qw + (u.kvh * g + i % g) * hd };
        let mut i = 0;
        while i < sc.nv {
            let nb = (sc.nv - i).min(SCORE_VECTORS);
            let (x, y) = union(&sc.range[i..i + nb]);
            if x < y {
                let qs: [usize; SCORE_VECTORS] = std::array::from_fn(|j| qptr(i + j.min(nb - 1)));
                // the first vectors' pass over the keys prefetches the next tile's
                let pf = if i == 0 { next } else { &[] };
                let scores = &mut sc.s[i * TILE..(i + nb) * TILE];
                if self.k.order == KvOrder::DimMajor {
                    // a group's keys are one block's consecutive slots: one offset a group
                    let key_at = |j: usize| self.offset(KvOrder::DimMajor, s, u, a0 + j);
                    self.scores_dim_major(scores, nb, qs, &sc.qpack, i, &key_at, a0, x, y, pf);
                } else {
                    self.scores(scores, nb, qs, &sc.qpack, i, &sc.offs[..n], x, y, pf);
                }
            }
            i += nb;
        }
        // the softmax step per vector: every vector's new maximum first (in `alpha` until its
        // rescale replaces it), so no vector's exponentials wait on its own reduction
        let st = &mut sc.span;
        for i in 0..sc.nv {
            let (x, y) = sc.range[i];
            if x < y {
                sc.alpha[i] = st.m[i].max(tile_max(&sc.s[i * TILE + x..i * TILE + y], self.simd.avx2()));
            }
        }
        for i in 0..sc.nv {
            let row = &mut sc.s[i * TILE..(i + 1) * TILE];
            let (x, y) = sc.range[i];
            if x == y {
                sc.alpha[i] = 1.0;
                row[..n].fill(0.0);
                continue;
            }
            let m = sc.alpha[i];
            let alpha = exp(st.m[i] - m);
            let sum = tile_exp_sum(&mut row[x..y], m, self.simd);
            row[..x].fill(0.0);
            row[y..n].fill(0.0);
            st.l[i] = st.l[i] * alpha + sum;
            st.m[i] = m;
            sc.alpha[i] = alpha;
        }
        // acc = acc * alpha + weights . values, a few vectors at a time
        let mut i = 0;
        while i < sc.nv {
            let nb = (sc.nv - i).min(self.simd.value_vectors(self.v.dtype, u.t1 - u.t0));
            let (x, y) = union(&sc.range[i..i + nb]);
            let acc = &mut st.acc[i * hd..(i + nb) * hd];
            let w = &sc.s[i * TILE..(i + nb) * TILE];
            let pf = if i == 0 { next } else { &[] };
            self.weighted_values(acc, nb, &sc.alpha[i..i + nb], w, &sc.offs[..n], x, y, pf);
            i += nb;
        }
    }

    /// Scores of `nb` vectors (queries at `q[qs[i]..]`, or pairs from `v0 / 2` on in `qpack` for
    /// the AVX-512 path) against keys `x..y` of the tile: `s[i * TILE + j] = dot(q_i, k_j) * scale`;
    /// rows `pf` (the next tile's keys) prefetched on the way.
    #[allow(clippy::too_many_arguments)]
    fn scores(&self, s: &mut [f32], nb: usize, qs: [usize; SCORE_VECTORS], qpack: &[f32], v0: usize, offs: &[usize], x: usize, y: usize, pf: &[usize]) {
        let hd = self.layout.head_dim;
        self.prefetch_outside(&self.k, pf, x, y);
        #[cfg(target_arch = "x86_64")]
        if self.simd == Simd::Avx512 {
            // SAFETY: AVX-512 F/BW, AVX2, FMA and F16C were detected (`Simd::for_head`); `qpack`
            // holds every pair of the unit's vectors (packed in `span_state`), `v0` is even (a
            // multiple of SCORE_VECTORS) and the keys are in bounds as below.
            unsafe {
                debug_assert!(v0.is_multiple_of(2) && (v0 / 2 + nb.div_ceil(2)) * 2 * hd <= qpack.len());
                let qp = qpack.as_ptr().add(v0 / 2 * 2 * hd);
                by_dtype!(self.k.dtype, avx512::scores(s, nb, qp, self.k, offs, x, y, hd, self.scale, pf))
            }
            return;
        }
        let _ = (qpack, v0);
        #[cfg(target_arch = "x86_64")]
        if self.simd == Simd::Avx2 {
            // SAFETY: AVX2, FMA and F16C were detected (`Simd::for_head`); every query and key row is in
            // bounds (the batch and block tables were checked on entry); unused query pointers
            // repeat the last used one.
            unsafe {
                let qp = qs.map(|o| self.q.as_ptr().add(o));
                by_dtype!(self.k.dtype, avx2::scores(s, nb, qp, self.k, offs, x, y, hd, self.scale, pf))
            }
            return;
        }
        for i in 0..nb {
            let q = &self.q[qs[i]..qs[i] + hd];
            for j in x..y {
                s[i * TILE + j] = dot_ref(q, &self.k, offs[j]) * self.scale;
            }
        }
    }

    /// [`Self::scores`] over dimension-major keys of the tile starting at position `a0` (key `j`'s
    /// first element at `key_at(j)`): each score one chain of fused multiply-adds over the head's
    /// dimensions in order ([`dot_dim_ref`]), on the SIMD paths eight or sixteen keys of a block a
    /// vector, so every path gives its bits.
    #[allow(clippy::too_many_arguments)]
    fn scores_dim_major(
        &self,
        s: &mut [f32],
        nb: usize,
        qs: [usize; SCORE_VECTORS],
        qpack: &[f32],
        v0: usize,
        key_at: &dyn Fn(usize) -> usize,
        a0: usize,
        x: usize,
        y: usize,
        pf: &[usize],
    ) {
        let (hd, stride) = (self.layout.head_dim, self.layout.block_size);
        self.prefetch_outside(&self.k, pf, x, y);
        #[cfg(target_arch = "x86_64")]
        if self.simd.avx2() {
            let lanes = if self.simd == Simd::Avx512 { 16 } else { 8 };
            let mut groups = [KeyGroup::default(); TILE / 8];
            let n = key_groups(lanes, a0, x, y, key_at, &mut groups);
            // SAFETY: the SIMD path's features were detected (`Simd::for_head`); every group's
            // lanes lie in one block of the plane (block sizes a multiple of 16,
            // `KvOrder::for_plane`), its stores masked to the tile's keys `x..y` of `s`'s rows;
            // `qpack` holds the unit's vectors in passes of SCORE_VECTORS (`pack_queries_dim`, in
            // `span_state`) and `v0` starts one.
            unsafe {
                debug_assert!(v0.is_multiple_of(SCORE_VECTORS) && (v0 / SCORE_VECTORS + 1) * SCORE_VECTORS * hd <= qpack.len());
                let (qt, sp, k, scale) = (qpack.as_ptr().add(v0 * hd), s.as_mut_ptr(), self.k, self.scale);
                // a pass's missing groups repeat its last one, masked off
                let pad = |pass: &[KeyGroup], g: usize| pass.get(g).copied().unwrap_or(KeyGroup { mask: 0, ..pass[pass.len() - 1] });
                if self.simd == Simd::Avx512 {
                    // passes of four groups of sixteen
                    let mut pf = avx2::Spread::new(pf, (x, y), n.div_ceil(4) * hd.div_ceil(DIMS_PER_PREFETCH));
                    for pass in groups[..n].chunks(4) {
                        let g: [KeyGroup; 4] = std::array::from_fn(|i| pad(pass, i));
                        dim_major_pass!(avx512, k.dtype, nb, (sp, qt, k, g, hd, stride, scale, &mut pf));
                    }
                } else {
                    let mut pf = avx2::Spread::new(pf, (x, y), n.div_ceil(2) * hd.div_ceil(DIMS_PER_PREFETCH));
                    for pass in groups[..n].chunks(2) {
                        let g: [KeyGroup; 2] = std::array::from_fn(|i| pad(pass, i));
                        dim_major_pass!(avx2, k.dtype, nb, (sp, qt, k, g, hd, stride, scale, &mut pf));
                    }
                }
            }
            return;
        }
        let _ = (a0, pf, qpack, v0);
        for i in 0..nb {
            let q = &self.q[qs[i]..qs[i] + hd];
            for j in x..y {
                s[i * TILE + j] = dot_dim_ref(q, &self.k, key_at(j), stride) * self.scale;
            }
        }
    }

    /// `acc_i = acc_i * alpha_i + sum_j w[i * TILE + j] v_j` over keys `x..y` in order; rows `pf`
    /// (the next tile's values) prefetched on the way.
    #[allow(clippy::too_many_arguments)]
    fn weighted_values(&self, acc: &mut [f32], nb: usize, alpha: &[f32], w: &[f32], offs: &[usize], x: usize, y: usize, pf: &[usize]) {
        let hd = self.layout.head_dim;
        self.prefetch_outside(&self.v, pf, x, y);
        #[cfg(target_arch = "x86_64")]
        if self.simd == Simd::Avx512 {
            // SAFETY: as in `scores`; `acc` holds `nb` (at most VALUE_VECTORS_512) rows of `hd`, a
            // multiple of 16, and `w` `nb` rows of TILE.
            unsafe { by_dtype!(self.v.dtype, avx512::weighted_values(acc, nb, alpha, w, self.v, offs, x, y, hd, pf)) }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.simd == Simd::Avx2 {
            // SAFETY: as in `scores`; `acc` holds `nb` rows of `hd` and `w` `nb` rows of TILE.
            unsafe { by_dtype!(self.v.dtype, avx2::weighted_values(acc, nb, alpha, w, self.v, offs, x, y, hd, pf)) }
            return;
        }
        for i in 0..nb {
            let a = &mut acc[i * hd..(i + 1) * hd];
            a.iter_mut().for_each(|v| *v *= alpha[i]);
            for j in x..y {
                let wj = w[i * TILE + j];
                for (d, av) in a.iter_mut().enumerate() {
                    *av = wj.mul_add(self.v.get(offs[j] + d), *av);
                }
            }
        }
    }

    /// Prefetches rows `pf[..x]` and `pf[y..]`, which the kernels' loop over keys `x..y` does not
    /// reach (a tile the first vectors see only part of).
    fn prefetch_outside(&self, view: &KvView, pf: &[usize], x: usize, y: usize) {
        #[cfg(target_arch = "x86_64")]
        if self.simd.avx2() && !pf.is_empty() {
            let hd = self.layout.head_dim;
            // SAFETY: prefetching is a hint and never faults; AVX2 was detected.
            unsafe {
                avx2::prefetch_rows(*view, pf, 0, x, hd);
                avx2::prefetch_rows(*view, pf, y, pf.len().saturating_sub(y), hd);
            }
        }
        let _ = (view, pf, x, y);
    }

    /// Divides the unit's folded state out into its rows of `out` (after the sinks' share).
    fn finish(&self, seqs: &[SeqSpan], u: &Unit, total: &mut State, out: &DisjointOut) {
        let s = &seqs[u.si];
        let (g, hd) = (self.group, self.layout.head_dim);
        let qw = self.layout.n_heads * hd;
        for i in 0..total.m.len() {
            let h = u.kvh * g + i % g;
            if let Some(sk) = self.sinks {
                total.fold_sink(i, sk[h]);
            }
            let row = s.q_start + u.t0 + i / g;
            // SAFETY: (row, head h) belongs to this unit only.
            let o = unsafe { out.slice(row * qw + h * hd, hd) };
            let l = total.l[i];
            for (o, &a) in o.iter_mut().zip(&total.acc[i * hd..(i + 1) * hd]) {
                *o = a / l;
            }
            if self.v.rot > 0 {
                crate::kv::unrotate(o, self.v.rot);
            }
        }
    }
}

/// Vectors whose scores one pass computes (each pass converts the tile's keys once): a GQA group
/// of six query heads (Qwen2.5-1.5B) in one.
const SCORE_VECTORS: usize = 6;
/// Vectors whose weighted values one pass accumulates (each pass converts the tile's values once):
/// two on the AVX2 path, whose passes take six chunks of eight dimensions (`avx2::values_nb`).
/// Three vectors by four chunks spilled an accumulator every key in the 16 registers; two by six
/// was 5% faster decoding at 16k and 18% faster on a 512-row prefill chunk there (Zen 3,
/// alternated in one process; three by three tied on the prefill).
const VALUE_VECTORS: usize = 2;
/// The same for one query row's group of plain values (a decode step), on the AVX2 path: up to
/// six vectors a pass by two chunks, each value converted once a tile (`avx2::row_values`). With the prefetches
/// spread over the passes, 6% faster than two by six decoding at 16k from memory, where the
/// values come in once and are used once; 3% slower on a 512-row prefill chunk, whose 96 vectors
/// read each tile from the L1 cache (Zen 3, 2 threads, alternated binaries).
const VALUE_VECTORS_ROW: usize = 6;
/// The same on the AVX-512 path (32 registers): a group of six query heads in one pass.
const VALUE_VECTORS_512: usize = 6;

/// The smallest range holding every non-empty one.
fn union(r: &[(usize, usize)]) -> (usize, usize) {
    r.iter().filter(|(x, y)| x < y).fold((usize::MAX, 0), |(a, b), &(x, y)| (a.min(x), b.max(y)))
}

fn tile_max(x: &[f32], simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: AVX2 was detected (`simd`); the lanes give the same value on every path.
        return unsafe { avx2::lane_max(x) };
    }
    let _ = simd;
    lane_max(x)
}

/// `x = exp(x - m)` and their sum in eight lanes (the same bits on every path: the one
/// function compiled for each instruction set, elementwise and in its written order).
fn tile_exp_sum(x: &mut [f32], m: f32, simd: Simd) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match simd {
        // SAFETY: AVX-512 F (with AVX2 and FMA) was detected (`Simd::for_head`).
        Simd::Avx512 => return unsafe { avx512::exp_shifted_sum(x, m) },
        // SAFETY: AVX2 and FMA were detected (`Simd::for_head`).
        Simd::Avx2 => return unsafe { avx2::exp_shifted_sum(x, m) },
        Simd::Scalar => {}
    }
    let _ = simd;
    exp_shifted_sum(x, m)
}

/// The reference dot of the scalar path, in the AVX2 path's order: eight lanes of fused
/// multiply-adds over the head, then the lanes summed as `hsum` does.
fn dot_ref(q: &[f32], k: &KvView, off: usize) -> f32 {
    let mut lanes = [0f32; 8];
    for (c, qc) in q.chunks(8).enumerate() {
        for (l, &qv) in qc.iter().enumerate() {
            lanes[l] = qv.mul_add(k.get(off + 8 * c + l), lanes[l]);
        }
    }
    let s: [f32; 4] = std::array::from_fn(|l| lanes[l] + lanes[l + 4]);
    (s[0] + s[2]) + (s[1] + s[3])
}

/// Dimensions the dimension-major scores read between two prefetches of the next tile's rows.
const DIMS_PER_PREFETCH: usize = 16;

/// Query vectors `0..n` (each `hd` floats at `q[offset(v)]`) laid out for the dimension-major
/// scores: passes of [`SCORE_VECTORS`] vectors, each pass `hd` rows of its vectors' values of one
/// dimension (the last vector repeated to fill a pass), so a kernel reads one pointer.
fn pack_queries_dim(packed: &mut Vec<f32>, q: &[f32], n: usize, hd: usize, offset: impl Fn(usize) -> usize) {
    packed.clear();
    for p in 0..n.div_ceil(SCORE_VECTORS) {
        let at: [usize; SCORE_VECTORS] = std::array::from_fn(|i| offset((p * SCORE_VECTORS + i).min(n - 1)));
        for d in 0..hd {
            packed.extend(at.iter().map(|&a| q[a + d]));
        }
    }
}

/// The reference score of dimension-major keys: one chain of fused multiply-adds over the
/// dimensions in order (`stride` elements apart), as each lane of the SIMD kernels computes it.
fn dot_dim_ref(q: &[f32], k: &KvView, off: usize, stride: usize) -> f32 {
    q.iter().enumerate().fold(0f32, |a, (d, &qv)| qv.mul_add(k.get(off + d * stride), a))
}

/// `lanes` consecutive slots of one dimension-major block: what one vector load of a dimension
/// holds, aligned to absolute positions (a multiple of `lanes`).
#[derive(Clone, Copy, Default)]
struct KeyGroup {
    /// Tile index of lane 0 (negative when the tile starts after it).
    at: isize,
    /// Element index of lane 0's first dimension.
    base: usize,
    /// The lanes that are keys `x..y` of the tile.
    mask: u32,
}

/// The groups covering keys `x..y` of the tile starting at position `a0` (key `j`'s first element
/// at `key_at(j)`), into `out`; how many. A tile lies in one aligned run of [`TILE`] positions,
/// so at most `TILE / lanes` groups.
fn key_groups(lanes: usize, a0: usize, x: usize, y: usize, key_at: &dyn Fn(usize) -> usize, out: &mut [KeyGroup]) -> usize {
    let (mut j, mut n) = (x, 0);
    while j < y {
        let lane = (a0 + j) % lanes;
        let end = (j + lanes - lane).min(y);
        out[n] = KeyGroup { at: j as isize - lane as isize, base: key_at(j) - lane, mask: ((1u32 << (end - j)) - 1) << lane };
        n += 1;
        j = end;
    }
    n
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(test)]
mod tests;
