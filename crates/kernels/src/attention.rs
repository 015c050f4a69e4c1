//! Causal attention of a flattened batch of queries over a paged KV cache.
//!
//! The cache stores, per slot (block * block_size + offset), `n_kv_heads * head_dim` keys and as
//! many values. Each (query token, head) pair is reduced over its context positions in order,
//! independent of which other sequences share the batch or how a prompt was chunked.

use crate::dot::{scaled_dots_heads, weighted_rows_sum};

#[derive(Clone, Copy, Debug)]
pub struct KvLayout {
    pub block_size: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    pub fn kv_width(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

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

/// Writes one token's keys/values into its slot.
pub fn write_kv(k_cache: &mut [f32], v_cache: &mut [f32], layout: &KvLayout, slot: usize, k: &[f32], v: &[f32]) {
    let w = layout.kv_width();
    k_cache[slot * w..(slot + 1) * w].copy_from_slice(k);
    v_cache[slot * w..(slot + 1) * w].copy_from_slice(v);
}

/// Query rows per task: long prompts are split so both cores share their attention.
const Q_CHUNK: usize = 16;

/// `q`: [tokens, n_heads * head_dim]; `out`: same shape.
///
/// One task per (sequence, KV head, chunk of query rows): the query heads that share a KV head
/// (grouped-query attention) and the rows of the chunk reuse its key and value rows from cache.
/// Each (query row, head) is still reduced exactly as on its own — scores `dot(q, k) * scale` in
/// position order, softmax over its own context, values accumulated in position order — so the
/// grouping never changes a result.
pub fn paged_attention(q: &[f32], out: &mut [f32], k_cache: &[f32], v_cache: &[f32], layout: &KvLayout, seqs: &[SeqSpan], scale: f32) {
    paged_attention_windowed(q, out, k_cache, v_cache, layout, seqs, scale, None, None)
}

/// [`paged_attention`] restricted to a sliding window: with `window = Some(w)` the query at
/// position `p` sees keys at positions `(p - w, p]` only, the `w` most recent including itself
/// (llama.cpp's `LLAMA_SWA_TYPE_STANDARD`: key `p0` is masked when `p - p0 >= w`). `None`: the
/// whole causal context. The cache still holds every position; only the reduction range shrinks.
/// `sinks` (gpt-oss's attention sinks): one logit per query head that joins each softmax's
/// denominator and gets no value ([`crate::ops::softmax_with_sink`]).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_windowed(
    q: &[f32],
    out: &mut [f32],
    k_cache: &[f32],
    v_cache: &[f32],
    layout: &KvLayout,
    seqs: &[SeqSpan],
    scale: f32,
    window: Option<usize>,
    sinks: Option<&[f32]>,
) {
    assert!(window != Some(0), "a sliding window must hold at least the query's own position");
    assert!(sinks.is_none_or(|s| s.len() == layout.n_heads), "one attention sink per query head");
    let hd = layout.head_dim;
    let qw = layout.n_heads * hd;
    let group = layout.n_heads / layout.n_kv_heads;
    let kvw = layout.kv_width();
    let mut tasks = Vec::new();
    for (si, s) in seqs.iter().enumerate() {
        for kvh in 0..layout.n_kv_heads {
            let mut t0 = 0;
            while t0 < s.q_len {
                let t1 = (t0 + Q_CHUNK).min(s.q_len);
                tasks.push((si, kvh, t0, t1));
                t0 = t1;
            }
        }
    }
    assert!(out.len() >= q.len());
    let optr = crate::pool::DisjointOut::new(out);
    let run = |&(si, kvh, t0, t1): &(usize, usize, usize, usize)| {
        let s = &seqs[si];
        // query row t sits at position base + t
        let base = s.context_len - s.q_len;
        let ctx = base + t1;
        // the first position any row of the chunk sees (row t0's window start)
        let first = window.map_or(0, |w| (base + t0 + 1).saturating_sub(w));
        // where position first + j's keys (and values) for this KV head start
        let offsets: Vec<usize> =
            (first..ctx).map(|p| (s.block_table[p / layout.block_size] as usize * layout.block_size + p % layout.block_size) * kvw + kvh * hd).collect();
        let mut scores = vec![0f32; group * (ctx - first)];
        let mut acc = vec![0f32; hd];
        for t in t0..t1 {
            let row = s.q_start + t;
            // query row t sees positions lo..=base + t (lo = 0 without a window)
            let end = base + t + 1;
            let lo = window.map_or(0, |w| end.saturating_sub(w));
            let offs = &offsets[lo - first..end - first];
            let len = end - lo;
            // the group's scores at once (each key read once for several heads), head-major
            let sc = &mut scores[..group * len];
            let h0 = kvh * group;
            scaled_dots_heads(sc, &q[row * qw + h0 * hd..row * qw + (h0 + group) * hd], group, k_cache, offs, scale);
            for (j, s) in sc.chunks_exact_mut(len).enumerate() {
                match sinks {
                    Some(sk) => crate::ops::softmax_with_sink(s, sk[h0 + j]),
                    None => crate::ops::softmax(s),
                }
                acc.fill(0.0);
                weighted_rows_sum(&mut acc, s, v_cache, offs);
                // SAFETY: (row, h0 + j) belongs to this task only.
                unsafe { optr.slice(row * qw + (h0 + j) * hd, hd) }.copy_from_slice(&acc);
            }
        }
    };
    // Waking the pool costs more than a small attention (a decode step at short context): only
    // go parallel when there are enough query-key products to share.
    let work: usize = seqs.iter().map(|s| s.q_len * window.map_or(s.context_len, |w| w.min(s.context_len))).sum::<usize>() * layout.n_heads;
    if tasks.len() < 2 || work < 2 * 1024 {
        tasks.iter().for_each(run);
    } else {
        crate::pool::parallel_for(tasks.len(), &|i| run(&tasks[i]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Plain attention over contiguous keys, the reference for the paged version.
    fn naive(q: &[f32], ks: &[Vec<f32>], vs: &[Vec<f32>], scale: f32) -> Vec<f32> {
        let mut s: Vec<f32> = ks.iter().map(|k| k.iter().zip(q).map(|(a, b)| a * b).sum::<f32>() * scale).collect();
        crate::ops::softmax(&mut s);
        let mut o = vec![0f32; q.len()];
        for (w, v) in s.iter().zip(vs) {
            for (a, x) in o.iter_mut().zip(v) {
                *a += w * x;
            }
        }
        o
    }

    #[test]
    fn paged_attention_matches_contiguous_attention_with_scattered_blocks() {
        let layout = KvLayout { block_size: 2, n_heads: 2, n_kv_heads: 1, head_dim: 4 };
        let table = [3u32, 0, 2]; // positions 0,1 -> block 3; 2,3 -> block 0; 4 -> block 2
        let mut kc = vec![0f32; 4 * 2 * 4];
        let mut vc = kc.clone();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for p in 0..5 {
            let k: Vec<f32> = (0..4).map(|i| ((p * 4 + i) as f32 * 0.3).sin()).collect();
            let v: Vec<f32> = (0..4).map(|i| ((p * 4 + i) as f32 * 0.7).cos()).collect();
            let slot = table[p / 2] as usize * 2 + p % 2;
            write_kv(&mut kc, &mut vc, &layout, slot, &k, &v);
            ks.push(k);
            vs.push(v);
        }
        // two query tokens at positions 3 and 4
        let q: Vec<f32> = (0..16).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut out = vec![0f32; 16];
        let seqs = [SeqSpan { q_start: 0, q_len: 2, context_len: 5, block_table: &table }];
        paged_attention(&q, &mut out, &kc, &vc, &layout, &seqs, 0.5);
        for t in 0..2 {
            for h in 0..2 {
                let qv = &q[t * 8 + h * 4..t * 8 + h * 4 + 4];
                let want = naive(qv, &ks[..4 + t], &vs[..4 + t], 0.5);
                let got = &out[t * 8 + h * 4..t * 8 + h * 4 + 4];
                for (a, b) in want.iter().zip(got) {
                    assert!((a - b).abs() < 1e-5, "token {t} head {h}: {a} vs {b}");
                }
            }
        }
    }

    /// A query's output is bitwise the same whatever else shares its task: alone, with the other
    /// rows of its prompt, or split across chunks (and with GQA groups of 3 heads).
    #[test]
    fn a_querys_result_does_not_depend_on_its_neighbours() {
        let layout = KvLayout { block_size: 4, n_heads: 6, n_kv_heads: 2, head_dim: 8 };
        let ctx = 40;
        let table: Vec<u32> = (0..10).rev().collect();
        let kvw = layout.kv_width();
        let mut kc = vec![0f32; 10 * 4 * kvw];
        let mut vc = kc.clone();
        for p in 0..ctx {
            let k: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.37).sin()).collect();
            let v: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.53).cos()).collect();
            let slot = table[p / 4] as usize * 4 + p % 4;
            write_kv(&mut kc, &mut vc, &layout, slot, &k, &v);
        }
        let qw = layout.n_heads * layout.head_dim;
        let q: Vec<f32> = (0..ctx * qw).map(|i| (i as f32 * 0.013).cos()).collect();
        // all 40 positions as one prompt (three chunks of 16)
        let mut all = vec![0f32; ctx * qw];
        let seqs = [SeqSpan { q_start: 0, q_len: ctx, context_len: ctx, block_table: &table }];
        paged_attention(&q, &mut all, &kc, &vc, &layout, &seqs, 0.3);
        // every position alone, as a decode step
        for t in [0, 15, 16, 17, 39] {
            let mut one = vec![0f32; qw];
            let seqs = [SeqSpan { q_start: 0, q_len: 1, context_len: t + 1, block_table: &table }];
            paged_attention(&q[t * qw..(t + 1) * qw], &mut one, &kc, &vc, &layout, &seqs, 0.3);
            assert_eq!(
                one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                all[t * qw..(t + 1) * qw].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "position {t}"
            );
        }
    }

    /// A sliding window of w keeps the w most recent positions, the query's own included
    /// (llama.cpp's boundary), whether the rows come as one prompt or one at a time.
    #[test]
    fn sliding_window_sees_the_last_w_positions_only() {
        let layout = KvLayout { block_size: 4, n_heads: 2, n_kv_heads: 1, head_dim: 8 };
        let ctx = 37;
        let table: Vec<u32> = (0..10).rev().collect();
        let kvw = layout.kv_width();
        let mut kc = vec![0f32; 10 * 4 * kvw];
        let mut vc = kc.clone();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for p in 0..ctx {
            let k: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.37).sin()).collect();
            let v: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.53).cos()).collect();
            write_kv(&mut kc, &mut vc, &layout, table[p / 4] as usize * 4 + p % 4, &k, &v);
            ks.push(k);
            vs.push(v);
        }
        let qw = layout.n_heads * layout.head_dim;
        let q: Vec<f32> = (0..ctx * qw).map(|i| (i as f32 * 0.013).cos()).collect();
        let w = 5;
        let mut all = vec![0f32; ctx * qw];
        let seqs = [SeqSpan { q_start: 0, q_len: ctx, context_len: ctx, block_table: &table }];
        paged_attention_windowed(&q, &mut all, &kc, &vc, &layout, &seqs, 0.3, Some(w), None);
        for t in [0usize, 3, 4, 5, 16, 17, 36] {
            let lo = (t + 1).saturating_sub(w);
            for h in 0..2 {
                let at = t * qw + h * 8;
                let want = naive(&q[at..at + 8], &ks[lo..=t], &vs[lo..=t], 0.3);
                for (a, b) in want.iter().zip(&all[at..at + 8]) {
                    assert!((a - b).abs() < 1e-5, "position {t} head {h}: {a} vs {b}");
                }
            }
            let mut one = vec![0f32; qw];
            let seqs = [SeqSpan { q_start: 0, q_len: 1, context_len: t + 1, block_table: &table }];
            paged_attention_windowed(&q[t * qw..(t + 1) * qw], &mut one, &kc, &vc, &layout, &seqs, 0.3, Some(w), None);
            assert_eq!(one, all[t * qw..(t + 1) * qw], "position {t} alone");
        }
        // a window at least as long as the context is plain causal attention
        let mut wide = vec![0f32; ctx * qw];
        paged_attention_windowed(&q, &mut wide, &kc, &vc, &layout, &seqs, 0.3, Some(ctx), None);
        let mut plain = vec![0f32; ctx * qw];
        paged_attention(&q, &mut plain, &kc, &vc, &layout, &seqs, 0.3);
        assert_eq!(wide, plain);
    }

    /// An attention sink per head joins the softmax's denominator only: against the naive
    /// attention with the sink's logit appended (and its value row zero), for each head.
    #[test]
    fn attention_sinks_take_a_share_of_the_softmax_and_give_nothing() {
        let layout = KvLayout { block_size: 4, n_heads: 4, n_kv_heads: 2, head_dim: 8 };
        let ctx = 11;
        let table: Vec<u32> = (0..4).collect();
        let kvw = layout.kv_width();
        let mut kc = vec![0f32; 4 * 4 * kvw];
        let mut vc = kc.clone();
        let (mut ks, mut vs) = (Vec::new(), Vec::new());
        for p in 0..ctx {
            let k: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.37).sin()).collect();
            let v: Vec<f32> = (0..kvw).map(|i| ((p * kvw + i) as f32 * 0.53).cos()).collect();
            write_kv(&mut kc, &mut vc, &layout, p, &k, &v);
            ks.push(k);
            vs.push(v);
        }
        let qw = layout.n_heads * layout.head_dim;
        let q: Vec<f32> = (0..ctx * qw).map(|i| (i as f32 * 0.013).cos()).collect();
        let sinks = [0.5f32, -2.0, 4.0, 1.0];
        let mut out = vec![0f32; ctx * qw];
        let seqs = [SeqSpan { q_start: 0, q_len: ctx, context_len: ctx, block_table: &table }];
        paged_attention_windowed(&q, &mut out, &kc, &vc, &layout, &seqs, 0.3, Some(4), Some(&sinks));
        for t in [0usize, 5, 10] {
            let lo = (t + 1).saturating_sub(4);
            for h in 0..4 {
                let kvh = h / 2;
                let at = t * qw + h * 8;
                let qv = &q[at..at + 8];
                let mut s: Vec<f64> =
                    ks[lo..=t].iter().map(|k| k[kvh * 8..kvh * 8 + 8].iter().zip(qv).map(|(a, b)| (a * b) as f64).sum::<f64>() * 0.3).collect();
                s.push(sinks[h] as f64);
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for d in 0..8 {
                    let want: f64 = (lo..=t).map(|p| (s[p - lo] - m).exp() / z * vs[p][kvh * 8 + d] as f64).sum();
                    assert!((want - out[at + d] as f64).abs() < 1e-5, "position {t} head {h}: {want} vs {}", out[at + d]);
                }
            }
        }
    }
}
