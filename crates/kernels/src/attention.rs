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

/// Keys per online-softmax step.
pub const TILE: usize = 64;
/// Keys per partial result; the fold unit that a decode step at depth splits over the threads.
pub const SPAN: usize = 32 * TILE;
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
    assert!(k.dtype == v.dtype && k.order == v.order, "keys and values of one type and order");
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
    let a = Attn { q, k, v, layout: *layout, scale, window, sinks, group: layout.n_heads / layout.n_kv_heads, simd: simd_ok(layout.head_dim) };
    a.run(seqs, out)
}

/// Calls the AVX2 kernel `$f` monomorphised for the view's type (`D`: 0 f32, 1 f16, 2 bf16, 3 q8_0,
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

/// Whether the AVX2 path serves heads of this size.
fn simd_ok(head_dim: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        f.avx2_fma && f16c() && head_dim.is_multiple_of(8)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = head_dim;
        false
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

/// One task's working memory.
struct Scratch {
    nv: usize,
    /// Where key `a0 + j` of the current tile starts for this KV head (element index).
    offs: Vec<usize>,
    /// Scores, then weights, of the current tile: `nv` rows of `TILE`.
    s: Vec<f32>,
    /// Per vector: the tile's rescale of its running state.
    alpha: Vec<f32>,
    /// Per vector: its keys in the current tile, `lo..hi` (empty: `lo == hi`).
    range: Vec<(usize, usize)>,
    /// The current span's state.
    span: State,
}

impl Scratch {
    fn new(a: &Attn, u: &Unit) -> Self {
        let nv = (u.t1 - u.t0) * a.group;
        Self { nv, offs: vec![0; TILE], s: vec![0.0; nv * TILE], alpha: vec![1.0; nv], range: vec![(0, 0); nv], span: State::new(nv, a.layout.head_dim) }
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
    simd: bool,
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
                for span in self.spans(seqs, u) {
                    self.span_state(seqs, u, span, &mut sc);
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
        let run = |i: usize| {
            let (ui, span) = tasks[i];
            let mut sc = Scratch::new(self, &units[ui]);
            self.span_state(seqs, &units[ui], span, &mut sc);
            *partials[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(sc.span);
        };
        if work < 2 * 1024 {
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

    /// The spans (by index) that any row of the unit sees.
    fn spans(&self, seqs: &[SeqSpan], u: &Unit) -> std::ops::Range<usize> {
        let s = &seqs[u.si];
        let (lo, _) = self.row_keys(s, u.t0);
        let (_, end) = self.row_keys(s, u.t1 - 1);
        lo / SPAN..end.div_ceil(SPAN)
    }

    /// Element index of position `p`'s keys (and values) of the unit's KV head.
    fn offset(&self, s: &SeqSpan, u: &Unit, p: usize) -> usize {
        let bs = self.layout.block_size;
        self.k.order.offset(&self.layout, s.block_table[p / bs] as usize * bs + p % bs, u.kvh)
    }

    /// The unit's state over span `span`, from empty, into `sc.span`: its tiles in order.
    fn span_state(&self, seqs: &[SeqSpan], u: &Unit, span: usize, sc: &mut Scratch) {
        let s = &seqs[u.si];
        let (lo, _) = self.row_keys(s, u.t0);
        let (_, end) = self.row_keys(s, u.t1 - 1);
        let (p0, p1) = ((span * SPAN).max(lo), ((span + 1) * SPAN).min(end));
        sc.span.reset();
        let mut a0 = p0;
        while a0 < p1 {
            let a1 = ((a0 / TILE + 1) * TILE).min(p1);
            self.prefetch(s, u, a1, (a1 + TILE).min(p1));
            self.tile(s, u, a0, a1, sc);
            a0 = a1;
        }
    }

    /// Asks for the keys and values of positions `a0..a1` (the next tile) to be brought into L2
    /// while this tile computes: a tile's rows are runs of at most a block, which the hardware
    /// prefetcher does not follow from one block to the next.
    fn prefetch(&self, s: &SeqSpan, u: &Unit, a0: usize, a1: usize) {
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            let bs = self.layout.block_size;
            let mut p = a0;
            while p < a1 {
                // one contiguous run: the rest of p's block (head-major), or one row
                let end = if self.k.order == KvOrder::HeadMajor { ((p / bs + 1) * bs).min(a1) } else { p + 1 };
                let e = self.offset(s, u, p);
                for view in [&self.k, &self.v] {
                    // SAFETY: prefetching is a hint and never faults.
                    unsafe { avx2::prefetch(view, e, (end - p) * self.layout.head_dim) };
                }
                p = end;
            }
        }
        let _ = (s, u, a0, a1);
    }

    /// One online-softmax step over keys `a0..a1` (inside one tile) for every vector of the unit.
    fn tile(&self, s: &SeqSpan, u: &Unit, a0: usize, a1: usize, sc: &mut Scratch) {
        let hd = self.layout.head_dim;
        let n = a1 - a0;
        for (j, o) in sc.offs[..n].iter_mut().enumerate() {
            *o = self.offset(s, u, a0 + j);
        }
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
                self.scores(&mut sc.s[i * TILE..(i + nb) * TILE], nb, qs, &sc.offs[..n], x, y);
            }
            i += nb;
        }
        // the softmax step per vector
        let st = &mut sc.span;
        for i in 0..sc.nv {
            let row = &mut sc.s[i * TILE..(i + 1) * TILE];
            let (x, y) = sc.range[i];
            if x == y {
                sc.alpha[i] = 1.0;
                row[..n].fill(0.0);
                continue;
            }
            let m = st.m[i].max(tile_max(&row[x..y], self.simd));
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
            let nb = (sc.nv - i).min(VALUE_VECTORS);
            let (x, y) = union(&sc.range[i..i + nb]);
            let acc = &mut st.acc[i * hd..(i + nb) * hd];
            let w = &sc.s[i * TILE..(i + nb) * TILE];
            self.weighted_values(acc, nb, &sc.alpha[i..i + nb], w, &sc.offs[..n], x, y);
            i += nb;
        }
    }

    /// Scores of `nb` vectors (queries at `q[qs[i]..]`) against keys `x..y` of the tile:
    /// `s[i * TILE + j] = dot(q_i, k_j) * scale`.
    fn scores(&self, s: &mut [f32], nb: usize, qs: [usize; SCORE_VECTORS], offs: &[usize], x: usize, y: usize) {
        let hd = self.layout.head_dim;
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            // SAFETY: AVX2, FMA and F16C were detected (`simd_ok`); every query and key row is in
            // bounds (the batch and block tables were checked on entry); unused query pointers
            // repeat the last used one.
            unsafe {
                let qp = qs.map(|o| self.q.as_ptr().add(o));
                by_dtype!(self.k.dtype, avx2::scores(s, nb, qp, self.k, offs, x, y, hd, self.scale))
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

    /// `acc_i = acc_i * alpha_i + sum_j w[i * TILE + j] v_j` over keys `x..y` in order.
    #[allow(clippy::too_many_arguments)]
    fn weighted_values(&self, acc: &mut [f32], nb: usize, alpha: &[f32], w: &[f32], offs: &[usize], x: usize, y: usize) {
        let hd = self.layout.head_dim;
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            // SAFETY: as in `scores`; `acc` holds `nb` rows of `hd` and `w` `nb` rows of TILE.
            unsafe { by_dtype!(self.v.dtype, avx2::weighted_values(acc, nb, alpha, w, self.v, offs, x, y, hd)) }
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
/// Vectors whose weighted values one pass accumulates (each pass converts the tile's values once).
const VALUE_VECTORS: usize = 3;

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

/// `x = exp(x - m)` and their sum in eight lanes (the same bits on every path).
fn tile_exp_sum(x: &mut [f32], m: f32, simd: bool) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: AVX2 was detected (`simd`).
        return unsafe { avx2::exp_shifted_sum(x, m) };
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{KvView, Q8_BLOCK, SCORE_VECTORS, TILE};
    use std::arch::x86_64::*;

    /// Prefetches (into L2) the view's `n` values from element `e` on, in the bytes their type
    /// takes (the quantized types: their bytes and their first scale).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn prefetch(v: &KvView, e: usize, n: usize) {
        if v.dtype.has_scales() {
            _mm_prefetch::<_MM_HINT_T1>(v.scales.as_ptr().wrapping_add(e / Q8_BLOCK) as *const i8);
        }
        let (base, bytes) = (v.data.as_ptr().wrapping_add(v.dtype.data_bytes(e)), v.dtype.data_bytes(n));
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T1>(base.wrapping_add(o) as *const i8);
            o += 64;
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn lane_max(x: &[f32]) -> f32 {
        crate::exp::lane_max(x)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn exp_shifted_sum(x: &mut [f32], m: f32) -> f32 {
        crate::exp::exp_shifted_sum(x, m)
    }

    /// Eight values from element `e` (a multiple of 8) of a view of type `D` (0 f32, 1 f16,
    /// 2 bf16, 3 q8_0, 4 q4_0) as f32: the exact conversion `KvView::get` makes.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load8<const D: u8>(v: KvView, e: usize) -> __m256 {
        let p = v.data.as_ptr();
        match D {
            0 => _mm256_loadu_ps(p.add(4 * e) as *const f32),
            1 => _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * e) as *const __m128i)),
            2 => _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.add(2 * e) as *const __m128i)), 16)),
            3 => {
                let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(e) as *const __m128i)));
                let d = _mm_cvtph_ps(_mm_cvtsi32_si128(*v.scales.get_unchecked(e / Q8_BLOCK) as i32));
                _mm256_mul_ps(q, _mm256_broadcastss_ps(d))
            }
            _ => {
                // values j and j + 16 of a block share byte j (low and high nibble)
                let (blk, r) = (e / Q8_BLOCK, e % Q8_BLOCK);
                let b = _mm_loadl_epi64(p.add(blk * (Q8_BLOCK / 2) + r % (Q8_BLOCK / 2)) as *const __m128i);
                let b = if r >= Q8_BLOCK / 2 { _mm_srli_epi16(b, 4) } else { b };
                let levels = _mm256_cvtepu8_epi32(_mm_and_si128(b, _mm_set1_epi8(0x0F)));
                let q = _mm256_cvtepi32_ps(_mm256_sub_epi32(levels, _mm256_set1_epi32(8)));
                let d = _mm_cvtph_ps(_mm_cvtsi32_si128(*v.scales.get_unchecked(e / Q8_BLOCK) as i32));
                _mm256_mul_ps(q, _mm256_broadcastss_ps(d))
            }
        }
    }

    /// The lanes summed: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), `dot_ref`'s order.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// An accumulator's two halves added (`hsum`'s first step).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn fold(v: __m256) -> __m128 {
        _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1))
    }

    /// Four accumulators' horizontal sums, each in `hsum`'s order: (l0 + l4) + (l2 + l6) and
    /// (l1 + l5) + (l3 + l7), then their sum.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum4(v: [__m256; 4]) -> __m128 {
        let (x0, x1, x2, x3) = (fold(v[0]), fold(v[1]), fold(v[2]), fold(v[3]));
        let (t0, t1) = (_mm_unpacklo_ps(x0, x1), _mm_unpacklo_ps(x2, x3));
        let (t2, t3) = (_mm_unpackhi_ps(x0, x1), _mm_unpackhi_ps(x2, x3));
        // r_l: lane l of each of the four
        let (r0, r1) = (_mm_movelh_ps(t0, t1), _mm_movehl_ps(t1, t0));
        let (r2, r3) = (_mm_movelh_ps(t2, t3), _mm_movehl_ps(t3, t2));
        _mm_add_ps(_mm_add_ps(r0, r2), _mm_add_ps(r1, r3))
    }

    /// `NB` queries against `NK` keys: one accumulator per (query, key) over the head, so each
    /// score has the same bits whatever the blocking.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn score_block<const D: u8, const NB: usize, const NK: usize>(
        s: *mut f32,
        q: [*const f32; SCORE_VECTORS],
        k: KvView,
        offs: &[usize],
        j: usize,
        hd: usize,
        scale: f32,
    ) {
        let mut acc = [[_mm256_setzero_ps(); NK]; NB];
        let ko: [usize; NK] = std::array::from_fn(|n| *offs.get_unchecked(j + n));
        for c in (0..hd).step_by(8) {
            let mut kv = [_mm256_setzero_ps(); NK];
            for n in 0..NK {
                kv[n] = load8::<D>(k, ko[n] + c);
            }
            for i in 0..NB {
                let qv = _mm256_loadu_ps(q[i].add(c));
                for n in 0..NK {
                    acc[i][n] = _mm256_fmadd_ps(qv, kv[n], acc[i][n]);
                }
            }
        }
        // four horizontal sums at a time share one transpose (hsum4: the same bits as hsum)
        let mut k = 0;
        while k + 4 <= NB * NK {
            let a: [__m256; 4] = std::array::from_fn(|x| acc[(k + x) / NK][(k + x) % NK]);
            let mut sums = [0f32; 4];
            _mm_storeu_ps(sums.as_mut_ptr(), _mm_mul_ps(hsum4(a), _mm_set1_ps(scale)));
            for (x, v) in sums.into_iter().enumerate() {
                *s.add((k + x) / NK * TILE + j + (k + x) % NK) = v;
            }
            k += 4;
        }
        while k < NB * NK {
            *s.add(k / NK * TILE + j + k % NK) = hsum(acc[k / NK][k % NK]) * scale;
            k += 1;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn scores_nb<const D: u8, const NB: usize, const NK: usize>(
        s: &mut [f32],
        q: [*const f32; SCORE_VECTORS],
        k: KvView,
        offs: &[usize],
        x: usize,
        y: usize,
        hd: usize,
        scale: f32,
    ) {
        let sp = s.as_mut_ptr();
        let mut j = x;
        while j + NK <= y {
            score_block::<D, NB, NK>(sp, q, k, offs, j, hd, scale);
            j += NK;
        }
        while j < y {
            score_block::<D, NB, 1>(sp, q, k, offs, j, hd, scale);
            j += 1;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores<const D: u8>(
        s: &mut [f32],
        nb: usize,
        q: [*const f32; SCORE_VECTORS],
        k: KvView,
        offs: &[usize],
        x: usize,
        y: usize,
        hd: usize,
        scale: f32,
    ) {
        // at most 12 accumulators (NB x NK) beside NK keys and a query in the 16 registers
        match nb {
            1 => scores_nb::<D, 1, 6>(s, q, k, offs, x, y, hd, scale),
            2 => scores_nb::<D, 2, 4>(s, q, k, offs, x, y, hd, scale),
            3 => scores_nb::<D, 3, 3>(s, q, k, offs, x, y, hd, scale),
            4 => scores_nb::<D, 4, 3>(s, q, k, offs, x, y, hd, scale),
            5 => scores_nb::<D, 5, 2>(s, q, k, offs, x, y, hd, scale),
            _ => scores_nb::<D, 6, 2>(s, q, k, offs, x, y, hd, scale),
        }
    }

    /// `NB` vectors' outputs, `NC` chunks of eight from dimension `d`: rescaled, then one fused
    /// multiply-add per key in order (each output lane's chain is the same whatever the blocking).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn value_block<const D: u8, const NB: usize, const NC: usize>(
        acc: *mut f32,
        alpha: &[f32],
        w: *const f32,
        v: KvView,
        offs: &[usize],
        x: usize,
        y: usize,
        d: usize,
        hd: usize,
    ) {
        let mut r = [[_mm256_setzero_ps(); NC]; NB];
        for i in 0..NB {
            let a = _mm256_set1_ps(alpha[i]);
            for c in 0..NC {
                r[i][c] = _mm256_mul_ps(_mm256_loadu_ps(acc.add(i * hd + d + 8 * c)), a);
            }
        }
        for j in x..y {
            let o = *offs.get_unchecked(j) + d;
            let wj: [__m256; NB] = std::array::from_fn(|i| _mm256_broadcast_ss(&*w.add(i * TILE + j)));
            for c in 0..NC {
                let vv = load8::<D>(v, o + 8 * c);
                for i in 0..NB {
                    r[i][c] = _mm256_fmadd_ps(wj[i], vv, r[i][c]);
                }
            }
        }
        for i in 0..NB {
            for c in 0..NC {
                _mm256_storeu_ps(acc.add(i * hd + d + 8 * c), r[i][c]);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn values_nb<const D: u8, const NB: usize>(acc: &mut [f32], alpha: &[f32], w: &[f32], v: KvView, offs: &[usize], x: usize, y: usize, hd: usize) {
        let (ap, wp) = (acc.as_mut_ptr(), w.as_ptr());
        let mut d = 0;
        while d + 32 <= hd {
            value_block::<D, NB, 4>(ap, alpha, wp, v, offs, x, y, d, hd);
            d += 32;
        }
        while d < hd {
            value_block::<D, NB, 1>(ap, alpha, wp, v, offs, x, y, d, hd);
            d += 8;
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn weighted_values<const D: u8>(
        acc: &mut [f32],
        nb: usize,
        alpha: &[f32],
        w: &[f32],
        v: KvView,
        offs: &[usize],
        x: usize,
        y: usize,
        hd: usize,
    ) {
        match nb {
            1 => values_nb::<D, 1>(acc, alpha, w, v, offs, x, y, hd),
            2 => values_nb::<D, 2>(acc, alpha, w, v, offs, x, y, hd),
            _ => values_nb::<D, 3>(acc, alpha, w, v, offs, x, y, hd),
        }
    }
}

#[cfg(test)]
mod tests;
