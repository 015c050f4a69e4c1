//! Drives `LlamaModel::forward` directly over a private paged KV cache, the way the engine does,
//! so model tests can build any batch shape (several sequences, prefill chunks beside decodes).

#![allow(dead_code)]

use specula_kernels::attention::KvLayout;
use specula_model::{ForwardBatch, KvStore, LlamaModel, SeqSpan};

pub const BLOCK_SIZE: usize = 16;
/// Sequences a test cache holds recurrent state for.
const SEQS: usize = 16;

/// A KV store plus a free list that hands blocks out in a scrambled order, so block tables are
/// not contiguous (as in the engine after some churn).
pub struct Cache {
    pub kv: KvStore,
    free: Vec<u32>,
    /// Recurrent-state slots handed out (hybrid models), one per sequence.
    states: usize,
}

/// One sequence's tokens, block table and how many tokens have their KV computed.
pub struct Seq {
    pub tokens: Vec<u32>,
    pub table: Vec<u32>,
    pub done: usize,
    /// Its recurrent-state slot (used by hybrid models only).
    pub state: usize,
}

impl Cache {
    pub fn new(model: &LlamaModel, num_blocks: usize) -> Self {
        let c = &model.config;
        let layout = KvLayout { block_size: BLOCK_SIZE, n_heads: c.n_heads, n_kv_heads: c.n_kv_heads, head_dim: c.head_dim };
        // odd blocks first, then even ones, each descending: tables jump around the store
        let mut free: Vec<u32> = (0..num_blocks as u32).filter(|b| b % 2 == 0).collect();
        free.extend((0..num_blocks as u32).filter(|b| b % 2 == 1));
        Self { kv: KvStore::for_model(c, layout, num_blocks, specula_kernels::kv::KvDtype::F32, SEQS).expect("a test KV store"), free, states: 0 }
    }

    pub fn seq(&mut self, tokens: &[u32]) -> Seq {
        let blocks = tokens.len().div_ceil(BLOCK_SIZE);
        assert!(self.free.len() >= blocks, "test cache too small");
        let table = self.free.split_off(self.free.len() - blocks);
        assert!(self.states < SEQS, "test cache holds state for {SEQS} sequences");
        // the slots in reverse too: a sequence's state slot is not its index
        self.states += 1;
        Seq { tokens: tokens.to_vec(), table, done: 0, state: SEQS - self.states }
    }
}

/// One forward pass computing the next `n` tokens of each listed sequence (n > 0). Returns, per
/// listed sequence, the logits of every row it computed (`n x vocab`).
pub fn forward(model: &LlamaModel, cache: &mut Cache, work: &mut [(&mut Seq, usize)]) -> Vec<Vec<f32>> {
    let mut tokens = Vec::new();
    let mut slots = Vec::new();
    let mut ranges = Vec::new();
    for (s, n) in work.iter() {
        let (start, n) = (s.done, *n);
        assert!(n > 0 && start + n <= s.tokens.len());
        ranges.push((tokens.len(), n, start + n));
        tokens.extend_from_slice(&s.tokens[start..start + n]);
        slots.extend((start..start + n).map(|p| s.table[p / BLOCK_SIZE] as usize * BLOCK_SIZE + p % BLOCK_SIZE));
    }
    let spans: Vec<SeqSpan> =
        work.iter().zip(&ranges).map(|((s, _), &(q_start, q_len, context_len))| SeqSpan { q_start, q_len, context_len, block_table: &s.table }).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let states: Vec<usize> = work.iter().map(|(s, _)| s.state).collect();
    let out = model
        .forward(&ForwardBatch { tokens: &tokens, seqs: &spans, slots: &slots, logits_rows: &rows, hidden_layers: &[], state_slots: &states }, &mut cache.kv)
        .expect("forward");
    let vocab = model.config.vocab_size;
    for (s, n) in work.iter_mut() {
        s.done += *n;
    }
    ranges.iter().map(|&(q0, n, _)| out.logits[q0 * vocab..(q0 + n) * vocab].to_vec()).collect()
}

/// Logits at every position of `prompt` computed alone, `chunks` tokens per pass (the last chunk
/// repeats until the prompt is done), on a pool of `threads` threads.
pub fn logits_alone(model: &LlamaModel, prompt: &[u32], chunks: &[usize], threads: usize) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let mut cache = Cache::new(model, prompt.len().div_ceil(BLOCK_SIZE) + 3);
        let mut s = cache.seq(prompt);
        let mut out = Vec::new();
        let mut i = 0;
        while s.done < prompt.len() {
            let n = chunks[i.min(chunks.len() - 1)].min(prompt.len() - s.done);
            out.extend(forward(model, &mut cache, &mut [(&mut s, n)]).remove(0));
            i += 1;
        }
        out
    })
}

/// Logits at every position of `target` computed inside a batch of 8 mixed sequences: seven
/// others of assorted lengths, some half-way through (a decode or a chunk beside the target's
/// prefill), some starting fresh; the target sits in the middle of the batch.
pub fn logits_in_mixed_batch(model: &LlamaModel, target: &[u32], threads: usize) -> Vec<f32> {
    let vocab = model.config.vocab_size as u32;
    let mut state = 12345u64;
    let mut rand_tokens = |n: usize| -> Vec<u32> {
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 33) % vocab as u64) as u32
            })
            .collect()
    };
    // (length, tokens computed in the first pass)
    let shapes = [(1, 0), (5, 4), (13, 0), (16, 15), (33, 20), (50, 49), (90, 7)];
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    pool.install(|| {
        let blocks: usize = shapes.iter().map(|(l, _)| l / BLOCK_SIZE + 1).sum::<usize>() + target.len() / BLOCK_SIZE + 1;
        let mut cache = Cache::new(model, blocks + 5);
        let mut others: Vec<(Seq, usize)> = shapes.iter().map(|&(len, first)| (cache.seq(&rand_tokens(len)), first)).collect();
        let mut t = cache.seq(target);
        {
            let mut first: Vec<(&mut Seq, usize)> = others.iter_mut().filter(|(_, f)| *f > 0).map(|(s, f)| (s, *f)).collect();
            forward(model, &mut cache, &mut first);
        }
        let (before, after) = others.split_at_mut(3);
        let mut second: Vec<(&mut Seq, usize)> = Vec::new();
        for (s, _) in before.iter_mut() {
            let n = s.tokens.len() - s.done;
            second.push((s, n));
        }
        let n = t.tokens.len();
        second.push((&mut t, n));
        for (s, _) in after.iter_mut() {
            let n = s.tokens.len() - s.done;
            second.push((s, n));
        }
        let mut out = forward(model, &mut cache, &mut second);
        out.remove(3)
    })
}

/// Asserts two logit arrays are equal bit for bit, naming the first differing position.
pub fn assert_bitwise_eq(what: &str, expected: &[f32], got: &[f32], vocab: usize) {
    assert_eq!(expected.len(), got.len(), "{what}: lengths differ");
    if let Some(i) = expected.iter().zip(got).position(|(a, b)| a.to_bits() != b.to_bits()) {
        panic!("{what}: logits differ first at position {} token {}: {} vs {}", i / vocab, i % vocab, expected[i], got[i]);
    }
}

/// Every batch-invariance check of invariant 1 (docs/architecture.md) on one prompt: chunking, batch
/// neighbours and thread count never change a bit of its logits.
pub fn assert_batch_invariant(model: &LlamaModel, prompt: &[u32]) {
    let vocab = model.config.vocab_size;
    let reference = logits_alone(model, prompt, &[prompt.len()], 2);
    assert!(reference.iter().all(|x| x.is_finite()), "non-finite logits");
    assert_bitwise_eq("one thread vs two", &reference, &logits_alone(model, prompt, &[prompt.len()], 1), vocab);
    assert_bitwise_eq("chunked 7 + rest", &reference, &logits_alone(model, prompt, &[7, prompt.len()], 2), vocab);
    assert_bitwise_eq("chunked by 5", &reference, &logits_alone(model, prompt, &[5], 2), vocab);
    assert_bitwise_eq("one token at a time", &reference, &logits_alone(model, prompt, &[1], 1), vocab);
    assert_bitwise_eq("in a mixed batch of 8, two threads", &reference, &logits_in_mixed_batch(model, prompt, 2), vocab);
    assert_bitwise_eq("in a mixed batch of 8, one thread", &reference, &logits_in_mixed_batch(model, prompt, 1), vocab);
}
