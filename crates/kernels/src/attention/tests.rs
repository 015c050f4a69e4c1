use super::*;
use crate::kv::{KvPlane, KvRole};

/// A paged cache of `ctx` positions written in a scattered block order, with the f32 values each
/// position holds (before rounding to the plane's type).
struct Cache {
    layout: KvLayout,
    table: Vec<u32>,
    k: KvPlane,
    v: KvPlane,
}

fn cache(layout: KvLayout, dtype: KvDtype, ctx: usize) -> Cache {
    let bs = layout.block_size;
    let blocks = ctx.div_ceil(bs) + 1;
    // blocks in a shuffled order (reversed, odd ones first), block 0 never used
    let mut table: Vec<u32> = (1..blocks as u32).rev().collect();
    table.sort_by_key(|b| b % 2 == 0);
    let kvw = layout.kv_width();
    let mut k = KvPlane::new(KvRole::Keys, dtype, layout, blocks).unwrap();
    let mut v = KvPlane::new(KvRole::Values, dtype, layout, blocks).unwrap();
    for p in 0..ctx {
        let slot = table[p / bs] as usize * bs + p % bs;
        let kr: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.37).sin() * 2.0).collect();
        let vr: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.53).cos()).collect();
        k.write(slot, &kr);
        v.write(slot, &vr);
    }
    Cache { layout, table, k, v }
}

impl Cache {
    fn slot(&self, p: usize) -> usize {
        self.table[p / self.layout.block_size] as usize * self.layout.block_size + p % self.layout.block_size
    }

    /// f64 attention of one query vector (head `h`) at position `pos` over the stored values.
    fn naive(&self, q: &[f32], h: usize, pos: usize, scale: f32, window: Option<usize>, sink: Option<f32>) -> Vec<f64> {
        let hd = self.layout.head_dim;
        let kvh = h / (self.layout.n_heads / self.layout.n_kv_heads);
        let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let mut s: Vec<f64> = (lo..=pos)
            .map(|p| {
                let k = self.k.read(self.slot(p));
                (0..hd).map(|d| q[d] as f64 * k[kvh * hd + d] as f64).sum::<f64>() * scale as f64
            })
            .collect();
        let m = s.iter().cloned().chain(sink.map(|x| x as f64)).fold(f64::NEG_INFINITY, f64::max);
        s.iter_mut().for_each(|x| *x = (*x - m).exp());
        let z: f64 = s.iter().sum::<f64>() + sink.map_or(0.0, |x| (x as f64 - m).exp());
        let mut o = vec![0f64; hd];
        for (w, p) in s.iter().zip(lo..=pos) {
            let v = self.v.read(self.slot(p));
            for d in 0..hd {
                o[d] += w / z * v[kvh * hd + d] as f64;
            }
        }
        o
    }

    #[allow(clippy::too_many_arguments)]
    fn run(&self, q: &[f32], seqs: &[SeqSpan], window: Option<usize>, sinks: Option<&[f32]>, simd: bool) -> Vec<f32> {
        let path = if simd { Simd::for_head(self.layout.head_dim) } else { Simd::Scalar };
        self.run_on(q, seqs, window, sinks, path)
    }

    fn run_on(&self, q: &[f32], seqs: &[SeqSpan], window: Option<usize>, sinks: Option<&[f32]>, simd: Simd) -> Vec<f32> {
        let l = &self.layout;
        let mut out = vec![0f32; q.len()];
        let a = Attn { q, k: self.k.view(), v: self.v.view(), layout: *l, scale: 0.3, window, sinks, group: l.n_heads / l.n_kv_heads, simd };
        a.run(seqs, &mut out);
        out
    }
}

fn queries(rows: usize, layout: &KvLayout) -> Vec<f32> {
    (0..rows * layout.n_heads * layout.head_dim).map(|i| (i as f32 * 0.013).cos()).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn in_pool<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap().install(f)
}

/// Every stored type against f64 attention over the values the plane holds, with scattered
/// blocks, grouped heads, a sliding window and sinks, over a context longer than a span.
#[test]
fn every_kv_type_matches_exact_attention_over_its_stored_values() {
    let layout = KvLayout { block_size: 16, n_heads: 6, n_kv_heads: 2, head_dim: 64 };
    let ctx = SPAN + 300;
    let qw = layout.n_heads * layout.head_dim;
    for dtype in KvDtype::ALL {
        let c = cache(layout, dtype, ctx);
        for (window, sinks) in [(None, None), (Some(700), Some(vec![0.5f32, -2.0, 4.0, 1.0, 0.0, 3.0]))] {
            // the last 20 positions as one prompt chunk
            let rows = 20;
            let q = queries(rows, &layout);
            let seqs = [SeqSpan { q_start: 0, q_len: rows, context_len: ctx, block_table: &c.table }];
            let out = c.run(&q, &seqs, window, sinks.as_deref(), true);
            for t in [0, 7, 19] {
                for h in 0..layout.n_heads {
                    let at = t * qw + h * layout.head_dim;
                    let want = c.naive(&q[at..at + layout.head_dim], h, ctx - rows + t, 0.3, window, sinks.as_ref().map(|s| s[h]));
                    for (d, (&w, &g)) in want.iter().zip(&out[at..at + layout.head_dim]).enumerate() {
                        assert!((w - g as f64).abs() < 2e-5, "{dtype} window {window:?} row {t} head {h} dim {d}: {w} vs {g}");
                    }
                }
            }
        }
    }
}

/// One query's output is bitwise the same alone (a decode step), inside a prompt chunked any
/// way, split over spans or not, on one thread or two, and on the scalar path or the SIMD one.
#[test]
fn a_querys_result_depends_on_nothing_but_its_own_context() {
    for dtype in KvDtype::ALL {
        for (layout, window) in [
            (KvLayout { block_size: 16, n_heads: 6, n_kv_heads: 2, head_dim: 64 }, None),
            (KvLayout { block_size: 4, n_heads: 3, n_kv_heads: 3, head_dim: 32 }, Some(150)),
            // Qwen2.5-1.5B's heads: six to a group, the AVX-512 path's full pairs and value pass
            (KvLayout { block_size: 16, n_heads: 12, n_kv_heads: 2, head_dim: 128 }, None),
        ] {
            let ctx = 2 * SPAN + 77;
            let c = cache(layout, dtype, ctx);
            let qw = layout.n_heads * layout.head_dim;
            let q = queries(ctx, &layout);
            let all_seqs = [SeqSpan { q_start: 0, q_len: ctx, context_len: ctx, block_table: &c.table }];
            let all = in_pool(2, || c.run(&q, &all_seqs, window, None, true));
            for t in [0, 15, 16, TILE - 1, TILE, TILE + 1, SPAN - 1, SPAN, SPAN + 1, ctx - 1] {
                let one_seqs = [SeqSpan { q_start: 0, q_len: 1, context_len: t + 1, block_table: &c.table }];
                let row = &q[t * qw..(t + 1) * qw];
                let want = bits(&all[t * qw..(t + 1) * qw]);
                for threads in [1, 2, 3] {
                    let one = in_pool(threads, || c.run(row, &one_seqs, window, None, true));
                    assert_eq!(bits(&one), want, "{dtype} window {window:?} position {t}, alone on {threads} threads");
                }
                let scalar = c.run(row, &one_seqs, window, None, false);
                assert_eq!(bits(&scalar), want, "{dtype} window {window:?} position {t}, scalar path");
            }
            // the prompt in three chunks of odd sizes, each with the chunk before in the cache
            let mut t0 = 0;
            for len in [37, 2 * SPAN - 100, ctx - 37 - (2 * SPAN - 100)] {
                let seqs = [SeqSpan { q_start: 0, q_len: len, context_len: t0 + len, block_table: &c.table }];
                let part = in_pool(1, || c.run(&q[t0 * qw..(t0 + len) * qw], &seqs, window, None, true));
                assert_eq!(bits(&part), bits(&all[t0 * qw..(t0 + len) * qw]), "{dtype} window {window:?} chunk at {t0}");
                t0 += len;
            }
        }
    }
}

/// Two sequences in one batch give each its own result (block tables, rows and contexts apart).
#[test]
fn sequences_sharing_a_batch_do_not_see_each_other() {
    let layout = KvLayout { block_size: 8, n_heads: 4, n_kv_heads: 2, head_dim: 32 };
    let c = cache(layout, KvDtype::F16, 600);
    let qw = layout.n_heads * layout.head_dim;
    let q = queries(6, &layout);
    // sequence b: the first 40 positions of the same cache (its own table prefix), 5 rows
    let a_seq = SeqSpan { q_start: 0, q_len: 1, context_len: 600, block_table: &c.table };
    let b_seq = SeqSpan { q_start: 1, q_len: 5, context_len: 40, block_table: &c.table };
    let both = c.run(&q, &[a_seq, b_seq], None, None, true);
    let a = c.run(&q[..qw], &[SeqSpan { q_start: 0, ..a_seq }], None, None, true);
    let b = c.run(&q[qw..], &[SeqSpan { q_start: 0, ..b_seq }], None, None, true);
    assert_eq!(bits(&both[..qw]), bits(&a));
    assert_eq!(bits(&both[qw..]), bits(&b));
}

/// The f32 entry point (the draft heads' caches) is attention over plain slices.
#[test]
fn plain_f32_slices_are_an_f32_cache() {
    let layout = KvLayout { block_size: 2, n_heads: 2, n_kv_heads: 1, head_dim: 4 };
    let table = [3u32, 0, 2];
    let mut kc = vec![0f32; 4 * 2 * 4];
    let mut vc = kc.clone();
    let (mut ks, mut vs) = (Vec::new(), Vec::new());
    for p in 0..5 {
        let k: Vec<f32> = (0..4).map(|i| ((p * 4 + i) as f32 * 0.3).sin()).collect();
        let v: Vec<f32> = (0..4).map(|i| ((p * 4 + i) as f32 * 0.7).cos()).collect();
        let slot = table[p / 2] as usize * 2 + p % 2;
        kc[slot * 4..slot * 4 + 4].copy_from_slice(&k);
        vc[slot * 4..slot * 4 + 4].copy_from_slice(&v);
        ks.push(k);
        vs.push(v);
    }
    let q: Vec<f32> = (0..16).map(|i| (i as f32 * 0.11).cos()).collect();
    let mut out = vec![0f32; 16];
    let seqs = [SeqSpan { q_start: 0, q_len: 2, context_len: 5, block_table: &table }];
    paged_attention(&q, &mut out, &kc, &vc, &layout, &seqs, 0.5);
    for t in 0..2 {
        for h in 0..2 {
            let qv = &q[t * 8 + h * 4..t * 8 + h * 4 + 4];
            let mut s: Vec<f64> = ks[..4 + t].iter().map(|k| k.iter().zip(qv).map(|(a, b)| (a * b) as f64).sum::<f64>() * 0.5).collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            s.iter_mut().for_each(|x| *x = (*x - m).exp());
            let z: f64 = s.iter().sum();
            for d in 0..4 {
                let want: f64 = s.iter().zip(&vs).map(|(w, v)| w / z * v[d] as f64).sum();
                let got = out[t * 8 + h * 4 + d] as f64;
                assert!((want - got).abs() < 1e-5, "token {t} head {h}: {want} vs {got}");
            }
        }
    }
}

/// The SIMD paths this CPU has give the scalar reference's bits: a prompt chunk's rows at the end
/// of a context longer than a span, groups of odd and even size (the AVX-512 scores' query pairs
/// with a lone last vector), heads whose value passes take every chunk count, every stored type,
/// with a window and sinks.
#[test]
fn every_simd_path_gives_the_reference_bits() {
    let mut ran = std::collections::BTreeSet::new();
    for (layout, sinks) in [
        (KvLayout { block_size: 16, n_heads: 10, n_kv_heads: 2, head_dim: 64 }, Some(vec![0.5f32, -2.0, 4.0, 1.0, 0.0, 3.0, 1.5, -1.0, 2.0, 0.25])),
        (KvLayout { block_size: 16, n_heads: 12, n_kv_heads: 2, head_dim: 128 }, None),
        (KvLayout { block_size: 8, n_heads: 7, n_kv_heads: 7, head_dim: 96 }, None),
        // 40 dimensions: the AVX2 values' passes of four chunks and of one (plain types only: the
        // quantized ones take heads of a multiple of 32)
        (KvLayout { block_size: 16, n_heads: 4, n_kv_heads: 2, head_dim: 40 }, None),
        // groups of three to six take passes of two chunks, a head of 40 a last one of one
        (KvLayout { block_size: 16, n_heads: 6, n_kv_heads: 2, head_dim: 40 }, None),
    ] {
        let ctx = SPAN + 100;
        for dtype in KvDtype::ALL.into_iter().filter(|d| !d.has_scales() || layout.head_dim.is_multiple_of(32)) {
            let c = cache(layout, dtype, ctx);
            // a prompt chunk's rows, and a decode step's one row (its own value kernel on AVX2)
            for (rows, window) in [9, 1].into_iter().flat_map(|r| [(r, None), (r, Some(700))]) {
                let q = queries(rows, &layout);
                let seqs = [SeqSpan { q_start: 0, q_len: rows, context_len: ctx, block_table: &c.table }];
                let want = bits(&c.run_on(&q, &seqs, window, sinks.as_deref(), Simd::Scalar));
                let best = Simd::for_head(layout.head_dim);
                for path in [Simd::Avx2, Simd::Avx512] {
                    if best == Simd::Scalar || (path == Simd::Avx512 && best != Simd::Avx512) {
                        continue;
                    }
                    ran.insert(if path == Simd::Avx2 { crate::cpu::PATH_AVX2 } else { crate::cpu::PATH_VNNI });
                    let got = bits(&in_pool(2, || c.run_on(&q, &seqs, window, sinks.as_deref(), path)));
                    assert_eq!(got, want, "{dtype} {layout:?} {rows} rows, window {window:?} on {path:?}");
                }
            }
        }
    }
    crate::cpu::assert_expected_paths_ran(&ran);
}
