//! Mixture-of-experts models: loading llama.cpp-named expert tensors (3-D stacks and the older
//! one-tensor-per-expert layout), clear errors for missing or mis-shaped ones, batch invariance
//! of the routed FFN, and an in-process expert-parallel split giving the same bits as one rank.
//! The numerical oracle (NumPy) is python/tests/test_moe_oracle.py.

mod common;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::QTensor;
use common::{logits_alone, logits_in_mixed_batch};
use specula_model::testing::{write_tiny_moe, GgmlDType, TinyMoe, TinySpec, TINY_VOCAB};
use specula_model::{load_model, load_model_with, ExchangeError, ExpertExchange, ExpertWeights, FeedForward, LlamaModel, LoadOptions, ModelError};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, Mutex};

fn tiny_moe(dir: &Path, name: &str, spec: &TinySpec) -> PathBuf {
    let path = dir.join(name);
    write_tiny_moe(&path, spec).expect("write tiny MoE");
    path
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 37 + seed * 11 + 5) % TINY_VOCAB as u32).collect()
}

#[test]
fn tiny_moe_loads_with_its_experts() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { moe: Some(TinyMoe { experts: 8, used: 2, expert_ffn: 32, shared_ffn: Some(64), norm_topk: None }), ..Default::default() };
    let m = load_model(&tiny_moe(dir.path(), "m.gguf", &spec)).unwrap().model;
    let moe = m.config.moe.clone().expect("MoE config");
    assert_eq!((moe.n_experts, moe.n_used, moe.expert_ffn, moe.shared_ffn, moe.norm_topk), (8, 2, 32, Some(64), true));
    for l in &m.layers {
        let FeedForward::Moe(f) = &l.ffn else { panic!("dense layer in a MoE model") };
        assert_eq!(f.experts.len(), 8);
        assert!(f.experts.iter().all(|e| e.as_ref().is_some_and(|e| (e.gate.rows, e.gate.cols, e.down.rows, e.down.cols) == (32, 64, 64, 32))));
        assert!(f.shared.as_ref().is_some_and(|s| s.gate.is_some()));
    }
}

#[test]
fn tiny_moe_runs_in_every_supported_expert_format_and_is_batch_invariant() {
    let dir = tempfile::tempdir().unwrap();
    for (i, format) in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F16, GgmlDType::F32].into_iter().enumerate() {
        let spec = TinySpec {
            weight_format: format,
            seed: 7,
            moe: Some(TinyMoe { shared_ffn: (i % 2 == 0).then_some(32), ..Default::default() }),
            ..Default::default()
        };
        let m = load_model(&tiny_moe(dir.path(), &format!("m{i}.gguf"), &spec)).unwrap().model;
        let p = prompt(40, i as u32);
        let whole = logits_alone(&m, &p, &[p.len()], 2);
        assert!(whole.iter().all(|x| x.is_finite()), "{format:?}: non-finite logits");
        assert_eq!(whole, logits_alone(&m, &p, &[7, 1, 16], 1), "{format:?}: chunked prefill or thread count changed the logits");
        assert_eq!(whole, logits_in_mixed_batch(&m, &p, 2), "{format:?}: batch neighbours changed the logits");
    }
}

#[test]
fn the_number_of_routed_experts_changes_the_output() {
    // Guard against a forward that ignores routing: the same weights with top-1 and top-2
    // routing must give different logits.
    let dir = tempfile::tempdir().unwrap();
    let top1 =
        load_model(&tiny_moe(dir.path(), "a.gguf", &TinySpec { moe: Some(TinyMoe { used: 1, ..Default::default() }), ..Default::default() })).unwrap().model;
    let top2 =
        load_model(&tiny_moe(dir.path(), "b.gguf", &TinySpec { moe: Some(TinyMoe { used: 2, ..Default::default() }), ..Default::default() })).unwrap().model;
    let p = prompt(12, 3);
    assert_ne!(logits_alone(&top1, &p, &[12], 1), logits_alone(&top2, &p, &[12], 1));
}

/// Rewrites a GGUF file, dropping tensors `drop` names and replacing metadata in `set`.
fn rewrite(src: &Path, dst: &Path, drop: &[&str], set: &[(&str, Value)], reshape: Option<(&str, Vec<usize>)>) {
    let mut f = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        if drop.contains(&name.as_str()) {
            continue;
        }
        let mut t = content.tensor(&mut f, name, &candle_core::Device::Cpu).unwrap();
        if let Some((n, shape)) = &reshape {
            if n == name {
                let d = t.dequantize(&candle_core::Device::Cpu).unwrap().flatten_all().unwrap().reshape(shape.as_slice()).unwrap();
                t = QTensor::quantize(&d, GgmlDType::F32).unwrap();
            }
        }
        tensors.push((name.clone(), t));
    }
    let mut md: Vec<(String, Value)> = content.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in set {
        md.retain(|(x, _)| x != k);
        md.push((k.to_string(), v.clone()));
    }
    let md: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut w = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut w, &md, &ts).unwrap();
}

fn load_err(path: &Path) -> String {
    match load_model(path) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_or_mis_shaped_expert_tensors_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { weight_format: GgmlDType::F32, ..Default::default() };
    let good = tiny_moe(dir.path(), "good.gguf", &spec);
    let bad = dir.path().join("bad.gguf");

    rewrite(&good, &bad, &["blk.1.ffn_up_exps.weight"], &[], None);
    let e = load_err(&bad);
    assert!(e.contains("blk.1.ffn_up_exps.weight") && e.contains("missing"), "{e}");

    rewrite(&good, &bad, &["blk.0.ffn_gate_inp.weight"], &[], None);
    let e = load_err(&bad);
    assert!(e.contains("blk.0.ffn_gate_inp.weight") && e.contains("missing"), "{e}");

    rewrite(&good, &bad, &[], &[("llama.expert_count", Value::U32(8))], None);
    let e = load_err(&bad);
    assert!(e.contains("ffn_gate_exps") && e.contains("4 experts") && e.contains("8"), "{e}");

    rewrite(&good, &bad, &[], &[("llama.expert_used_count", Value::U32(5))], None);
    let e = load_err(&bad);
    assert!(e.contains("5 experts used per token out of 4"), "{e}");

    // a router with the wrong shape
    rewrite(&good, &bad, &[], &[], Some(("blk.0.ffn_gate_inp.weight", vec![2, 128])));
    let e = load_err(&bad);
    assert!(e.contains("router") && e.contains("[2, 128]"), "{e}");

    // a 2-D tensor where the 3-D expert stack belongs
    rewrite(&good, &bad, &[], &[], Some(("blk.0.ffn_down_exps.weight", vec![4 * 64, 64])));
    let e = load_err(&bad);
    assert!(e.contains("blk.0.ffn_down_exps.weight") && e.contains("3 dimensions"), "{e}");

    // routers without expert_count
    let dense_md = dir.path().join("nocount.gguf");
    rewrite_without_key(&good, &dense_md, "llama.expert_count");
    let e = load_err(&dense_md);
    assert!(e.contains("llama.expert_count") && e.contains("ffn_gate_inp"), "{e}");
}

fn rewrite_without_key(src: &Path, dst: &Path, key: &str) {
    let mut f = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors = Vec::new();
    for name in content.tensor_infos.keys() {
        tensors.push((name.clone(), content.tensor(&mut f, name, &candle_core::Device::Cpu).unwrap()));
    }
    let md: Vec<(&str, &Value)> = content.metadata.iter().filter(|(k, _)| k.as_str() != key).map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(dst).unwrap(), &md, &ts).unwrap();
}

#[test]
fn per_expert_tensors_of_older_files_load_like_the_stacks() {
    // Older llama.cpp files store blk.N.ffn_gate.E.weight per expert instead of one 3-D stack.
    let dir = tempfile::tempdir().unwrap();
    let good = tiny_moe(dir.path(), "stacked.gguf", &TinySpec { weight_format: GgmlDType::F32, ..Default::default() });
    let split = dir.path().join("split.gguf");
    let mut f = std::fs::File::open(&good).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    for name in content.tensor_infos.keys() {
        let t = content.tensor(&mut f, name, &candle_core::Device::Cpu).unwrap();
        match name.strip_suffix("_exps.weight") {
            Some(stem) => {
                let d = t.dequantize(&candle_core::Device::Cpu).unwrap();
                for e in 0..4 {
                    let one = d.get(e).unwrap();
                    let one =
                        candle_core::Tensor::from_vec(one.flatten_all().unwrap().to_vec1::<f32>().unwrap(), one.dims(), &candle_core::Device::Cpu).unwrap();
                    tensors.push((format!("{stem}.{e}.weight"), QTensor::quantize(&one, GgmlDType::F32).unwrap()));
                }
            }
            None => tensors.push((name.clone(), t)),
        }
    }
    let md: Vec<(&str, &Value)> = content.metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    gguf_file::write(&mut std::fs::File::create(&split).unwrap(), &md, &ts).unwrap();
    let (a, b) = (load_model(&good).unwrap().model, load_model(&split).unwrap().model);
    let p = prompt(20, 1);
    assert!(logits_alone(&a, &p, &[20], 1) == logits_alone(&b, &p, &[20], 1), "per-expert tensors give other logits than the stacks");
}

/// `--expert-weights mapped`: the experts are read in place from the file's map (nothing
/// repacked, their bytes counted as in place), the dense weights are repacked as before, and the
/// logits are the repacked model's bits, in a whole prefill, in chunks on one thread and beside
/// other sequences in one batch. Formats without an int8 kernel (F16) stay repacked.
#[test]
fn experts_read_in_place_give_the_repacked_bits() {
    let dir = tempfile::tempdir().unwrap();
    let load = |path: &Path, w: ExpertWeights| load_model_with(path, &LoadOptions { expert_weights: w, ..Default::default() }).unwrap();
    for (i, format) in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::F16].into_iter().enumerate() {
        let spec = TinySpec { weight_format: format, seed: 11, moe: Some(TinyMoe { shared_ffn: Some(32), ..Default::default() }), ..Default::default() };
        let path = tiny_moe(dir.path(), &format!("m{i}.gguf"), &spec);
        let (packed, mapped) = (load(&path, ExpertWeights::Repacked), load(&path, ExpertWeights::Mapped));
        let experts = |m: &LlamaModel| -> Vec<bool> {
            m.layers
                .iter()
                .flat_map(|l| match &l.ffn {
                    FeedForward::Moe(f) => f.experts.iter().flatten().flat_map(|e| [e.gate.is_in_place(), e.up.is_in_place(), e.down.is_in_place()]).collect(),
                    FeedForward::Dense(_) => vec![],
                })
                .collect()
        };
        let int8 = format != GgmlDType::F16;
        assert!(experts(&mapped.model).iter().all(|&p| p == int8), "{format:?}: mapped experts read in place where the format has an int8 kernel");
        assert!(experts(&packed.model).iter().all(|&p| !p), "{format:?}");
        assert_eq!(packed.model.in_place_bytes(), 0);
        assert_eq!(mapped.model.in_place_bytes() > 0, int8, "{format:?}");
        for l in &mapped.model.layers {
            assert!(l.mixer_matrices().iter().all(|m| !m.is_in_place()), "dense weights stay repacked");
            let FeedForward::Moe(f) = &l.ffn else { panic!("dense layer") };
            assert!(!f.shared.as_ref().expect("shared expert").ffn.gate.is_in_place(), "the shared expert stays repacked");
        }
        let p = prompt(40, i as u32);
        let want = logits_alone(&packed.model, &p, &[p.len()], 2);
        assert_eq!(want, logits_alone(&mapped.model, &p, &[p.len()], 2), "{format:?}: whole prefill");
        assert_eq!(want, logits_alone(&mapped.model, &p, &[7, 1, 16], 1), "{format:?}: chunks, one thread");
        assert_eq!(want, logits_in_mixed_batch(&mapped.model, &p, 2), "{format:?}: mixed batch");
    }
}

#[test]
fn auto_maps_the_experts_only_when_the_repacked_copy_would_not_fit() {
    let gb = 1usize << 30;
    assert_eq!(ExpertWeights::Auto.settle(18 * gb as u64, Some(22 * gb)), ExpertWeights::Repacked, "a 30B-A3B file on a 24 GB machine");
    assert_eq!(ExpertWeights::Auto.settle(18 * gb as u64, Some(16 * gb)), ExpertWeights::Mapped, "on a 16 GB one");
    assert_eq!(ExpertWeights::Auto.settle(36 * gb as u64, Some(22 * gb)), ExpertWeights::Mapped, "two in-process ranks");
    assert_eq!(ExpertWeights::Auto.settle(18 * gb as u64, None), ExpertWeights::Repacked, "unknown memory");
    assert_eq!(ExpertWeights::Mapped.settle(1, Some(22 * gb)), ExpertWeights::Mapped, "a choice is kept");
    assert_eq!(ExpertWeights::Repacked.settle(36 * gb as u64, Some(gb)), ExpertWeights::Repacked, "a choice is kept");
}

/// An in-process exchange for `n` threads: a barrier-synchronised mailbox (no engine needed).
struct ThreadExchange {
    rank: usize,
    shared: Arc<Mailbox>,
    rows: std::sync::atomic::AtomicUsize,
    calls: std::sync::atomic::AtomicUsize,
}

struct Mailbox {
    n: usize,
    barrier: Barrier,
    slots: Mutex<Vec<Vec<f32>>>,
}

impl ThreadExchange {
    fn group(n: usize) -> Vec<Arc<ThreadExchange>> {
        let shared = Arc::new(Mailbox { n, barrier: Barrier::new(n), slots: Mutex::new(vec![Vec::new(); n]) });
        (0..n).map(|rank| Arc::new(ThreadExchange { rank, shared: shared.clone(), rows: 0.into(), calls: 0.into() })).collect()
    }

    /// Everyone posts `mine`; returns every rank's post.
    fn swap(&self, mine: &[f32]) -> Vec<Vec<f32>> {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.shared.slots.lock().unwrap()[self.rank] = mine.to_vec();
        self.shared.barrier.wait();
        let all = self.shared.slots.lock().unwrap().clone();
        self.shared.barrier.wait();
        all
    }
}

impl ExpertExchange for ThreadExchange {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.shared.n
    }
    fn begin_step(&self, rows: usize) {
        self.rows.store(rows, std::sync::atomic::Ordering::Relaxed);
        self.calls.store(0, std::sync::atomic::Ordering::Relaxed);
    }
    fn step_rows(&self) -> usize {
        self.rows.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn exchanges_this_step(&self) -> usize {
        self.calls.load(std::sync::atomic::Ordering::Relaxed)
    }
    fn all_gather(&self, local: &[f32], out: &mut [f32]) -> Result<(), ExchangeError> {
        out.copy_from_slice(&self.swap(local).concat());
        Ok(())
    }
    fn all_to_all(&self, send: &[f32], recv: &mut [f32]) -> Result<(), ExchangeError> {
        let all = self.swap(send);
        let c = send.len() / self.shared.n;
        for (i, from) in all.iter().enumerate() {
            recv[i * c..(i + 1) * c].copy_from_slice(&from[self.rank * c..(self.rank + 1) * c]);
        }
        Ok(())
    }
    fn abort(&self) {}
}

#[test]
fn expert_parallel_split_gives_the_same_logits_as_one_rank() {
    let dir = tempfile::tempdir().unwrap();
    let spec = TinySpec { weight_format: GgmlDType::Q4_1, seed: 3, moe: Some(TinyMoe { experts: 8, ..Default::default() }), ..Default::default() };
    let path = tiny_moe(dir.path(), "m.gguf", &spec);
    let single = load_model(&path).unwrap().model;
    // rank r works on its own prompt (different lengths: the exchange pads to the longest)
    let prompts: Vec<Vec<u32>> = (0..4).map(|r| prompt(9 + 13 * r, r as u32)).collect();
    let expected: Vec<Vec<f32>> = prompts.iter().map(|p| logits_alone(&single, p, &[p.len()], 1)).collect();
    for n in [2usize, 4] {
        let exchanges = ThreadExchange::group(n);
        let got: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = exchanges
                .iter()
                .map(|ex| {
                    let (path, prompts, ex) = (&path, &prompts, ex.clone());
                    s.spawn(move || {
                        let mut m: LlamaModel = load_model(path).unwrap().model;
                        m.enable_expert_parallel(ex.clone()).unwrap();
                        let held = match &m.layers[0].ffn {
                            FeedForward::Moe(f) => f.experts.iter().filter(|e| e.is_some()).count(),
                            FeedForward::Dense(_) => 0,
                        };
                        assert_eq!(held, 8 / n, "rank {} holds 1/{n} of the experts", ex.rank());
                        let longest = prompts[..n].iter().map(Vec::len).max().unwrap();
                        ex.begin_step(longest);
                        let p = &prompts[ex.rank()];
                        let out = logits_alone(&m, p, &[p.len()], 1);
                        assert_eq!(ex.exchanges_this_step(), m.exchanges_per_forward());
                        out
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in 0..n {
            assert_eq!(got[r], expected[r], "DP={n}: rank {r}'s logits differ from the single-rank model");
        }
    }
}

#[test]
fn expert_parallel_refuses_a_size_that_does_not_divide_the_experts() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny_moe(dir.path(), "m.gguf", &TinySpec::default());
    let mut m = load_model(&path).unwrap().model;
    let ex = ThreadExchange::group(3).remove(1);
    let e = m.enable_expert_parallel(ex).unwrap_err();
    assert!(matches!(e, ModelError::Unsupported(_)) && e.to_string().contains("4 experts") && e.to_string().contains("3 ranks"), "{e}");
    let dense = dir.path().join("dense.gguf");
    specula_model::testing::write_tiny_llama(&dense, &TinySpec::default()).unwrap();
    let mut d = load_model(&dense).unwrap().model;
    let e = d.enable_expert_parallel(ThreadExchange::group(1).remove(0)).unwrap_err();
    assert!(e.to_string().contains("dense"), "{e}");
}
