//! The mtp proposer (docs/mtp-head-format.md): a one-layer head file checked against its target
//! at load with clear errors, drafts that only ever use the pruned vocabulary and that match a
//! naive reference forward of the head, and greedy output through the whole engine that is token
//! for token the output without speculation (docs/architecture.md invariant 1).

mod spec_support;

use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use spec_support::{spec_config, tiny_model, End, Rig};
use specula_engine::speculative::mtp::{HeadWeights, MtpHead, MtpProposer};
use specula_engine::speculative::mtp_format::{
    self as fmt, random_head, save_head, write_random_head, HeadConfig, HeadContext, HeadFile, HeadWeightsF32, StoredDtype,
};
use specula_engine::speculative::{build_proposer, Draft, DraftRequest, Proposer, SpecError, SpecMethod};
use specula_engine::types::SeqId;
use specula_engine::{EngineConfig, SamplingParams};
use specula_model::testing::{write_tiny_llama, TinySpec, TINY_VOCAB};
use specula_model::{load_model, LlamaModel};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

fn target(path: &Path) -> LlamaModel {
    load_model(path).expect("load tiny target").model
}

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()
}

fn tiny_config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 128,
        max_model_len: 256,
        block_size: 16,
        num_kv_blocks: 64,
        enable_prefix_caching: true,
        threads: 2,
        ..Default::default()
    }
}

/// Deterministic pseudo-random hidden states of the size the target produces.
fn hidden(h: usize, seed: u64) -> Vec<f32> {
    let mut rng = spec_support::Rng(seed);
    (0..h).map(|_| (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0).collect()
}

/// A request of a sequence the proposer has not drafted for before (its drafting state a fresh
/// one, leaked: a test's few bytes).
fn request<'a>(seq: u64, tokens: &'a [u32], max_draft: usize, params: &'a SamplingParams, hidden: Option<&'a [f32]>) -> DraftRequest<'a> {
    DraftRequest { seq: SeqId(seq), tokens, prompt_len: tokens.len().min(2), max_draft, params, hidden, rng: None, drafting: Box::leak(Box::default()) }
}

fn load_err(path: &Path, target: &LlamaModel) -> String {
    match MtpHead::load(path, target) {
        Ok(_) => panic!("{} loaded but should have been refused", path.display()),
        Err(e) => e.to_string(),
    }
}

/// Copies the head file at `src` to `dst`, dropping tensor `drop`, replacing the bytes of the
/// tensors in `replace` (same dtype and shape), and editing the metadata.
fn rewrite(src: &Path, dst: &Path, drop: Option<&str>, replace: &[(&str, Vec<u8>)], edit: impl FnOnce(&mut HashMap<String, String>)) {
    let bytes = std::fs::read(src).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, header) = SafeTensors::read_metadata(&bytes).unwrap();
    let mut md = header.metadata().clone().unwrap();
    edit(&mut md);
    let mut views = Vec::new();
    for (name, v) in st.tensors() {
        if Some(name.as_str()) == drop {
            continue;
        }
        let data = replace.iter().find(|(n, _)| *n == name).map_or(v.data(), |(_, b)| b.as_slice());
        views.push((name, TensorView::new(v.dtype(), v.shape().to_vec(), data).unwrap()));
    }
    safetensors::serialize_to_file(views, &Some(md), dst).unwrap();
}

// ---------------------------------------------------------------------------------------------
// Vocabulary maps
// ---------------------------------------------------------------------------------------------

#[test]
fn d2t_and_t2d_round_trip_through_the_head_file() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 1));
    let path = dir.path().join("head.safetensors");
    write_random_head(&path, &t, 40, 7).unwrap();

    let head = MtpHead::load(&path, &t).unwrap();
    let vocab = head.vocab();
    assert_eq!((vocab.draft_vocab(), vocab.target_vocab()), (40, TINY_VOCAB));
    for d in 0..40 {
        let tok = vocab.d2t(d).unwrap();
        assert_eq!(vocab.t2d(tok), Some(d), "draft id {d} -> target {tok} -> back");
        assert!(head.covers(tok));
    }
    let d2t: HashSet<u32> = vocab.d2t_slice().iter().copied().collect();
    assert_eq!(d2t.len(), 40, "d2t ids are distinct");
    assert_ne!(vocab.d2t_slice(), (0..40).collect::<Vec<u32>>().as_slice(), "the seeded subset is not simply the first ids");
    for tok in (0..TINY_VOCAB as u32).filter(|t| !d2t.contains(t)) {
        assert_eq!(vocab.t2d(tok), None, "target token {tok} is outside the pruned vocabulary");
        assert!(!head.covers(tok));
    }

    // the stored t2d is exactly the inverse, and the trainer's label mapping reads it
    let file = HeadFile::open(&path).unwrap();
    let t2d: Vec<i32> = file.ids(fmt::T2D, TINY_VOCAB).unwrap().into_iter().map(|v| v as i32).collect();
    assert_eq!(t2d, fmt::t2d_from_d2t(vocab.d2t_slice(), TINY_VOCAB));
    let all: Vec<u32> = (0..TINY_VOCAB as u32).collect();
    let labels = fmt::map_targets(&t2d, &all);
    assert_eq!(labels, all.iter().map(|&tok| vocab.t2d(tok)).collect::<Vec<_>>());
    assert_eq!(labels.iter().filter(|l| l.is_some()).count(), 40);
}

// ---------------------------------------------------------------------------------------------
// Proposals
// ---------------------------------------------------------------------------------------------

#[test]
fn tokens_outside_the_pruned_vocabulary_are_never_proposed() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 2));
    let path = dir.path().join("head.safetensors");
    write_random_head(&path, &t, 24, 3).unwrap();
    let mut p = MtpProposer::load(&path, &t).unwrap();
    let allowed: HashSet<u32> = p.head().vocab().d2t_slice().iter().copied().collect();
    let greedy = SamplingParams::greedy(64);
    let sampled = SamplingParams { temperature: 1.5, seed: Some(5), repetition_penalty: 1.3, ..SamplingParams::default() };
    let h = t.config.hidden_size;
    let mut proposed = 0;
    for round in 0..20u64 {
        // last tokens mostly outside the pruned vocabulary: the head still reads their embedding
        let toks: Vec<Vec<u32>> = (0..4).map(|i| vec![10, 20, (round * 13 + i * 61) as u32 % TINY_VOCAB as u32]).collect();
        let hs: Vec<Vec<f32>> = (0..4).map(|i| hidden(h, round * 4 + i)).collect();
        let mut reqs: Vec<DraftRequest> =
            (0..4).map(|i| request(i as u64, &toks[i], 1 + (i + round as usize) % 4, if i % 2 == 0 { &greedy } else { &sampled }, Some(&hs[i]))).collect();
        let drafts = p.propose(&mut reqs, &pool()).unwrap();
        for (r, d) in reqs.iter().zip(&drafts) {
            assert_eq!(d.tokens.len(), r.max_draft, "a head always has a token to propose");
            proposed += d.tokens.len();
            for (j, tok) in d.tokens.iter().enumerate() {
                assert!(allowed.contains(tok), "proposed token {tok} is outside the pruned vocabulary");
                if let Some(q) = &d.probs {
                    assert_eq!(q[j].len(), TINY_VOCAB);
                    assert!(q[j][*tok as usize] > 0.0, "the proposed token has probability 0 under its own q");
                    assert!(q[j].iter().enumerate().all(|(x, &v)| v == 0.0 || allowed.contains(&(x as u32))), "q puts mass outside the pruned vocabulary");
                    assert!((q[j].iter().sum::<f32>() - 1.0).abs() < 1e-4);
                }
            }
            assert_eq!(d.probs.is_none(), r.params.is_greedy(), "greedy drafts are one-hot (probs None), sampled ones carry q");
        }
    }
    assert!(proposed > 100);
}

#[test]
fn no_hidden_state_or_no_room_means_no_proposal() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 3));
    let path = dir.path().join("head.safetensors");
    write_random_head(&path, &t, 64, 1).unwrap();
    let mut p = MtpProposer::load(&path, &t).unwrap();
    assert!(p.needs_hidden());
    let params = SamplingParams::greedy(16);
    let toks = [1u32, 2, 3];
    let h = hidden(t.config.hidden_size, 9);
    let mut reqs = [request(1, &toks, 3, &params, None), request(2, &toks, 0, &params, Some(&h)), request(3, &toks, 3, &params, Some(&h))];
    let drafts = p.propose(&mut reqs, &pool()).unwrap();
    assert_eq!(drafts[0], Draft::default());
    assert_eq!(drafts[1], Draft::default());
    assert_eq!(drafts[2].tokens.len(), 3);
}

/// The confidence gate: a greedy chain ends at the first draft the head gives less than the gate
/// (softmax at temperature 1), so a gated chain is a prefix of the ungated one, shorter for some
/// sequences; sampled drafts are not gated.
#[test]
fn greedy_drafts_end_where_the_head_is_unsure_and_sampled_ones_do_not() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 7));
    let path = dir.path().join("head.safetensors");
    write_random_head(&path, &t, 64, 8).unwrap();
    let greedy = SamplingParams::greedy(64);
    let sampled = SamplingParams { temperature: 1.0, seed: Some(2), ..SamplingParams::default() };
    let h: Vec<Vec<f32>> = (0..12).map(|i| hidden(t.config.hidden_size, 700 + i)).collect();
    let toks: Vec<Vec<u32>> = (0..12).map(|i| vec![2, 11 * i as u32 + 1]).collect();
    fn reqs<'a>(toks: &'a [Vec<u32>], h: &'a [Vec<f32>], params: &'a SamplingParams) -> Vec<DraftRequest<'a>> {
        (0..toks.len()).map(|i| request(i as u64, &toks[i], 4, params, Some(&h[i]))).collect()
    }
    let (greedy, sampled) = (&greedy, &sampled);
    let full = MtpProposer::load(&path, &t).unwrap().propose(&mut reqs(&toks, &h, greedy), &pool()).unwrap();
    let mut shorter = 0;
    for gate in [0.02f32, 0.05, 0.2] {
        let gated = MtpProposer::load(&path, &t).unwrap().with_min_confidence(gate).propose(&mut reqs(&toks, &h, greedy), &pool()).unwrap();
        for (f, g) in full.iter().zip(&gated) {
            assert_eq!(f.tokens.len(), 4);
            assert!(f.tokens.starts_with(&g.tokens), "the gate only ends a chain early: {:?} vs {:?}", g.tokens, f.tokens);
            shorter += usize::from(g.tokens.len() < 4);
        }
    }
    assert!(shorter > 0, "a random head should be unsure somewhere");
    // never confident enough: no greedy drafts at all; sampled drafts keep their length
    let none = MtpProposer::load(&path, &t).unwrap().with_min_confidence(1.01).propose(&mut reqs(&toks, &h, greedy), &pool()).unwrap();
    assert!(none.iter().all(|d| d.tokens.is_empty()));
    let s = MtpProposer::load(&path, &t).unwrap().with_min_confidence(1.01).propose(&mut reqs(&toks, &h, sampled), &pool()).unwrap();
    assert!(s.iter().all(|d| d.tokens.len() == 4));
}

/// A sequence's drafts depend on its own tokens and hidden state only, not on its batch.
#[test]
fn a_sequences_drafts_do_not_depend_on_the_batch() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 4));
    let path = dir.path().join("head.safetensors");
    write_random_head(&path, &t, 100, 2).unwrap();
    let mut p = MtpProposer::load(&path, &t).unwrap();
    let params = SamplingParams::greedy(16);
    let h: Vec<Vec<f32>> = (0..6).map(|i| hidden(t.config.hidden_size, 100 + i)).collect();
    let toks: Vec<Vec<u32>> = (0..6).map(|i| vec![40 + i as u32, 7 * i as u32]).collect();
    let alone = p.propose(&mut [request(0, &toks[0], 5, &params, Some(&h[0]))], &pool()).unwrap();
    let mut reqs: Vec<DraftRequest> = (0..6).map(|i| request(i as u64, &toks[i], 5 - i % 3, &params, Some(&h[i]))).collect();
    let batched = p.propose(&mut reqs, &pool()).unwrap();
    assert_eq!(alone[0], batched[0]);
}

/// The head computed plainly, one sequence at a time, with every weight in f32 (the semantics a
/// trainer must reproduce): step j feeds concat(embed(token), hidden) through fc, one pre-norm
/// decoder layer attending over chain positions 0..=j (RoPE rotate-half at position j), the
/// output norm and lm_head; the argmax draft id maps through d2t and the layer's output is the
/// next step's hidden state.
fn reference_greedy_chain(t: &LlamaModel, cfg: &HeadConfig, w: &HeadWeightsF32, last: u32, h0: &[f32], k: usize) -> Vec<u32> {
    let (h, hd, nh, nkv) = (cfg.target_hidden, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
    let matvec = |m: &[f32], x: &[f32]| -> Vec<f32> { m.chunks_exact(x.len()).map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum()).collect() };
    let norm = |x: &[f32], wt: &[f32]| -> Vec<f32> {
        let s = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32 + cfg.rms_eps).sqrt();
        x.iter().zip(wt).map(|(v, g)| v / s * g).collect()
    };
    let rope = |x: &mut [f32], pos: usize| {
        for head in x.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let a = pos as f32 / cfg.rope_theta.powf(2.0 * i as f32 / hd as f32);
                let (x0, x1) = (head[i], head[i + hd / 2]);
                head[i] = x0 * a.cos() - x1 * a.sin();
                head[i + hd / 2] = x0 * a.sin() + x1 * a.cos();
            }
        }
    };
    let (mut tok, mut hid, mut ks, mut vs, mut out) = (last, h0.to_vec(), Vec::<Vec<f32>>::new(), Vec::<Vec<f32>>::new(), Vec::new());
    for pos in 0..k {
        let mut inp = vec![0f32; 2 * h];
        t.embed_into(tok, &mut inp[..h]);
        inp[h..].copy_from_slice(&hid);
        let mut x = matvec(&w.fc, &inp);
        let xn = norm(&x, &w.attn_norm);
        let (mut q, mut kk) = (matvec(&w.attn_q, &xn), matvec(&w.attn_k, &xn));
        rope(&mut q, pos);
        rope(&mut kk, pos);
        ks.push(kk);
        vs.push(matvec(&w.attn_v, &xn));
        let mut attn = vec![0f32; nh * hd];
        for head in 0..nh {
            let g = head / (nh / nkv);
            let qh = &q[head * hd..(head + 1) * hd];
            let scores: Vec<f32> = ks.iter().map(|kv| qh.iter().zip(&kv[g * hd..(g + 1) * hd]).map(|(a, b)| a * b).sum::<f32>() / (hd as f32).sqrt()).collect();
            let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for (p, v) in e.iter().zip(&vs) {
                for d in 0..hd {
                    attn[head * hd + d] += p / z * v[g * hd + d];
                }
            }
        }
        x.iter_mut().zip(matvec(&w.attn_output, &attn)).for_each(|(a, b)| *a += b);
        let xn = norm(&x, &w.ffn_norm);
        let act: Vec<f32> = matvec(&w.ffn_gate, &xn).iter().zip(matvec(&w.ffn_up, &xn)).map(|(g, u)| g / (1.0 + (-g).exp()) * u).collect();
        x.iter_mut().zip(matvec(&w.ffn_down, &act)).for_each(|(a, b)| *a += b);
        let logits = matvec(&w.lm_head, &norm(&x, &w.norm));
        let d = logits.iter().enumerate().fold(0, |best, (i, &v)| if v > logits[best] { i } else { best });
        tok = w.d2t[d];
        out.push(tok);
        hid = x;
    }
    out
}

#[test]
fn greedy_drafts_match_a_naive_reference_forward_of_the_head() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 5));
    let (cfg, w) = random_head(&t, 120, 11).unwrap();
    let path = dir.path().join("head.safetensors");
    save_head(&path, &w, &cfg, StoredDtype::F32).unwrap();
    // the weights as stored: the reference computes in f32 (the Q8_0 default is checked below)
    let mut p = MtpProposer::load_with(&path, &t, HeadWeights::AsStored).unwrap();
    let params = SamplingParams::greedy(16);
    let k = 6;
    let hs: Vec<Vec<f32>> = (0..5).map(|i| hidden(cfg.target_hidden, 300 + i)).collect();
    let toks: Vec<Vec<u32>> = (0..5).map(|i| vec![3, 90 + 31 * i as u32]).collect();
    let mut reqs: Vec<DraftRequest> = (0..5).map(|i| request(i as u64, &toks[i], k, &params, Some(&hs[i]))).collect();
    let drafts = p.propose(&mut reqs, &pool()).unwrap();
    let mut distinct = HashSet::new();
    for (i, d) in drafts.iter().enumerate() {
        let want = reference_greedy_chain(&t, &cfg, &w, toks[i][1], &hs[i], k);
        assert_eq!(d.tokens, want, "sequence {i}");
        distinct.extend(want);
    }
    assert!(distinct.len() > 3, "the chains should not all collapse onto one token: {distinct:?}");
}

#[test]
fn f16_bf16_and_q8_0_heads_load_and_draft_like_the_f32_head() {
    let dir = tempfile::tempdir().unwrap();
    let t = target(&tiny_model(dir.path(), 6));
    let (cfg, w) = random_head(&t, 80, 4).unwrap();
    let params = SamplingParams::greedy(16);
    let hs: Vec<Vec<f32>> = (0..8).map(|i| hidden(cfg.target_hidden, 500 + i)).collect();
    let toks: Vec<Vec<u32>> = (0..8).map(|i| vec![5, 17 * i as u32]).collect();
    let mut reqs: Vec<DraftRequest> = (0..8).map(|i| request(i as u64, &toks[i], 1, &params, Some(&hs[i]))).collect();
    let mut first = Vec::new();
    for (dtype, name) in [(StoredDtype::F32, "f32"), (StoredDtype::F16, "f16"), (StoredDtype::BF16, "bf16")] {
        let path = dir.path().join(format!("head-{name}.safetensors"));
        save_head(&path, &w, &cfg, dtype).unwrap();
        let drafts = MtpProposer::load_with(&path, &t, HeadWeights::AsStored).unwrap().propose(&mut reqs, &pool()).unwrap();
        first.push(drafts.iter().map(|d| d.tokens[0]).collect::<Vec<u32>>());
    }
    // the default: the F32 head requantized to Q8_0 at load
    let path = dir.path().join("head-f32.safetensors");
    let drafts = MtpProposer::load(&path, &t).unwrap().propose(&mut reqs, &pool()).unwrap();
    first.push(drafts.iter().map(|d| d.tokens[0]).collect::<Vec<u32>>());
    // a head stored as Q8_0 holds exactly the blocks serving computes from the F32 file (the same
    // drafts, served as stored or through the default load), in about 34/64 of F16's bytes
    let (q8_path, f16_path) = (dir.path().join("head-q8_0.safetensors"), dir.path().join("head-f16.safetensors"));
    save_head(&q8_path, &w, &cfg, StoredDtype::Q8_0).unwrap();
    let size = |p: &Path| std::fs::metadata(p).unwrap().len();
    assert!(size(&q8_path) * 10 < size(&f16_path) * 7, "q8_0 {} bytes, f16 {}", size(&q8_path), size(&f16_path));
    for weights in [HeadWeights::AsStored, HeadWeights::Q8_0] {
        let stored = MtpProposer::load_with(&q8_path, &t, weights).unwrap().propose(&mut reqs, &pool()).unwrap();
        assert_eq!(stored.iter().map(|d| d.tokens[0]).collect::<Vec<u32>>(), first[3], "{weights:?}");
    }
    // rounding may flip a near tie, not most first drafts
    for (i, other) in first[1..].iter().enumerate() {
        let same = first[0].iter().zip(other).filter(|(a, b)| a == b).count();
        assert!(same >= 6, "dtype {i}: {:?} vs f32 {:?}", other, first[0]);
    }
}

// ---------------------------------------------------------------------------------------------
// Through the engine
// ---------------------------------------------------------------------------------------------

/// Per sequence: its prompt length and the positions of the rows handed to the proposer, in order.
type RowsSeen = HashMap<SeqId, (usize, Vec<usize>)>;

/// Records every proposed token (to check them against the pruned vocabulary afterwards) and,
/// per sequence, the positions of the target rows the engine handed over (`rows`).
struct Recording {
    inner: Box<dyn Proposer>,
    seen: Arc<Mutex<Vec<u32>>>,
    rows: Arc<Mutex<RowsSeen>>,
    /// The target's hidden size.
    hidden_size: usize,
}

impl Recording {
    fn new(inner: Box<dyn Proposer>, seen: Arc<Mutex<Vec<u32>>>, hidden_size: usize) -> Self {
        Self { inner, seen, rows: Default::default(), hidden_size }
    }
}

impl Proposer for Recording {
    fn propose(&mut self, reqs: &mut [DraftRequest], pool: &rayon::ThreadPool) -> Result<Vec<Draft>, SpecError> {
        let mut rows = self.rows.lock().unwrap();
        for r in reqs.iter() {
            let Some(hidden) = r.hidden else { continue };
            let n = hidden.len() / self.hidden_size;
            let e = rows.entry(r.seq).or_insert((r.prompt_len, Vec::new()));
            e.1.extend((0..n).map(|j| r.tokens.len() - n + j - 1));
        }
        drop(rows);
        let drafts = self.inner.propose(reqs, pool)?;
        self.seen.lock().unwrap().extend(drafts.iter().flat_map(|d| d.tokens.iter().copied()));
        Ok(drafts)
    }
    fn rollback(&mut self, seq: SeqId, kept: usize) {
        self.inner.rollback(seq, kept)
    }
    fn remove(&mut self, seq: SeqId) {
        self.inner.remove(seq)
    }
    fn hidden_layers(&self) -> &[usize] {
        self.inner.hidden_layers()
    }
}

fn prompts() -> Vec<Vec<u32>> {
    ["hello hello hello hello", "abcabcabcabc", "The quick brown fox", "1 2 3 4 5 6", "zzzz"].iter().map(|s| s.bytes().map(u32::from).collect()).collect()
}

/// Both kinds of head, reading the final hidden state or several layers' (fused); a `sequence`
/// head also must be handed every row of every sequence once, in order, from the last prompt row
/// on (what its attention context is built from), drafting or not.
#[test]
fn greedy_with_mtp_speculation_is_token_for_token_greedy_without() {
    for (context, layers) in [(HeadContext::Chain, vec![1]), (HeadContext::Sequence, vec![1]), (HeadContext::Sequence, vec![0, 1])] {
        greedy_with_mtp_head_is_greedy_without(context, &layers);
    }
}

fn greedy_with_mtp_head_is_greedy_without(context: HeadContext, layers: &[usize]) {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 7);
    let t = target(&model);
    let head = dir.path().join("head.safetensors");
    let (mut hc, mut w) = random_head(&t, 64, 5).unwrap();
    hc.context = context;
    if layers.len() > 1 {
        w.fuse = fmt::pass_through_fuse(&hc, layers, 0.5, 3).unwrap();
        hc.feature_layers = layers.to_vec();
    }
    save_head(&head, &w, &hc, StoredDtype::F32).unwrap();
    let allowed: HashSet<u32> = MtpHead::load(&head, &t).unwrap().vocab().d2t_slice().iter().copied().collect();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(40) };
    let reqs: Vec<(Vec<u32>, SamplingParams)> = prompts().into_iter().map(|p| (p, params.clone())).collect();

    let plain = Rig::new(&model, tiny_config(), None).run_batch(&reqs);
    let cfg = spec_config(SpecMethod::Mtp, 4, Some(&head));
    let inner = build_proposer(&cfg, &t, &tiny_config()).expect("the production build_proposer loads the head");
    let seen = Arc::new(Mutex::new(Vec::new()));
    assert_eq!(inner.hidden_layers(), layers);
    let recording = Recording::new(inner, seen.clone(), t.config.hidden_size * layers.len());
    let rows = recording.rows.clone();
    let mut rig = Rig::with_proposer(&model, tiny_config(), Some((cfg, Box::new(recording))));
    let spec = rig.run_batch(&reqs);
    rig.assert_no_leaks();
    let rows = rows.lock().unwrap();
    assert_eq!(rows.len(), reqs.len());
    for (prompt_len, positions) in rows.values() {
        let outputs = spec.iter().map(|o| o.tokens.len());
        // the rows of every emitted token but the last (which ends the sequence, no more drafts)
        let expected: Vec<usize> = (prompt_len - 1..prompt_len - 1 + positions.len()).collect();
        assert_eq!(positions, &expected, "rows handed over out of order or with gaps");
        // the last step emits 1 + up to k tokens and hands over no rows
        assert!(
            outputs.clone().any(|n| (positions.len() + 1..=positions.len() + 5).contains(&n)),
            "a sequence of {} rows matches no output length",
            positions.len()
        );
    }

    let mut outside = 0;
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert!(matches!(a.end, End::Finished(_)), "prompt {i}: {:?}", a.end);
        assert_eq!(a.tokens, b.tokens, "prompt {i}: greedy tokens differ with mtp speculation");
        assert_eq!(a.end, b.end);
        outside += a.tokens.iter().filter(|t| !allowed.contains(t)).count();
    }
    assert!(outside > 0, "the target emitted only pruned-vocabulary tokens: the test proves less than it says");
    let seen = seen.lock().unwrap();
    assert!(seen.iter().all(|t| allowed.contains(t)), "a token outside the pruned vocabulary was proposed");
    let m = rig.engine.spec_metrics().expect("speculation is on");
    assert!(m.num_draft_tokens > 0, "the mtp proposer never drafted: {m:?}");
    // identity with zero accepted drafts would prove only that rejection works
    assert!(m.num_accepted_tokens > 0, "no mtp draft was ever accepted: {m:?}");
    assert_eq!(m.num_draft_tokens as usize, seen.len(), "every proposed token was verified");
}

#[test]
fn seeded_sampling_with_mtp_is_reproducible_and_returns_every_block() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path(), 8);
    let t = target(&model);
    let head = dir.path().join("head.safetensors");
    write_random_head(&head, &t, TINY_VOCAB, 6).unwrap();
    let params = SamplingParams { temperature: 0.7, seed: Some(42), ignore_eos: true, max_tokens: 30, ..SamplingParams::default() };
    let reqs: Vec<(Vec<u32>, SamplingParams)> = prompts().into_iter().map(|p| (p, params.clone())).collect();
    let run = || {
        let cfg = spec_config(SpecMethod::Mtp, 3, Some(&head));
        let p = build_proposer(&cfg, &t, &tiny_config()).unwrap();
        let mut rig = Rig::with_proposer(&model, tiny_config(), Some((cfg, p)));
        let out = rig.run_batch(&reqs);
        rig.assert_no_leaks();
        assert!(rig.engine.spec_metrics().unwrap().num_draft_tokens > 0);
        out.into_iter().map(|o| o.tokens).collect::<Vec<_>>()
    };
    let a = run();
    assert!(a.iter().all(|t| t.len() == 30));
    assert_eq!(a, run());
}

// ---------------------------------------------------------------------------------------------
// Refusals with clear errors
// ---------------------------------------------------------------------------------------------

struct Fixture {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    target: LlamaModel,
    head: PathBuf,
}

fn fixture(seed: u64) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let target = target(&tiny_model(dir.path(), seed));
    let head = dir.path().join("head.safetensors");
    write_random_head(&head, &target, 32, 1).unwrap();
    Fixture { dir: dir.path().to_path_buf(), _dir: dir, target, head }
}

#[test]
fn a_corrupt_or_truncated_head_file_is_refused() {
    let f = fixture(10);
    let garbage = f.dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"this is not a safetensors file at all").unwrap();
    let e = load_err(&garbage, &f.target);
    assert!(e.contains("garbage.safetensors") && e.contains("not a valid safetensors file"), "{e}");

    let bytes = std::fs::read(&f.head).unwrap();
    let truncated = f.dir.join("truncated.safetensors");
    std::fs::write(&truncated, &bytes[..bytes.len() - 100]).unwrap();
    let e = load_err(&truncated, &f.target);
    assert!(e.contains("corrupt or truncated"), "{e}");

    let e = load_err(&f.dir.join("absent.safetensors"), &f.target);
    assert!(e.contains("cannot read"), "{e}");

    let foreign = f.dir.join("foreign.safetensors");
    rewrite(&f.head, &foreign, None, &[], |md| {
        md.insert("format".into(), "eagle3".into());
    });
    let e = load_err(&foreign, &f.target);
    assert!(e.contains("metadata format is 'eagle3', expected 'specula-mtp-v1'"), "{e}");

    let no_key = f.dir.join("no-key.safetensors");
    rewrite(&f.head, &no_key, None, &[], |md| {
        md.remove("rope_theta");
    });
    assert!(load_err(&no_key, &f.target).contains("metadata key 'rope_theta' is missing"));
}

#[test]
fn a_missing_or_misshapen_tensor_is_named() {
    let f = fixture(11);
    for name in [fmt::FFN_UP, fmt::LM_HEAD, fmt::T2D, fmt::D2T] {
        let p = f.dir.join("missing.safetensors");
        rewrite(&f.head, &p, Some(name), &[], |_| {});
        let e = load_err(&p, &f.target);
        assert!(e.contains(&format!("tensor '{name}' is missing")), "{e}");
    }
    let p = f.dir.join("misshapen.safetensors");
    rewrite(&f.head, &p, None, &[], |md| {
        md.insert("ffn".into(), "96".into());
    });
    let e = load_err(&p, &f.target);
    assert!(e.contains("tensor 'layer.ffn_gate.weight' has shape [128, 64], expected [96, 64]"), "{e}");
    // a head said to read two layers needs the matrix that fuses them
    rewrite(&f.head, &p, None, &[], |md| {
        md.insert("feature_layers".into(), "0,1".into());
    });
    let e = load_err(&p, &f.target);
    assert!(e.contains(&format!("tensor '{}' is missing", fmt::FUSE)), "{e}");
    rewrite(&f.head, &p, None, &[], |md| {
        md.insert("feature_layers".into(), "1,7".into());
    });
    let e = load_err(&p, &f.target);
    assert!(e.contains("'feature_layers'"), "{e}");
}

#[test]
fn a_head_of_another_hidden_size_is_refused() {
    let f = fixture(12);
    let small = f.dir.join("small.gguf");
    write_tiny_llama(&small, &TinySpec { hidden: 32, heads: 2, kv_heads: 1, ffn: 64, ..Default::default() }).unwrap();
    let small_head = f.dir.join("small-head.safetensors");
    write_random_head(&small_head, &target(&small), 32, 1).unwrap();
    let e = load_err(&small_head, &f.target);
    assert!(e.contains("head hidden size 32 does not match the target's 64"), "{e}");
}

#[test]
fn a_head_trained_for_another_target_is_refused() {
    let f = fixture(13);
    let other = target(&tiny_model(&f.dir, 14)); // same shapes, other weights
    let e = load_err(&f.head, &other);
    assert!(e.contains("this head was trained for a different target model"), "{e}");
    // a head may list several accepted fingerprints
    let both = f.dir.join("both.safetensors");
    let fp = fmt::target_fingerprint(&other);
    rewrite(&f.head, &both, None, &[], |md| {
        let own = md["target_fingerprint"].clone();
        md.insert("target_fingerprint".into(), format!("{own}, {fp}"));
    });
    MtpHead::load(&both, &other).expect("listed fingerprint");
    MtpHead::load(&both, &f.target).expect("own fingerprint");
    assert_eq!(fmt::target_fingerprint(&f.target), fmt::target_fingerprint(&target(&tiny_model(&f.dir, 13))), "the fingerprint is a function of the weights");
    assert_eq!(fp.len(), 64);
}

#[test]
fn out_of_range_d2t_and_inconsistent_t2d_are_refused() {
    let f = fixture(15);
    let file = HeadFile::open(&f.head).unwrap();
    let d2t = file.ids(fmt::D2T, 32).unwrap();
    let t2d = file.ids(fmt::T2D, TINY_VOCAB).unwrap();

    let mut bad = d2t.clone();
    bad[3] = 9999;
    let p = f.dir.join("bad-d2t.safetensors");
    rewrite(&f.head, &p, None, &[(fmt::D2T, bad.iter().flat_map(|v| v.to_le_bytes()).collect())], |_| {});
    let e = load_err(&p, &f.target);
    assert!(e.contains("d2t[3] = 9999 is outside the target vocabulary of 259 tokens"), "{e}");

    let mut dup = d2t.clone();
    dup[1] = dup[0];
    rewrite(&f.head, &p, None, &[(fmt::D2T, dup.iter().flat_map(|v| v.to_le_bytes()).collect())], |_| {});
    assert!(load_err(&p, &f.target).contains("d2t maps two draft ids"));

    let outside = (0..TINY_VOCAB).find(|&t| t2d[t] == -1).unwrap();
    let mut bad = t2d.clone();
    bad[outside] = 0;
    rewrite(&f.head, &p, None, &[(fmt::T2D, bad.iter().flat_map(|&v| (v as i32).to_le_bytes()).collect())], |_| {});
    let e = load_err(&p, &f.target);
    assert!(e.contains(&format!("t2d is inconsistent with d2t: t2d[{outside}] = 0 but d2t gives -1")), "{e}");
}

#[test]
fn build_proposer_explains_what_mtp_needs() {
    let f = fixture(16);
    let no_head = spec_config(SpecMethod::Mtp, 3, None);
    // a target without a prediction layer of its own needs a head file
    let e = build_proposer(&no_head, &f.target, &tiny_config()).err().unwrap().to_string();
    assert!(e.contains("has no multi-token-prediction layer of its own (nextn); pass --draft-model"), "{e}");
    let cfg = spec_config(SpecMethod::Mtp, 3, Some(&f.head));
    let e = build_proposer(&cfg, &f.target.config, &tiny_config()).err().unwrap().to_string();
    assert!(e.contains("build it from the loaded target model"), "{e}");
    let p = build_proposer(&cfg, &f.target, &tiny_config()).unwrap();
    assert!(p.needs_hidden());
}

// ---------------------------------------------------------------------------------------------
// The head shipped for the default model (heads/README.md)
// ---------------------------------------------------------------------------------------------

fn shipped_head() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../heads/smollm2-135m-instruct-q4_1.mtp.safetensors")
}

/// The first `n` held-out prompts (heads/heldout-prompts.txt, one per line: topics the head
/// never saw in training), chat template applied.
fn heldout_prompts(model: &Path, n: usize) -> Vec<Vec<u32>> {
    let loaded = load_model(model).expect("load default model");
    let template = loaded.chat_template.expect("the default model ships a chat template");
    let text = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../heads/heldout-prompts.txt")).expect("heads/heldout-prompts.txt");
    let prompts: Vec<Vec<u32>> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .take(n)
        .map(|line| {
            let msgs = [specula_model::ChatMessage { role: "user".into(), content: line.into() }];
            loaded.tokenizer.encode(&template.render(&msgs, true).expect("render chat")).expect("encode")
        })
        .collect();
    assert_eq!(prompts.len(), n, "heads/heldout-prompts.txt has too few prompts");
    prompts
}

fn default_model_config() -> EngineConfig {
    EngineConfig {
        max_num_seqs: 32,
        max_num_batched_tokens: 1024,
        max_model_len: 512,
        block_size: 16,
        num_kv_blocks: 320,
        enable_prefix_caching: true,
        threads: 2,
        ..Default::default()
    }
}

struct ShippedRuns {
    plain: Vec<spec_support::Outcome>,
    mtp: Vec<spec_support::Outcome>,
    metrics: specula_engine::speculative::SpecMetrics,
    /// Every token the head proposed.
    proposed: Vec<u32>,
    pruned: HashSet<u32>,
}

/// 20 held-out prompts, greedy with top-5 logprobs, without speculation and with the shipped head
/// (k = 3, adaptive off so every step drafts): shared by the tests below.
fn shipped_runs() -> Option<&'static ShippedRuns> {
    static RUNS: std::sync::OnceLock<Option<ShippedRuns>> = std::sync::OnceLock::new();
    RUNS.get_or_init(|| {
        let model = specula_model::testing::model_for_tests("mtp_head (shipped head)")?;
        let params = SamplingParams { logprobs: Some(5), ..SamplingParams::greedy(48) };
        let reqs: Vec<(Vec<u32>, SamplingParams)> = heldout_prompts(&model, 20).into_iter().map(|p| (p, params.clone())).collect();
        let plain = Rig::new(&model, default_model_config(), None).run_batch(&reqs);
        let t = target(&model);
        let cfg = spec_config(SpecMethod::Mtp, 3, Some(&shipped_head()));
        let inner = build_proposer(&cfg, &t, &default_model_config()).expect("the shipped head loads for the default model");
        let pruned: HashSet<u32> = MtpHead::load(&shipped_head(), &t).unwrap().vocab().d2t_slice().iter().copied().collect();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut rig = Rig::with_proposer(&model, default_model_config(), Some((cfg, Box::new(Recording::new(inner, seen.clone(), t.config.hidden_size)))));
        let mtp = rig.run_batch(&reqs);
        rig.assert_no_leaks();
        let metrics = rig.engine.spec_metrics().expect("speculation is on").clone();
        let proposed = std::mem::take(&mut *seen.lock().unwrap());
        Some(ShippedRuns { plain, mtp, metrics, proposed, pruned })
    })
    .as_ref()
}

#[test]
fn greedy_with_the_shipped_head_is_token_for_token_greedy_without_on_20_heldout_prompts() {
    let Some(r) = shipped_runs() else { return };
    let total: usize = r.plain.iter().map(|o| o.tokens.len()).sum();
    assert!(total >= 20 * 20, "only {total} tokens generated: the comparison proves little");
    for (i, (a, b)) in r.plain.iter().zip(&r.mtp).enumerate() {
        assert!(matches!(a.end, End::Finished(_)), "prompt {i} without speculation: {:?}", a.end);
        assert_eq!(a.tokens, b.tokens, "held-out prompt {i}: greedy tokens differ with the shipped mtp head");
        assert_eq!(a.end, b.end);
    }
    assert!(r.mtp.iter().any(|o| o.step_sizes.iter().any(|&n| n > 1)), "no step emitted verified drafts");
}

/// The shipped head is trained: on prompts it never saw, with k = 3 drafted every step, about 15%
/// of its draft tokens are accepted (a random head's: about 1%), and it proposes only from its
/// pruned vocabulary while the target still emits tokens outside it (verification alone produces
/// those).
#[test]
fn the_shipped_head_is_trained_and_drafts_only_its_pruned_vocabulary() {
    let Some(r) = shipped_runs() else { return };
    let m = &r.metrics;
    assert_eq!(m.num_draft_tokens as usize, r.proposed.len(), "every proposed token was verified");
    let rate = m.num_accepted_tokens as f64 / m.num_draft_tokens.max(1) as f64;
    assert!(rate > 0.1, "the shipped head's acceptance rate is {rate:.3} on held-out prompts: is it trained? {m:?}");
    assert!(r.proposed.iter().all(|t| r.pruned.contains(t)), "a token outside the pruned vocabulary was proposed");
    let t = target(&specula_model::testing::model_for_tests("mtp_head (shipped head)").expect("shipped_runs ran, so the model is there"));
    assert_eq!(
        MtpHead::load(&shipped_head(), &t).unwrap().config.context,
        HeadContext::Sequence,
        "heads/README.md says the shipped head attends over the sequence"
    );
    let outside: usize = r.plain.iter().map(|o| o.tokens.iter().filter(|t| !r.pruned.contains(t)).count()).sum();
    eprintln!("acceptance rate {rate:.3}; {outside} emitted tokens lie outside the pruned vocabulary ({m:?})");
}

#[test]
fn logprobs_with_the_shipped_head_equal_logprobs_without() {
    let Some(r) = shipped_runs() else { return };
    let mut verified = 0;
    for (i, (a, b)) in r.plain.iter().zip(&r.mtp).enumerate() {
        assert_eq!((a.logprobs.len(), b.logprobs.len()), (a.tokens.len(), b.tokens.len()), "prompt {i}: one logprob entry per token");
        verified += b.step_sizes.iter().filter(|&&n| n > 1).sum::<usize>();
        for (j, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
            let at = format!("prompt {i}, token {j}");
            assert_eq!(x.token, y.token, "{at}");
            assert!((x.logprob - y.logprob).abs() <= 1e-5, "{at}: logprob {} vs {}", x.logprob, y.logprob);
            for ((ta, la), (tb, lb)) in x.top.iter().zip(&y.top) {
                assert_eq!(ta, tb, "{at}: top-5 ids {:?} vs {:?}", x.top, y.top);
                assert!((la - lb).abs() <= 1e-5, "{at}: top-5 logprobs {:?} vs {:?}", x.top, y.top);
            }
        }
    }
    assert!(verified > 50, "only {verified} tokens came from verification steps");
}

/// The shipped file refused with a clear error when it does not fit: another target (a tiny model
/// of another shape), a fingerprint that is not the target's, a damaged file.
#[test]
fn the_shipped_head_refuses_a_mismatched_target_or_a_damaged_file() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = target(&tiny_model(dir.path(), 15));
    let e = load_err(&shipped_head(), &tiny);
    assert!(e.contains("head hidden size 576 does not match the target's 64"), "{e}");
    let Some(model) = specula_model::testing::model_for_tests("mtp_head (shipped head, refusals)") else { return };
    let t = target(&model);
    let other = dir.path().join("other.safetensors");
    rewrite(&shipped_head(), &other, None, &[], |md| {
        md.insert("target_fingerprint".into(), "0".repeat(64));
    });
    let e = load_err(&other, &t);
    assert!(e.contains("this head was trained for a different target model"), "{e}");
    let bytes = std::fs::read(shipped_head()).unwrap();
    let cut = dir.path().join("cut.safetensors");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&cut, &t);
    assert!(e.contains("cut.safetensors"), "the error names the file: {e}");
}

/// A draft step costs what its weights take to read, next to a target step: F16 twice the bytes
/// of a weight, Q8_0 (the default, and the shipped file's type) 34 bytes per block of 32; measured
/// at 2 threads, a Q8_0 draft step of the shipped head takes about a tenth of a plain decode step
/// of the default model.
#[test]
fn the_shipped_heads_draft_cost_follows_the_bytes_it_reads() {
    let Some(model) = specula_model::testing::model_for_tests("the_shipped_heads_draft_cost_follows_the_bytes_it_reads") else { return };
    let t = load_model(&model).expect("load default model").model;
    let q8 = MtpProposer::load(&shipped_head(), &t).unwrap().cost_per_draft_token(&t.config);
    let as_stored = MtpProposer::load_with(&shipped_head(), &t, HeadWeights::AsStored).unwrap().cost_per_draft_token(&t.config);
    assert_eq!(as_stored, q8, "the shipped file stores its matrices as Q8_0: served as stored");
    let dir = tempfile::tempdir().unwrap();
    let f16_path = dir.path().join("f16.safetensors");
    let (cfg, w) = HeadFile::open(&shipped_head()).unwrap().weights_f32().unwrap();
    save_head(&f16_path, &w, &cfg, StoredDtype::F16).unwrap();
    let f16 = MtpProposer::load_with(&f16_path, &t, HeadWeights::AsStored).unwrap().cost_per_draft_token(&t.config);
    assert!((f16 / q8 - 2.0 / (34.0 / 32.0)).abs() < 1e-9, "f16 {f16} q8 {q8}");
    assert!((0.07..0.15).contains(&q8), "{q8}");
}
