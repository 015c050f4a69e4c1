//! The prefix cache's lower tiers: blocks evicted from the KV store come back from host memory,
//! and blocks written to `--prefix-cache-dir` by one engine are loaded by the next, with the same
//! tokens and logprobs as the KV computed or found in the store; corrupt or foreign files are
//! never loaded.

mod common;

use common::*;
use specula_engine::kv_cache::disk_tier::model_key;
use specula_engine::kv_cache::{hash_block, DiskTierConfig, PrefixTierConfig};
use specula_engine::{EngineConfig, RequestEvent, SamplingParams};
use specula_kernels::kv::KvDtype;
use std::path::Path;

/// What a request got: its tokens with their logprobs (bits), and the prompt tokens it found
/// cached.
#[derive(Debug, PartialEq)]
struct Outcome {
    tokens: Vec<(u32, u32)>,
    cached: usize,
}

fn outcome(c: &Client) -> Outcome {
    let mut tokens = Vec::new();
    let mut cached = usize::MAX;
    for e in &c.events {
        match e {
            RequestEvent::Delta { tokens: t, logprobs, .. } => {
                assert_eq!(t.len(), logprobs.len());
                tokens.extend(t.iter().zip(logprobs).map(|(&t, lp)| (t, lp.logprob.to_bits())));
            }
            RequestEvent::Finished { cached_tokens, .. } => cached = *cached_tokens,
            RequestEvent::Failed { message } => panic!("{}: failed: {message}", c.id),
            _ => {}
        }
    }
    Outcome { tokens, cached }
}

fn params() -> SamplingParams {
    SamplingParams { logprobs: Some(3), ..greedy(12) }
}

fn run_one(h: &mut Harness, prompt: &[u32]) -> Outcome {
    let mut c = h.submit(prompt.to_vec(), params());
    h.run(&mut [&mut c], 400);
    outcome(&c)
}

/// A pool of 20 blocks (320 tokens): two other 150-token prompts evict a first one's blocks.
fn small_pool(tiers: PrefixTierConfig, async_scheduling: bool) -> EngineConfig {
    EngineConfig { num_kv_blocks: 20, max_model_len: 256, async_scheduling, prefix_tiers: tiers, ..tiny_config() }
}

#[test]
fn a_prompt_evicted_to_host_memory_comes_back_with_the_same_tokens_and_logprobs() {
    let model = TinyModel::new();
    let a = prompt(150, 1);
    for async_scheduling in [false, true] {
        let tiers = PrefixTierConfig { host_bytes: 64 << 20, disk: None };
        let mut h = Harness::on(&model, small_pool(tiers, async_scheduling), Spec::None);
        let first = run_one(&mut h, &a);
        assert_eq!(first.cached, 0);
        let again = run_one(&mut h, &a);
        assert_eq!(again.cached, 144, "async {async_scheduling}: 9 whole blocks found in the KV store");
        assert_eq!(again.tokens, first.tokens);
        // two other prompts take the whole pool: a's blocks are evicted (and saved)
        run_one(&mut h, &prompt(150, 2));
        run_one(&mut h, &prompt(150, 3));
        let before = h.engine.prefix_cache_stats();
        let back = run_one(&mut h, &a);
        assert_eq!(back.cached, 144, "async {async_scheduling}: a's blocks came back");
        let loaded = h.engine.prefix_cache_stats().host_hit_tokens - before.host_hit_tokens;
        assert!(loaded >= 64, "async {async_scheduling}: only {loaded} tokens came from host memory");
        assert_eq!(back.tokens, first.tokens, "async {async_scheduling}");
        // loaded blocks joined the prefix cache: the next identical prompt finds them in the store
        let before = h.engine.prefix_cache_stats();
        let after = run_one(&mut h, &a);
        assert_eq!((after.cached, &after.tokens), (144, &first.tokens));
        assert_eq!(h.engine.prefix_cache_stats().host_hit_tokens, before.host_hit_tokens, "found in the store, not loaded again");
        h.assert_idle_and_leak_free();
    }
    // the same without the host tier: evicted means recomputed
    let mut h = Harness::on(&model, small_pool(PrefixTierConfig::default(), false), Spec::None);
    run_one(&mut h, &a);
    run_one(&mut h, &prompt(150, 2));
    run_one(&mut h, &prompt(150, 3));
    assert_eq!(run_one(&mut h, &a).cached, 0);
}

fn disk(dir: &Path, model: &Path) -> PrefixTierConfig {
    PrefixTierConfig { host_bytes: 0, disk: Some(DiskTierConfig { dir: dir.to_path_buf(), max_bytes: 1 << 30, model_key: model_key(model).unwrap() }) }
}

#[test]
fn blocks_written_to_disk_by_one_engine_are_loaded_by_the_next_and_bad_files_never() {
    let model = TinyModel::new();
    let dir = tempfile::tempdir().unwrap();
    let a = prompt(150, 7);
    let first = {
        let mut h = Harness::on(&model, small_pool(disk(dir.path(), &model.path), false), Spec::None);
        let o = run_one(&mut h, &a);
        h.assert_idle_and_leak_free();
        o
    }; // the engine is dropped: its disk writes are finished
    let ns_dirs: Vec<_> = std::fs::read_dir(dir.path()).unwrap().flatten().map(|e| e.path()).collect();
    assert_eq!(ns_dirs.len(), 1, "one namespace folder");
    let files = || -> Vec<std::path::PathBuf> {
        let mut v: Vec<_> = std::fs::read_dir(&ns_dirs[0]).unwrap().flatten().map(|e| e.path()).collect();
        v.sort();
        v
    };
    assert!(files().len() >= 9, "every whole prompt block was written: {} files", files().len());

    // a new engine (a new process, as far as the cache knows) loads them, async too
    for async_scheduling in [false, true] {
        let mut cfg = small_pool(disk(dir.path(), &model.path), async_scheduling);
        cfg.prefix_tiers.host_bytes = 0;
        let mut h = Harness::on(&model, cfg, Spec::None);
        let o = run_one(&mut h, &a);
        assert_eq!(o, Outcome { tokens: first.tokens.clone(), cached: 144 }, "async {async_scheduling}");
        assert_eq!(h.engine.prefix_cache_stats().disk_hit_tokens, 144);
        h.assert_idle_and_leak_free();
    }

    // another KV type is another namespace: nothing to load, nothing mixed up
    let mut cfg = small_pool(disk(dir.path(), &model.path), false);
    cfg.kv_cache_dtype = KvDtype::F32;
    let mut h = Harness::on(&model, cfg, Spec::None);
    assert_eq!(run_one(&mut h, &a).cached, 0);
    drop(h);

    // a corrupt file (a flipped byte in the prompt's 5th block) stops the chain there: 4 blocks
    // loaded, the rest computed, the same tokens
    let mut hash = None;
    for chunk in a.chunks_exact(16).take(5) {
        hash = Some(hash_block(hash, chunk));
    }
    let fifth = ns_dirs[0].join(format!("{:016x}.kvb", hash.unwrap().0));
    let mut bytes = std::fs::read(&fifth).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&fifth, bytes).unwrap();
    let mut h = Harness::on(&model, small_pool(disk(dir.path(), &model.path), false), Spec::None);
    let o = run_one(&mut h, &a);
    assert_eq!(o, Outcome { tokens: first.tokens.clone(), cached: 64 }, "the chain stops at the corrupt block");
    h.assert_idle_and_leak_free();
    drop(h);
    assert!(files().len() >= 9, "the corrupt file was removed and written again from the recomputed block");
}
